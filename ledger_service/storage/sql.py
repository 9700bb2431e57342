"""The SQLAlchemy store: one implementation for SQLite and PostgreSQL.

Per-lane admission is serialized by a lock on the lane's row: `SELECT ... FOR
UPDATE` on PostgreSQL. On SQLite every move goes through this process's one
writer (storage/writer.py: admission state in memory, a group commit per
batch), inside the database's single write lock taken by BEGIN IMMEDIATE.
Reads, on both, are SqlTransaction's statements.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from sqlalchemy import (
    Connection,
    Engine,
    Integer,
    String,
    and_,
    any_,
    bindparam,
    case,
    delete,
    event,
    func,
    insert,
    literal,
    select,
    text,
    true,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from ledger_service.application import deadlines
from ledger_service.application.ports import (
    EdgeQuery,
    Edges,
    EventQuery,
    StateTally,
    StoreTransaction,
)
from ledger_service.application.throttle import ERROR_LOG_INTERVAL_SECONDS, Throttle, more
from ledger_service.domain import chain, policies
from ledger_service.domain.bookings import Booking, BookingState
from ledger_service.domain.errors import LedgerError, StoreDamaged, StoreUnavailable
from ledger_service.domain.events import Event, evolve
from ledger_service.domain.policies import MAX_BUDGET_DEPTH, LanePolicy
from ledger_service.domain.window import Overdue, StoredSums, WindowState, WindowTotals
from ledger_service.storage import chaining, database, prepared, records, translate, watchdog
from ledger_service.storage.group_commit import GroupCommitter
from ledger_service.storage.horizon import APPEND_BEGINS, CommitHorizon, handed_seq
from ledger_service.storage.lane_commit import LaneCommitter, LaneCommitters, Pooled
from ledger_service.storage.pool_shares import PoolShares
from ledger_service.storage.schema import bookings, events, lanes, window_states
from ledger_service.storage.writer import WriterState

T = TypeVar("T")
log = logging.getLogger(__name__)

# PostgreSQL: every PutLane holds it alone, since its checks of the budget
# tree (a parent's depth, a subtree's, a lane's first version) read lanes it
# does not lock. Moves never take it.
CONFIGURATION_LOCK_KEY = 0x4C414E45  # "LANE"

# PostgreSQL: how long after the last move refused for a reason the write
# probe cannot see (translate.unseen_by_probe: a server out of disk, memory or
# connections) health stays NOT_SERVING. Every such refusal starts it again, so health holds steady
# while moves fail, and turns SERVING this long after the last one.
RESOURCE_HOLD_SECONDS = 10.0


def _for_a_move(context: ExceptionContext) -> bool:
    """Whether a failed statement was a move's (its connection set to write) or
    a connect's, which moves need too. A read refused for lack of resources (a
    sort past temp_file_limit, 53400) tells nothing of moves: it does not hold
    health NOT_SERVING (RESOURCE_HOLD_SECONDS) while every move is admitted."""
    connection = context.connection
    return connection is None or bool(connection.get_execution_options().get("ledger_write"))


class SqlStore:
    def __init__(
        self,
        engine: Engine,
        *,
        max_transaction_retries: int = 5,
        request_deadline_seconds: float = 5.0,
        group_commit_batch: int = 64,
        pool_shares: PoolShares | None = None,
        logs_damage: bool = True,
    ) -> None:
        self._engine = engine
        # PostgreSQL: each grant's share of the pool's connections (storage/pool_shares.py).
        self._pool_shares = pool_shares
        self._sqlite = engine.dialect.name == "sqlite"
        self._max_retries = max_transaction_retries
        self._deadline_seconds = request_deadline_seconds
        # SQLite: moves queued while a commit is on its way share the next one,
        # and the one writer keeps what moves read in memory (storage/writer.py).
        self._writer = WriterState()
        self._damage: StoreDamaged | None = None
        self._damage_lock = threading.Lock()
        # The server's log line for damage; off in a command, whose own line says it.
        self._logs_damage = logs_damage
        # A database refusing every call is said once an interval, not once a call.
        self._error_log = Throttle(ERROR_LOG_INTERVAL_SECONDS)
        # Why this process cannot write the database, while it cannot (SQLite:
        # the file; PostgreSQL: the role's privileges or a read-only database).
        self._write_problem: str | None = None
        # PostgreSQL: a move was stopped while it waited (translate.WAITED_CODES),
        # so the write probe looks for a lock another session holds.
        self._probe_writes = False
        # PostgreSQL: when a move was last refused for a reason the probe
        # cannot see (RESOURCE_HOLD_SECONDS), by time.monotonic().
        self._unseen_refusal_at: float | None = None
        # SQLite: a write failed, so the probe commits one (a full disk, say,
        # passes a write transaction rolled back), until one commits.
        self._write_failed = False
        # SQLite: a move gave up waiting for another process's write lock, so
        # the probe waits the busy timeout for it, until it gets it.
        self._lock_held = False
        # SQLite: the file was deleted or replaced under the server (for good).
        self._replaced: str | None = None
        # PostgreSQL: where readers stop (storage/horizon.py).
        self._horizon = CommitHorizon()
        # PostgreSQL: interrupts a transaction still running at its deadline.
        self._watchdog = None if self._sqlite else watchdog.Watchdog()
        event.listen(engine, "handle_error", self._on_engine_error)
        # PostgreSQL: a transaction's connection comes with ledger_write set by
        # its engine (the same pool); set on each connection, it cost 4-9 us a
        # move (docs/benchmarks.md, "the call path's layers, cut").
        self._engines = {
            write: engine.execution_options(ledger_write=write) for write in (False, True)
        }
        self._committer = (
            GroupCommitter(
                engine,
                max_batch=max(1, group_commit_batch),
                # This process's writers queue there, not in SQLite's busy handler.
                write_gate=database.write_gate(engine),
                on_begin=self._begin_batch,
                on_failure=self._writer.failed,
                on_end=self._writer.end,
                on_error=self._on_store_error,
            )
            if self._sqlite
            else None
        )
        # PostgreSQL: a lane's moves queued in this process share a transaction.
        self._lanes = (
            None
            if self._sqlite
            else LaneCommitters(
                lambda: LaneCommitter(
                    self._pooled,
                    lambda connection: SqlTransaction(connection, False, horizon=self._horizon),
                    lambda transact, until: self._reconnecting(transact, False, until),
                    max_batch=max(1, group_commit_batch),
                    on_error=self._on_lane_error,
                )
            )
        )

    @property
    def engine(self) -> Engine:
        return self._engine

    def queued_moves(self) -> int:
        """Moves waiting for a group commit: SQLite's next, or on PostgreSQL
        their lane's (those of a batch under way not counted)."""
        if self._committer is not None:
            return self._committer.queued()
        return self._lanes.queued() if self._lanes is not None else 0

    def run(
        self,
        work: Callable[[StoreTransaction], T],
        *,
        write: bool = True,
        in_turn: bool = False,
        snapshot: bool = False,
        replayable: bool = False,
        lane: str = "",
    ) -> T:
        if self._damage is not None:  # nothing is served from a damaged database
            raise StoreDamaged(self._damage.what, self._damage.advice)
        deadline = deadlines.work_deadline(self._deadline_seconds)
        for attempt in range(self._max_retries + 1):
            if time.monotonic() >= deadline:
                raise StoreUnavailable()
            try:
                with self._translated(for_a_move=write, deadline=deadline):
                    if lane and write and self._lanes is not None:
                        return self._lanes.of(lane).submit(work, deadline)
                    return self._run_once(work, write, in_turn, snapshot, replayable, deadline)
            except StoreUnavailable as error:
                if not translate.is_retryable(error) or attempt == self._max_retries:
                    raise
                pause = min(0.05 * 2**attempt, 0.5) * random.random()
                if time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)
        raise AssertionError("unreachable")

    @contextmanager
    def _translated(self, for_a_move: bool = True, deadline: float = math.inf) -> Iterator[None]:
        """translate.translated(), noting a damaged store and logging a failure
        (`for_a_move`: whether a move's, see _for_a_move; one met at `deadline`
        is said to be the watchdog's cut)."""
        try:
            with translate.translated(self._engine):
                yield
        except StoreDamaged as error:
            self.note_damage(error)
            raise
        except StoreUnavailable as error:
            cause = error.__cause__
            waited = cause is not None and translate.driver_code(cause) in translate.WAITED_CODES
            if waited and not self._sqlite:
                self._probe_writes = True
            if isinstance(cause, PoolTimeoutError):
                unsaid = self._error_log("pool")
                if unsaid is not None:
                    log.warning(
                        "no database connection free within the pool timeout%s", more(unsaid)
                    )
            elif cause is not None and (refused := translate.connect_refused(cause)):
                self._note_connect_refused(cause, *refused)
            elif (
                cause is not None
                and not translate.is_retryable(error)
                and not self._note_cannot_write(cause, for_a_move)  # said there, in words
            ):
                driver = translate.driver_error(cause)
                code = translate.driver_code(cause) or "no code"
                said = translate.driver_message(cause)
                # libpq gives a failed connection no code: its words tell the
                # kinds apart ("too many connections", "Connection refused").
                kind = said[:120] if code == "no code" else code
                unsaid = self._error_log(f"{type(driver).__name__} {kind}")
                if unsaid is not None:
                    log.warning(
                        "database error (%s): %s: %s%s%s%s",
                        code,
                        type(driver).__name__,
                        said,
                        _WAITED if waited else "",
                        watchdog.cut_note(deadline),
                        more(unsaid),
                    )
            raise

    @property
    def horizon(self) -> CommitHorizon:
        """Where this process's PostgreSQL readers stop (unused on SQLite)."""
        return self._horizon

    @property
    def damage(self) -> StoreDamaged | None:
        """The damage the database reported, if it ever did: kept until the
        process stops, since a damaged store does not heal by itself."""
        return self._damage

    def note_damage(self, error: StoreDamaged) -> None:
        """Marks the store damaged (logged once): from then on it serves nothing."""
        with self._damage_lock:
            first = self._damage is None
            if first:
                self._damage = error
        if first and self._logs_damage:
            log.error(
                "THE DATABASE IS DAMAGED (%s, %s): %s. Nothing is served from it: every "
                "move is refused with STORE_DAMAGED until it is repaired",
                error.what,
                database.redacted(database.source_url(self._engine)),
                error.advice,
            )

    def _on_engine_error(self, context: ExceptionContext) -> None:
        """Any statement on the engine (recovery's included) that meets damage,
        or a file SQLite may not write (checked again by the next ping)."""
        self._note_error(context.original_exception, _for_a_move(context))

    def _on_store_error(self, error: LedgerError) -> None:
        """A group commit failed by the database (its statements on the driver
        raise no engine event)."""
        cause = translate.foreign_cause(error)
        if cause is not None:
            self._note_error(cause)

    def _on_lane_error(self, error: LedgerError) -> None:
        """A lane's batch failed: its statements are noted by the engine's
        event, but its connection, taken by raw_connection, raises none."""
        cause = translate.foreign_cause(error)
        if cause is not None and (refused := translate.connect_refused(cause)):
            self._note_connect_refused(cause, *refused)

    def _note_error(self, foreign: BaseException, for_a_move: bool = True) -> None:
        domain = translate.translate(foreign)
        if isinstance(domain, StoreDamaged):
            self.note_damage(domain)
        code = translate.driver_code(foreign)
        if self._sqlite and code in translate.CANNOT_WRITE and self._write_problem is None:
            self._write_problem = f"a write failed ({code})"
            self._write_failed = True
        if self._sqlite and translate.lock_wait_gave_up(foreign):
            self._lock_held = True  # health asks the probe (`ping`)
        self._note_cannot_write(foreign, for_a_move)

    def _note_cannot_write(self, foreign: BaseException, for_a_move: bool = True) -> bool:
        """Whether `foreign` is a PostgreSQL write refused (translate.cannot_write:
        a privilege, a read-only database, a server out of disk, memory or
        connections): then said in words, at most once an interval, and health
        is NOT_SERVING until `ping` finds it may write again."""
        condition = None if self._sqlite else translate.cannot_write(foreign)
        if condition is None or (not for_a_move and translate.unseen_by_probe(foreign)):
            return False  # a read's lack of resources: logged as any failed read
        what, advice = condition
        if translate.unseen_by_probe(foreign):
            self._unseen_refusal_at = time.monotonic()
        problem = f"{what}: {translate.driver_message(foreign)}"
        self._cannot_write(
            problem,
            f"cannot write {translate.driver_code(foreign)}",
            f"{problem}. Health is NOT_SERVING and every move is refused "
            f"(STORE_UNAVAILABLE) until it can; {advice}, and the server serves again by itself",
        )
        return True

    def _note_connect_refused(self, cause: BaseException, what: str, advice: str) -> None:
        """A connect PostgreSQL refused for lack of slots: every call that needs a
        new connection fails until one frees, so an ERROR at most once an interval.
        The health probe, on a connection already open, passes meanwhile: health
        is held NOT_SERVING as after a move refused for lack of a resource."""
        self._unseen_refusal_at = time.monotonic()
        with self._damage_lock:
            self._write_problem = f"{what}: {translate.driver_message(cause)}"
        unsaid = self._error_log("connect refused 53300")
        if unsaid is not None:
            log.error(
                "THE DATABASE REFUSED A CONNECTION (%s): %s: %s. Calls that need a new "
                "connection are refused (STORE_UNAVAILABLE) until one frees; %s%s",
                database.redacted(database.source_url(self._engine)),
                what,
                translate.driver_message(cause),
                advice,
                more(unsaid),
            )

    def _cannot_write(self, problem: str, key: str, said: str) -> None:
        """Health is NOT_SERVING until `ping` finds the database may be written
        again; `said` at most once an interval for each `key`."""
        with self._damage_lock:
            self._write_problem = problem
        unsaid = self._error_log(key)
        if unsaid is not None:
            log.error(
                "THE DATABASE CANNOT BE WRITTEN (%s): %s%s",
                database.redacted(database.source_url(self._engine)),
                said,
                more(unsaid),
            )

    def _begin_batch(self, connection: Connection) -> None:
        self._check_file(writing=True)
        self._writer.begin(connection)

    def _check_file(self, *, writing: bool = False) -> None:
        """Raises StoreUnavailable once the SQLite file is no longer the one the
        server opened: a move written to a deleted file is lost at the next
        start. Only a restart opens the file that is there now. `writing`: the
        writer's connection is open, so its write-ahead log must be there too."""
        if self._replaced is None:
            problem = database.file_replaced(self._engine)
            if problem is None and writing:
                problem = database.wal_deleted(self._engine)
            if problem is None:
                return
            self._replaced = problem
            log.error(
                "THE DATABASE FILE IS GONE: %s. Health is NOT_SERVING and every move is "
                "refused (STORE_UNAVAILABLE); put the right file in place and restart the "
                "server",
                problem,
            )
        raise StoreUnavailable()

    def check_writable(self, stop: threading.Event | None = None) -> str | None:
        """Why the database cannot be written now (None: it can), logged when
        that changes. Health is NOT_SERVING while it cannot (`ping`). A wait
        for another process's write lock ends once `stop` is set."""
        if self._write_problem is not None:
            # Connections SQLite opened read-only keep the process's hold on the
            # files read-only, the probe's too: only fresh ones can tell.
            self._engine.dispose()
        problem = database.write_problem(
            self._engine, grow=self._write_failed, lock_held=self._lock_held, stop=stop
        )
        self._write_failed = self._write_failed and problem is not None
        self._lock_held = self._lock_held and problem is not None
        before, self._write_problem = self._write_problem, problem
        if problem is not None and problem.startswith(database.LOCK_HELD):
            if before != problem:
                log.error(
                    "THE DATABASE IS LOCKED: %s. Health is NOT_SERVING and moves are refused "
                    "(STORE_UNAVAILABLE) at their deadline; end that process's write "
                    "transaction and the server serves again by itself",
                    problem,
                )
        elif problem is not None and (before is None or before.startswith("a write failed")):
            log.error(
                "THE DATABASE CANNOT BE WRITTEN: %s. Health is NOT_SERVING and every move is "
                "refused (STORE_UNAVAILABLE) until it can; give this process write access to "
                "the file and its directory, and room to make them longer (free disk space, "
                "raise its file-size limit), and the server serves again by itself",
                problem,
            )
        elif problem is None and before is not None and not before.startswith("a write failed"):
            # Said only after the line above: a failed write the probe then
            # passes (a file-size limit near the log's size) logs nothing.
            log.info("the database can be written again")
        return problem

    def _run_once(
        self,
        work: Callable[[StoreTransaction], T],
        write: bool,
        in_turn: bool,
        snapshot: bool,
        replayable: bool,
        deadline: float,
    ) -> T:
        # A read in turn needs the writer, which cannot begin on a file it may
        # not write: while so, it reads the file as any read does, summing the
        # window afresh (the writer's memory is dropped with its failed batch).
        in_turn = in_turn and self._write_problem is None
        if write and self._replaced is not None:
            raise StoreUnavailable()  # said once, in _check_file: no batch to fail and log
        if self._committer is not None and (write or in_turn):
            return self._committer.submit(
                lambda connection: self._writer.run(
                    connection, work, _sqlite_transaction, write=write
                ),
                deadline,
            )
        transact = functools.partial(self._transact, work, write, in_turn or snapshot, deadline)
        if self._watchdog is None:
            return transact([])
        return self._reconnecting(transact, write and not replayable, deadline)

    def _reconnecting(
        self,
        transact: Callable[[list[SqlTransaction]], T],
        ambiguous_commit_fails: bool,
        deadline: float,
    ) -> T:
        """PostgreSQL: runs `transact` once more, on a new connection, when its
        connection died (translate.lost_connection: a failover, a backend
        terminated) with time left. A pooled connection killed while idle
        is only found dead by its next statement: without this, every call
        that met one failed with UNAVAILABLE. Nothing of a transaction whose
        COMMIT was not sent was kept. One whose COMMIT was sent may have been
        kept: a move's repeat is answered as the first was (its request id),
        any other write (`ambiguous_commit_fails`) fails. A connection that
        could not be made is not tried again: the call ends UNAVAILABLE by its
        deadline."""
        started: list[SqlTransaction] = []
        try:
            return transact(started)
        except (DBAPIError, StoreUnavailable) as error:  # translated by a statement, or not yet
            committing = bool(started) and started[-1].commit_sent
            if (
                not started  # no connection: refused or timed out, not lost
                or not translate.lost_connection(error)
                or (committing and ambiguous_commit_fails)
                # The new connection's handshake ends by it (watchdog.DeadlineConnection).
                or time.monotonic() >= deadline
            ):
                raise
            self._say_lost(error, "the call")
        return transact([])

    def _say_lost(self, error: BaseException, what: str) -> None:
        """Logs a lost connection that `what` runs again past, once an interval."""
        unsaid = self._error_log("lost connection")
        if unsaid is not None:
            log.warning(
                "a database connection was lost (%s: %s); %s runs again on a new connection%s",
                translate.driver_code(error.__cause__ or error) or "no code",
                translate.driver_message(error),
                what,
                more(unsaid),
            )

    def _transact(
        self,
        work: Callable[[StoreTransaction], T],
        write: bool,
        snapshot: bool,
        deadline: float,
        started: list[SqlTransaction],
    ) -> T:
        """Runs `work` in one transaction; `started` gets its SqlTransaction."""
        if self._watchdog is None:  # SQLite: local, bounded by its busy timeout and the gate
            with self._engine.connect() as connection:
                connection = connection.execution_options(ledger_write=write)
                with connection.begin():
                    return work(SqlTransaction(connection, self._sqlite))
        with self._watched(deadline, write=write) as connection:
            if snapshot and not write:
                # Reads take no lock: a move may commit between two of their
                # statements. One snapshot for all (a read-only REPEATABLE READ
                # transaction never fails to serialize) keeps, say, a kept
                # window and the bookings that crossed its edges from one instant.
                connection = connection.execution_options(isolation_level="REPEATABLE READ")
            with connection.begin():
                tx = SqlTransaction(connection, False, horizon=self._horizon)
                started.append(tx)
                result = work(tx)
                tx.commit()
            return result

    @contextmanager
    def _watched(self, deadline: float, *, write: bool = False) -> Iterator[Connection]:
        """A PostgreSQL connection under a watch until `deadline`, checkout
        included (the pool's wait, the handshake and the ping); `write`: a
        move's (ledger_write, which the error handling reads)."""
        with self._shared_watch(deadline) as watch, self._engines[write].connect() as connection:
            try:
                yield connection
            finally:
                # Before the connection goes back: one the watch interrupted is dropped.
                if watch.disarm():
                    connection.invalidate()

    @contextmanager
    def _pooled(self, deadline: float) -> Iterator[Pooled]:
        """PostgreSQL: a pooled connection for a lane's batch of moves, watched
        as _watched's, without SQLAlchemy's Connection and transaction around
        it: the batch's statements go through libpq (BEGIN with the first,
        COMMIT with the last), and those only cost CPU (docs/benchmarks.md). A
        failed batch is rolled back through SQLAlchemy (Pooled.roll_back_failed)."""
        with self._shared_watch(deadline) as watch:
            connection = self._engines[True].raw_connection()
            pooled = Pooled(self._engines[True], connection)
            try:
                yield pooled
            except BaseException:
                pooled.roll_back_failed()
                raise
            finally:
                # Before the connection goes back: one the watch interrupted
                # is dropped. Invalidated (here, or by a statement that
                # found it lost), it is back in the pool already.
                if watch.disarm() and connection.is_valid:
                    connection.invalidate()
                if connection.is_valid:
                    connection.close()

    @contextmanager
    def _shared_watch(self, deadline: float) -> Iterator[watchdog.Watch]:
        """One of the grant's share of the pool, and a watch until `deadline`
        around what is done with the connection taken under it."""
        assert self._watchdog is not None, "SQLite is local: no watch"
        owner = self._take_pool_share(deadline)
        try:
            with self._watchdog.watch(deadline) as watch:
                yield watch
        finally:
            if self._pool_shares is not None:
                self._pool_shares.give_back(owner)

    def _take_pool_share(self, deadline: float) -> str:
        """One of the current grant's share of the pool, waited for until
        `deadline`; the grant to give it back for ("": none taken)."""
        if self._pool_shares is None:
            return ""
        try:
            return self._pool_shares.take(deadline)
        except StoreUnavailable:
            unsaid = self._error_log("pool share")
            if unsaid is not None:
                log.warning(
                    "a call of grant %s waited until its deadline for a database connection: "
                    "the grant's other calls held its share of the pool "
                    "(max_connections_per_grant, %d), or the grants' calls together "
                    "held the pool's %d connections%s",
                    self._pool_shares.owner(),
                    self._pool_shares.share,
                    self._pool_shares.pool,
                    more(unsaid),
                )
            raise

    def ping(
        self, timeout_seconds: float | None = None, stop: threading.Event | None = None
    ) -> None:
        """Raises StoreUnavailable unless the database answers (on PostgreSQL
        within `timeout_seconds`, default the request deadline), StoreDamaged
        once it reported damage. On SQLite it reads the schema, which a
        damaged header or a truncated file fails, and while a file could not be
        written, checks whether it can be now (no longer once `stop` is set)."""
        if self._damage is not None:
            raise self._damage
        if self._sqlite:
            self._check_file()
            with self._translated(), self._engine.connect() as connection:
                connection.execute(text("SELECT count(*) FROM sqlite_master")).scalar_one()
            wanted = self._write_problem is not None or self._lock_held
            if wanted and self.check_writable(stop) is not None:
                raise StoreUnavailable()
            return
        bound = self._deadline_seconds if timeout_seconds is None else timeout_seconds
        deadline = time.monotonic() + bound
        with self._translated(deadline=deadline):
            connected: list[bool] = []
            try:
                self._ping_once(deadline, bound, connected)
            except DBAPIError as error:
                # A connection that died since its last use (a failover, every
                # backend terminated) says nothing of the database: once more on
                # a new one, as a call does (`_reconnecting`), by the same deadline.
                if not connected or not translate.lost_connection(error):
                    raise
                if time.monotonic() >= deadline:
                    raise
                self._say_lost(error, "the health probe")
                self._ping_once(deadline, bound, [])

    def _ping_once(self, deadline: float, bound_seconds: float, connected: list[bool]) -> None:
        """One PostgreSQL probe; `connected` gets an item once it has a connection."""
        with self._watched(deadline) as connection:
            connected.append(True)
            connection.execute(select(literal(1))).scalar_one()
            probe = self._write_problem is not None or self._probe_writes
            if probe and not self._may_write(connection, bound_seconds):
                raise StoreUnavailable()

    def _may_write(self, connection: Connection, bound_seconds: float) -> bool:
        """After a move was refused a write (translate.cannot_write)
        or stopped while it waited (translate.WAITED_CODES): whether the role
        may now write what a move writes, and take the table locks it takes,
        asked by statements that change no row (PostgreSQL checks privileges
        and read-only-ness, and takes the table's lock, before it looks for
        rows), in the ping's transaction, rolled back. A lock is waited for a
        quarter of the probe's time at most."""
        lock_timeout_ms = max(1, int(bound_seconds * 1000 / 4))
        table = ""
        try:
            connection.exec_driver_sql(f"SET LOCAL lock_timeout = {lock_timeout_ms}")
            for probed, statement in _WRITE_PROBES:
                table = probed  # the one a failure names
                connection.exec_driver_sql(statement)
        except DBAPIError as error:
            code = translate.driver_code(error)
            if code == "55P03":  # lock_not_available: another session holds the table
                connection.rollback()
                self._note_locked(connection, table)
                return False
            if translate.cannot_write(error) is None:
                raise
            self._note_cannot_write(error)
            return False
        finally:
            connection.rollback()
        refused_at = self._unseen_refusal_at
        if refused_at is not None and time.monotonic() - refused_at < RESOURCE_HOLD_SECONDS:
            return False  # passed, as it does out of disk, memory or connections: moves say more
        with self._damage_lock:
            before, self._write_problem = self._write_problem, None
            self._probe_writes = False
        if before is not None:
            log.info("the database can be written again")
        return True

    def _note_locked(self, connection: Connection, table: str) -> None:
        """Health is NOT_SERVING while `table` is locked against moves; said
        once an interval, naming the sessions that hold it."""
        holders = connection.execute(_LOCK_HOLDERS, {"table": table}).all()
        lock_timeout = connection.execute(text("SHOW lock_timeout")).scalar_one()
        connection.rollback()
        held = "; ".join(
            f"pid {pid} holds {mode}, its transaction open {int(age or 0)} s"
            for pid, mode, age in holders
        )
        problem = f"the table {table!r} is locked by another session"
        self._cannot_write(
            problem,
            f"locked {table}",
            f"{problem} ({held or 'it let go before it could be named'}): every move waits "
            f"for the lock until lock_timeout ({lock_timeout}) or its deadline, and fails. "
            "Health is NOT_SERVING until it is released; end that session's transaction (or "
            "pg_terminate_backend(pid)), and the server serves again by itself",
        )

    def close(self, timeout_seconds: float = 10.0) -> bool:
        """Waits up to `timeout_seconds` for the commit under way; whether
        nothing was left running."""
        idle = self._committer is None or self._committer.close(timeout_seconds)
        idle = (self._lanes is None or self._lanes.close(timeout_seconds)) and idle
        if self._watchdog is not None:
            self._watchdog.close()
        self._engine.dispose()
        return idle


