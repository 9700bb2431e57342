"""An event deleted by hand from the middle of the log: what the rebuild
says when its fold cannot apply a later event (docs/recovery.md)."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from ledger_service.recovery.rebuild import FULL_LOG_SOURCE, Route
from ledger_service.recovery.store import RebuildFailed
from tests.recovery.conftest import History, open_history

# More events than the planner's rate sample (recovery_sample_events, 2,000).
BOOKINGS = 1_300


@pytest.fixture(scope="module")
def long_template(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, int]:
    path = tmp_path_factory.mktemp("long") / "ledger.db"
    for history in open_history(f"sqlite:///{path}", bookings=BOOKINGS):
        now_us = history.clock.now_us()
    return path, now_us


@pytest.fixture
def long_history(
    long_template: tuple[pathlib.Path, int], tmp_path: pathlib.Path
) -> Iterator[History]:
    """A SQLite history of a few thousand events."""
    target = tmp_path / "copy.db"
    target.write_bytes(long_template[0].read_bytes())
    yield from open_history(f"sqlite:///{target}", long_template[1])


def _delete_a_settled_reserve_after(history: History, after_seq: int) -> tuple[int, int, str, str]:
    """Deletes by hand the first reserve past `after_seq` whose booking is
    settled later; (the reserve's seq, the settle's seq, lane, booking)."""
    reserve, settle, lane, booking = _first_settled_reserve(history, after_seq)
    history.sql("DROP TRIGGER events_refuse_delete", f"DELETE FROM events WHERE seq = {reserve}")
    return reserve, settle, lane, booking


def _first_settled_reserve(history: History, after_seq: int) -> tuple[int, int, str, str]:
    with history.engine.connect() as connection:
        row = connection.exec_driver_sql(
            "SELECT r.seq, s.seq, r.lane, r.reservation_id FROM events r JOIN events s "
            "ON s.lane = r.lane AND s.reservation_id = r.reservation_id AND s.kind = 'settled' "
            f"WHERE r.kind = 'reserved' AND r.seq > {after_seq} ORDER BY r.seq LIMIT 1"
        ).one()
    return int(row[0]), int(row[1]), str(row[2]), str(row[3])


def test_a_rebuild_that_meets_the_event_names_its_seq_lane_and_booking(
    long_history: History,
) -> None:
    """`ledger rebuild` skips the planner: it stops on the event, and says
    which it is and what is wrong with it."""
    _, settle, lane, booking = _delete_a_settled_reserve_after(long_history, 2_100)
    recovery = long_history.recovery(batch_events=1000)
    # Past the broken link, as a rebuild whose plan accepted it goes.
    accepted = tuple(recovery._walk(None, ()).breaks)
    assert [found.seq for found in accepted] == [settle]
    with pytest.raises(RebuildFailed) as failed:
        recovery.rebuild(Route(FULL_LOG_SOURCE, None, accepted))
    said = str(failed.value)
    assert f"event {settle} cannot be applied" in said, said
    assert f"the settled event of booking {booking!r} in lane {lane!r}" in said, said
    assert "no reserve before it in the log" in said, said
