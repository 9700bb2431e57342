"""Group commit for SQLite: many moves, one durable transaction, one fsync.

SQLite has one writer at a time and every durable commit costs an fsync
(synchronous=FULL). Rather than trading durability for speed, moves that
arrive while a commit is on its way are committed together in the next one.
No caller is answered before the commit that holds its move is on disk.

There is no writer thread: the first caller to find no commit under way
becomes the leader and commits, in its own thread, every move queued by then
(its own first). Callers arriving meanwhile queue; when the leader is done it
hands the lead to the oldest of them, which commits all the queued moves in
one transaction. A lone caller thus pays no hand-off between threads, and a
busy server still commits in batches (docs/benchmarks.md has the figures).

A batch has no savepoints. A move refused before it wrote anything leaves
nothing to undo, and the batch goes on: the store's moves write to memory
and the batch's rows go to the database at its end (storage/writer.py), so
that is nearly every refusal. A move refused after writing, or failed by a
database error (which may have ended the transaction), cannot be undone
alone: the whole transaction is rolled back, that move is answered with its
refusal, and the batch's other moves run again in a new transaction. Whether
a move wrote is counted, not guessed: SQLite's total_changes for the
connection; a savepoint per move would add two statements to each.

No caller waits past its own deadline. A leader waits for the write lock
(this process's write gate, then another process's lock in SQLite's busy
handler, in tries of LOCK_TRY_SECONDS with the clock read between them)
until its own deadline only; when it gives up, its batch's moves
whose deadlines have not passed go back to the head of the queue, nothing
of them written, and the oldest leads on. A follower whose deadline passes
withdraws its move: one still queued, or taken into a batch but not begun,
is never written. One whose move has begun is in a batch that holds the
write lock (BEGIN IMMEDIATE) and commits within milliseconds: its caller
waits for that commit up to BEGUN_WAIT_SECONDS more (less for a short
call: within its answer's margin), then is answered
unavailable, and the batch may still commit the move; the caller's retry
with the same id is answered as the first call (docs/semantics.md).

All batches run on one connection, kept for the committer's life (and
replaced after a database error): leaders follow one another, never overlap.
A batch's transaction is held inside `write_gate` (storage/database.py), the
lock every writer of this process takes around its write transaction.
`on_begin` runs first in every batch's transaction, `on_failure` after the
transaction was rolled back, `on_error` with a database error that failed a
batch or a move, and `on_end` last before the commit: the store
checks its writer's memory against the file, drops it, and writes the
batch's rows and advances the projections' marker with them.

storage/lane_commit.py runs the same leaders and followers for one
PostgreSQL lane's moves, with a transaction of its own per batch.
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from sqlalchemy import Connection, Engine, RootTransaction
from sqlalchemy.exc import DBAPIError

from ledger_service.application.throttle import ERROR_LOG_INTERVAL_SECONDS, Throttle, more
from ledger_service.domain.errors import LedgerError, StoreDamaged, StoreUnavailable
from ledger_service.storage import translate, watchdog
from ledger_service.storage.database import LOCK_HELD

T = TypeVar("T")
log = logging.getLogger(__name__)

# How long past its deadline a caller whose move has begun waits for its
# batch's commit: at most BEGUN_WAIT_SECONDS, and at most half the answer's
# margin (api/deadlines.py: a tenth of the call, a ninth of the work's time).
BEGUN_WAIT_SECONDS = 0.05
BEGUN_WAIT_OF_BUDGET = 1 / 18
# The longest one BEGIN waits in SQLite's busy handler for another process's
# write lock. The handler adds up the sleeps it asks for, not the time that
# passes, and on a loaded machine each sleep ends late: a 0.9 s busy timeout
# took up to 1.53 s, past the answer's margin. Between tries the leader reads
# the clock, so its wait ends by its deadline give or take one try's sleeps.
LOCK_TRY_SECONDS = 0.02
# A leader that has waited this long for another process's write lock says
# so, at most one line an interval: another writer's commit takes
# milliseconds, a wait this long is a transaction held open (a `sqlite3`
# shell), and the health probe tells it only after the busy timeout.
LOCK_WAIT_LOGGED_SECONDS = 0.1


class _Move(Generic[T]):
    """One caller's move. Its caller waits on `_signal`, a bare lock taken at
    creation and released to wake it: once when it is handed the lead, once
    when its batch is done. A lock, not a threading.Event: Event.set goes
    through a Python Condition, and near saturation (16 calls in flight) the
    Events' set and creation were 12% of the server's GIL time (py-spy --gil)."""

    __slots__ = (
        "_signal",
        "begun_wait",
        "deadline",
        "error",
        "finished",
        "lead",
        "result",
        "started",
        "withdrawn",
        "work",
    )

    def __init__(self, work: Callable[[Any], T], deadline: float) -> None:
        self.work = work
        self.deadline = deadline
        budget = deadline - time.monotonic()
        self.begun_wait = min(BEGUN_WAIT_SECONDS, max(0.0, budget * BEGUN_WAIT_OF_BUDGET))
        self._signal = _thread.allocate_lock()
        self._signal.acquire()
        self.lead = False
        self.finished = False
        # Under the committer's mutex: its batch began it; its caller gave up.
        self.started = False
        self.withdrawn = False
        self.result: T | None = None
        self.error: BaseException | None = None

    def wait(self, timeout_seconds: float) -> bool:
        """Until woken or timed out; True when woken."""
        return self._signal.acquire(timeout=max(0.0, timeout_seconds))

    def wake(self) -> None:
        # Released already (a wake its caller has not waited for yet): it stays woken.
        with contextlib.suppress(RuntimeError):
            self._signal.release()

    def finish(self, result: T | None = None, error: BaseException | None = None) -> None:
        self.result, self.error, self.finished = result, error, True
        self.wake()


# A batch's answered moves: each with its result or its refusal.
Outcomes = list[tuple[_Move[Any], Any, BaseException | None]]
# The move of a batch that cannot be undone alone, and its failure; None: none.
Undone = tuple[int, BaseException] | None


class GroupCommitter:
    def __init__(
        self,
        engine: Engine,
        *,
        max_batch: int = 64,
        max_queue: int = 1024,
        on_begin: Callable[[Connection], None] = lambda _connection: None,
        on_failure: Callable[[], None] = lambda: None,
        on_end: Callable[[Connection], None] = lambda _connection: None,
        on_error: Callable[[LedgerError], None] = lambda _error: None,
        write_gate: threading.Lock | None = None,
    ) -> None:
        self._engine = engine
        self._on_error = on_error
        self._write_gate = write_gate
        self._on_begin = on_begin
        self._on_failure = on_failure
        self._on_end = on_end
        self._connection: Connection | None = None
        self._max_batch = max_batch
        self._max_queue = max_queue
        self._mutex = threading.Lock()
        self._queue: collections.deque[_Move[Any]] = collections.deque()
        self._leading = False
        self._stopped = False
        # A database that fails every batch (a full disk) fails hundreds a second.
        self._failure_log = Throttle(ERROR_LOG_INTERVAL_SECONDS)
        self._idle = threading.Condition(self._mutex)
        # The batch under way got its transaction (the write lock): its leader's alone.
        self._begun = False
        # The busy timeout this committer last set, and on which driver
        # connection: set again only when either differs (_run_batch).
        self._busy: tuple[Any, int] | None = None

    def submit(self, work: Callable[[Any], T], deadline: float) -> T:
        """Runs `work` in the next batch and returns once that batch is durable."""
        move: _Move[T] = _Move(work, deadline)
        with self._mutex:
            if self._stopped or len(self._queue) >= self._max_queue:
                raise StoreUnavailable()
            self._queue.append(move)
            if not self._leading:
                self._leading = move.lead = True
        if not move.lead:
            self._follow(move)
        if move.lead:
            self._lead(move)
        if move.error is not None:
            try:
                raise move.error
            finally:
                # The error's traceback holds this frame: without this, the
                # cycle kept every frame of the call (its gRPC call among them,
                # and with it an HTTP/2 stream of the connection) until the
                # collector ran.
                move = None  # type: ignore[assignment]
        return move.result  # type: ignore[return-value]

    def _follow(self, move: _Move[Any]) -> None:
        """Waits until the move is committed, or this caller is handed the
        lead, or its deadline. Not begun then (queued, or in a batch still
        waiting for the lock), the move is withdrawn and never written; begun,
        it is waited for a little longer, and its batch may still commit it
        after the caller is answered (the module's docstring)."""
        if move.wait(move.deadline - time.monotonic()):
            return
        with self._mutex:
            if move.lead or move.finished:
                return
            if move in self._queue:
                self._queue.remove(move)
            move.withdrawn = not move.started
        if move.withdrawn or not move.wait(move.begun_wait):
            raise StoreUnavailable()

    def _lead(self, leader: _Move[Any]) -> None:
        """Commits one batch (the leader's own move is its first), then hands
        the lead to the oldest move still queued. The leader waits for the
        write lock until its own deadline; the moves of a batch that never
        began are queued again, at the head, but for those out of time."""
        with self._mutex:
            batch = [self._queue.popleft() for _ in range(min(self._max_batch, len(self._queue)))]
        unbegun: list[_Move[Any]] = []
        try:
            unbegun = self._commit(batch, leader.deadline)
        finally:
            with self._mutex:
                now = time.monotonic()
                for move in reversed(unbegun):
                    if move.withdrawn or move.finished:
                        continue
                    if move is leader or now >= move.deadline:
                        move.finish(error=StoreUnavailable())
                    else:
                        self._queue.appendleft(move)
                if self._queue:
                    successor = self._queue[0]
                    successor.lead = True
                    successor.wake()
                else:
                    self._leading = False
                    self._idle.notify_all()

    def busy(self) -> bool:
        """Whether a batch is under way or a move is queued."""
        with self._mutex:
            return self._leading or bool(self._queue)

    def queued(self) -> int:
        """Moves waiting for a batch (the one committing not counted)."""
        with self._mutex:
            return len(self._queue)

    def close(self, timeout_seconds: float = 10.0) -> bool:
        """Refuses new moves and waits for those under way; whether they ended."""
        with self._mutex:
            self._stopped = True
            self._idle.wait_for(lambda: not self._leading, timeout=timeout_seconds)
            if self._leading:
                return False
            self._disconnect()
            return True

    def _connect(self) -> Connection:
        if self._connection is None:
            self._connection = self._engine.connect().execution_options(ledger_write=True)
            self._busy = None  # a pooled connection: another holder may have set its own
        return self._connection

    def _disconnect(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                connection.close()
            except DBAPIError:
                log.warning("closing the writer's connection failed", exc_info=True)

    def _commit(self, batch: list[_Move[Any]], until: float) -> list[_Move[Any]]:
        """Commits the batch, waiting for the write lock until `until` (the
        leader's deadline); returns its moves when it never began. So a lane's
        short deadline never fails another lane's move, and no caller waits
        past its own."""
        gate = self._write_gate
        if gate is not None and not gate.acquire(timeout=max(0.0, until - time.monotonic())):
            return batch
        try:
            return self._commit_in_gate(batch, until)
        finally:
            if gate is not None:
                gate.release()

    def _commit_in_gate(self, batch: list[_Move[Any]], until: float) -> list[_Move[Any]]:
        # Each pass answers at least one move, so at most len(batch) passes.
        while batch:
            batch, begun = self._attempt(batch, until)
            if not begun:
                return batch
        return []

    def _attempt(self, batch: list[_Move[Any]], until: float) -> tuple[list[_Move[Any]], bool]:
        """Commits the batch in one transaction and answers its moves; returns
        the moves to run again (a move refused after writing: see above), and
        False with the batch when it gave up waiting for the write lock."""
        outcomes: Outcomes = []
        undone: Undone = None
        self._begun = False
        try:
            with translate.translated():
                undone = self._run_batch(batch, outcomes, until)
        except LedgerError as error:
            self._log_failure(len(batch), error, until)
            self._on_error(error)
            if not self._begun and self._gave_up(error):
                self._on_failure()
                self._disconnect()
                return batch, False  # nothing written: its moves may wait on
            # Damage is told as such; any other failure of the batch as unavailable.
            self._fail(batch, error if isinstance(error, StoreDamaged) else StoreUnavailable())
            return [], True
        except BaseException as error:  # a bug: never leave a caller waiting
            log.exception("group commit failed")
            self._fail(batch, error)
            return [], True
        if undone is not None:
            self._on_failure()
            index, refusal = undone
            if translate.foreign_cause(refusal) is not None:
                # The database refused: the connection itself may be what failed
                # (SQLite opened it read-only, say). The next batch opens another.
                self._disconnect()
                if isinstance(refusal, LedgerError):
                    self._on_error(refusal)
            batch[index].finish(error=refusal)
            return batch[:index] + batch[index + 1 :], True
        for move, result, failure in outcomes:
            move.finish(result, failure)
        return [], True

    def _gave_up(self, error: BaseException) -> bool:
        """Whether the batch's failure was its wait for the write lock."""
        return translate.lock_wait_gave_up(error)

    def _run_batch(
        self,
        batch: list[_Move[Any]],
        outcomes: Outcomes,
        until: float,
    ) -> Undone:
        """Runs the batch's moves in one transaction, appending to `outcomes`;
        returns the first move that cannot be undone alone, and its failure."""
        undone: Undone = None
        connection = self._connect()
        driver: Any = connection.connection.driver_connection
        with self._begin(connection, driver, until) as transaction:
            self._begun = True
            self._on_begin(connection)
            for index, move in enumerate(batch):
                before = driver.total_changes
                result, failure, from_database = self._one(connection, move)
                # A database error may have ended the transaction itself
                # (SQLite rolls back on some): never go on after one.
                if failure is not None and (from_database or driver.total_changes != before):
                    undone = (index, failure)
                    break
                outcomes.append((move, result, failure))
            if undone is not None:
                transaction.rollback()
            else:
                self._on_end(connection)
        return undone

    def _begin(self, connection: Connection, driver: Any, until: float) -> RootTransaction:
        """The batch's transaction (BEGIN IMMEDIATE), once another process's
        write lock is free; waits for it in tries until `until` by the clock,
        then raises SQLite's "database is locked" (LOCK_TRY_SECONDS)."""
        began, said = time.monotonic(), False
        while True:
            self._set_busy_timeout(driver, min(until - time.monotonic(), LOCK_TRY_SECONDS))
            try:
                return connection.begin()
            except DBAPIError as error:
                now = time.monotonic()
                if not translate.lock_wait_gave_up(error) or now >= until:
                    raise
                if not said and now - began >= LOCK_WAIT_LOGGED_SECONDS:
                    said = True
                    self._log_lock_wait(now - began)

    def _set_busy_timeout(self, driver: Any, seconds: float) -> None:
        """One statement, left out when this connection has that timeout
        already (nearly every batch's is one whole try)."""
        busy_ms = max(1, int(seconds * 1000))
        if self._busy is None or self._busy[0] is not driver or self._busy[1] != busy_ms:
            self._busy = None  # unknown until the statement has run
            driver.execute(f"PRAGMA busy_timeout={busy_ms}")
            self._busy = (driver, busy_ms)

    def _log_lock_wait(self, waited_seconds: float) -> None:
        unsaid = self._failure_log("lock wait")
        if unsaid is not None:
            log.warning(
                "%s on %s for %.1f s: moves wait for it, each until its caller's deadline%s",
                LOCK_HELD,
                self._engine.url.database,
                waited_seconds,
                more(unsaid),
            )

    def _log_failure(self, moves: int, error: LedgerError, until: float) -> None:
        """One line for a failed batch, with the database's code and words, at
        most one an interval."""
        unsaid = self._failure_log("batch")
        if unsaid is None:
            return
        code = translate.driver_code(error.__cause__) if error.__cause__ else ""
        log.warning(
            "group commit of %d moves failed: %s (%s: %s)%s%s",
            moves,
            type(error).__name__,
            code or "no code",
            translate.driver_message(error) or "no message",
            watchdog.cut_note(until),
            more(unsaid),
        )

    def _fail(self, batch: list[_Move[Any]], error: BaseException) -> None:
        self._on_failure()
        self._disconnect()
        for move in batch:
            move.finish(error=error)

    def _one(
        self, connection: Connection, move: _Move[Any]
    ) -> tuple[Any, BaseException | None, bool]:
        """The move's result or refusal, and whether it failed in the database."""
        with self._mutex:
            if move.withdrawn or time.monotonic() > move.deadline:
                return None, StoreUnavailable(), False  # its caller has given up: do not book it
            move.started = True
        try:
            with translate.translated():
                return move.work(connection), None, False
        except LedgerError as error:
            # A refusal is an answer: it leaves its frames (and their caller's,
            # this batch's) behind, so that it and the batch hold no cycle.
            return None, _without_frames(error), translate.foreign_cause(error) is not None
        except Exception as error:
            return None, error, translate.foreign_cause(error) is not None


def _without_frames(error: BaseException) -> BaseException:
    """`error`, and the errors it was raised from, without their tracebacks."""
    seen: BaseException | None = error
    while seen is not None:
        seen.__traceback__ = None
        seen = seen.__cause__ or seen.__context__
    return error