# What a move writes: the event, the booking's and the windows' upserts, and
# a PutLane's lane. Each statement matches no row.
_WRITE_PROBES = tuple(
    (table, f"INSERT INTO {table} SELECT * FROM {table} WHERE false")
    for table in ("events", "bookings", "window_states", "lanes")
) + tuple(
    (table, f"UPDATE {table} SET {column} = {column} WHERE false")
    for table, column in (("bookings", "lane"), ("window_states", "lane"), ("lanes", "lane"))
)
# The sessions that hold a lock on a table, for the log line.
_LOCK_HOLDERS = text(
    "SELECT l.pid, l.mode, extract(epoch FROM now() - a.xact_start)::bigint"
    " FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid"
    " WHERE l.relation = to_regclass(:table) AND l.granted AND l.pid <> pg_backend_pid()"
    " ORDER BY l.pid"
)
# What a move's log line adds when it was stopped while it waited.
_WAITED = (
    " (stopped while it waited: for a lock another session holds, most often; health's "
    "write probe looks for one)"
)

_OF_MEMBERS = bookings.c.lane.in_(bindparam("members", expanding=True))
_OF_LANE = bookings.c.lane == bindparam("lane")
_IS_OPEN = bookings.c.state == "open"


# The domain's expiry rule in SQL, the one copy every query uses: "open past
# its deadline counts as expired", from that instant, swept or not
# (Booking.is_expired_at, is_open_at, amount_at in domain/bookings.py).
# tests/storage/test_expiry_rule.py holds them to the domain on both databases.
# `now` is an instant in microseconds: an int or a bound parameter.


