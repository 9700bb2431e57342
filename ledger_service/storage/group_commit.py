"""Group commit for SQLite: many moves, one durable transaction, one fsync.

SQLite has one writer at a time and every durable commit costs an fsync
(synchronous=FULL). Rather than trading durability for speed, one writer
thread takes the moves queued while the previous batch was committing, runs
each inside its own SAVEPOINT (so one move's refusal rolls back only that
move), and commits them together. No caller is answered before the commit
that holds its move is on disk.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError

from ledger_service.domain.errors import LedgerError, StoreUnavailable

T = TypeVar("T")
log = logging.getLogger(__name__)


class _Move(Generic[T]):
    def __init__(self, work: Callable[[Connection], T], deadline: float) -> None:
        self.work = work
        self.deadline = deadline
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None

    def finish(self, result: T | None = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


class GroupCommitter:
    def __init__(self, engine: Engine, *, max_batch: int = 64, max_queue: int = 1024) -> None:
        self._engine = engine
        self._max_batch = max_batch
        self._queue: queue.Queue[_Move[Any] | None] = queue.Queue(maxsize=max_queue)
        self._stopped = False
        self._writer = threading.Thread(target=self._run, name="group-commit", daemon=True)
        self._writer.start()

    def submit(self, work: Callable[[Connection], T], deadline: float) -> T:
        """Runs `work` in the next batch and returns once that batch is durable."""
        if self._stopped:
            raise StoreUnavailable()
        move: _Move[T] = _Move(work, deadline)
        try:
            self._queue.put(move, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            raise StoreUnavailable() from None
        if not move.done.wait(timeout=max(0.0, deadline - time.monotonic()) + 1.0):
            # The move may still commit later; the caller retries with the same id.
            raise StoreUnavailable()
        if move.error is not None:
            raise move.error
        return move.result  # type: ignore[return-value]

    def close(self) -> None:
        self._stopped = True
        self._queue.put(None)
        self._writer.join(timeout=10)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < self._max_batch:
                try:
                    move = self._queue.get_nowait()
                except queue.Empty:
                    break
                if move is None:
                    self._queue.put(None)  # stop after this batch
                    break
                batch.append(move)
            self._commit(batch)

    def _commit(self, batch: list[_Move[Any]]) -> None:
        outcomes: list[tuple[_Move[Any], Any, BaseException | None]] = []
        try:
            with self._engine.connect() as connection:
                connection = connection.execution_options(ledger_write=True)
                with connection.begin():
                    for move in batch:
                        outcomes.append((move, *self._one(connection, move)))
        except (DBAPIError, LedgerError) as error:
            log.warning("group commit of %d moves failed: %s", len(batch), type(error).__name__)
            for move in batch:
                move.finish(error=StoreUnavailable())
            return
        except BaseException as error:  # a bug: never leave a caller waiting
            log.exception("group commit failed")
            for move in batch:
                move.finish(error=error)
            return
        for move, result, failure in outcomes:
            move.finish(result, failure)

    @staticmethod
    def _one(connection: Connection, move: _Move[Any]) -> tuple[Any, BaseException | None]:
        if time.monotonic() > move.deadline:
            return None, StoreUnavailable()  # its caller has given up: do not book it
        savepoint = connection.begin_nested()
        try:
            result = move.work(connection)
        except LedgerError as error:
            savepoint.rollback()
            return None, error
        except DBAPIError as error:
            savepoint.rollback()
            return None, StoreUnavailable().with_traceback(error.__traceback__)
        except Exception as error:
            savepoint.rollback()
            return None, error
        savepoint.commit()
        return result, None
