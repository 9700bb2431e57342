"""The trace headers the Python client sends fit the ledger's header limit
(max_metadata_bytes, 16 KiB, with a grant of up to 4,096 characters): a
tracestate longer than 512 characters is dropped, as the Node client drops it
(MAX_TRACESTATE_LENGTH in clients/node/lib/tracing.js). OpenTelemetry takes 32
members of up to 256+256 characters: a 16,031-character tracestate from
upstream made every call RESOURCE_EXHAUSTED, which the client reads as an
outage, so each model call was Denied 'unreachable' for as long as it lasted."""

from __future__ import annotations

from typing import Any

from ledger_client.tracing import MAX_TRACESTATE_LENGTH, TracingInterceptor
from opentelemetry import context, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736


class _Details:
    method = "/ledger.v1.Ledger/GetBalance"
    timeout = 5.0
    metadata = (("authorization", "Bearer x"),)
    credentials = None
    wait_for_ready = None
    compression = None


class _Done:
    def add_done_callback(self, callback: Any) -> None:
        pass


def _sent_headers(state: TraceState) -> dict[str, str]:
    parent = SpanContext(TRACE_ID, 0x00F067AA0BA902B7, True, TraceFlags(1), state)
    sent: dict[str, str] = {}

    def continuation(details: Any, request: Any) -> _Done:
        sent.update(details.metadata)
        return _Done()

    interceptor = TracingInterceptor("127.0.0.1:1", tracer_provider=TracerProvider())
    token = context.attach(trace.set_span_in_context(NonRecordingSpan(parent)))
    try:
        interceptor.intercept_unary_unary(continuation, _Details(), None)
    finally:
        context.detach(token)
    return sent


def test_a_tracestate_past_512_characters_is_not_sent() -> None:
    long_state = TraceState([(f"k{index:02d}" + "a" * 240, "v" * 256) for index in range(32)])
    assert len(long_state.to_header()) > 16_000
    sent = _sent_headers(long_state)
    assert "tracestate" not in sent, len(sent["tracestate"])
    assert sent["traceparent"].startswith(f"00-{TRACE_ID:032x}-")


def test_a_tracestate_of_512_characters_is_sent() -> None:
    # Two members: a value takes at most 256 characters.
    state = TraceState([("k1", "v" * 254), ("k2", "v" * (MAX_TRACESTATE_LENGTH - 261))])
    assert len(state.to_header()) == MAX_TRACESTATE_LENGTH
    assert _sent_headers(state)["tracestate"] == state.to_header()
