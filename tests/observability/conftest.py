"""Fixtures of the observability tests: a ledger server whose telemetry goes to
the OpenTelemetry SDK's in-memory span exporter and metric reader, and the lane
client traced into the same exporter.

The lane client traces through OpenTelemetry's global tracer provider (that is
how an application configures it); it can be set once per process, so it is set
once here, with a processor that forwards to the current test's exporter.
"""

from __future__ import annotations

import collections
import os
import pathlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import sqlalchemy as sa
from google.protobuf import duration_pb2, timestamp_pb2
from opentelemetry import trace
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.server import LedgerServer
from ledger_service.settings import Settings
from ledger_service.telemetry import Telemetry, configure_telemetry

POSTGRES_URL = os.environ.get(
    "LEDGER_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
RPC_TIMEOUT_SECONDS = 30.0
MICROS_PER_SECOND = 1_000_000
# A fixed instant with a sub-second part, as the core tests use.
START_US = 1_800_000_000 * MICROS_PER_SECOND + 123_456
# JEV at $0.10 / $0.40 per million input / output tokens: 10_000 request bytes
# and 500 output tokens cap at 486 nanos.
JEV_PRICE = pb.ModelPrice(
    input_nanos_per_million_tokens=100_000, output_nanos_per_million_tokens=400_000
)


class _Forwarder(SpanExporter):
    """The global provider's exporter: hands spans to the current test's exporter."""

    def __init__(self) -> None:
        self.target: InMemorySpanExporter | None = None

    def export(self, spans: Any) -> SpanExportResult:
        target = self.target
        return target.export(spans) if target is not None else SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


_FORWARDER = _Forwarder()


@pytest.fixture(scope="session")
def global_tracer_provider() -> TracerProvider:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider(shutdown_on_exit=False)
        trace.set_tracer_provider(provider)
    assert isinstance(trace.get_tracer_provider(), TracerProvider)
    provider.add_span_processor(SimpleSpanProcessor(_FORWARDER))
    return provider


@pytest.fixture
def span_exporter(global_tracer_provider: TracerProvider) -> Iterator[InMemorySpanExporter]:
    """Every span of the test: the server's and the lane client's."""
    exporter = InMemorySpanExporter()
    _FORWARDER.target = exporter
    yield exporter
    _FORWARDER.target = None


@pytest.fixture
def metric_reader() -> InMemoryMetricReader:
    return InMemoryMetricReader()


@pytest.fixture
def telemetry(
    span_exporter: InMemorySpanExporter, metric_reader: InMemoryMetricReader
) -> Iterator[Telemetry]:
    configured = configure_telemetry({}, span_exporter=span_exporter, metric_reader=metric_reader)
    yield configured
    configured.shutdown()


def start_server(
    data_dir: pathlib.Path, telemetry: Telemetry | None, **overrides: Any
) -> LedgerServer:
    values: dict[str, Any] = {
        "database_url": f"sqlite:///{data_dir}/ledger.db",
        "data_dir": data_dir,
        "listen": "127.0.0.1:0",
        "test_clock": True,
        "sweep_interval_seconds": 0.05,
    }
    values.update(overrides)
    server = LedgerServer(Settings(**values), telemetry=telemetry)
    server.start()
    return server


@pytest.fixture
def server_with(tmp_path: pathlib.Path) -> Iterator[Callable[..., LedgerServer]]:
    """Starts a server with the telemetry given (in tmp_path/other); stops it at teardown."""
    started: list[LedgerServer] = []

    def start(telemetry: Telemetry, **overrides: Any) -> LedgerServer:
        started.append(start_server(tmp_path / "other", telemetry, **overrides))
        return started[-1]

    yield start
    for server in started:
        server.stop(0)


@pytest.fixture
def traced_server(tmp_path: pathlib.Path, telemetry: Telemetry) -> Iterator[LedgerServer]:
    """A server with the test clock, its telemetry in memory; auth on (admin grant)."""
    server = start_server(tmp_path, telemetry)
    yield server
    server.stop(0)


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class _Grant(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):  # type: ignore[misc]
    def __init__(self, grant: str) -> None:
        self._metadata = (("authorization", f"Bearer {grant}"),)

    def _with_grant(self, details: Any) -> Any:
        return _CallDetails(
            details.method,
            details.timeout,
            (*(details.metadata or ()), *self._metadata),
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_grant(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_grant(details), request)


class Ledger:
    """Stubs with the admin grant, and the few helpers the tests share."""

    def __init__(self, channel: grpc.Channel, raw: grpc.Channel) -> None:
        self.ledger = pb_grpc.LedgerStub(channel)
        self.admin = pb_grpc.LaneAdminStub(channel)
        self.clock = pb_grpc.TestClockStub(channel)
        self.anonymous = pb_grpc.LedgerStub(raw)

    def put_lane(
        self,
        lane: str = "recall",
        limit_nanos: int = 500_000_000,
        *,
        hold_ttl_seconds: int | None = None,
    ) -> pb.Lane:
        message = pb.Lane(lane=lane, limit_nanos=limit_nanos, prices={"jev": JEV_PRICE})
        if hold_ttl_seconds is not None:
            message.hold_ttl.CopyFrom(duration_pb2.Duration(seconds=hold_ttl_seconds))
        stored: pb.Lane = self.admin.PutLane(
            pb.PutLaneRequest(lane=message), timeout=RPC_TIMEOUT_SECONDS
        )
        return stored

    def set_time_us(self, instant_us: int) -> None:
        seconds, micros = divmod(instant_us, MICROS_PER_SECOND)
        self.clock.SetTime(
            timestamp_pb2.Timestamp(seconds=seconds, nanos=micros * 1000),
            timeout=RPC_TIMEOUT_SECONDS,
        )

    def advance_seconds(self, seconds: int) -> None:
        self.clock.Advance(duration_pb2.Duration(seconds=seconds), timeout=RPC_TIMEOUT_SECONDS)

    def reserve(
        self,
        reservation_id: str,
        *,
        lane: str = "recall",
        request_bytes: int = 10_000,
        ttl_seconds: int | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> pb.ReserveResponse:
        request = pb.ReserveRequest(
            lane=lane,
            reservation_id=reservation_id,
            model="jev",
            request_bytes=request_bytes,
            max_output_tokens=500,
        )
        if ttl_seconds is not None:
            request.ttl.CopyFrom(duration_pb2.Duration(seconds=ttl_seconds))
        response: pb.ReserveResponse = self.ledger.Reserve(
            request, metadata=metadata, timeout=RPC_TIMEOUT_SECONDS
        )
        return response

    def settle(
        self,
        reservation_id: str,
        outcome: int,
        *,
        lane: str = "recall",
        input_tokens: int = 0,
        output_tokens: int = 0,
    ) -> pb.SettleResponse:
        response: pb.SettleResponse = self.ledger.Settle(
            pb.SettleRequest(
                lane=lane,
                reservation_id=reservation_id,
                outcome=outcome,  # type: ignore[arg-type]
                input_tokens=input_tokens,
                output_tokens=output_tokens,
            ),
            timeout=RPC_TIMEOUT_SECONDS,
        )
        return response

    def refund(self, reservation_id: str, *, lane: str = "recall") -> pb.RefundResponse:
        response: pb.RefundResponse = self.ledger.Refund(
            pb.RefundRequest(lane=lane, reservation_id=reservation_id, http_status=403),
            timeout=RPC_TIMEOUT_SECONDS,
        )
        return response

    def audit(self, lane: str = "recall", biggest: int = 0) -> pb.Audit:
        found: pb.Audit = self.ledger.GetAudit(
            pb.GetAuditRequest(lane=lane, biggest=biggest), timeout=RPC_TIMEOUT_SECONDS
        )
        return found

    def events(self, lane: str = "recall", **filters: Any) -> list[pb.Event]:
        found: list[pb.Event] = []
        token = ""
        for _ in range(1_000):
            page = self.ledger.ListEvents(
                pb.ListEventsRequest(lane=lane, page_size=1000, page_token=token, **filters),
                timeout=RPC_TIMEOUT_SECONDS,
            )
            found.extend(page.events)
            token = page.next_page_token
            if not token:
                return found
        raise AssertionError("ListEvents kept giving page tokens")


@pytest.fixture
def connect() -> Iterator[Callable[[LedgerServer], Ledger]]:
    """Opens ready channels carrying a server's admin grant; closes them at teardown."""
    opened: list[grpc.Channel] = []

    def open_to(server: LedgerServer) -> Ledger:
        raw = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        opened.append(raw)
        grpc.channel_ready_future(raw).result(timeout=10)
        ledger = Ledger(grpc.intercept_channel(raw, _Grant(server.admin_grant)), raw)
        if server.settings.test_clock:
            ledger.set_time_us(START_US)
        return ledger

    yield open_to
    for channel in opened:
        channel.close()


@pytest.fixture
def ledger(traced_server: LedgerServer, connect: Callable[[LedgerServer], Ledger]) -> Ledger:
    return connect(traced_server)


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A PostgreSQL URL whose search_path is a fresh schema, dropped afterwards.
    Skipped when PostgreSQL is unreachable, except under CI=true, where it fails."""
    admin = sa.create_engine(POSTGRES_URL, connect_args={"connect_timeout": 3})
    schema = f"obs_{uuid.uuid4().hex[:12]}"
    try:
        with admin.begin() as connection:
            connection.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    except sa.exc.SQLAlchemyError as error:
        admin.dispose()
        problem = f"PostgreSQL is unreachable: {type(error).__name__}"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{problem}; under CI=true the PostgreSQL tests must run")
        pytest.skip(problem)
    try:
        yield f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as connection:
            connection.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
