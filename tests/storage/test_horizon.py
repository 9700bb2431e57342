"""The commit horizon on PostgreSQL (storage/horizon.py) on a log longer than one walk."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from ledger_service.application.ledger import Ledger
from ledger_service.domain import moves
from ledger_service.domain.clock import ManualClock
from ledger_service.storage import horizon
from ledger_service.storage.sql import SqlStore
from tests.storage.conftest import RECALL, START_US

pytestmark = pytest.mark.postgres


def test_a_fresh_horizon_jumps_over_a_log_longer_than_one_walk(
    postgres_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = Ledger(postgres_store, ManualClock(START_US))
    ledger.put_lane(RECALL)
    for index in range(12):
        ledger.reserve(moves.ReserveCommand(RECALL.lane, f"r-{index}", "jev", 1000, 10))
    # Three seqs a walk, and no waiting: each advance is one step.
    monkeypatch.setattr(horizon, "MAX_WALK", 3)
    monkeypatch.setattr(horizon, "MAX_WAIT_SECONDS", 0.0)
    fresh = horizon.CommitHorizon()
    with postgres_store.engine.connect() as connection:
        assert fresh.advance(connection) == 3  # the first walk
        # Nothing was in flight when it stopped: the whole log is final.
        assert fresh.advance(connection) == 13


def test_a_seq_taken_by_the_newest_transaction_is_not_passed_while_it_runs(
    postgres_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The append in flight is the newest transaction and nothing completed after
    it took its xid: its xid equals every snapshot's xmax and is in no snapshot's
    list of running xids. The hole it leaves must wait for it all the same."""
    ledger = Ledger(postgres_store, ManualClock(START_US))
    ledger.put_lane(RECALL)
    monkeypatch.setattr(horizon, "MAX_WAIT_SECONDS", 0.0)
    tracker = horizon.CommitHorizon()
    engine = postgres_store.engine
    with engine.connect() as appender, engine.connect() as reader:
        assert tracker.advance(reader) == 1
        reader.commit()
        # As an append does: an xid first, then a seq, and no commit yet.
        appender.execute(text("SELECT pg_current_xact_id()"))
        in_flight = int(appender.execute(text("SELECT nextval('events_seq_seq')")).scalar_one())
        for _ in range(3):
            assert tracker.advance(reader) < in_flight
            reader.commit()
        appender.rollback()  # the append failed: its seq is a hole for good
        passed = []
        for _ in range(3):  # once the transaction is gone, the hole is passed
            passed.append(tracker.advance(reader))
            reader.commit()
        assert passed[-1] == in_flight, passed


def test_a_hole_seen_late_in_a_reader_transaction_waits_for_the_append_that_holds_it(
    postgres_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader's transaction keeps the xid it took as a hole's bound. A second
    hole seen in the same transaction, handed out after that xid, must not be
    bound by it: its append may have an xid above it and still be running."""
    ledger = Ledger(postgres_store, ManualClock(START_US))
    ledger.put_lane(RECALL)
    monkeypatch.setattr(horizon, "MAX_WAIT_SECONDS", 0.0)
    tracker = horizon.CommitHorizon()
    engine = postgres_store.engine
    next_seq = text("SELECT nextval('events_seq_seq')")
    take_xid = text("SELECT pg_current_xact_id()")
    with (
        engine.connect() as first,
        engine.connect() as late,
        engine.connect() as other,
        engine.connect() as reader,
    ):
        assert tracker.advance(reader) == 1
        reader.commit()
        first.execute(take_xid)
        held_first = int(first.execute(next_seq).scalar_one())
        assert tracker.advance(reader) < held_first  # a hole: the reader takes an xid
        late.execute(take_xid)  # after the reader's xid
        held_late = int(late.execute(next_seq).scalar_one())
        other.execute(take_xid)
        other.execute(next_seq)
        other.rollback()
        first.rollback()
        # Still the reader's transaction: the first hole is final, the late one not.
        assert tracker.advance(reader) < held_late
        reader.commit()
        for _ in range(3):
            assert tracker.advance(reader) < held_late, "passed a seq still in flight"
            reader.commit()
        late.rollback()
        passed = []
        for _ in range(3):
            passed.append(tracker.advance(reader))
            reader.commit()
        assert passed[-1] >= held_late, passed
