"""Deadlines for PostgreSQL work that the database server cannot enforce itself.

statement_timeout and lock_timeout run inside the server, and TCP keepalives
need a host that stops acknowledging packets. A server that is frozen (SIGSTOP,
a hung host, a stalled disk) does neither: its kernel still ACKs, and a thread
blocked in libpq waits for as long as the freeze lasts. So the store arms a
Watch around every PostgreSQL transaction with the call's deadline, and the
Watchdog's thread interrupts it from outside when that passes:

1. `cancel_grace_seconds` before the deadline (a quarter of a shorter
   budget) it asks the server to cancel the statement (psycopg's cancel_safe,
   waited for until the deadline at most). A slow but live server aborts the
   statement (57014) and answers.
2. At the deadline, if the transaction is still running, it shuts the
   connection's socket down (shutdown(2) on a duplicate of libpq's descriptor;
   the descriptor itself stays open, so its number cannot be reused under
   libpq). The blocked thread returns at once with a driver error, which
   translate.py maps to StoreUnavailable.

The store discards every connection a watch interrupted (SQLAlchemy
invalidation) instead of returning it to the pool. Pool checkout runs under
the watch too: `DeadlinePool` bounds the wait for a free connection by the
deadline, `on_checkout` attaches the connection and pings it there (the
pool's own pre-ping would run before the watch knows the connection), and
`DeadlineConnection` ends a new connection's handshake at the deadline too:
the watch holds the handshake's socket, which is shut at the deadline like a
statement's.
"""

from __future__ import annotations

import _thread
import contextlib
import contextvars
import math
import os
import socket
import threading
import time
from collections.abc import Generator, Iterator
from typing import Any

import psycopg
from sqlalchemy.pool import QueuePool

# libpq's connect_timeout is whole seconds, and it takes anything below 2 as 2.
MIN_CONNECT_TIMEOUT_SECONDS = 2


# What a failure's log line adds when it came at its call's deadline: the
# driver's words ("server closed the connection unexpectedly") tell of the
# watchdog's cut, and read as a database that crashed.
_CUT = (
    " (at its deadline: this server ended the transaction, which the database had not "
    "finished; the driver's words tell of that end, not of a database failure)"
)


def cut_note(deadline: float) -> str:
    """The note for a failure met now, under a call whose deadline is `deadline`."""
    return _CUT if time.monotonic() >= deadline else ""


