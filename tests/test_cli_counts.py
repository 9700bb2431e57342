"""Counts read as English: `ledger verify` and `ledger snapshot` on a ledger of
one lane said "1 events, 1 lanes, 0 bookings" (an operator's report, 2026-12).

The commands run in process on a SQLite ledger written through the
application layer, as tests/recovery does; no server is started.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from ledger_service import cli
from ledger_service.application.ledger import Ledger
from ledger_service.domain.clock import ManualClock
from ledger_service.domain.counts import counted
from ledger_service.domain.moves import ReserveCommand
from ledger_service.storage import database, migrate
from ledger_service.storage.sql import SqlStore
from tests.storage.conftest import RECALL, START_US


def test_a_count_of_one_takes_the_singular_and_any_other_the_plural() -> None:
    assert counted(1, "lane") == "1 lane"
    assert [counted(n, "booking") for n in (0, 2)] == ["0 bookings", "2 bookings"]
    assert counted(1, "entry", "entries") == "1 entry"
    assert counted(3, "entry", "entries") == "3 entries"


@pytest.fixture
def one_lane(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Ledger]:
    """A ledger of one lane in tmp_path/ledger.db, where --data-dir finds it."""
    for key in ("LEDGER_DATABASE_URL", "LEDGER_DATA_DIR"):
        monkeypatch.delenv(key, raising=False)
    engine = database.create(f"sqlite:///{tmp_path}/ledger.db", database.EngineLimits(pool_size=2))
    migrate.upgrade(engine)
    store = SqlStore(engine, request_deadline_seconds=10.0)
    ledger = Ledger(store, ManualClock(START_US))
    ledger.put_lane(RECALL)
    try:
        yield ledger
    finally:
        store.close()


def _run(capsys: pytest.CaptureFixture[str], *arguments: str) -> str:
    assert cli.main(list(arguments)) == 0
    return capsys.readouterr().out


def test_verify_and_snapshot_count_one_lane_and_one_event_in_the_singular(
    one_lane: Ledger, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    verified = _run(capsys, "verify", "--data-dir", str(tmp_path), "--at-us", str(START_US))
    assert verified.startswith("verified 1 event, 1 lane, 0 bookings, "), verified
    snapshot = _run(capsys, "snapshot", "--data-dir", str(tmp_path))
    assert ": 1 lane, 0 bookings, digest " in snapshot, snapshot


def test_one_booking_is_counted_in_the_singular(
    one_lane: Ledger, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    one_lane.reserve(ReserveCommand("recall", "r-1", "jev", 7000, 200))
    verified = _run(capsys, "verify", "--data-dir", str(tmp_path), "--at-us", str(START_US))
    assert verified.startswith("verified 2 events, 1 lane, 1 booking, "), verified
    snapshot = _run(capsys, "snapshot", "--data-dir", str(tmp_path))
    assert ": 1 lane, 1 booking, digest " in snapshot, snapshot
