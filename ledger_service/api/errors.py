"""The one error table: each domain error becomes one gRPC status code and a
machine-readable reason (trailing metadata `ledger-reason`, and `ledger-field`
for bad input), sent a second time in gRPC's rich error model
(`grpc-status-details-bin`: a google.rpc.Status with an ErrorInfo), which
grpcurl, Envoy and most gRPC clients read. Everything else becomes a
constant INTERNAL with an opaque id that is also in the server log: no SQL,
URL, path or traceback ever leaves.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from google.rpc import error_details_pb2, status_pb2

from ledger_service.domain import errors

if TYPE_CHECKING:
    from ledger_service.api.pipeline import Continuation, Handler

log = logging.getLogger(__name__)

REASON_KEY = "ledger-reason"
FIELD_KEY = "ledger-field"
ERROR_ID_KEY = "ledger-error-id"
# gRPC's rich error model (google.rpc.Status), and the ErrorInfo domain of our reasons.
DETAILS_KEY = "grpc-status-details-bin"
ERROR_DOMAIN = "ledger.v1"
INTERNAL_MESSAGE = "internal error"
UNDECODABLE_REASON = "UNDECODABLE_REQUEST"
UNDECODABLE_MESSAGE = "the request is not a valid message for this method"
# The grant interceptor's refusals (api/auth.py), the table's rows for auth.
UNAUTHENTICATED_REASON = "UNAUTHENTICATED"
PERMISSION_DENIED_REASON = "PERMISSION_DENIED"
# A status message is sent twice in the trailers (grpc-message, percent-encoded,
# and inside the rich status): past gRPC's 8 KiB of metadata the caller would
# get RESOURCE_EXHAUSTED with no reason. So it is cut at this many UTF-8 bytes.
MAX_MESSAGE_BYTES = 1000

# Most specific first: the first matching class wins.
ERROR_TABLE: tuple[tuple[type[errors.LedgerError], grpc.StatusCode], ...] = (
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.LaneNotFound, grpc.StatusCode.NOT_FOUND),
    (errors.BookingNotFound, grpc.StatusCode.NOT_FOUND),
    (errors.ReservationConflict, grpc.StatusCode.ALREADY_EXISTS),
    (errors.BookingAlreadyEnded, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.BookingWasDenied, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.BookingStillOpen, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.CorrectionConflict, grpc.StatusCode.ALREADY_EXISTS),
    (errors.TooManyWatchers, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.TooManyReconciles, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.TooManyCalls, grpc.StatusCode.RESOURCE_EXHAUSTED),
    # UNAVAILABLE, not DATA_LOSS: the caller's request is sound and nothing was
    # booked, the clients' outage mode (which UNAVAILABLE drives) is what a lane
    # needs while the ledger cannot answer, and once an operator restores the
    # database the same request, sent again with the same ids, succeeds.
    # The reason tells it from an outage that heals by itself.
    (errors.ShuttingDown, grpc.StatusCode.UNAVAILABLE),
    (errors.StoreDamaged, grpc.StatusCode.UNAVAILABLE),
    (errors.StoreUnavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.RecoveryRequired, grpc.StatusCode.UNAVAILABLE),
)


def status_of(error: errors.LedgerError) -> grpc.StatusCode:
    for error_class, code in ERROR_TABLE:
        if isinstance(error, error_class):
            return code
    return grpc.StatusCode.INTERNAL


def refuse(
    context: grpc.ServicerContext,
    code: grpc.StatusCode,
    message: str,
    reason: str,
    **extra: str,
) -> None:
    """Ends the call with `code` and `message`, the reason (and each of `extra`,
    as `ledger-<name>`) in our own trailers, and beside them gRPC's rich error
    model: a google.rpc.Status with one ErrorInfo (the reason, ERROR_DOMAIN,
    `extra` as its metadata), as grpcio-status builds it. Raises."""
    message = bounded_message(message)
    info = error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN, metadata=extra)
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(info)
    trailers: list[tuple[str, str | bytes]] = [(REASON_KEY, reason)]
    trailers += [(f"ledger-{name.replace('_', '-')}", value) for name, value in extra.items()]
    trailers.append((DETAILS_KEY, status.SerializeToString()))
    context.set_trailing_metadata(tuple(trailers))
    context.abort(code, message)


def bounded_message(message: str) -> str:
    """The message, or its first MAX_MESSAGE_BYTES of UTF-8 (whole characters)
    and an ellipsis."""
    encoded = message.encode("utf-8", "replace")
    if len(encoded) <= MAX_MESSAGE_BYTES:
        return message
    return encoded[: MAX_MESSAGE_BYTES - 3].decode("utf-8", "ignore") + "..."


def _abort(context: grpc.ServicerContext, error: BaseException) -> None:
    """Ends the call with the status the table gives `error`. Raises."""
    if isinstance(error, errors.LedgerError) and status_of(error) is not grpc.StatusCode.INTERNAL:
        extra = {"field": error.field} if isinstance(error, errors.InvalidArgument) else {}
        refuse(context, status_of(error), error.message, error.reason, **extra)
    error_id = uuid.uuid4().hex[:16]
    log.error("internal error %s", error_id, exc_info=error)
    message = f"{INTERNAL_MESSAGE} (id {error_id})"
    refuse(context, grpc.StatusCode.INTERNAL, message, "INTERNAL", error_id=error_id)


def refuse_unauthenticated(context: grpc.ServicerContext, message: str) -> None:
    """Ends the call: no valid grant came. Raises."""
    refuse(context, grpc.StatusCode.UNAUTHENTICATED, message, UNAUTHENTICATED_REASON)


def refuse_permission(context: grpc.ServicerContext, message: str) -> None:
    """Ends the call: the grant does not cover the method or the lane. Raises."""
    refuse(context, grpc.StatusCode.PERMISSION_DENIED, message, PERMISSION_DENIED_REASON)


def _is_abort(error: BaseException, context: grpc.ServicerContext) -> bool:
    """grpcio's context.abort raises a bare Exception after setting the code."""
    code = getattr(context, "code", lambda: None)()
    return code is not None and code is not grpc.StatusCode.OK and type(error) is Exception


class ErrorInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Applies the error table to every handler, unary and streaming alike.

    It also decodes the request itself, so that bytes that are not the method's
    message get INVALID_ARGUMENT with a constant text, and it catches what the
    interceptors inside it raise while choosing a handler (grpcio would answer
    UNKNOWN). Put it outside every interceptor that can fail; an interceptor
    outside it sees undecoded requests and must not raise.
    """

    def intercept_service(
        self,
        continuation: Continuation,
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        try:
            handler = continuation(handler_call_details)
        except Exception as error:
            return grpc.unary_unary_rpc_method_handler(_failing(error))
        if handler is None:
            return None
        decode = handler.request_deserializer
        return replace_behaviour(
            handler,
            unary=lambda behaviour: _guard_unary(behaviour, decode),
            stream=lambda behaviour: _guard_stream(_decoding(behaviour, decode)),
            request_deserializer=None,
        )


Behaviour = Callable[[Any, grpc.ServicerContext], Any]


class WrappingInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """An interceptor that wraps each handler's behaviour (wrap_handler): what
    most of ours do. A subclass says how it wraps a handler that answers with
    one message (`wrap_unary`) and one that answers with a stream
    (`wrap_stream`), and which methods it leaves alone (`skips`); by default
    it leaves everything as it is."""

    def intercept_service(
        self,
        continuation: Continuation,
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        return wrap_handler(
            continuation,
            handler_call_details,
            unary=self.wrap_unary,
            stream=self.wrap_stream,
            skip=self.skips,
        )

    def wrap_unary(self, behaviour: Behaviour) -> Behaviour:
        return behaviour

    def wrap_stream(self, behaviour: Behaviour) -> Behaviour:
        return behaviour

    def skips(self, method: str) -> bool:
        return False


def wrap_handler(
    continuation: Continuation,
    details: grpc.HandlerCallDetails,
    *,
    unary: Callable[[Behaviour], Behaviour],
    stream: Callable[[Behaviour], Behaviour],
    skip: Callable[[str], bool] = lambda method: False,
) -> Handler | None:
    """The handler the call finds, its behaviour wrapped (replace_behaviour)
    unless it has none or `skip` leaves its method alone: what most of the
    interceptors do, each with its own wrappers."""
    handler = continuation(details)
    if handler is None or skip(details.method):
        return handler
    return replace_behaviour(
        handler, unary=unary, stream=stream, request_deserializer=handler.request_deserializer
    )


def replace_behaviour(
    handler: grpc.RpcMethodHandler[Any, Any],
    *,
    unary: Callable[[Behaviour], Behaviour],
    stream: Callable[[Behaviour], Behaviour],
    request_deserializer: Callable[[bytes], Any] | None,
) -> grpc.RpcMethodHandler[Any, Any]:
    """The same handler with its behaviour wrapped: `unary` for handlers that
    answer with one message, `stream` for those that answer with a stream.

    A handler on gRPC's callback API (`experimental_non_blocking`, which the
    health service's Watch uses) is returned as it is: wrapped in a plain
    function, grpcio would run it as a blocking stream holding one of the
    pool's threads for its whole life, and Health.Watch needs no grant."""
    behaviours = (handler.unary_unary, handler.unary_stream, handler.stream_unary)
    if any(
        getattr(b, "experimental_non_blocking", False) for b in (*behaviours, handler.stream_stream)
    ):
        return handler
    serializer = handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            unary(handler.unary_unary), request_deserializer, serializer
        )
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            stream(handler.unary_stream), request_deserializer, serializer
        )
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(
            unary(handler.stream_unary), request_deserializer, serializer
        )
    assert handler.stream_stream is not None, "a handler has one of four behaviours"
    return grpc.stream_stream_rpc_method_handler(
        stream(handler.stream_stream), request_deserializer, serializer
    )