class Watch:
    """One transaction's deadline and the connection it runs on. Its end is
    told by `_ended`, a bare lock taken at creation and released by the first
    disarm: a threading.Event (a Python Condition) made and set for every
    move cost 2-4% of a PostgreSQL move's CPU (group_commit._Move's reason)."""

    __slots__ = (
        "_ended", "armed", "connection", "deadline", "fire_at", "handshake", "interrupted", "lock",
    )  # fmt: skip

    def __init__(self, deadline: float, grace_seconds: float) -> None:
        self.deadline = deadline
        self.fire_at = deadline - grace_seconds
        # The psycopg connection the transaction is on, once checked out.
        self.connection: Any = None
        # The socket descriptor of a new connection's handshake, while one runs.
        self.handshake: int | None = None
        # Held by the interrupter while it touches the connection, and by
        # disarm, so a connection is never touched once it may be back in the pool.
        self.lock = threading.Lock()
        self.armed = True
        self.interrupted = False
        self._ended = _thread.allocate_lock()
        self._ended.acquire()

    def remaining_seconds(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def attach(self, connection: Any) -> None:
        with self.lock:
            self.connection = connection

    def detach(self) -> bool:
        """Forgets the connection (waiting for an interruption under way),
        before anything closes it; whether the watch interrupted it."""
        with self.lock:
            self.connection = None
            return self.interrupted

    def disarm(self) -> bool:
        """Ends the watch (waiting for an interruption under way); whether it
        interrupted the connection, which must then be discarded."""
        with self.lock:
            if self.armed:
                self.armed = False
                self._ended.release()
            return self.interrupted

    def wait_ended(self, timeout_seconds: float) -> bool:
        """Until disarmed or timed out; True when disarmed."""
        if self._ended.acquire(timeout=max(0.0, timeout_seconds)):
            self._ended.release()  # ended for good: any later wait returns at once
            return True
        return False


_CURRENT: contextvars.ContextVar[Watch | None] = contextvars.ContextVar(
    "ledger_watch", default=None
)


def current() -> Watch | None:
    """The watch armed around this thread's transaction, if any."""
    return _CURRENT.get()


class Watchdog:
    """One thread that interrupts the transactions whose deadline passed.

    It holds only the armed watches (at most one per thread inside a
    transaction) and sleeps until the earliest one is due; each interruption
    runs on a short-lived thread of its own, so a cancel request that a frozen
    server never answers delays no other."""

    def __init__(self, cancel_grace_seconds: float = 0.5) -> None:
        self._grace_seconds = cancel_grace_seconds
        self._armed: set[Watch] = set()
        self._condition = threading.Condition()
        self._waking_at = math.inf
        self._thread: threading.Thread | None = None
        self._closed = False

    @contextlib.contextmanager
    def watch(self, deadline: float) -> Iterator[Watch]:
        """Arms a watch until the block ends; the block must disarm it before
        its connection goes back to the pool (leaving the block also does)."""
        budget = max(0.0, deadline - time.monotonic())
        watch = Watch(deadline, min(self._grace_seconds, budget / 4))
        with self._condition:
            if self._closed:
                raise RuntimeError("the watchdog is closed")
            self._armed.add(watch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
                self._thread.start()
            if watch.fire_at < self._waking_at:
                self._condition.notify()
        token = _CURRENT.set(watch)
        try:
            yield watch
        finally:
            _CURRENT.reset(token)
            watch.disarm()
            with self._condition:
                self._armed.discard(watch)

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5)

    def _run(self) -> None:
        with self._condition:
            while not self._closed:
                now = time.monotonic()
                due = [watch for watch in self._armed if watch.fire_at <= now]
                for watch in due:
                    self._armed.discard(watch)
                    threading.Thread(
                        target=interrupt, args=(watch,), name="watchdog-interrupt", daemon=True
                    ).start()
                self._waking_at = min((watch.fire_at for watch in self._armed), default=math.inf)
                wait = None if self._waking_at == math.inf else self._waking_at - now
                self._condition.wait(wait)


def interrupt(watch: Watch) -> None:
    """Cancels the watch's statement, then at its deadline shuts its socket."""
    with watch.lock:
        if not watch.armed:
            return
        watch.interrupted = True
        if watch.connection is not None:
            # A frozen server never answers the cancel: wait for it no longer
            # than the deadline, where the socket is shut.
            with contextlib.suppress(Exception):
                watch.connection.cancel_safe(timeout=max(0.01, watch.remaining_seconds()))
    if watch.wait_ended(watch.remaining_seconds()):
        return
    with watch.lock:
        if watch.armed and watch.connection is not None:
            shut_down(watch.connection)
        elif watch.armed and watch.handshake is not None:
            _shut_socket(watch.handshake)


def shut_down(connection: Any) -> None:
    """Shuts down a psycopg connection's socket without closing its descriptor:
    a thread blocked on it returns with an error at once."""
    try:
        descriptor = connection.pgconn.socket
    except Exception:  # already closed: nothing is blocked on it
        return
    _shut_socket(descriptor)


def _shut_socket(descriptor: int) -> None:
    with (
        contextlib.suppress(OSError),
        socket.socket(fileno=os.dup(descriptor)) as duplicate,
    ):
        duplicate.shutdown(socket.SHUT_RDWR)


def connect_timeout_for(configured_seconds: int) -> int:
    """The connect_timeout for a connection opened now: the configured one, or
    less when this thread's watch has less left (never below libpq's floor)."""
    watch = current()
    if watch is None:
        return configured_seconds
    left = math.floor(watch.remaining_seconds())
    return max(MIN_CONNECT_TIMEOUT_SECONDS, min(configured_seconds, left))


class DeadlineConnection(psycopg.Connection[Any]):
    """A psycopg connection whose handshake ends by the deadline of the
    calling thread's watch: libpq's connect_timeout is whole seconds, at least
    2, longer than a lane's 0.25 s call. psycopg drives the handshake from
    Python, waking every 0.1 s (its wait interval), and gives up when the
    step it wakes for raises: a step past the deadline does. The watch holds
    the handshake's socket, shut at the deadline, so that wake comes then and
    not up to 0.1 s later, past a short call's margin."""

    @classmethod
    def _connect_gen(cls, conninfo: str = "") -> Generator[tuple[int, Any], Any, Any]:
        steps = super()._connect_gen(conninfo)
        watch = current()
        return steps if watch is None else _by_deadline(steps, watch)


def _by_deadline(
    steps: Generator[tuple[int, Any], Any, Any], watch: Watch
) -> Generator[tuple[int, Any], Any, Any]:
    """`steps` (a handshake) until the watch's deadline; then a ConnectionTimeout.
    Each step runs under the watch's lock, so the watchdog never shuts a
    descriptor libpq has closed (and the process may have reused) meanwhile."""
    ready: Any = None
    try:
        while True:
            if time.monotonic() >= watch.deadline:
                raise psycopg.errors.ConnectionTimeout("connection timeout expired (deadline)")
            with watch.lock:
                try:
                    waiting_for = steps.send(ready)
                except StopIteration as done:
                    watch.handshake = None
                    return done.value
                watch.handshake = waiting_for[0]
            ready = yield waiting_for
    finally:
        with watch.lock:
            watch.handshake = None
            steps.close()  # a handshake cut short: its libpq connection is finished


class DeadlinePool(QueuePool):
    """A QueuePool whose wait for a free connection also ends at the deadline
    of the calling thread's watch. QueuePool reads its `_timeout` on every
    checkout; here it is the smaller of the configured wait and the time the
    watch has left (tests/storage/test_frozen_database.py holds that it is)."""

    @property
    def _timeout(self) -> float:
        watch = current()
        if watch is None:
            return self._configured_timeout
        return min(self._configured_timeout, watch.remaining_seconds())

    @_timeout.setter
    def _timeout(self, value: float) -> None:
        self._configured_timeout = value
