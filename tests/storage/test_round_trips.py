"""Round trips a move makes to PostgreSQL (docs/postgresql.md, "Round trips per move").

Counted in the store: each libpq pipeline is one round trip, and so is any
statement that goes through SQLAlchemy instead. The bench counts the same
through a latency proxy (`python -m bench --only roundtrips`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import pytest
from sqlalchemy import event, select, text

from ledger_service.application.ledger import Ledger
from ledger_service.application.ports import EventQuery
from ledger_service.domain import chain, moves
from ledger_service.domain.clock import ManualClock
from ledger_service.domain.events import EventKind, Outcome
from ledger_service.storage import libpq, records
from ledger_service.storage.schema import events
from ledger_service.storage.sql import SqlStore, SqlTransaction
from tests.storage.conftest import RECALL, START_US

pytestmark = pytest.mark.postgres


class RoundTrips:
    def __init__(self, store: SqlStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        pipeline = libpq.pipeline

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return pipeline(*args, **kwargs)

        monkeypatch.setattr(libpq, "pipeline", counted)
        event.listen(store.engine, "before_cursor_execute", self._statement)

    def _statement(self, *_args: Any) -> None:
        self.count += 1

    def of(self, move: Any) -> int:
        self.count = 0
        move()
        return self.count


def _reserve(ledger: Ledger, reservation_id: str) -> None:
    command = moves.ReserveCommand(RECALL.lane, reservation_id, "jev", 1000, 10)
    assert ledger.reserve(command).admitted


def _settle(ledger: Ledger, reservation_id: str) -> None:
    command = moves.SettleCommand(RECALL.lane, reservation_id, Outcome.SUCCEEDED, 10, 5)
    ledger.settle(command)


def test_a_reserve_and_a_settle_are_three_round_trips_each(
    postgres_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = ManualClock(START_US)
    ledger = Ledger(postgres_store, clock)
    ledger.put_lane(RECALL)
    _reserve(ledger, "warm-up")
    trips = RoundTrips(postgres_store, monkeypatch)
    clock.advance_us(1_000)
    # BEGIN, the locks, the lane's reads and a seq; the window's edges; the
    # event's INSERT, the booking's and the window's writes and the COMMIT.
    assert trips.of(lambda: _reserve(ledger, "r-1")) == 3
    clock.advance_us(1_000)
    assert trips.of(lambda: _settle(ledger, "r-1")) == 3


def test_events_sent_with_the_commit_keep_each_lanes_chain_in_seq_order(
    postgres_store: SqlStore,
) -> None:
    """Each event's seq is taken in the move's first round trip and its INSERT
    sent with the COMMIT: the log holds every move's event, with content and
    links intact in seq order. A repeated Reserve appends nothing."""
    clock = ManualClock(START_US)
    ledger = Ledger(postgres_store, clock)
    ledger.put_lane(RECALL)
    for index in range(5):
        clock.advance_us(1_000)
        _reserve(ledger, f"r-{index}")
        _reserve(ledger, f"r-{index}")  # a repeat: answered from the first
        _settle(ledger, f"r-{index}")
    with postgres_store.engine.connect() as connection:
        rows = connection.execute(select(events).order_by(events.c.seq)).mappings().all()
    logged = [records.event_from_row(dict(row)) for row in rows]
    kinds = [event.kind for event in logged]
    assert kinds == [EventKind.LANE_CONFIGURED] + [EventKind.RESERVED, EventKind.SETTLED] * 5
    walker = chain.ChainWalker()
    assert [walker.check(event) for event in logged] == [None] * len(logged)


def test_a_child_takes_its_seq_only_once_its_parents_lock_is_granted(
    postgres_store: SqlStore,
) -> None:
    """A child's move locks its own lane and then its parent's. Its seq must
    come after the parent's lock: a seq taken while it waits would put its
    event before those of a sibling the parent admitted first, and a replay
    of the parent's events in seq order would meet a Reserve with bookings
    its admission did not see."""
    clock = ManualClock(START_US)
    ledger = Ledger(postgres_store, clock)
    ledger.put_lane(dataclasses.replace(RECALL, lane="team"))
    ledger.put_lane(dataclasses.replace(RECALL, lane="first", parent="team"))
    # The probe reads outside a transaction: within one, pg_stat_activity
    # keeps the snapshot of its first read.
    autocommit = postgres_store.engine.execution_options(isolation_level="AUTOCOMMIT")
    with postgres_store.engine.connect() as holder, autocommit.connect() as probe:
        last_seq = probe.execute(text("SELECT last_value FROM events_seq_seq")).scalar_one()
        holder.execute(text("SELECT 1 FROM lanes WHERE lane = 'team' FOR UPDATE"))
        holder_pid = holder.execute(text("SELECT pg_backend_pid()")).scalar_one()
        child = threading.Thread(
            target=ledger.reserve, args=(moves.ReserveCommand("first", "f", "jev", 1000, 10),)
        )
        child.start()
        waiting = text(
            "SELECT count(*) FROM pg_stat_activity WHERE :pid = ANY(pg_blocking_pids(pid))"
        )
        for _ in range(3000):  # a new connection may take seconds to open
            if probe.execute(waiting, {"pid": holder_pid}).scalar_one():
                break
            time.sleep(0.01)
        else:
            pytest.fail("the child's move never waited for its parent's lock")
        assert probe.execute(text("SELECT last_value FROM events_seq_seq")).scalar_one() == last_seq
        holder.rollback()
        child.join(30)
    [reserved] = ledger.list_events(EventQuery(lane="first", kinds=("reserved",)))
    assert reserved.seq == last_seq + 1


@pytest.mark.parametrize("parents", [1, 2, 3])
def test_a_move_under_parents_leaves_no_hole_and_is_three_round_trips(
    postgres_store: SqlStore, monkeypatch: pytest.MonkeyPatch, parents: int
) -> None:
    """However deep its budgets nest, a move is three round trips: the locks
    of its lane and every parent with what it reads of them and its seq; the
    edges of every budget's window; the writes and the COMMIT. Locking the
    parents takes no seq the move never uses."""
    clock = ManualClock(START_US)
    ledger = Ledger(postgres_store, clock)
    above: str | None = None
    for level in range(parents):
        ledger.put_lane(dataclasses.replace(RECALL, lane=f"team-{level}", parent=above))
        above = f"team-{level}"
    for child in ("child", "sibling"):
        ledger.put_lane(dataclasses.replace(RECALL, lane=child, parent=above))
    child_reserve = moves.ReserveCommand("child", "warm-up", "jev", 1000, 10)
    assert ledger.reserve(child_reserve).admitted
    trips = RoundTrips(postgres_store, monkeypatch)
    clock.advance_us(1_000)
    reserve = dataclasses.replace(child_reserve, reservation_id="r-1")
    assert trips.of(lambda: ledger.reserve(reserve)) == 3
    clock.advance_us(1_000)
    settle = moves.SettleCommand("child", "r-1", Outcome.SUCCEEDED, 10, 5)
    assert trips.of(lambda: ledger.settle(settle)) == 3
    with postgres_store.engine.connect() as connection:
        seqs = list(connection.execute(select(events.c.seq).order_by(events.c.seq)).scalars())
    assert seqs == list(range(1, len(seqs) + 1))


@pytest.mark.parametrize("joins_from", ["another parent", "no parent"])
def test_a_lane_that_joins_a_parent_is_in_seq_order_as_the_new_parent_admitted_it(
    postgres_store: SqlStore, monkeypatch: pytest.MonkeyPatch, joins_from: str
) -> None:
    """A PutLane that moves a lane under another root locks the lane and its
    old chain before the new parent. A seq taken before that last lock would
    put the lane's joining before a sibling's Reserve that the new parent
    admitted first; a replay in seq order would then count the lane in the
    parent's budget when the Reserve was admitted."""
    clock = ManualClock(START_US)
    ledger = Ledger(postgres_store, clock)
    for root in ("old-team", "new-team"):
        ledger.put_lane(dataclasses.replace(RECALL, lane=root))
    old_parent = "old-team" if joins_from == "another parent" else None
    ledger.put_lane(dataclasses.replace(RECALL, lane="mover", parent=old_parent))
    ledger.put_lane(dataclasses.replace(RECALL, lane="sibling", parent="new-team"))
    paused, go_on = threading.Event(), threading.Event()
    pausing_thread: list[threading.Thread] = []
    lock_lane = SqlTransaction.lock_lane

    def pausing(tx: SqlTransaction, lane: str, reservation_id: str = "", **options: Any) -> Any:
        policy = lock_lane(tx, lane, reservation_id, **options)
        # The PutLane holds the mover's chain, not yet the new parent.
        if threading.current_thread() in pausing_thread and lane == (old_parent or "mover"):
            paused.set()
            assert go_on.wait(30)
        return policy

    monkeypatch.setattr(SqlTransaction, "lock_lane", pausing)
    moving = threading.Thread(
        target=ledger.put_lane, args=(dataclasses.replace(RECALL, lane="mover", parent="new-team"),)
    )
    pausing_thread.append(moving)
    moving.start()
    assert paused.wait(30)
    clock.advance_us(1_000)
    admitted = ledger.reserve(moves.ReserveCommand("sibling", "s", "jev", 1000, 10))
    go_on.set()
    moving.join(30)
    joined = ledger.list_events(EventQuery(lane="mover", kinds=("lane_configured",)))[-1]
    assert joined.policy is not None and joined.policy["parent"] == "new-team"
    assert admitted.event.seq < joined.seq


