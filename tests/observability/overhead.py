"""What tracing and metrics cost per RPC, measured side by side (docs/observability.md).

    .venv/bin/python -m tests.observability.overhead

1. The interceptors alone: intercept_service plus the wrapped behaviour around a
   Reserve handler that answers at once (no network, no database), with no
   exporter, with the SDK's in-memory span exporter, metric reader, or both.
2. End to end: GetBalance over loopback gRPC, on servers without the tracing
   interceptors, with no exporter, and with in-memory spans and metrics,
   interleaved in rounds so that the machine's load falls on all alike.

Not a test: its figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import collections
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ledger_service import server as server_module
from ledger_service.api import tracing
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.settings import Settings
from ledger_service.telemetry import Telemetry, configure_telemetry

TRACEPARENT = ("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
METADATA = (TRACEPARENT, ("authorization", "Bearer x"))
ISOLATED_CALLS = 20_000
END_TO_END_CALLS = 2_000
ROUNDS = 3
RESPONSE = pb.ReserveResponse(
    decision=pb.ADMITTED,
    hold_nanos=486,
    cap_nanos=486,
    balance=pb.Balance(lane="recall", limit_nanos=500_000_000, spent_nanos=486, open_bookings=1),
)
REQUEST = pb.ReserveRequest(
    lane="recall", reservation_id="r1", model="jev", request_bytes=10_000, max_output_tokens=500
)


class _Details(collections.namedtuple("_Details", "method invocation_metadata")):
    pass


class _Context:
    def invocation_metadata(self) -> Any:
        return METADATA

    def peer(self) -> str:
        return "ipv4:127.0.0.1:54321"

    def code(self) -> None:
        return None

    def is_active(self) -> bool:
        return True


def isolated_us(telemetry: Telemetry | None) -> float:
    """Microseconds per call through both interceptors (None: the bare handler)."""
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: RESPONSE)
    context = _Context()
    if telemetry is None:
        started = time.perf_counter_ns()
        for _ in range(ISOLATED_CALLS):
            handler.unary_unary(REQUEST, context)
        return (time.perf_counter_ns() - started) / ISOLATED_CALLS / 1000
    outer, inner = tracing.interceptors(telemetry.tracer, telemetry.meter)
    outer.listening_on("127.0.0.1", 50051)
    details = _Details("/ledger.v1.Ledger/Reserve", METADATA)
    started = time.perf_counter_ns()
    for _ in range(ISOLATED_CALLS):
        wrapped = outer.intercept_service(
            lambda d: inner.intercept_service(lambda _: handler, d), details
        )
        assert wrapped is not None
        wrapped.unary_unary(REQUEST, context)
    return (time.perf_counter_ns() - started) / ISOLATED_CALLS / 1000


class _Passthrough(grpc.ServerInterceptor):  # type: ignore[type-arg]
    def intercept_service(self, continuation: Any, details: Any) -> Any:
        return continuation(details)

    def listening_on(self, host: str, port: int) -> None:
        return None


def end_to_end_us(telemetry: Telemetry | None) -> list[float]:
    """Microseconds of each GetBalance round trip (None: no tracing interceptors)."""
    real = tracing.interceptors
    if telemetry is None:
        server_module.tracing.interceptors = lambda *_: (_Passthrough(), _Passthrough())  # type: ignore[assignment,return-value]
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="ledger-overhead-"))
    settings = Settings(
        database_url=f"sqlite:///{data_dir}/ledger.db",
        data_dir=data_dir,
        listen="127.0.0.1:0",
        auth_enabled=False,
        sweep_interval_seconds=3600,
    )
    try:
        server = server_module.LedgerServer(
            settings, telemetry=telemetry or configure_telemetry({})
        )
    finally:
        server_module.tracing.interceptors = real
    server.start()
    try:
        return _round_trips(server.port)
    finally:
        server.stop(0)


def _round_trips(port: int) -> list[float]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        price = pb.ModelPrice(input_nanos_per_million_tokens=1, output_nanos_per_million_tokens=1)
        lane = pb.Lane(lane="recall", limit_nanos=10**9, prices={"jev": price})
        pb_grpc.LaneAdminStub(channel).PutLane(pb.PutLaneRequest(lane=lane))
        stub = pb_grpc.LedgerStub(channel)
        request = pb.GetBalanceRequest(lane="recall")
        for _ in range(END_TO_END_CALLS // 10):
            stub.GetBalance(request, metadata=(TRACEPARENT,))
        samples = []
        for _ in range(END_TO_END_CALLS):
            started = time.perf_counter_ns()
            stub.GetBalance(request, metadata=(TRACEPARENT,))
            samples.append((time.perf_counter_ns() - started) / 1000)
        return samples


def configurations() -> Iterator[tuple[str, Callable[[], Telemetry | None]]]:
    yield "no tracing", lambda: None
    yield "exporter none", lambda: configure_telemetry({})
    yield "in-memory spans", lambda: configure_telemetry({}, span_exporter=InMemorySpanExporter())
    yield "in-memory metrics", lambda: configure_telemetry({}, metric_reader=InMemoryMetricReader())
    yield (
        "in-memory spans + metrics",
        lambda: configure_telemetry(
            {}, span_exporter=InMemorySpanExporter(), metric_reader=InMemoryMetricReader()
        ),
    )


def main() -> None:
    isolated: dict[str, list[float]] = collections.defaultdict(list)
    end_to_end: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(ROUNDS):
        for label, make in configurations():
            telemetry = make()
            isolated[label].append(isolated_us(telemetry))
            if label in {"no tracing", "exporter none", "in-memory spans + metrics"}:
                end_to_end[label].extend(end_to_end_us(telemetry))
            if telemetry is not None:
                telemetry.shutdown()
    for label, values in isolated.items():
        print(f"interceptors alone, {label:26s} {statistics.median(values):8.1f} us per call")
    for label, samples in end_to_end.items():
        print(
            f"GetBalance end to end, {label:23s} median {statistics.median(samples):8.1f} us"
            f"  mean {statistics.fmean(samples):8.1f} us  ({len(samples)} calls)"
        )


if __name__ == "__main__":
    main()