def expired_at(now: Any) -> Any:
    """Booking.is_expired_at(now): open, and now at or past its deadline."""
    return and_(_IS_OPEN, bookings.c.expires_at_us <= now)


def held_at(now: Any) -> Any:
    """Booking.is_open_at(now): open, and its deadline still ahead."""
    return and_(_IS_OPEN, bookings.c.expires_at_us > now)


def amount_at(now: Any) -> Any:
    """Booking.amount_at(now): an expired booking counts its expire charge."""
    expire_charge = case(
        (bookings.c.expire_charge == "hold", bookings.c.hold_nanos), else_=literal(0)
    )
    return case((expired_at(now), expire_charge), else_=bookings.c.amount_nanos)


def _stored_sums(of_budget: Any, after: str, until: str, name: str) -> Any:
    """Stored amounts of the budget's bookings with after < reserved_at <= until."""
    return (
        select(
            func.coalesce(func.sum(bookings.c.amount_nanos), 0).label("amount"),
            func.coalesce(func.sum(case((_IS_OPEN, bookings.c.amount_nanos), else_=0)), 0).label(
                "open_amount"
            ),
            func.coalesce(func.sum(case((_IS_OPEN, 1), else_=0)), 0).label("open_count"),
        )
        .where(
            of_budget,
            bookings.c.reserved_at_us > bindparam(after),
            bookings.c.reserved_at_us <= bindparam(until),
        )
        .subquery(name)
    )


