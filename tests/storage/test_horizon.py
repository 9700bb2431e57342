"""The commit horizon on PostgreSQL (storage/horizon.py): a log longer than one
walk, appends in flight, and transactions that are not the ledger's appends."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy import Connection, Engine, text

from ledger_service.application.ledger import Ledger
from ledger_service.application.ports import EventQuery
from ledger_service.domain import moves
from ledger_service.domain.clock import ManualClock
from ledger_service.domain.errors import BookingNotFound
from ledger_service.domain.events import Outcome
from ledger_service.storage import horizon
from ledger_service.storage.horizon import APPEND_BEGINS
from ledger_service.storage.sql import SqlStore
from tests.storage.conftest import POSTGRES_URL, RECALL, START_US

pytestmark = pytest.mark.postgres

NEXT_SEQ = text("SELECT nextval('events_seq_seq')")
# A transaction that is not an append: an xid, and no maintenance lock.
TAKE_XID = text("SELECT pg_current_xact_id()")
# Beside the tests' own database, on the same cluster.
OTHER_DATABASE = f"{sa.make_url(POSTGRES_URL).database}_other"


@pytest.fixture
def pg_ledger(postgres_store: SqlStore, monkeypatch: pytest.MonkeyPatch) -> Ledger:
    """A ledger whose one lane's PutLane is seq 1; reads do not wait for appends."""
    ledger = Ledger(postgres_store, ManualClock(START_US))
    ledger.put_lane(RECALL)
    monkeypatch.setattr(horizon, "MAX_WAIT_SECONDS", 0.0)
    return ledger


def _tracking(reader: Connection) -> horizon.CommitHorizon:
    """A fresh horizon, moved over the PutLane in a transaction of its own."""
    tracker = horizon.CommitHorizon()
    assert tracker.advance(reader) == 1
    reader.commit()
    return tracker


@pytest.fixture
def other_database() -> Iterator[Engine]:
    """A second database on the same cluster, dropped afterwards."""
    admin = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'DROP DATABASE IF EXISTS "{OTHER_DATABASE}"'))
        connection.execute(text(f'CREATE DATABASE "{OTHER_DATABASE}"'))
    engine = sa.create_engine(sa.make_url(POSTGRES_URL).set(database=OTHER_DATABASE))
    try:
        yield engine
    finally:
        engine.dispose()
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE "{OTHER_DATABASE}"'))
        admin.dispose()


@contextlib.contextmanager
def _sessions(engine: Engine, count: int) -> Iterator[list[Connection]]:
    """`count` connections of `engine`, closed (rolled back) when the block ends."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(engine.connect()) for _ in range(count)]


def _passed(tracker: horizon.CommitHorizon, reader: Connection) -> list[int]:
    """Three reads, each in a transaction of its own."""
    passed = []
    for _ in range(3):
        passed.append(tracker.advance(reader))
        reader.commit()
    return passed


def _last_seq(connection: Connection) -> int:
    return int(connection.execute(text("SELECT max(seq) FROM events")).scalar_one())


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


@pytest.mark.usefixtures("pg_ledger")
@pytest.mark.parametrize("unrelated", [False, True], ids=["alone", "beside-an-older-xid"])
def test_a_seq_taken_by_the_newest_transaction_is_not_passed_while_it_runs(
    postgres_store: SqlStore, unrelated: bool
) -> None:
    """The append in flight is the newest transaction and nothing completed after
    it took its xid: its xid equals every snapshot's xmax and is in no snapshot's
    list of running xids. The hole it leaves must wait for it all the same, and
    only for it: an older transaction that appends nothing may still run."""
    engine = postgres_store.engine
    with _sessions(engine, 3) as (other, appender, reader):
        tracker = _tracking(reader)
        if unrelated:
            other.execute(TAKE_XID)
        # As an append does: the maintenance lock and an xid, then a seq, and no commit yet.
        appender.execute(APPEND_BEGINS)
        in_flight = int(appender.execute(NEXT_SEQ).scalar_one())
        for _ in range(3):
            assert tracker.advance(reader) < in_flight
            reader.commit()
        appender.rollback()  # the append failed: its seq is a hole for good
        # Once the append is gone the hole is passed, whatever else runs.
        passed = _passed(tracker, reader)
        assert passed[-1] == in_flight, passed
        other.rollback()


@pytest.mark.usefixtures("pg_ledger")
def test_a_hole_seen_late_in_a_reader_transaction_waits_for_the_append_that_holds_it(
    postgres_store: SqlStore,
) -> None:
    """A reader's transaction keeps the xid it took as a hole's bound. A second
    hole seen in the same transaction, handed out after that xid, must not be
    bound by it: its append may have an xid above it and still be running."""
    engine = postgres_store.engine
    with _sessions(engine, 4) as (first, late, other, reader):
        tracker = _tracking(reader)
        first.execute(APPEND_BEGINS)
        held_first = int(first.execute(NEXT_SEQ).scalar_one())
        assert tracker.advance(reader) < held_first  # a hole: the reader takes an xid
        late.execute(APPEND_BEGINS)  # after the reader's xid
        held_late = int(late.execute(NEXT_SEQ).scalar_one())
        other.execute(APPEND_BEGINS)
        other.execute(NEXT_SEQ)
        other.rollback()
        first.rollback()
        # Still the reader's transaction: the first hole is final, the late one not.
        assert tracker.advance(reader) < held_late
        reader.commit()
        for _ in range(3):
            assert tracker.advance(reader) < held_late, "passed a seq still in flight"
            reader.commit()
        late.rollback()
        passed = _passed(tracker, reader)
        assert passed[-1] >= held_late, passed


# Holes and transactions that are not the ledger's appends -----------------------


def test_a_transaction_in_another_database_does_not_hold_a_hole(
    postgres_store: SqlStore, pg_ledger: Ledger, other_database: Engine
) -> None:
    """xids are the cluster's: another database's transaction, older than the
    hole, is below its bound, yet it cannot hold one of the ledger's seqs."""
    with (
        other_database.connect() as unrelated,
        postgres_store.engine.connect() as appender,
        postgres_store.engine.connect() as reader,
    ):
        tracker = _tracking(reader)
        unrelated.execute(TAKE_XID)
        appender.execute(APPEND_BEGINS)
        hole = int(appender.execute(NEXT_SEQ).scalar_one())
        appender.rollback()
        pg_ledger.reserve(moves.ReserveCommand(RECALL.lane, "after-the-hole", "jev", 1000, 10))
        last = _last_seq(reader)
        assert last > hole
        assert _passed(tracker, reader)[-1] == last, "stopped at the hole"
        unrelated.rollback()


