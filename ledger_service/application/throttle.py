"""Log lines of one kind at most once an interval, counting the rest: a
database that refuses every call refuses hundreds a second. Here, below the
storage and the edge, so that both use it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

# A failure of one kind is logged at most once this often.
ERROR_LOG_INTERVAL_SECONDS = 10.0
# Kinds are few (a code and a class); past this many the memory starts over.
MAX_KINDS = 64


class Throttle:
    """Says whether a line of a kind may be logged now: the first at once, then
    at most one an interval, with how many were held back since the last."""

    def __init__(self, interval_seconds: float, clock: Callable[[], float] = time.monotonic):
        self._interval = interval_seconds
        self.clock = clock
        self._lock = threading.Lock()
        self._said: dict[str, tuple[float, int]] = {}

    def __call__(self, kind: str) -> int | None:
        """None: hold this one back; else how many of its kind were held back."""
        now = self.clock()
        with self._lock:
            said_at, unsaid = self._said.get(kind, (float("-inf"), 0))
            if now - said_at < self._interval:
                self._said[kind] = (said_at, unsaid + 1)
                return None
            if len(self._said) > MAX_KINDS:
                self._said.clear()
            self._said[kind] = (now, 0)
            return unsaid


def more(unsaid: int) -> str:
    """The tail of a line that others of its kind were held back before."""
    return f" (and {unsaid} more like it, not logged)" if unsaid else ""