def _overdue(of_budget: Any) -> Any:
    return (
        select(
            func.coalesce(func.sum(bookings.c.amount_nanos), 0).label("held"),
            func.coalesce(
                func.sum(
                    case((bookings.c.expire_charge == "hold", bookings.c.hold_nanos), else_=0)
                ),
                0,
            ).label("expire_charge"),
            func.count().label("count"),
        )
        .where(
            of_budget,
            expired_at(bindparam("now")),
            # "+ 0" keeps the planners off the (lane, reserved_at) index, which would
            # walk the whole window: open holds past their deadline are few (the
            # sweeper ends them within a second) and (lane, state, expires_at) finds them.
            bookings.c.reserved_at_us + 0 > bindparam("window_start"),
            bookings.c.reserved_at_us + 0 <= bindparam("now"),
        )
        .subquery("overdue")
    )


def _window_edges(of_budget: Any) -> Any:
    """One row: the stored sums of the bookings entering the window and of those
    leaving it, and the overdue holds inside it. Three aggregates, one statement:
    each statement a move runs costs more in Python than in the database."""
    entering = _stored_sums(of_budget, "enter_after", "enter_until", "entering")
    leaving = _stored_sums(of_budget, "leave_after", "leave_until", "leaving")
    overdue = _overdue(of_budget)
    # Single rows each: joined on true, not left to a cartesian product.
    joined = entering.join(leaving, true()).join(overdue, true())
    columns = [*entering.c, *leaving.c, *overdue.c]
    return select(*columns).select_from(joined)


