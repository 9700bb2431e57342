"""Traces and metrics of every RPC, through OpenTelemetry.

Two interceptors share one record per call:

- `TracingInterceptor` is the outermost. It starts a SERVER span for every RPC,
  named and described by the OpenTelemetry RPC semantic conventions (`rpc.system`,
  `rpc.service`, `rpc.method`, `rpc.grpc.status_code`, `server.address`/`port`),
  as a child of the caller's W3C `traceparent` when a valid one came in. The span
  is current while the handler runs, so `servicers.trace_id_of` stores its trace
  id on every event the request writes: the caller's trace id, or a fresh one.
  When the handler is done it records the gRPC status code on the span and the
  call's metrics.
- `MessageInterceptor` is the innermost. It sees the decoded request and the
  response message, and notes the ledger's own attributes on the call's record
  (`ledger.lane`, `ledger.reservation_id`, `ledger.decision`, the amounts and the
  balance after the move).

The error table and the grant check sit between the two, so a refused or failed
call is traced with the status code the caller got.

Cost: with no exporter the tracer samples nothing (spans are non-recording but
still carry trace ids) and there is no meter, so a call pays for a traceparent
parse (only when one came in), two random ids, a non-recording span and the
OpenTelemetry context's attach and detach, and builds no attributes at all;
it reads no status code, and the innermost interceptor wraps nothing.
Both interceptors read everything that varies from call to call (the metadata,
the peer) inside the wrapped behaviour, never while choosing the handler, so
one wrapper serves every call of a method (`pipeline.MethodPipeline` builds it
once).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import Message
from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from ledger_service.api.auth import RefusalLog
from ledger_service.api.errors import REASON_KEY, Behaviour, replace_behaviour, wrap_handler
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb

if TYPE_CHECKING:
    from ledger_service.api.pipeline import Continuation, Handler

# Health checks and reflection are not traced: probes would drown the ledger's calls.
UNTRACED_SERVICES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
# Per the RPC conventions, these codes make a SERVER span an error; the others
# (INVALID_ARGUMENT, NOT_FOUND, ...) are the caller's business and leave it unset.
SERVER_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)
# Milliseconds: a healthy ledger answers in a few; the client's deadline is 250.
DURATION_BUCKETS_MS = (0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 5000.0)
# Requests are read before they are validated: keep what they name short on a span.
MAX_NAME_CHARACTERS = 256
RESERVE_METHOD = "/ledger.v1.Ledger/Reserve"
ENDING_METHODS = frozenset({"/ledger.v1.Ledger/Settle", "/ledger.v1.Ledger/Refund"})

_PROPAGATOR = TraceContextTextMapPropagator()
TRACEPARENT_KEY = "traceparent"
_RECORD_KEY = otel_context.create_key("ledger-call-record")
# The parent of a call that brought no traceparent: an empty context, never changed
# (set_value and set_span_in_context copy it), so one serves every such call.
_NO_PARENT = Context()

Metadata = Sequence[tuple[str, str | bytes]]


class _MetadataGetter(Getter[Metadata]):
    """Reads W3C headers from gRPC invocation metadata (binary values skipped)."""

    def get(self, carrier: Metadata, key: str) -> list[str] | None:
        values = [value for name, value in carrier if name == key and isinstance(value, str)]
        return values or None

    def keys(self, carrier: Metadata) -> list[str]:
        return [name for name, _ in carrier]


_GETTER = _MetadataGetter()

# The loggers that warn about a caller's traceparent and tracestate (too long,
# a malformed member, quoted): one line a call, for callers with no grant too.
_HEADER_LOGGERS = ("opentelemetry.trace.propagation.tracecontext", "opentelemetry.trace.span")
_MAX_HEADER_WARNING_CHARACTERS = 200


class _HeaderWarnings(logging.Filter):
    """Takes those loggers' lines and writes them, cut short, as refusals are
    written: at most 10 a second, the rest counted, so that a caller sending
    bad trace headers in a loop cannot fill the disk. The header itself is
    treated as absent (docs/observability.md: a fresh trace)."""

    def __init__(self) -> None:
        super().__init__()
        self._lines = RefusalLog(
            logger=logging.getLogger(__name__), level=logging.WARNING, what="trace header warnings"
        )

    def filter(self, record: logging.LogRecord) -> bool:
        self._lines.write("%s", record.getMessage()[:_MAX_HEADER_WARNING_CHARACTERS])
        return False


_HEADER_WARNINGS = _HeaderWarnings()


def _limit_header_warnings() -> None:
    for name in _HEADER_LOGGERS:
        logger = logging.getLogger(name)
        if _HEADER_WARNINGS not in logger.filters:
            logger.addFilter(_HEADER_WARNINGS)


@dataclasses.dataclass
class CallRecord:
    """What the innermost interceptor learned about one call from its messages."""

    attributes: dict[str, AttributeValue] = dataclasses.field(default_factory=dict)
    balance: pb.Balance | None = None
    # Why a Settle was refused as impossible usage, for the metrics only (the
    # span has it as ledger.reason, from the caller's trailers).
    refused: str = ""


@dataclasses.dataclass(frozen=True)
class _Method:
    name: str  # the span's name: "ledger.v1.Ledger/Reserve"
    full_name: str  # gRPC's: "/ledger.v1.Ledger/Reserve"
    attributes: dict[str, AttributeValue]


class RpcMetrics:
    """The instruments, created once from a meter."""

    def __init__(self, meter: metrics.Meter) -> None:
        self.rpc_duration = meter.create_histogram(
            "rpc.server.duration",
            unit="ms",
            description="Time to answer each RPC, by method and status code.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_MS,
        )
        self.reserve_duration = meter.create_histogram(
            "ledger.reserve.duration",
            unit="ms",
            description="Time to answer each Reserve, by lane and decision.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_MS,
        )
        self.decisions = meter.create_counter(
            "ledger.reserve.decisions",
            unit="{reserve}",
            description="Reserves answered, by lane, decision and denial reason.",
        )
        self.charges = meter.create_counter(
            "ledger.charges",
            unit="{nano}",
            description="Charges answered by Settle and Refund, in nanos of the lane's "
            "currency, by lane and outcome (a repeated answer counts again).",
        )
        self.endings = meter.create_counter(
            "ledger.endings",
            unit="{booking}",
            description="Settle and Refund answers, by lane and outcome.",
        )
        self.refused_settles = meter.create_counter(
            "ledger.settle.refused",
            unit="{settle}",
            description="Settles refused as usage no request could have produced (nothing "
            "booked, the booking left as it was), by lane and ledger-reason.",
        )
        self.spent = meter.create_gauge(
            "ledger.lane.spent", unit="{nano}", description="Spent in the lane's window."
        )
        self.held = meter.create_gauge(
            "ledger.lane.held", unit="{nano}", description="Held by open bookings."
        )
        self.limit = meter.create_gauge(
            "ledger.lane.limit", unit="{nano}", description="The lane's limit."
        )
        self.open_holds = meter.create_gauge(
            "ledger.lane.open_holds",
            unit="{booking}",
            description="Open bookings in the lane's window.",
        )

    def record(
        self, method: _Method, code: grpc.StatusCode, elapsed_ms: float, record: CallRecord
    ) -> None:
        self.rpc_duration.record(
            elapsed_ms, {**method.attributes, "rpc.grpc.status_code": code.value[0]}
        )
        found = record.attributes
        if record.refused:
            self.refused_settles.add(
                1, {"ledger.lane": found.get("ledger.lane", ""), "ledger.reason": record.refused}
            )
        if code is not grpc.StatusCode.OK:
            return
        lane = found.get("ledger.lane", "")
        if method.full_name == RESERVE_METHOD and "ledger.decision" in found:
            decision = {"ledger.lane": lane, "ledger.decision": found["ledger.decision"]}
            self.reserve_duration.record(elapsed_ms, decision)
            reason = found.get("ledger.denial_reason")
            self.decisions.add(
                1, decision if reason is None else {**decision, "ledger.denial_reason": reason}
            )
        if method.full_name in ENDING_METHODS and "ledger.charge_nanos" in found:
            outcome = {"ledger.lane": lane, "ledger.outcome": found.get("ledger.outcome", "")}
            charge = found["ledger.charge_nanos"]
            self.charges.add(charge if isinstance(charge, int) else 0, outcome)
            self.endings.add(1, outcome)
        if record.balance is not None:
            self._record_balance(record.balance)

    def _record_balance(self, balance: pb.Balance) -> None:
        lane = {"ledger.lane": balance.lane}
        self.spent.set(balance.spent_nanos, lane)
        self.held.set(balance.held_nanos, lane)
        self.limit.set(balance.limit_nanos, lane)
        self.open_holds.set(balance.open_bookings, lane)


class TracingInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """The outermost interceptor: one SERVER span per RPC, and the call's metrics.

    `rpc_metrics` is None when no metrics exporter is configured: then nothing
    is measured at all.
    """

    def __init__(self, tracer: trace.Tracer, rpc_metrics: RpcMetrics | None = None) -> None:
        self._tracer = tracer
        self._metrics = rpc_metrics
        self._server_attributes: dict[str, AttributeValue] = {}
        self._methods: dict[str, _Method] = {}

    def listening_on(self, host: str, port: int) -> None:
        """Adds server.address and server.port to every span from now on."""
        self._server_attributes = {"server.address": host.strip("[]"), "server.port": port}
        self._methods = {}

    def intercept_service(
        self,
        continuation: Continuation,
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        full_name = handler_call_details.method
        return wrap_handler(
            continuation,
            handler_call_details,
            unary=lambda behaviour: self._traced_unary(behaviour, full_name),
            stream=lambda behaviour: self._traced_stream(behaviour, full_name),
            skip=lambda method: method.startswith(UNTRACED_SERVICES),
        )

    def _method(self, full_name: str) -> _Method:
        """The span name and static attributes of a method; one per registered method."""
        method = self._methods.get(full_name)
        if method is None:
            service, _, name = full_name.lstrip("/").partition("/")
            attributes: dict[str, AttributeValue] = {
                "rpc.system": "grpc",
                "rpc.service": service,
                "rpc.method": name,
                **self._server_attributes,
            }
            method = _Method(f"{service}/{name}", full_name, attributes)
            self._methods[full_name] = method
        return method

    def _start(
        self, full_name: str, context: grpc.ServicerContext
    ) -> tuple[_Method, trace.Span, CallRecord | None, Context]:
        # Looked up per call, not captured by the wrapper: listening_on may come later.
        method = self._method(full_name)
        parent = _parent_of(context.invocation_metadata())
        span = self._tracer.start_span(
            method.name, context=parent, kind=trace.SpanKind.SERVER, attributes=method.attributes
        )
        recording = span.is_recording()
        if recording:
            for key, value in _peer_attributes(context.peer()).items():
                span.set_attribute(key, value)
        call_context = trace.set_span_in_context(span, parent)
        if not recording and self._metrics is None:
            return method, span, None, call_context
        record = CallRecord()
        return method, span, record, otel_context.set_value(_RECORD_KEY, record, call_context)

    def _finish(
        self,
        method: _Method,
        span: trace.Span,
        record: CallRecord | None,
        code: grpc.StatusCode,
        started_ns: int,
        context: grpc.ServicerContext,
    ) -> None:
        if span.is_recording():
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if record is not None:
                span.set_attributes(record.attributes)
            # Why the call failed, as its caller was told (the ledger-reason trailer).
            reason = reason_of(context) if code is not grpc.StatusCode.OK else ""
            if reason:
                span.set_attribute("ledger.reason", reason)
            if code in SERVER_ERROR_CODES:
                span.set_attribute("error.type", code.name)
                described = f"{code.name} {reason}" if reason else code.name
                span.set_status(trace.Status(trace.StatusCode.ERROR, described))
        span.end()
        if self._metrics is not None and record is not None:
            elapsed_ms = (time.perf_counter_ns() - started_ns) / 1e6
            self._metrics.record(method, code, elapsed_ms, record)

    def _traced_unary(self, behaviour: Behaviour, full_name: str) -> Behaviour:
        def traced(request: Any, context: grpc.ServicerContext) -> Any:
            started_ns = time.perf_counter_ns()
            method, span, record, call_context = self._start(full_name, context)
            token = otel_context.attach(call_context)
            answered = grpc.StatusCode.UNKNOWN  # the code unless the handler set one
            try:
                response = behaviour(request, context)
                answered = grpc.StatusCode.OK
                return response
            finally:
                otel_context.detach(token)
                if record is None:
                    # Nothing records the span nor measures the call: nobody
                    # reads its status code.
                    span.end()
                else:
                    code = status_code_of(context, answered)
                    self._finish(method, span, record, code, started_ns, context)

        return traced

    def _traced_stream(self, behaviour: Behaviour, full_name: str) -> Callable[..., Iterator[Any]]:
        def traced(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            started_ns = time.perf_counter_ns()
            method, span, record, call_context = self._start(full_name, context)
            code = grpc.StatusCode.UNKNOWN
            responses: Iterator[Any] = iter(())
            try:
                # The span is current only while the handler runs, never across a
                # yield: the thread may serve other work between two messages.
                responses = _attached(call_context, lambda: iter(behaviour(request, context)))
                while True:
                    try:
                        response = _attached(call_context, lambda: next(responses))
                    except StopIteration:
                        break
                    yield response
                # A handler that stops because the caller left (WatchEvents does) was cancelled.
                ended = grpc.StatusCode.OK if context.is_active() else grpc.StatusCode.CANCELLED
                code = status_code_of(context, ended)
            except GeneratorExit:
                code = grpc.StatusCode.CANCELLED  # the caller went away mid-stream
                raise
            except BaseException:
                code = status_code_of(context, grpc.StatusCode.UNKNOWN)
                raise
            finally:
                # Ends the handler now (its own cleanup runs), not when it is collected.
                close = getattr(responses, "close", None)
                if close is not None:
                    _attached(call_context, close)
                self._finish(method, span, record, code, started_ns, context)

        return traced


def _parent_of(metadata: Metadata | None) -> Context:
    """The caller's span context from a W3C `traceparent`, if one came in.

    Most calls bring none: looking for the header first spares them the
    propagator (which reads `tracestate` only after a valid `traceparent`).
    """
    if not metadata:
        return _NO_PARENT
    for name, _value in metadata:
        if name == TRACEPARENT_KEY:
            return _PROPAGATOR.extract(metadata, context=Context(), getter=_GETTER)
    return _NO_PARENT


def _attached(call_context: Context, work: Callable[[], Any]) -> Any:
    token = otel_context.attach(call_context)
    try:
        return work()
    finally:
        otel_context.detach(token)


class MessageInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """The innermost interceptor: notes the ledger's attributes from the decoded
    request and the response on the call's record, when the call has one.

    Its handlers are the servicers' own, the same for every call of a method, so
    each is wrapped once (one per registered method: bounded). With `observing`
    False (no span is ever recorded, no metric read: no call has a record) it
    wraps nothing, and a call pays for no look for a record.
    """

    def __init__(self, observing: bool = True) -> None:
        self._observing = observing
        self._wrapped: dict[str, tuple[Any, grpc.RpcMethodHandler[Any, Any]]] = {}

    def intercept_service(
        self,
        continuation: Continuation,
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not self._observing or method.startswith(UNTRACED_SERVICES):
            return handler
        known = self._wrapped.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = replace_behaviour(
            handler,
            unary=_observed_unary,
            stream=_observed_stream,
            request_deserializer=handler.request_deserializer,
        )
        self._wrapped[method] = (handler, wrapped)
        return wrapped


def _observed_unary(behaviour: Behaviour) -> Behaviour:
    def observed(request: Any, context: grpc.ServicerContext) -> Any:
        record = otel_context.get_value(_RECORD_KEY)
        if not isinstance(record, CallRecord):
            return behaviour(request, context)
        if isinstance(request, Message):
            note_request(record, request)
        response = behaviour(request, context)
        if isinstance(response, Message):
            note_response(record, response)
            if isinstance(request, Message):
                note_answered_move(record, request)
        return response

    return observed


def _observed_stream(behaviour: Behaviour) -> Callable[..., Iterator[Any]]:
    def observed(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        record = otel_context.get_value(_RECORD_KEY)
        if not isinstance(record, CallRecord):
            yield from behaviour(request, context)
            return
        if isinstance(request, Message):
            note_request(record, request)
        sent = 0
        try:
            for response in behaviour(request, context):
                sent += 1
                yield response
        finally:
            record.attributes["ledger.messages_sent"] = sent

    return observed


def note_refused_settle(reason: str) -> None:
    """Counts the current call as a refused Settle (RpcMetrics.refused_settles)."""
    record = otel_context.get_value(_RECORD_KEY)
    if isinstance(record, CallRecord):
        record.refused = reason


def note_lane(lane: str) -> None:
    """Names the one lane the current call is about (`ledger.lane`), for a
    request that names its lanes elsewhere than in `lane` (Reconcile's rows)."""
    record = otel_context.get_value(_RECORD_KEY)
    if isinstance(record, CallRecord):
        record.attributes["ledger.lane"] = lane[:MAX_NAME_CHARACTERS]


def note_request(record: CallRecord, request: Message) -> None:
    """The ledger's attributes a request carries: its lane, booking and move."""
    found = record.attributes
    if isinstance(request, pb.PutLaneRequest):
        found["ledger.lane"] = request.lane.lane[:MAX_NAME_CHARACTERS]
        return
    if isinstance(request, pb.ReconcileRequest):
        # Only the lane of rows that name none: the call's lane is its rows'.
        if request.default_lane:
            found["ledger.default_lane"] = request.default_lane[:MAX_NAME_CHARACTERS]
        return
    lane = getattr(request, "lane", "")
    if isinstance(lane, str) and lane:
        found["ledger.lane"] = lane[:MAX_NAME_CHARACTERS]
    reservation_id = getattr(request, "reservation_id", "")
    if isinstance(reservation_id, str) and reservation_id:
        found["ledger.reservation_id"] = reservation_id[:MAX_NAME_CHARACTERS]
    if isinstance(request, pb.ReserveRequest):
        found["ledger.model"] = request.model[:MAX_NAME_CHARACTERS]
    elif isinstance(request, (pb.SettleRequest, pb.RefundRequest)):
        found["ledger.http_status"] = request.http_status


def note_answered_move(record: CallRecord, request: Message) -> None:
    """The outcome a Settle or Refund reported, once the ledger answered it: a
    refused one booked nothing, so its span claims no outcome."""
    if isinstance(request, pb.SettleRequest):
        record.attributes["ledger.outcome"] = _enum_name(pb.Outcome, request.outcome)
    elif isinstance(request, pb.RefundRequest):
        record.attributes["ledger.outcome"] = "refunded"


def note_response(record: CallRecord, response: Message) -> None:
    """The ledger's attributes an answer carries: the decision, amounts, balance."""
    found = record.attributes
    balance: pb.Balance | None = None
    if isinstance(response, pb.ReserveResponse):
        admitted = response.decision == pb.ADMITTED
        found["ledger.decision"] = "admitted" if admitted else "denied"
        found["ledger.hold_nanos"] = response.hold_nanos
        found["ledger.cap_nanos"] = response.cap_nanos
        if not admitted:
            found["ledger.denial_reason"] = _enum_name(pb.DenialReason, response.denial_reason)
            if response.denied_by:
                found["ledger.denied_by"] = response.denied_by
        balance = response.balance
    elif isinstance(response, pb.SettleResponse):
        found["ledger.charge_nanos"] = response.charged_nanos
        found["ledger.booking_state"] = _enum_name(pb.BookingState, response.state)
        balance = response.balance
    elif isinstance(response, pb.RefundResponse):
        found["ledger.charge_nanos"] = 0
        balance = response.balance
    elif isinstance(response, pb.CorrectResponse):
        balance = response.balance
    elif isinstance(response, pb.Balance):
        balance = response
    elif isinstance(response, pb.Audit):
        balance = response.balance
        found["ledger.audit.flags"] = list(response.flags)
    if balance is not None and balance.lane:
        record.balance = balance
        found["ledger.spent_nanos"] = balance.spent_nanos
        found["ledger.limit_nanos"] = balance.limit_nanos
        found["ledger.held_nanos"] = balance.held_nanos
        found["ledger.open_bookings"] = balance.open_bookings


def _enum_name(enum: Any, number: int) -> str:
    """'succeeded' for Outcome SUCCEEDED; the number itself for a value this
    server does not know (a request may carry any number: it must not fail here)."""
    known = enum.DESCRIPTOR.values_by_number.get(number)
    return str(known.name).lower() if known is not None else str(number)


def reason_of(context: grpc.ServicerContext) -> str:
    """The `ledger-reason` the error table set on the call's trailers, or ""."""
    trailers = getattr(context, "trailing_metadata", lambda: None)() or ()
    for key, value in trailers:
        if key == REASON_KEY and isinstance(value, str):
            return value[:MAX_NAME_CHARACTERS]
    return ""


def status_code_of(context: grpc.ServicerContext, default: grpc.StatusCode) -> grpc.StatusCode:
    """The code the handler (or the error table) set, else `default`."""
    code = getattr(context, "code", lambda: None)()
    return code if isinstance(code, grpc.StatusCode) else default


def _peer_attributes(peer: str) -> dict[str, AttributeValue]:
    """'ipv4:127.0.0.1:54321' or 'ipv6:[::1]:54321' -> network.peer.address / port."""
    family, _, address = peer.partition(":")
    if family not in {"ipv4", "ipv6"}:
        return {}
    host, _, port = address.rpartition(":")
    attributes: dict[str, AttributeValue] = {"network.peer.address": host.strip("[]")}
    if port.isdigit():
        attributes["network.peer.port"] = int(port)
    return attributes


def interceptors(
    tracer: trace.Tracer, meter: metrics.Meter | None, *, records_spans: bool = True
) -> tuple[TracingInterceptor, MessageInterceptor]:
    """The outermost and the innermost interceptor of a server, in that order.
    `records_spans` False: the tracer records no span (Telemetry.records_spans)."""
    _limit_header_warnings()
    rpc_metrics = RpcMetrics(meter) if meter is not None else None
    observing = records_spans or rpc_metrics is not None
    return TracingInterceptor(tracer, rpc_metrics), MessageInterceptor(observing)