def test_a_new_lane_under_a_chain_of_parents_leaves_no_hole(postgres_store: SqlStore) -> None:
    ledger = Ledger(postgres_store, ManualClock(START_US))
    for lane, parent in (("top", None), ("middle", "top"), ("bottom", "middle")):
        ledger.put_lane(dataclasses.replace(RECALL, lane=lane, parent=parent))
    with postgres_store.engine.connect() as connection:
        seqs = list(connection.execute(select(events.c.seq).order_by(events.c.seq)).scalars())
    assert seqs == [1, 2, 3]


def test_a_move_whose_parent_is_moved_while_it_waits_counts_against_the_new_chain(
    postgres_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A move locks its lane's chain of budgets in one statement, which reads
    the chain before its locks are granted. If a PutLane moves the parent
    under another root meanwhile, the rows it locked no longer link up: the
    move locks the new root too and is admitted against it, not the old."""
    clock = ManualClock(START_US)
    ledger = Ledger(postgres_store, clock)
    ledger.put_lane(dataclasses.replace(RECALL, lane="old-root"))
    ledger.put_lane(dataclasses.replace(RECALL, lane="new-root", limit_nanos=1))
    ledger.put_lane(dataclasses.replace(RECALL, lane="team", parent="old-root"))
    ledger.put_lane(dataclasses.replace(RECALL, lane="child", parent="team"))
    paused, go_on = threading.Event(), threading.Event()
    moving: list[threading.Thread] = []
    lock_lane = SqlTransaction.lock_lane

    def pausing(tx: SqlTransaction, lane: str, reservation_id: str = "", **options: Any) -> Any:
        policy = lock_lane(tx, lane, reservation_id, **options)
        if threading.current_thread() in moving and lane == "team":
            paused.set()  # the PutLane holds the team's row, not yet the new root's
            assert go_on.wait(30)
        return policy

    monkeypatch.setattr(SqlTransaction, "lock_lane", pausing)
    moved = dataclasses.replace(RECALL, lane="team", parent="new-root")
    moving.append(threading.Thread(target=ledger.put_lane, args=(moved,)))
    moving[0].start()
    assert paused.wait(30)
    answers: list[Any] = []
    reserve = moves.ReserveCommand("child", "r-1", "jev", 1000, 10)
    child = threading.Thread(target=lambda: answers.append(ledger.reserve(reserve)))
    child.start()
    autocommit = postgres_store.engine.execution_options(isolation_level="AUTOCOMMIT")
    with autocommit.connect() as probe:
        waiting = text(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE wait_event_type = 'Lock' AND query LIKE '%chain%'"
        )
        for _ in range(3000):
            if probe.execute(waiting).scalar_one():
                break
            time.sleep(0.01)
        else:
            pytest.fail("the child's move never waited for the team's lock")
    go_on.set()
    moving[0].join(30)
    child.join(30)
    [answer] = answers
    assert not answer.admitted  # the new root's limit of one nano refuses it
    joined = ledger.list_events(EventQuery(lane="team", kinds=("lane_configured",)))[-1]
    assert joined.seq < answer.event.seq