# SQLite: a budget of several lanes (a parent) binds its members as an
# expanding IN and runs through SQLAlchemy.
_WINDOW_EDGES = _window_edges(_OF_MEMBERS)
_EVENT_COLUMNS = tuple(column.name for column in events.c if column.name != "seq")


def _chain() -> Any:
    """(lane, parent, depth) of the lane (depth 0) and the lanes above it,
    nearest first: the budgets of a move on the lane, MAX_BUDGET_DEPTH at most."""
    chain = (
        select(lanes.c.lane, lanes.c.parent, literal(0).label("depth"))
        .where(lanes.c.lane == bindparam("lane"))
        .cte("chain", recursive=True)
    )
    above = lanes.alias("above")
    higher = select(above.c.lane, above.c.parent, (chain.c.depth + 1).label("depth")).where(
        above.c.lane == chain.c.parent, chain.c.depth < MAX_BUDGET_DEPTH - 1
    )
    return chain.union_all(higher)


def _below(top: Any) -> Any:
    """(lane, parent) of every lane under `top`, down to MAX_BUDGET_DEPTH levels
    in all: the edges policies.members walks, gathered in one statement."""
    below = (
        select(lanes.c.lane, lanes.c.parent, literal(2).label("level"))
        .where(lanes.c.parent == top)
        .cte("below", recursive=True)
    )
    deeper = select(lanes.c.lane, lanes.c.parent, (below.c.level + 1).label("level")).where(
        lanes.c.parent == below.c.lane, below.c.level < MAX_BUDGET_DEPTH
    )
    below = below.union_all(deeper)
    return select(below.c.lane, below.c.parent)


_CHAIN = _chain()
_LOCKED_CHAIN = (
    func.ledger_lock_chain(bindparam("lane"), bindparam("levels", type_=Integer))
    .table_valued(*(column.name for column in lanes.c), with_ordinality="ordinality")
    .alias("locked")
)


# The statements of every move, compiled once per dialect (storage/prepared.py).
_HOT = prepared.Statements(
    lane=select(lanes).where(lanes.c.lane == bindparam("lane")),
    # PostgreSQL: the lane's row and then each ancestor's, locked in that
    # order, each parent read from the row just locked (migration 0007).
    chain_for_update=select(*(_LOCKED_CHAIN.c[column.name] for column in lanes.c)).order_by(
        _LOCKED_CHAIN.c.ordinality
    ),
    children=select(lanes.c.lane).where(lanes.c.parent == bindparam("parent")),
    # The kept windows of the lane's budgets, and the lanes under the top one.
    chain_windows=select(window_states).join(_CHAIN, window_states.c.lane == _CHAIN.c.lane),
    chain_below=_below(
        select(_CHAIN.c.lane).order_by(_CHAIN.c.depth.desc()).limit(1).scalar_subquery()
    ),
    booking=select(bookings).where(
        bookings.c.lane == bindparam("lane"),
        bookings.c.reservation_id == bindparam("reservation_id"),
    ),
    window_state=select(window_states).where(window_states.c.lane == bindparam("lane")),
    window_edges=_window_edges(_OF_LANE),
    # PostgreSQL: a parent's budget, its members bound as one array.
    budget_window_edges=_window_edges(
        bookings.c.lane == any_(bindparam("members", type_=postgresql.ARRAY(String)))
    ),
    # PostgreSQL, first in every write: the maintenance lock, shared (a rebuild
    # takes it alone), and an xid before any seq (storage/horizon.py).
    maintenance=APPEND_BEGINS,
    chain_lock=select(func.pg_advisory_xact_lock(func.hashtextextended(bindparam("lane"), 0))),
    configuration_lock=text(f"SELECT pg_advisory_xact_lock({CONFIGURATION_LOCK_KEY})"),
    visible_last_seq=select(func.coalesce(func.max(events.c.seq), 0)).where(
        events.c.seq <= bindparam("horizon")
    ),
    commit=text("COMMIT"),
    insert_event=insert(events)
    .values({name: bindparam(name) for name in _EVENT_COLUMNS})
    .returning(events.c.seq),
    # PostgreSQL: a seq taken behind the row locks of a lane and its ancestors,
    # and the event that uses it. None for a lane that does not exist yet.
    next_seq=select(func.nextval("events_seq_seq")).where(lanes.c.lane == bindparam("lane")),
    insert_event_at=insert(events).values(
        {name: bindparam(name) for name in ("seq", *_EVENT_COLUMNS)}
    ),
    event=select(events).where(events.c.seq == bindparam("seq")),
    correction=select(events).where(
        events.c.lane == bindparam("lane"),
        events.c.kind == "corrected",
        events.c.correction_id == bindparam("correction_id"),
    ),
    save_lane=prepared.upsert(lanes, ("lane",)),
    save_booking=prepared.upsert(bookings, ("lane", "reservation_id")),
    save_window_state=prepared.upsert(window_states, ("lane",)),
)


@dataclasses.dataclass
class _Known:
    """What one transaction learnt behind its locks (which keep it true until
    commit): lane policies, budget members, chain heads and kept windows."""

    lanes: dict[str, LanePolicy] = dataclasses.field(default_factory=dict)
    members: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    heads: dict[str, str] = dataclasses.field(default_factory=dict)
    windows: dict[str, WindowState] = dataclasses.field(default_factory=dict)


