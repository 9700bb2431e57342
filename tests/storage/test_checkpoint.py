"""SQLite's WAL checkpoints run in a thread of their own (storage/checkpoint.py),
not inside the commit that fills the WAL; the writer keeps SQLite's own as a
safety net, and closing the store stops the thread."""

from __future__ import annotations

import time
from pathlib import Path

import sqlalchemy as sa

from ledger_service.application.ledger import Ledger
from ledger_service.domain import moves
from ledger_service.domain.clock import ManualClock
from ledger_service.storage import checkpoint, database, migrate
from ledger_service.storage.sql import SqlStore
from tests.storage.conftest import RECALL, START_US

WAIT_SECONDS = 10.0


def _store(url: str, interval_seconds: float) -> SqlStore:
    engine = database.create(url, database.EngineLimits())
    migrate.upgrade(engine)
    return SqlStore(engine, checkpoint_interval_seconds=interval_seconds)


def _moves(store: SqlStore, count: int) -> None:
    ledger = Ledger(store, ManualClock(START_US))
    ledger.put_lane(RECALL)
    for number in range(count):
        command = moves.ReserveCommand(RECALL.lane, f"r-{number}", "jev", 4_000, 100)
        assert ledger.reserve(command).admitted


def test_commits_are_checkpointed_by_the_thread(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    store = _store(f"sqlite:///{path}", interval_seconds=0.01)
    try:
        _moves(store, 30)
        deadline = time.monotonic() + WAIT_SECONDS
        count, last = store.checkpoints()
        while (last is None or last[1] != last[2]) and time.monotonic() < deadline:
            time.sleep(0.01)
            count, last = store.checkpoints()
        assert count >= 1
        assert last is not None
        busy, frames, copied = last
        # Every frame of the WAL copied back into the database file.
        assert (busy, copied) == (0, frames) and frames > 0
        with store.engine.connect() as connection:
            rows = connection.execute(sa.text("SELECT count(*) FROM bookings")).scalar_one()
        assert rows == 30
    finally:
        store.close()


def test_the_writer_keeps_a_safety_net_and_close_stops_the_thread(tmp_path: Path) -> None:
    store = _store(f"sqlite:///{tmp_path}/ledger.db", interval_seconds=0.01)
    _moves(store, 1)
    committer = store._committer
    assert committer is not None and committer._connection is not None
    driver = committer._connection.connection.driver_connection
    assert driver is not None
    (pages,) = driver.execute("PRAGMA wal_autocheckpoint").fetchone()
    assert pages == checkpoint.SAFETY_NET_PAGES
    thread = store._checkpointer._thread if store._checkpointer is not None else None
    assert thread is not None and thread.is_alive()
    store.close()
    assert not thread.is_alive()


def test_without_the_thread_sqlite_checkpoints_in_the_commit(tmp_path: Path) -> None:
    store = _store(f"sqlite:///{tmp_path}/ledger.db", interval_seconds=0)
    try:
        _moves(store, 1)
        assert store.checkpoints() == (0, None)
        committer = store._committer
        assert committer is not None and committer._connection is not None
        driver = committer._connection.connection.driver_connection
        assert driver is not None
        (pages,) = driver.execute("PRAGMA wal_autocheckpoint").fetchone()
        assert pages == 1000  # SQLite's default: the commit that fills the WAL checkpoints
    finally:
        store.close()
