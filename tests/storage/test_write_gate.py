"""This process's SQLite writers queue on one lock (storage/database.py,
write_gate), not in SQLite's busy handler: a move behind a snapshot's or a
rebuild's write transaction gets in when that one commits, however long it
took, within the move's own deadline. In SQLite's busy handler it would
sleep in growing steps (1, 2, 5, ... 100 ms) and fail at busy_timeout."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from ledger_service.application.ledger import Ledger
from ledger_service.domain import moves
from ledger_service.domain.clock import ManualClock
from ledger_service.domain.errors import StoreUnavailable
from ledger_service.recovery.store import SqlRecoveryStore
from ledger_service.storage import database, migrate
from ledger_service.storage.sql import SqlStore
from tests.storage.conftest import RECALL, START_US

# SQLite's own wait for the write lock, far shorter than the hold below.
BUSY_TIMEOUT_MS = 200
HOLD_SECONDS = 0.6


def _ledger(
    tmp_path: Path, *, group_commit_batch: int = 64, deadline_seconds: float = 5.0
) -> tuple[Ledger, SqlStore]:
    limits = database.EngineLimits(sqlite_busy_timeout_ms=BUSY_TIMEOUT_MS)
    engine = database.create(f"sqlite:///{tmp_path}/gate.db", limits)
    migrate.upgrade(engine)
    sql_store = SqlStore(
        engine, request_deadline_seconds=deadline_seconds, group_commit_batch=group_commit_batch
    )
    ledger = Ledger(sql_store, ManualClock(START_US))
    ledger.put_lane(RECALL)
    return ledger, sql_store


def _hold_a_write(recovery: SqlRecoveryStore, holding: threading.Event) -> None:
    with recovery._writing():
        holding.set()
        time.sleep(HOLD_SECONDS)


@pytest.mark.parametrize("group_commit_batch", [64, 1], ids=["group commit", "one by one"])
def test_a_move_waits_for_an_in_process_writer_past_sqlites_busy_timeout(
    tmp_path: Path, group_commit_batch: int
) -> None:
    ledger, store = _ledger(tmp_path, group_commit_batch=group_commit_batch)
    try:
        recovery = SqlRecoveryStore(store.engine)
        holding = threading.Event()
        writer = threading.Thread(target=_hold_a_write, args=(recovery, holding))
        writer.start()
        assert holding.wait(5.0)
        command = moves.ReserveCommand(RECALL.lane, "r-1", "jev", 4_000, 100)
        assert ledger.reserve(command).admitted  # not StoreUnavailable after 200 ms
        writer.join()
    finally:
        store.close()


def test_a_move_still_gives_up_at_its_deadline(tmp_path: Path) -> None:
    """A gate held for good (a stuck writer) costs a move its deadline, never a hang."""
    ledger, store = _ledger(tmp_path, deadline_seconds=0.2)
    try:
        gate = database.write_gate(store.engine)
        assert gate is not None
        with gate:
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                ledger.reserve(moves.ReserveCommand(RECALL.lane, "r-1", "jev", 4_000, 100))
            assert time.monotonic() - started < 5.0
    finally:
        store.close()
