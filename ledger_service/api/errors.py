"""The one error table: each domain error becomes one gRPC status code and a
machine-readable reason (trailing metadata `ledger-reason`, and `ledger-field`
for bad input). Everything else becomes a constant INTERNAL with an opaque id
that is also in the server log: no SQL, URL, path or traceback ever leaves.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from ledger_service.domain import errors

log = logging.getLogger(__name__)

REASON_KEY = "ledger-reason"
FIELD_KEY = "ledger-field"
ERROR_ID_KEY = "ledger-error-id"
INTERNAL_MESSAGE = "internal error"

# Most specific first: the first matching class wins.
ERROR_TABLE: tuple[tuple[type[errors.LedgerError], grpc.StatusCode], ...] = (
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.LaneNotFound, grpc.StatusCode.NOT_FOUND),
    (errors.BookingNotFound, grpc.StatusCode.NOT_FOUND),
    (errors.ReservationConflict, grpc.StatusCode.ALREADY_EXISTS),
    (errors.BookingAlreadyEnded, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.BookingWasDenied, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.TooManyWatchers, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.StoreUnavailable, grpc.StatusCode.UNAVAILABLE),
)


def status_of(error: errors.LedgerError) -> grpc.StatusCode:
    for error_class, code in ERROR_TABLE:
        if isinstance(error, error_class):
            return code
    return grpc.StatusCode.INTERNAL


def _abort(context: grpc.ServicerContext, error: BaseException) -> None:
    """Ends the call with the status the table gives `error`. Raises."""
    if isinstance(error, errors.LedgerError) and status_of(error) is not grpc.StatusCode.INTERNAL:
        metadata: list[tuple[str, str]] = [(REASON_KEY, error.reason)]
        if isinstance(error, errors.InvalidArgument):
            metadata.append((FIELD_KEY, error.field))
        context.set_trailing_metadata(tuple(metadata))
        context.abort(status_of(error), error.message)
    error_id = uuid.uuid4().hex[:16]
    log.error("internal error %s", error_id, exc_info=error)
    context.set_trailing_metadata(((REASON_KEY, "INTERNAL"), (ERROR_ID_KEY, error_id)))
    context.abort(grpc.StatusCode.INTERNAL, f"{INTERNAL_MESSAGE} (id {error_id})")


def _is_abort(error: BaseException, context: grpc.ServicerContext) -> bool:
    """grpcio's context.abort raises a bare Exception after setting the code."""
    code = getattr(context, "code", lambda: None)()
    return code is not None and code is not grpc.StatusCode.OK and type(error) is Exception


class ErrorInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Applies the error table to every unary and streaming handler."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _guard_unary(handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _guard_stream(handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


def _guard_unary(behaviour: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[..., Any]:
    def guarded(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return behaviour(request, context)
        except Exception as error:
            if _is_abort(error, context):
                raise
            _abort(context, error)
            raise  # unreachable: abort raises

    return guarded


def _guard_stream(
    behaviour: Callable[[Any, grpc.ServicerContext], Iterator[Any]],
) -> Callable[..., Iterator[Any]]:
    def guarded(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from behaviour(request, context)
        except Exception as error:
            if _is_abort(error, context):
                raise
            _abort(context, error)

    return guarded
