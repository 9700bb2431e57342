"""Server reflection, with a bound on its streams at once.

A reflection stream needs no grant and holds a thread of the pool while its
client keeps it open, so idle ones could hold every thread. A client such as
grpcurl opens one, asks and closes it: `Settings.reflection_streams` are open
at once, and one more is refused at once with RESOURCE_EXHAUSTED /
TOO_MANY_WATCHERS.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any, cast

from grpc_reflection.v1alpha import reflection

from ledger_service.domain.errors import TooManyWatchers


class BoundedReflectionServicer(reflection.ReflectionServicer):
    def __init__(self, service_names: Iterable[str], streams: int) -> None:
        super().__init__(tuple(service_names))
        self._limit = streams
        self._streams = threading.BoundedSemaphore(streams)

    # grpcio-reflection's stub says None; the method is a generator of answers.
    def ServerReflectionInfo(  # type: ignore[override]
        self, request_iterator: Any, context: Any
    ) -> Iterator[Any]:
        if not self._streams.acquire(blocking=False):
            raise TooManyWatchers(f"{self._limit} reflection streams are open")
        try:
            answers = super().ServerReflectionInfo(request_iterator, context)
            yield from cast(Iterator[Any], answers)
        finally:
            self._streams.release()