def _sqlite_transaction(connection: Connection) -> SqlTransaction:
    return SqlTransaction(connection, True)


class SqlTransaction:
    """One transaction's statements. On PostgreSQL a move is three round trips:
    BEGIN with the locks of its lane and every budget above it, what the move
    reads of them and a seq for its event (lock_lane); every budget's window
    edges; the event's INSERT, the booking and window writes and the COMMIT
    (deferred, and sent before any later statement)."""

    def __init__(
        self,
        connection: Connection | Pooled,
        is_sqlite: bool,
        *,
        horizon: CommitHorizon | None = None,
    ) -> None:
        self._raw = connection
        self._sqlite = is_sqlite
        self._memo = _Known()
        self._horizon = horizon
        self._deferred: list[prepared.Call] = []
        self._maintained = False  # PostgreSQL: the maintenance lock is held
        self._chained: set[str] = set()  # PostgreSQL: lanes whose appends are serialized here
        self._prefetched_bookings: dict[tuple[str, str], Booking | None] = {}
        self._prefetched_windows: dict[str, WindowState | None] = {}
        # PostgreSQL: a seq taken behind these lanes' row locks, not yet used.
        self._taken_seq: tuple[frozenset[str], int] | None = None
        # Whether the transaction's first lock found its lane (None: no lock yet).
        self._seq_useful: bool | None = None
        # PostgreSQL: the COMMIT has been sent; if the connection dies now, the
        # transaction may have been kept or not.
        self.commit_sent = False
        # PostgreSQL: a write was sent or deferred (a batch's move that cannot
        # be undone alone: storage/lane_commit.py).
        self.wrote = False

    @property
    def _carrier(self) -> Connection | Pooled:
        """What the hot statements run on, once the writes deferred ahead of
        any statement are sent."""
        if self._deferred:
            self.flush()
        return self._raw

    @property
    def _connection(self) -> Connection:
        """SQLAlchemy's Connection, once the writes deferred ahead of any statement are sent."""
        raw = self._carrier
        return raw if isinstance(raw, Connection) else raw.sqlalchemy

    def commit(self) -> None:
        """PostgreSQL: the deferred writes and the COMMIT, in one round trip.
        (The transaction's own commit then finds nothing left to do.)"""
        calls, self._deferred = self._deferred, []
        self.commit_sent = True
        prepared.pipelined(self._raw, [*calls, (_HOT("commit", self._raw), {})])

    def flush(self) -> None:
        """PostgreSQL: sends the deferred writes, in one round trip, without COMMIT."""
        calls, self._deferred = self._deferred, []
        for cursor in prepared.pipelined(self._raw, calls) if calls else ():
            cursor.close()

    def _defer(self, name: str, values: dict[str, Any]) -> None:
        self.wrote = True
        self._deferred.append((_HOT(name, self._raw), values))

    # Lanes -----------------------------------------------------------------

    def lock_lane(
        self, lane: str, reservation_id: str = "", *, budgets: bool = True
    ) -> LanePolicy | None:
        # Known only once locked in this transaction.
        policy = self._memo.lanes.get(lane)
        if policy is not None:
            return policy
        if not self._sqlite:
            return self._lock_lane_and_read(lane, reservation_id, budgets)
        row = _HOT("lane", self._raw).mapping(self._carrier, {"lane": lane})
        if row is None:
            return None
        policy = self._memo.lanes[lane] = records.lane_from_row(row)
        return policy

    def lock_configuration(self) -> None:
        if self._sqlite:
            return  # one writer at a time already
        calls = [*self._maintenance_calls(), (_HOT("configuration_lock", self._raw), {})]
        for cursor in self._took_maintenance(prepared.pipelined(self._carrier, calls)):
            cursor.close()

    def _maintenance_calls(self) -> list[prepared.Call]:
        if self._maintained:
            return []
        return [(_HOT("maintenance", self._raw), {}), (chaining.state_statement(self._raw), {})]

    def _took_maintenance(self, cursors: list[Any]) -> list[Any]:
        """Checks the marker read behind the maintenance lock; the other cursors."""
        if self._maintained:
            return cursors
        cursors[0].close()
        chaining.check_state(cursors[1].fetchone())
        cursors[1].close()
        self._maintained = True
        return cursors[2:]

    def _lock_lane_and_read(
        self, lane: str, reservation_id: str, budgets: bool
    ) -> LanePolicy | None:
        """PostgreSQL: one round trip takes the locks (the maintenance lock
        first, then the rows of the lane and its ancestors, nearest first) and,
        behind them, reads what a move on the lane reads next: its budgets'
        kept windows and members, its chain head and its booking."""
        keys = {"lane": lane}
        levels = {"lane": lane, "levels": MAX_BUDGET_DEPTH if budgets else 1}
        reads: list[prepared.Call] = [
            (_HOT("chain_for_update", self._raw), levels),
            (_HOT("chain_windows", self._raw), keys),
            (_HOT("chain_below", self._raw), keys),
            (chaining.head_statement(self._raw), keys),
        ]
        if reservation_id:
            booking_keys = {"lane": lane, "reservation_id": reservation_id}
            reads.append((_HOT("booking", self._raw), booking_keys))
        # The seq of the move's next event, taken behind the row locks of its
        # lane and every budget above it (so every budget's events are in seq
        # order as its lock admitted them) and after the xid (storage/horizon.py):
        # its INSERT then waits for the COMMIT's round trip. Unused, it is a
        # hole. None is taken when the first lock found no lane: a new lane's
        # event takes its seq with its INSERT.
        take_seq = self._seq_useful is not False
        if take_seq:
            reads.append((_HOT("next_seq", self._raw), keys))
        cursors = self._took_maintenance(
            prepared.pipelined(self._carrier, [*self._maintenance_calls(), *reads])
        )
        locked = [records.lane_from_row(row) for row in _mappings(reads[0], cursors[0])]
        windows = {row["lane"]: _window_state_of(row) for row in _mappings(reads[1], cursors[1])}
        below = cursors[2].fetchall()
        head = cursors[3].fetchone()
        booking = prepared.fetched_mapping(reads[4], cursors[4]) if reservation_id else None
        seq = cursors[-1].fetchone() if take_seq else None
        if self._seq_useful is None:
            self._seq_useful = bool(locked)
        if not locked:
            return None  # nothing was locked: nothing read behind the lock is kept
        self._chained.update(policy.lane for policy in locked)
        # A seq taken before this lock would put this move's event before
        # events this lock admitted first: it is dropped (a hole) for this one.
        self._taken_seq = (frozenset(self._chained), int(seq[0])) if seq is not None else None
        children: dict[str, list[str]] = {}
        for child, parent in below:
            children.setdefault(parent, []).append(child)
        for policy in locked:
            self._memo.lanes[policy.lane] = policy
            self._prefetched_windows[policy.lane] = windows.get(policy.lane)
            members = policies.members(policy.lane, lambda parent: children.get(parent, ()))
            self._memo.members[policy.lane] = members
        self._memo.heads[lane] = (head[0] if head is not None else None) or chain.GENESIS_HASH
        if reservation_id:
            key = (lane, reservation_id)
            self._prefetched_bookings[key] = records.booking_from_row(booking) if booking else None
        return locked[0]

    def get_lane(self, lane: str) -> LanePolicy | None:
        row = _HOT("lane", self._raw).mapping(self._carrier, {"lane": lane})
        return records.lane_from_row(row) if row is not None else None

    def list_lanes(self, after_lane: str, limit: int) -> Sequence[LanePolicy]:
        rows = self._connection.execute(
            select(lanes).where(lanes.c.lane > after_lane).order_by(lanes.c.lane).limit(limit)
        ).mappings()
        return [records.lane_from_row(row) for row in rows]

    def save_lane(self, policy: LanePolicy) -> None:
        self.wrote = True
        _HOT("save_lane", self._raw).run(self._carrier, records.lane_values(policy))
        self._memo.lanes[policy.lane] = policy
        self._memo.members.clear()

    # Bookings --------------------------------------------------------------

    def get_booking(self, lane: str, reservation_id: str) -> Booking | None:
        key = (lane, reservation_id)
        if key in self._prefetched_bookings:
            return self._prefetched_bookings.pop(key)
        row = _HOT("booking", self._raw).mapping(
            self._carrier, {"lane": lane, "reservation_id": reservation_id}
        )
        return records.booking_from_row(row) if row is not None else None

    def save_booking(self, booking: Booking) -> None:
        values = records.booking_values(booking)
        self._prefetched_bookings.pop((booking.lane, booking.reservation_id), None)
        if self._sqlite:
            _HOT("save_booking", self._raw).run(self._carrier, values)
        else:
            self._defer("save_booking", values)

    def subtree(self, lane: str, max_depth: int) -> Sequence[Sequence[str]]:
        return policies.subtree(lane, self._children_of, max_depth)

    def _children_of(self, parent: str) -> list[str]:
        children = _HOT("children", self._raw)
        return [name for (name,) in children.all(self._carrier, {"parent": parent})]

    def _budget_lanes(self, lane: str) -> list[str]:
        # A budget's members do not change inside a move (PutLane drops its kept
        # windows), so one look per transaction is enough.
        members = self._memo.members.get(lane)
        if members is None:
            members = policies.members(lane, self._children_of)
            self._memo.members[lane] = members
        return members

    def _single(self, lane: str) -> bool:
        """Whether the lane's budget is its own bookings only (no lanes below it)."""
        return self._budget_lanes(lane) == [lane]

    def _of_budget(self, lane: str) -> Any:
        members = self._budget_lanes(lane)
        return bookings.c.lane == lane if len(members) == 1 else bookings.c.lane.in_(members)

    def window_state(self, lane: str) -> WindowState | None:
        # Kept windows are a table on PostgreSQL only: SQLite's are the one
        # writer's memory (storage/writer.py), which moves and balances read.
        known = self._memo.windows.get(lane)
        if known is not None or self._sqlite:
            return known
        if lane in self._prefetched_windows:
            state = self._prefetched_windows.pop(lane)
        else:
            row = _HOT("window_state", self._raw).mapping(self._carrier, {"lane": lane})
            state = _window_state_of(row) if row is not None else None
        if state is not None:
            self._memo.windows[lane] = state
        return state

    def save_window_state(self, state: WindowState) -> None:
        if not self._sqlite:
            self._defer("save_window_state", records.window_values(state))
        self._memo.windows[state.lane] = state

    def drop_window_states(self, lanes: Sequence[str]) -> None:
        self._memo.members.clear()
        for lane in lanes:
            self._memo.windows.pop(lane, None)
        if lanes and not self._sqlite:
            self.wrote = True
            self._connection.execute(delete(window_states).where(window_states.c.lane.in_(lanes)))

    def window_edges(self, queries: Sequence[EdgeQuery]) -> list[Edges]:
        if self._sqlite:  # a read beside the writer, which answers the moves' own
            rows = [self._edges_row(query) for query in queries]
        else:  # every budget's edges in one round trip
            calls = [self._edges_call(query) for query in queries]
            rows = [cursor.fetchone() for cursor in prepared.pipelined(self._carrier, calls)]
        return [_edges_of(row) for row in rows]

    def _edges_call(self, query: EdgeQuery) -> prepared.Call:
        """PostgreSQL: a lane's own budget by its name, a parent's by its members."""
        members = self._budget_lanes(query.lane)
        if len(members) == 1:
            return _HOT("window_edges", self._raw), {"lane": query.lane, **_edge_bounds(query)}
        return _HOT("budget_window_edges", self._raw), {"members": members, **_edge_bounds(query)}

    def _edges_row(self, query: EdgeQuery) -> Sequence[Any]:
        """SQLite: prepared for a lane that is its own budget (most reads),
        through SQLAlchemy's expanding IN for a parent."""
        members = self._budget_lanes(query.lane)
        if len(members) == 1:
            values = {"lane": query.lane, **_edge_bounds(query)}
            row = _HOT("window_edges", self._raw).one(self._carrier, values)
        else:
            values = {"members": members, **_edge_bounds(query)}
            row = self._connection.execute(_WINDOW_EDGES, values).one()
        assert row is not None
        return row

    def _in_window(self, lane: str, now_us: int, window_us: int) -> Any:
        return and_(
            self._of_budget(lane),
            bookings.c.reserved_at_us > now_us - window_us,
            bookings.c.reserved_at_us <= now_us,
            bookings.c.state != "rejected",
        )

    def window_totals(self, lane: str, now_us: int, window_us: int) -> WindowTotals:
        is_held = held_at(now_us)
        held = func.coalesce(func.sum(case((is_held, bookings.c.amount_nanos), else_=0)), 0)
        charged = func.coalesce(func.sum(case((is_held, literal(0)), else_=amount_at(now_us))), 0)
        open_count = func.coalesce(func.sum(case((is_held, 1), else_=0)), 0)
        # Translated here, not only at the transaction's end: a sum past the
        # database's integers is the request's SumOutOfRange, which its move
        # names by field (application/ledger.py).
        with translate.translated():
            row = self._connection.execute(
                select(held, charged, open_count).where(self._in_window(lane, now_us, window_us))
            ).one()
        return WindowTotals(int(row[0]), int(row[1]), int(row[2]))

    def aging(self, lane: str, now_us: int, window_us: int) -> Iterator[tuple[int, int]]:
        result = self._connection.execute(
            select(bookings.c.reserved_at_us, amount_at(now_us))
            .where(self._in_window(lane, now_us, window_us))
            .order_by(bookings.c.reserved_at_us)
        )
        for reserved_at_us, amount in result:
            yield int(reserved_at_us), int(amount)

    def expired_open_bookings(self, now_us: int, limit: int) -> Sequence[Booking]:
        rows = self._connection.execute(
            select(bookings)
            .where(expired_at(now_us))
            .order_by(bookings.c.expires_at_us)
            .limit(limit)
        ).mappings()
        return [records.booking_from_row(row) for row in rows]

    # Events ----------------------------------------------------------------

    def append(self, event: Event) -> Event:
        if not self._sqlite:
            self._serialize_chain(event.lane)
        # The lane's last hash, read where no append to the lane can race it.
        previous = self._memo.heads.get(event.lane)
        if previous is None:
            previous = chaining.lane_head(self._connection, event.lane)
        digest = chain.event_hash(previous, event)
        values = records.event_values(event)
        values["hash"], values["previous_hash"] = digest, previous
        if self._taken_seq is not None and event.lane in self._taken_seq[0]:
            seq, self._taken_seq = self._taken_seq[1], None
            self._defer("insert_event_at", {**values, "seq": seq})
        else:
            self.wrote = True
            row = _HOT("insert_event", self._raw).one(self._carrier, values)
            assert row is not None
            seq = int(row[0])
        # SQLite advances the marker (PostgreSQL read it behind the maintenance lock).
        if self._sqlite:
            chaining.advance_position(self._connection, seq)
        self._memo.heads[event.lane] = digest
        if event.policy is not None:
            # As a reader will see it: the policy through its JSON column.
            return records.event_from_row({**values, "seq": seq})
        return evolve(event, seq=seq, hash=digest, previous_hash=previous)

    def _serialize_chain(self, lane: str) -> None:
        """PostgreSQL: holds the maintenance lock and a lock that serializes the
        lane's appends: its row lock, or for a lane without a row yet (its first
        PutLane) an advisory lock on its name."""
        calls = self._maintenance_calls()
        if lane not in self._chained:
            calls.append((_HOT("chain_lock", self._raw), {"lane": lane}))
            self._memo.heads.pop(lane, None)  # read again behind the lock
        if calls:
            for cursor in self._took_maintenance(prepared.pipelined(self._carrier, calls)):
                cursor.close()
        self._chained.add(lane)

    def get_event(self, seq: int) -> Event | None:
        row = _HOT("event", self._raw).mapping(self._carrier, {"seq": seq})
        return records.event_from_row(row) if row is not None else None

    def get_correction(self, lane: str, correction_id: str) -> Event | None:
        row = _HOT("correction", self._raw).mapping(
            self._carrier, {"lane": lane, "correction_id": correction_id}
        )
        return records.event_from_row(row) if row is not None else None

    def list_events(self, query: EventQuery) -> Sequence[Event]:
        # Plain rows of EVENT_COLUMNS, converted in one call, cheaper than a row
        # mapping and an event_from_row per event (a `ledger verify` reads
        # every event this way).
        if self._horizon is None or (query.lane_locked and query.lane):
            # SQLite, or a reader holding the lane's lock: no lane's append (of
            # the lane's: none) is in flight past what the read sees.
            return self._events_up_to(query, query.after_seq, None, query.limit)
        # PostgreSQL: never past an append still in flight. A page full below
        # the horizon as it stands holds no seq such an append could take, so
        # only a page that ends short waits for them and reads on.
        horizon = self._horizon.advance(self._connection, wanted=0)
        page = list(self._events_up_to(query, query.after_seq, horizon, query.limit))
        if len(page) == query.limit:
            return page
        after_seq = max(query.after_seq, horizon)
        waited = self._horizon.advance(self._connection)
        if waited > after_seq:
            page.extend(self._events_up_to(query, after_seq, waited, query.limit - len(page)))
        return page

    def _events_up_to(
        self, query: EventQuery, after_seq: int, horizon: int | None, limit: int
    ) -> Sequence[Event]:
        columns = [events.c[name] for name in records.EVENT_COLUMNS]
        statement = select(*columns).where(events.c.seq > after_seq)
        if horizon is not None:
            statement = statement.where(events.c.seq <= horizon)
        if query.lane:
            statement = statement.where(events.c.lane == query.lane)
        if query.reservation_id:
            statement = statement.where(events.c.reservation_id == query.reservation_id)
        if query.kinds:
            statement = statement.where(events.c.kind.in_(query.kinds))
        rows = self._connection.execute(statement.order_by(events.c.seq).limit(limit)).all()
        return records.events_from_rows(rows)

    def last_seq(self) -> int:
        if self._horizon is not None:  # the last event at or below the horizon
            horizon = self._horizon.advance(self._connection)
            row = _HOT("visible_last_seq", self._raw).one(self._carrier, {"horizon": horizon})
            return int(row[0]) if row is not None else 0
        return self._highest_seq()

    def last_handed_seq(self) -> int:
        # SQLite's one writer hands out the seq after the highest written.
        return self._highest_seq() if self._sqlite else handed_seq(self._connection)

    def _highest_seq(self) -> int:
        return int(
            self._connection.execute(select(func.coalesce(func.max(events.c.seq), 0))).scalar_one()
        )

    def execute_text(self, sql: str) -> None:
        """For tests of the append-only guard only."""
        self._connection.execute(text(sql))

    # The audit ---------------------------------------------------------------

    @staticmethod
    def _reserved_inside(lanes_of_budget: Sequence[str], now_us: int, window_us: int) -> Any:
        """Every booking of the budget reserved inside the window, denied ones included."""
        return and_(
            bookings.c.lane.in_(list(lanes_of_budget)),
            bookings.c.reserved_at_us > now_us - window_us,
            bookings.c.reserved_at_us <= now_us,
        )

    def window_tally(
        self, lanes: Sequence[str], now_us: int, window_us: int
    ) -> Sequence[StateTally]:
        state_now = case(
            (expired_at(now_us), literal("expired")),
            else_=bookings.c.state,
        )
        # Grouped in an outer query: PostgreSQL cannot match a GROUP BY on an
        # expression with bound parameters to the same expression in SELECT.
        per_booking = (
            select(state_now.label("state"), amount_at(now_us).label("amount"))
            .where(self._reserved_inside(lanes, now_us, window_us))
            .subquery()
        )
        rows = self._connection.execute(
            select(
                per_booking.c.state,
                func.count(),
                func.coalesce(func.sum(per_booking.c.amount), 0),
            ).group_by(per_booking.c.state)
        )
        return [
            StateTally(BookingState(state), int(count), int(amount))
            for state, count, amount in rows
        ]

    def biggest_bookings(
        self, lanes: Sequence[str], now_us: int, window_us: int, limit: int
    ) -> Sequence[Booking]:
        amount = amount_at(now_us)
        rows = self._connection.execute(
            select(bookings)
            .where(self._reserved_inside(lanes, now_us, window_us), amount > 0)
            .order_by(amount.desc(), bookings.c.reserved_at_us, bookings.c.reservation_id)
            .limit(limit)
        ).mappings()
        return [records.booking_from_row(row) for row in rows]

    def next_release(
        self, lanes: Sequence[str], now_us: int, window_us: int
    ) -> tuple[int, int] | None:
        amount = amount_at(now_us)
        counting = and_(self._reserved_inside(lanes, now_us, window_us), amount > 0)
        oldest = self._connection.execute(
            select(func.min(bookings.c.reserved_at_us)).where(counting)
        ).scalar_one()
        if oldest is None:
            return None
        freed = self._connection.execute(
            select(func.coalesce(func.sum(amount), 0)).where(
                counting, bookings.c.reserved_at_us == oldest
            )
        ).scalar_one()
        return int(oldest), int(freed)


def _window_state_of(row: dict[str, Any]) -> WindowState:
    sums = StoredSums(
        int(row["amount_nanos"]), int(row["open_amount_nanos"]), int(row["open_bookings"])
    )
    return WindowState(str(row["lane"]), int(row["window_us"]), int(row["as_of_us"]), sums)


def _edge_bounds(query: EdgeQuery) -> dict[str, int]:
    return {
        "enter_after": query.entering[0],
        "enter_until": query.entering[1],
        "leave_after": query.leaving[0],
        "leave_until": query.leaving[1],
        "now": query.now_us,
        "window_start": query.now_us - query.window_us,
    }


def _edges_of(row: Sequence[Any]) -> Edges:
    values = [int(value) for value in row[0:9]]
    return StoredSums(*values[0:3]), StoredSums(*values[3:6]), Overdue(*values[6:9])


def _mappings(call: prepared.Call, cursor: Any) -> list[dict[str, Any]]:
    rows = [call[0].as_mapping(row, cursor) for row in cursor.fetchall()]
    return [row for row in rows if row is not None]