def test_a_transaction_that_appends_nothing_does_not_hold_a_hole(
    postgres_store: SqlStore, pg_ledger: Ledger
) -> None:
    """The same for a transaction with an xid in the ledger's own database that
    never took the maintenance lock; the hole here is a refused Settle's."""
    engine = postgres_store.engine
    with _sessions(engine, 2) as (unrelated, reader):
        tracker = _tracking(reader)
        unrelated.execute(TAKE_XID)
        with pytest.raises(BookingNotFound):
            pg_ledger.settle(moves.SettleCommand(RECALL.lane, "never-reserved", Outcome.SUCCEEDED))
        pg_ledger.reserve(moves.ReserveCommand(RECALL.lane, "after-the-hole", "jev", 1000, 10))
        last = _last_seq(reader)
        assert last > 2, "the refused Settle left no hole"
        assert _passed(tracker, reader)[-1] == last, "stopped at the hole"
        unrelated.rollback()


@pytest.mark.usefixtures("pg_ledger")
def test_an_append_in_flight_keeps_its_hole_in_the_reader_transaction_that_took_the_bound(
    postgres_store: SqlStore,
) -> None:
    """The reader's open transaction holds the hole's bound, an unrelated older
    transaction holds the oldest xid: the append in flight below the bound still
    keeps its hole, and once it ends the same reader transaction passes it."""
    engine = postgres_store.engine
    with _sessions(engine, 3) as (unrelated, appender, reader):
        tracker = _tracking(reader)
        unrelated.execute(TAKE_XID)
        appender.execute(APPEND_BEGINS)
        in_flight = int(appender.execute(NEXT_SEQ).scalar_one())
        assert tracker.advance(reader) < in_flight  # the bound: the reader's xid
        assert reader.execute(text("SELECT pg_current_xact_id_if_assigned()")).scalar()
        for _ in range(3):
            assert tracker.advance(reader) < in_flight, "passed a seq still in flight"
        appender.rollback()
        assert tracker.advance(reader) == in_flight
        reader.commit()
        unrelated.rollback()


@pytest.mark.usefixtures("pg_ledger")
def test_appends_begun_after_the_bound_do_not_hold_a_hole(postgres_store: SqlStore) -> None:
    """A busy ledger always has appends in flight: those whose xid is above the
    hole's bound, or that hold the maintenance lock without an xid yet, take
    seqs above it, so the hole is passed while they and an older unrelated
    transaction run (up to the seq the newer append holds)."""
    engine = postgres_store.engine
    lock_only = text(f"SELECT pg_advisory_xact_lock_shared({horizon.EVENT_APPEND_LOCK_KEY})")
    with _sessions(engine, 5) as (unrelated, failed, newer, starting, reader):
        tracker = _tracking(reader)
        unrelated.execute(TAKE_XID)
        failed.execute(APPEND_BEGINS)
        hole = int(failed.execute(NEXT_SEQ).scalar_one())
        failed.rollback()
        assert tracker.advance(reader) < hole  # the hole is seen, its bound taken
        reader.commit()
        newer.execute(APPEND_BEGINS)
        in_flight = int(newer.execute(NEXT_SEQ).scalar_one())
        starting.execute(lock_only)  # midway through APPEND_BEGINS
        assert _passed(tracker, reader) == [hole] * 3
        newer.rollback()
        starting.rollback()
        unrelated.rollback()
        assert _passed(tracker, reader)[-1] == in_flight


class _Waits:
    """horizon's `time`, with each pause recorded instead of slept."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self.monotonic = time.monotonic

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)


def test_a_page_full_below_the_horizon_does_not_wait_for_appends_in_flight(
    postgres_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read waited for every append in flight when it began, also when its page
    was full long before their seqs: with 24 lane threads writing through one
    replica, a ListEvents page of 50 old events on the other took 0.2-0.6 s
    (5 ms idle), and `ledger history`, some 30 such pages, 5-7 s. A page that
    is full below the horizon holds no seq an append in flight could take."""
    ledger = Ledger(postgres_store, ManualClock(START_US))
    ledger.put_lane(RECALL)
    for index in range(3):
        ledger.reserve(moves.ReserveCommand(RECALL.lane, f"r-{index}", "jev", 1000, 10))
    waits = _Waits()
    monkeypatch.setattr(horizon, "time", waits)
    with postgres_store.engine.connect() as appender:
        appender.execute(APPEND_BEGINS)
        in_flight = int(appender.execute(NEXT_SEQ).scalar_one())
        full = ledger.list_events(EventQuery(limit=2))
        assert waits.pauses == []
        # A page that reaches the append in flight still waits for it.
        short = ledger.list_events(EventQuery(after_seq=2, limit=10))
        assert waits.pauses != []
        appender.rollback()
    assert [event.seq for event in full] == [1, 2]
    assert [event.seq for event in short] == [3, 4]
    assert in_flight == 5
