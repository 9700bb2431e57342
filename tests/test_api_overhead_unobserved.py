"""What a call pays for when nothing reads what the tracing would gather (no
span recorded, no metric): the server gathers none of it, and composes no
wrapper that has no work to do. Every job stays: the span and its trace id,
the grant's share where there are grants."""

from __future__ import annotations

import pathlib
from typing import Any

import grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

from ledger_service.api import tracing
from ledger_service.api.arrival import ArrivalWatch
from ledger_service.api.auth import AuthInterceptor
from ledger_service.api.pipeline import MethodPipeline
from ledger_service.api.shares import GrantShareInterceptor
from ledger_service.server import LedgerServer
from ledger_service.telemetry import configure_telemetry
from tests.conftest import ledger_settings

RESERVE = "/ledger.v1.Ledger/Reserve"


class _Context:
    """A call's context that counts how often its status code is read."""

    def __init__(self) -> None:
        self.code_reads = 0

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5"

    def code(self) -> None:
        self.code_reads += 1
        return None


def test_a_call_nothing_records_reads_no_status_code_yet_has_a_trace_id() -> None:
    tracer = TracerProvider(sampler=ALWAYS_OFF).get_tracer("test")
    outer = tracing.TracingInterceptor(tracer)  # and no metrics
    trace_ids: list[int] = []

    def handler(request: Any, context: Any) -> str:
        trace_ids.append(tracing.trace.get_current_span().get_span_context().trace_id)
        return "answer"

    context = _Context()
    assert outer._traced_unary(handler, RESERVE)(None, context) == "answer"
    assert context.code_reads == 0
    assert trace_ids and trace_ids[0] != 0


def test_the_innermost_interceptor_wraps_nothing_when_nothing_is_observed() -> None:
    tracer = TracerProvider(sampler=ALWAYS_OFF).get_tracer("test")
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    details: Any = type("Details", (), {"method": RESERVE, "invocation_metadata": ()})()
    _, unobserved = tracing.interceptors(tracer, None, records_spans=False)
    _, observed = tracing.interceptors(tracer, None)
    assert unobserved.intercept_service(lambda _: handler, details) is handler
    assert observed.intercept_service(lambda _: handler, details) is not handler


def test_telemetry_says_whether_spans_are_recorded() -> None:
    assert not configure_telemetry({}).records_spans
    assert configure_telemetry({}, span_exporter=InMemorySpanExporter()).records_spans


def _chain(tmp_path: pathlib.Path, **overrides: Any) -> list[type]:
    composed: list[MethodPipeline] = []

    class Recorder:
        def __init__(self, *_arguments: Any, interceptors: Any = (), **_options: Any) -> None:
            composed.extend(interceptors)

        def __getattr__(self, _name: str) -> Any:
            return lambda *_arguments, **_options: None

    settings = ledger_settings(tmp_path, **overrides)
    LedgerServer(settings, transport=Recorder, telemetry=configure_telemetry({}))
    return [type(interceptor) for interceptor in composed[0]._interceptors]


def test_a_server_without_grants_composes_no_grant_share(tmp_path: pathlib.Path) -> None:
    with_grants = _chain(tmp_path / "grants")
    assert with_grants.index(GrantShareInterceptor) == with_grants.index(AuthInterceptor) + 1
    assert GrantShareInterceptor not in _chain(tmp_path / "none", auth_enabled=False)


def test_a_call_counts_as_serving_from_its_wait_until_served() -> None:
    watch = ArrivalWatch(arrival_seconds=10.0, max_waiting=100, threads=1)
    counted: list[int] = []

    def requests() -> Any:
        counted.append(watch._serving)  # while it waits for its message
        yield "message"

    try:
        assert watch.first_request(requests(), None) == "message"  # type: ignore[arg-type]
        assert counted == [1] and watch._serving == 1
        watch.served()
        assert watch._serving == 0
    finally:
        watch.close()
