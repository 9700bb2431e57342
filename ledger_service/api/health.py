"""Health checking: the serving status by service name, for Check and Watch.

Our own servicer rather than grpcio's stock one, for two reasons:

- The stock servicer sends a watcher its update while holding the lock that a
  watch's end also takes. That end runs on gRPC's polling thread, and a send
  waits for the polling thread to report it done: a status change (the
  database going away, a stop) that met a watch ending hung the whole server.
  Here `_lock` guards the map and the watchers and is held for no send; sends
  are kept in order by `_sends`, which gRPC's own threads never take.
- The stock servicer keeps an entry for every name ever watched, for the
  process's life. A name not served is answered SERVICE_UNKNOWN and held open,
  as the protocol asks, with nothing kept once the watch ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeAlias

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

Send: TypeAlias = Callable[[health_pb2.HealthCheckResponse | None], None]
Status: TypeAlias = health_pb2.HealthCheckResponse.ServingStatus.ValueType


# The generated base answers the methods not written here (List) UNIMPLEMENTED.
class HealthServicer(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    def __init__(self, names: Iterable[str]) -> None:
        self._watchable = frozenset(("", *names))
        self._lock = threading.Lock()
        self._sends = threading.Lock()
        self._status: dict[str, Status] = {"": health_pb2.HealthCheckResponse.SERVING}
        self._watchers: dict[str, set[Send]] = {}
        self._shutting_down = False

    def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> Any:
        with self._lock:
            status = self._status.get(request.service)
        if status is None:
            context.set_code(grpc.StatusCode.NOT_FOUND)
            return health_pb2.HealthCheckResponse()
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(self, request: health_pb2.HealthCheckRequest, context: Any, send: Send) -> None:
        service = request.service
        kept = service in self._watchable
        with self._sends:
            with self._lock:
                status = self._status.get(service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                if kept:
                    self._watchers.setdefault(service, set()).add(send)
            send(health_pb2.HealthCheckResponse(status=status))

        def ended() -> None:
            with self._lock:
                watchers = self._watchers.get(service, set())
                watchers.discard(send)
                if not watchers:
                    self._watchers.pop(service, None)
            send(None)

        if not context.add_callback(ended):
            ended()  # the call had already ended

    # Sent by gRPC's callback API, on no thread of the pool, for the watch's life.
    Watch.experimental_non_blocking = True  # type: ignore[attr-defined]

    def set(self, service: str, status: Status) -> None:
        """Sets a name's status and tells its watchers; ignored once shutting down."""
        with self._sends:
            if self._shutting_down:
                return
            self._tell(service, status)

    def enter_graceful_shutdown(self) -> None:
        """Every name NOT_SERVING, for good: later `set`s are ignored."""
        with self._sends:
            if self._shutting_down:
                return
            self._shutting_down = True
            with self._lock:
                names = list(self._status)
            for name in names:
                self._tell(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def watcher_count(self) -> int:
        with self._lock:
            return sum(len(watchers) for watchers in self._watchers.values())

    def _tell(self, service: str, status: Status) -> None:
        # Called holding `_sends`: the updates reach each watcher in order.
        with self._lock:
            self._status[service] = status
            watchers = list(self._watchers.get(service, ()))
        for send in watchers:
            send(health_pb2.HealthCheckResponse(status=status))
