"""Health checking: grpcio's servicer, keeping nothing for names it does not serve."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from grpc_health.v1 import health, health_pb2


class HealthServicer(health.HealthServicer):
    """The stock servicer keeps an entry for every service name ever watched,
    for the life of the process: watches of made-up names, each up to a message
    long, grow its memory without bound. Those names are answered SERVICE_UNKNOWN
    and held open, as the protocol asks, with nothing kept once they end."""

    def __init__(self, names: Iterable[str]) -> None:
        super().__init__()
        self._watchable = frozenset(("", *names))

    def Watch(
        self,
        request: health_pb2.HealthCheckRequest,
        context: Any,
        send_response_callback: Callable[[health_pb2.HealthCheckResponse | None], None]
        | None = None,
    ) -> Any:
        if request.service in self._watchable or send_response_callback is None:
            return super().Watch(request, context, send_response_callback)
        unknown = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        send_response_callback(health_pb2.HealthCheckResponse(status=unknown))
        # Ends the stream when the call does, as the stock servicer's own watches do.
        context.add_callback(lambda: send_response_callback(None))
        return None