def _decoding(behaviour: Behaviour, decode: Callable[[bytes], Any] | None) -> Behaviour:
    """Decodes the request (or each message of a request stream) before `behaviour`."""
    if decode is None:
        return behaviour

    def decoded(request: Any, context: grpc.ServicerContext) -> Any:
        return behaviour(decode_request(request, decode, context), context)

    return decoded


def decode_request(
    request: Any, decode: Callable[[bytes], Any], context: grpc.ServicerContext
) -> Any:
    """The decoded request, or a stream that decodes each message as it is read.
    Ends the call with INVALID_ARGUMENT (a constant text) on bytes that do not decode."""
    if isinstance(request, bytes):
        return _decode(request, decode, context)
    return (_decode(item, decode, context) for item in request)


def _decode(raw: bytes, decode: Callable[[bytes], Any], context: grpc.ServicerContext) -> Any:
    try:
        return decode(raw)
    except Exception:
        refuse_undecodable(context)
        raise  # unreachable: abort raises


def refuse_undecodable(context: grpc.ServicerContext) -> None:
    """Ends the call: its request is not a whole message of the method's type. Raises."""
    refuse(context, grpc.StatusCode.INVALID_ARGUMENT, UNDECODABLE_MESSAGE, UNDECODABLE_REASON)


def _failing(error: Exception) -> Behaviour:
    def fail(request: Any, context: grpc.ServicerContext) -> Any:
        _abort(context, error)

    return fail


def _guard_unary(behaviour: Behaviour, decode: Callable[[bytes], Any] | None) -> Behaviour:
    """`behaviour` under the error table, its request decoded first (in the
    same frame: every call passes here)."""

    def guarded(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            if decode is not None:
                request = decode_request(request, decode, context)
            return behaviour(request, context)
        except Exception as error:
            if _is_abort(error, context):
                raise
            _abort(context, error)
            raise  # unreachable: abort raises

    return guarded


def _guard_stream(behaviour: Behaviour) -> Callable[..., Iterator[Any]]:
    def guarded(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from behaviour(request, context)
        except Exception as error:
            if _is_abort(error, context):
                raise
            _abort(context, error)

    return guarded
