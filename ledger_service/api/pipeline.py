"""The server's interceptors, applied once per method instead of once per call.

grpcio runs its interceptor pipeline on the thread that accepts calls, for every
call: each interceptor asks the next for the handler and wraps what it gets in
fresh closures and a fresh handler tuple. Ours read nothing of a call but its
method name while they choose a handler (the metadata, the grant, the trace
parent are all read inside the wrapped behaviour), so what the chain returns
depends only on the method and on the servicer's handler. `MethodPipeline` runs
the chain once per method and hands the same handler to every later call of it,
which spares each call the whole chain on the accepting thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc

if TYPE_CHECKING:
    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]
    Continuation: TypeAlias = Callable[[grpc.HandlerCallDetails], Handler | None]


class MethodPipeline(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Interceptors in grpc.server's order (the first is the outermost), composed
    once per method.

    Every interceptor given must choose its handler from the method name and the
    handler inside it alone, never from a call's metadata. The cache holds one
    entry per method that has a handler (bounded by the registered methods); it
    is checked against the servicer's handler on every call, so a handler that
    changes is wrapped afresh.
    """

    def __init__(self, interceptors: Sequence[grpc.ServerInterceptor]) -> None:  # type: ignore[type-arg]
        self._interceptors = tuple(interceptors)
        self._composed: dict[str, tuple[Handler, Handler | None]] = {}

    def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler | None:
        try:
            handler = continuation(handler_call_details)
        except Exception as error:
            # As without the cache: the chain's error table answers it.
            return self._compose(_raising(error), handler_call_details)
        if handler is None:
            return self._compose(lambda _details: None, handler_call_details)
        method = handler_call_details.method
        known = self._composed.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        composed = self._compose(lambda _details: handler, handler_call_details)
        self._composed[method] = (handler, composed)
        return composed

    def _compose(
        self, innermost: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler | None:
        """What grpcio's own pipeline returns: each interceptor around the next."""

        def at(index: int, details: grpc.HandlerCallDetails) -> Handler | None:
            if index == len(self._interceptors):
                return innermost(details)
            return self._interceptors[index].intercept_service(
                lambda inner_details: at(index + 1, inner_details), details
            )

        return at(0, handler_call_details)


def _raising(error: Exception) -> Continuation:
    def raising(_details: grpc.HandlerCallDetails) -> Handler | None:
        raise error

    return raising
