"""Optional OpenTelemetry tracing of a lane's calls to the ledger.

LaneClient installs this interceptor on its channel when `opentelemetry-api` is
installed (the `tracing` extra: `pip install 'ledger-client[tracing]'`); without
it nothing is imported and nothing changes. Each call gets a CLIENT span named
like the method (`ledger.v1.Ledger/Reserve`) with the RPC semantic conventions'
attributes, and its context travels to the ledger as W3C `traceparent`: the
ledger's SERVER span joins the lane's trace, and the ledger stores that trace id
on every event the call writes.

Which trace a call joins: a `traceparent` the client already put on the call wins
(LaneClient sends one for a model call's trace id, and a journal replay must keep
the trace of the call it replays); otherwise the current OpenTelemetry context.
Until the application configures an OpenTelemetry SDK, the API's tracer records
nothing and a call's metadata is left as it was.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

INSTRUMENTATION_NAME = "ledger_client"
TRACE_HEADERS = ("traceparent", "tracestate")
# The longest tracestate sent, as the Node client's MAX_TRACESTATE_LENGTH: what
# W3C propagators keep. OpenTelemetry takes 32 members of 256+256 characters,
# 16 KiB, past the ledger's header limit (max_metadata_bytes) on its own.
MAX_TRACESTATE_LENGTH = 512

_PROPAGATOR = TraceContextTextMapPropagator()
Metadata = Sequence[tuple[str, str | bytes]]


class _MetadataGetter(Getter[Metadata]):
    def get(self, carrier: Metadata, key: str) -> list[str] | None:
        values = [value for name, value in carrier if name == key and isinstance(value, str)]
        return values or None

    def keys(self, carrier: Metadata) -> list[str]:
        return [name for name, _ in carrier]


_GETTER = _MetadataGetter()


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


def server_attributes(target: str) -> dict[str, AttributeValue]:
    """'host:port', 'dns:///host:port' or '[::1]:port' -> server.address / server.port."""
    address = target.split("///", 1)[-1]
    host, separator, port = address.rpartition(":")
    if not separator or not port.isdigit():
        return {"server.address": address.strip("[]")} if address else {}
    return {"server.address": host.strip("[]"), "server.port": int(port)}


class TracingInterceptor(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[type-arg]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[type-arg]
):
    """One CLIENT span per call, its context injected as `traceparent`."""

    def __init__(self, target: str, tracer_provider: trace.TracerProvider | None = None) -> None:
        # Without a provider, the global one: a proxy until the application sets it.
        self._tracer = trace.get_tracer(INSTRUMENTATION_NAME, tracer_provider=tracer_provider)
        self._server_attributes = server_attributes(target)

    def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        return self._intercept(continuation, client_call_details, request)

    def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        return self._intercept(continuation, client_call_details, request)

    def _intercept(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        metadata: list[tuple[str, str | bytes]] = list(details.metadata or ())
        span = self._start(details.method, metadata)
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        if len(carrier.get("tracestate", "")) > MAX_TRACESTATE_LENGTH:
            del carrier["tracestate"]
        if carrier:
            metadata = [(k, v) for k, v in metadata if k not in TRACE_HEADERS]
            metadata.extend(carrier.items())
        traced = _CallDetails(
            details.method,
            details.timeout,
            tuple(metadata),
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )
        try:
            outcome = continuation(traced, request)
        except BaseException:
            _end(span, grpc.StatusCode.UNKNOWN)
            raise
        # Right away for a blocking call; when the call ends for a future or a stream.
        outcome.add_done_callback(lambda call: _end(span, _code_of(call)))
        return outcome

    def _start(self, method: str, metadata: Metadata) -> trace.Span:
        parent: Context = otel_context.get_current()
        if any(name == "traceparent" for name, _ in metadata):
            given = _PROPAGATOR.extract(metadata, context=Context(), getter=_GETTER)
            # The given trace wins; within it, the lane's own current span is the
            # real parent (a model call's traceparent names a span nobody records).
            if trace.get_current_span(given).get_span_context().trace_id != _current_trace(parent):
                parent = given
        service, _, name = method.lstrip("/").partition("/")
        attributes: dict[str, AttributeValue] = {
            "rpc.system": "grpc",
            "rpc.service": service,
            "rpc.method": name,
            **self._server_attributes,
        }
        return self._tracer.start_span(
            f"{service}/{name}", context=parent, kind=trace.SpanKind.CLIENT, attributes=attributes
        )


def _current_trace(context: Context | None = None) -> int:
    """The trace id of the current span (0: none)."""
    span_context = trace.get_current_span(context).get_span_context()
    return span_context.trace_id if span_context.is_valid else 0


def current_trace_id() -> str:
    """The current OpenTelemetry span's trace id as 32 hex digits, or "" without one:
    the trace a model call joins when it is given no trace id of its own."""
    trace_id = _current_trace()
    return format(trace_id, "032x") if trace_id else ""


def _code_of(call: Any) -> grpc.StatusCode:
    try:
        code = call.code()
    except Exception:
        return grpc.StatusCode.UNKNOWN
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN


def _end(span: trace.Span, code: grpc.StatusCode) -> None:
    if span.is_recording():
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code is not grpc.StatusCode.OK:
            span.set_attribute("error.type", code.name)
            span.set_status(trace.Status(trace.StatusCode.ERROR, code.name))
    span.end()


def instrument(
    channel: grpc.Channel, target: str, tracer_provider: trace.TracerProvider | None = None
) -> grpc.Channel:
    """The channel with every call traced."""
    return grpc.intercept_channel(channel, TracingInterceptor(target, tracer_provider))
