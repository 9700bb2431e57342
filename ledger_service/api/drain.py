"""The drain on a stop: calls already running are answered, later ones refused.

grpcio's own stop refuses new connections, but the calls that reached the
server and were not yet handed to a worker are cancelled outright, and it
stops as soon as the workers are idle. So the server drains first, while
grpcio still takes calls: every call already in a handler runs to its answer,
and every call that reaches a handler after the drain began is held, without
any work done, until grpcio has stopped taking calls (`release`), then
answered UNAVAILABLE / SHUTTING_DOWN (safe to send again). Holding it keeps
its client from sending another call that grpcio would cancel at its stop.
Only once none is running, streams included (or at the grace limit, or when
`hurry` is called: the operator's second stop signal) does grpcio stop. Health and reflection
are neither counted nor refused. A held call is said in the log, at most once
an interval per method: an operator sees who still sends to a stopping server.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import grpc

from ledger_service.api.auth import is_open
from ledger_service.api.errors import Behaviour, WrappingInterceptor, wrap_handler
from ledger_service.application.throttle import ERROR_LOG_INTERVAL_SECONDS, Throttle, more
from ledger_service.domain.errors import ShuttingDown

if TYPE_CHECKING:
    from ledger_service.api.pipeline import Continuation, Handler

log = logging.getLogger(__name__)

# The shortest drain: long enough for grpcio to hand every call that reached it
# before the drain began to a (free) worker, which answers or holds it.
SETTLE_SECONDS = 0.1
# A held call is answered this long before its own deadline at the latest, so
# that its client reads SHUTTING_DOWN, not DEADLINE_EXCEEDED.
HOLD_MARGIN_SECONDS = 0.05


class Drain(WrappingInterceptor):
    def __init__(self) -> None:
        # The calls' paths take the lock itself: the condition's own `with`
        # costs a Python call more, on every call (docs/benchmarks.md).
        self._lock = threading.RLock()
        self._condition = threading.Condition(self._lock)
        self._running = 0
        self._draining = False
        self._released = False
        # The drain is to end now, whatever still runs (a second stop signal).
        self._hurried = False
        # When the last counted call ended: its client may send again at once.
        self._last_end = 0.0
        # The held calls' lines, one kind per method.
        self._held_log = Throttle(ERROR_LOG_INTERVAL_SECONDS)

    def skips(self, method: str) -> bool:
        return is_open(method)

    def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler | None:
        # The wrappers know their method, for the held calls' line (composed
        # once per method, api/pipeline.py: no call pays for it).
        method = handler_call_details.method
        return wrap_handler(
            continuation,
            handler_call_details,
            unary=functools.partial(self.wrap_unary, method=method),
            stream=functools.partial(self.wrap_stream, method=method),
            skip=self.skips,
        )

    def _admit(self, context: grpc.ServicerContext | None, method: str) -> None:
        """Counts a call as running; once draining, holds it until released
        (or nearly its deadline) and refuses it."""
        with self._lock:
            if self._draining:
                self._say_held(method)
                remaining = context.time_remaining() if context is not None else None
                # A call without a deadline has about 2^63 s remaining in
                # grpcio, past what any wait takes (OverflowError): no bound.
                if remaining is not None and remaining >= threading.TIMEOUT_MAX:
                    remaining = None
                hold = None if remaining is None else max(0.0, remaining - HOLD_MARGIN_SECONDS)
                self._condition.wait_for(lambda: self._released, hold)
                raise ShuttingDown()
            self._running += 1

    def _say_held(self, method: str) -> None:
        unsaid = self._held_log(method)
        if unsaid is not None:
            log.info(
                "holding a call that arrived while draining: %s; it is refused "
                "SHUTTING_DOWN (safe to send again) once the server takes no more calls%s",
                method,
                more(unsaid),
            )

    def _ended(self) -> None:
        with self._lock:
            self._running -= 1
            self._last_end = time.monotonic()
            if self._draining:  # only a drain waits for calls to end
                self._condition.notify_all()

    def wrap_unary(self, behaviour: Behaviour, method: str = "") -> Behaviour:
        def counted(request: Any, context: grpc.ServicerContext) -> Any:
            self._admit(context, method)
            try:
                return behaviour(request, context)
            finally:
                self._ended()

        return counted

    def wrap_stream(self, behaviour: Behaviour, method: str = "") -> Behaviour:
        """A response stream runs while grpcio iterates it: counted from its
        first step until it ends, fails or is closed (a cancelled call's).
        It is waited for as a call is: the event feed ends it on a stop with
        SHUTTING_DOWN; one blocked in its send (a reader that takes nothing)
        runs on to the grace limit, and is cut off there."""

        def counted(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            self._admit(context, method)
            try:
                yield from behaviour(request, context)
            finally:
                self._ended()

        return counted

    def drain(self, deadline: float) -> int:
        """Holds new calls from now on and waits until none is running, and
        SETTLE_SECONDS more after the drain began and after the last call
        ended (a call that reached grpcio meanwhile, a client's resend of an
        answer included, is handed to a worker and held), or until `deadline`
        (time.monotonic()), or until `hurry`; returns how many were still
        running then."""
        with self._condition:
            self._draining = True
            began = time.monotonic()
            while True:
                now = time.monotonic()
                if now >= deadline or self._hurried:
                    return self._running
                settled = min(max(began, self._last_end) + SETTLE_SECONDS, deadline)
                if self._running == 0 and now >= settled:
                    return 0
                self._condition.wait((settled if self._running == 0 else deadline) - now)

    def hurry(self) -> None:
        """Ends the drain now (or, called before it, as soon as it begins), as
        its deadline would: the calls still running are left to grpcio's stop."""
        with self._condition:
            self._hurried = True
            self._condition.notify_all()

    def release(self) -> None:
        """Answers the held calls, and every later one at once: grpcio has
        stopped taking calls."""
        with self._condition:
            self._released = True
            self._condition.notify_all()
