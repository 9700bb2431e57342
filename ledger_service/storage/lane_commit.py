"""Group commit of one hot lane's moves on PostgreSQL, inside one replica.

Moves of a lane wait for its row lock, and each pays its own transaction,
lock wait and durable COMMIT. Moves of the same lane that arrive while one
of that lane is under way in this process queue here (no connection taken),
and the next leader runs all of them in one transaction: the lane's locks
taken by the first, each move's work in turn on its own SqlTransaction, one
COMMIT. No caller is answered before that commit (storage/group_commit.py's
rules: its leader and followers, deadlines, and a refused move's undoing).

A move's writes are deferred (SqlTransaction) and sent in a round trip of
their own before the next move begins, so a database error is told to the
move that caused it; the last move's go with the COMMIT, as a lone move's
do. Moves of different lanes never share a transaction: two replicas could
take their locks in opposite orders.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import PoolProxiedConnection

from ledger_service.domain.errors import LedgerError
from ledger_service.storage import translate
from ledger_service.storage.group_commit import GroupCommitter, Outcomes, Undone, _Move

# Lanes whose committers are kept after their moves (each a few small objects).
MAX_IDLE_LANES = 1024


class Pooled:
    """PostgreSQL: the pooled DBAPI connection a lane's batch of moves holds
    (storage/sql.py's SqlStore._pooled). Its hot statements run on it through prepared.py; a
    statement SQLAlchemy executes runs on `sqlalchemy`, a Connection made on it
    when first needed (its transaction is the batch's, begun by whichever
    statement comes first) and never closed: the batch's end gives the pooled
    connection back."""

    def __init__(self, engine: Engine, connection: PoolProxiedConnection) -> None:
        self._engine = engine
        self.connection = connection
        self.dialect = engine.dialect
        self._sqlalchemy: Connection | None = None

    @property
    def sqlalchemy(self) -> Connection:
        if self._sqlalchemy is None:
            self._sqlalchemy = Connection(self._engine, self.connection)
        return self._sqlalchemy

    def rollback(self) -> None:
        """Rolls the batch back. A connection invalidated under it (a statement
        the watch interrupted, one found lost) has no session left to roll
        back: its transaction ended with it."""
        driver = self.connection.driver_connection
        if driver is not None:
            driver.rollback()

    def roll_back_failed(self) -> None:
        """After a failed batch: its transaction rolled back through SQLAlchemy,
        as its own transaction was, so that a connection found lost takes the
        pool's other connections with it (SQLAlchemy's rule; a backend
        terminated is seldom alone) and the batch's retry gets a new one. The
        batch's own error is the one raised."""
        sqlalchemy = self.sqlalchemy
        if sqlalchemy.invalidated:
            return
        with contextlib.suppress(DBAPIError):
            if not sqlalchemy.in_transaction():
                sqlalchemy.begin()
            sqlalchemy.rollback()


class LaneCommitter(GroupCommitter):
    """One lane's committer: GroupCommitter's queue and leaders, a
    PostgreSQL transaction a batch on `session`'s pooled connection (watched)."""

    def __init__(
        self,
        session: Callable[[float], contextlib.AbstractContextManager[Pooled]],
        transaction: Callable[[Pooled], Any],
        reconnecting: Callable[[Callable[[list[Any]], Any], float], Any],
        *,
        max_batch: int,
        on_error: Callable[[LedgerError], None],
    ) -> None:
        # No engine: a batch's connection comes from `session`, whose connect
        # raises no engine event: `on_error` notes its failure.
        super().__init__(None, max_batch=max_batch, on_error=on_error)  # type: ignore[arg-type]
        self._session = session
        self._transaction = transaction
        self._reconnecting = reconnecting
        self._until = 0.0

    def _commit(self, batch: list[_Move[Any]], until: float) -> list[_Move[Any]]:
        self._until = until
        while batch:
            if time.monotonic() >= until:
                return batch  # the leader's time is up: the next leader takes them
            batch, begun = self._attempt(batch, until)
            if not begun:
                return batch
        return []

    def _gave_up(self, error: BaseException) -> bool:
        """A batch that failed before its first move held the lane's lock, at
        the leader's deadline (the watch interrupted its wait): nothing was
        written, and its moves wait on for the next leader."""
        return time.monotonic() >= self._until

    def _disconnect(self) -> None:
        pass  # each batch's connection goes back to the pool at its end

    def _run_batch(
        self,
        batch: list[_Move[Any]],
        outcomes: Outcomes,
        until: float,
    ) -> Undone:
        def transact(started: list[Any]) -> Undone:
            outcomes.clear()  # a lost connection's run left nothing
            with self._session(until) as connection:
                undone = self._run_moves(connection, batch, outcomes, started)
                if undone is not None:
                    connection.rollback()
            return undone

        # Every move is replayable: a batch whose connection died runs again.
        return self._reconnecting(transact, until)  # type: ignore[no-any-return]

    def _run_moves(
        self,
        connection: Pooled,
        batch: list[_Move[Any]],
        outcomes: Outcomes,
        started: list[Any],
    ) -> Undone:
        tx: Any = None
        owner: int | None = None  # the move whose writes are still deferred
        for index, move in enumerate(batch):
            if owner is not None and (failure := _sent(tx.flush)) is not None:
                return owner, failure
            tx = self._transaction(connection)
            started.append(tx)
            result, failure, from_database = self._one(tx, move)
            if failure is not None and translate.lost_connection(failure):
                raise failure  # the whole batch's: it runs again on a new connection
            if failure is not None and (from_database or tx.wrote):
                return index, failure
            self._begun = True
            owner = index if tx.wrote else None
            outcomes.append((move, result, failure))
        if tx is not None and (failure := _sent(tx.commit)) is not None:
            if owner is None:
                raise failure
            return owner, failure
        return None


def _sent(send: Callable[[], None]) -> BaseException | None:
    """Sends a move's deferred writes (and the COMMIT); the database's refusal
    of them, if any. A lost connection is the batch's: raised."""
    try:
        with translate.translated():
            send()
    except LedgerError as error:
        if translate.lost_connection(error):
            raise
        return error
    return None


class LaneCommitters:
    """A committer for each lane with a move under way in this process. Idle
    ones are dropped once MAX_IDLE_LANES are kept: a lane's moves still queue
    on its row lock in the database if two committers of it ever overlap."""

    def __init__(self, make: Callable[[], LaneCommitter]) -> None:
        self._make = make
        self._lanes: dict[str, LaneCommitter] = {}
        self._lock = threading.Lock()

    def of(self, lane: str) -> LaneCommitter:
        with self._lock:
            committer = self._lanes.get(lane)
            if committer is None:
                if len(self._lanes) >= MAX_IDLE_LANES:
                    self._lanes = {name: kept for name, kept in self._lanes.items() if kept.busy()}
                committer = self._lanes[lane] = self._make()
            return committer

    def queued(self) -> int:
        with self._lock:
            committers = list(self._lanes.values())
        return sum(committer.queued() for committer in committers)

    def close(self, timeout_seconds: float) -> bool:
        with self._lock:
            committers = list(self._lanes.values())
        return all(committer.close(timeout_seconds) for committer in committers)
