"""Round trips a move makes to PostgreSQL (docs/postgresql.md, "Round trips per move").

Counted in the store: each libpq pipeline is one round trip, and so is any
statement that goes through SQLAlchemy instead. The bench counts the same
through a latency proxy (`python -m bench --only roundtrips`).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import pytest
from sqlalchemy import event, select

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


def test_a_parents_events_are_in_seq_order_as_its_lock_admitted_them(
    postgres_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child's move holds its own lane's lock before its parent's. Its seq
    is taken after the parent's lock, so a sibling that got the parent first
    has the lower seq: a replay of the parent's events in seq order meets
    each Reserve with the bookings its admission saw."""
    clock = ManualClock(START_US)
    ledger = Ledger(postgres_store, clock)
    ledger.put_lane(dataclasses.replace(RECALL, lane="team"))
    for child in ("first", "second"):
        ledger.put_lane(dataclasses.replace(RECALL, lane=child, parent="team"))
    locked_first, go_on = threading.Event(), threading.Event()
    lock_lane = SqlTransaction.lock_lane

    def pausing(tx: SqlTransaction, lane: str, reservation_id: str = "") -> Any:
        policy = lock_lane(tx, lane, reservation_id)
        if lane == "first":
            locked_first.set()
            assert go_on.wait(30)
        return policy

    monkeypatch.setattr(SqlTransaction, "lock_lane", pausing)
    first = threading.Thread(
        target=ledger.reserve, args=(moves.ReserveCommand("first", "f", "jev", 1000, 10),)
    )
    first.start()
    assert locked_first.wait(30)
    # "second" takes the parent's lock while "first" holds only its own lane's.
    second = ledger.reserve(moves.ReserveCommand("second", "s", "jev", 1000, 10))
    go_on.set()
    first.join(30)
    [first_event] = ledger.list_events(EventQuery(lane="first", kinds=("reserved",)))
    assert second.event.seq < first_event.seq


def test_a_move_under_a_parent_leaves_no_hole_and_makes_few_round_trips(
    postgres_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Locking the parent takes no seq the move never uses, and the parent's
    budget (its member lanes, its window) is read in the locks' round trips:
    the child's own lock, the parent's, the windows' edges, its seq and the
    COMMIT's pipeline."""
    clock = ManualClock(START_US)
    ledger = Ledger(postgres_store, clock)
    ledger.put_lane(dataclasses.replace(RECALL, lane="team"))
    for child in ("child", "sibling"):
        ledger.put_lane(dataclasses.replace(RECALL, lane=child, parent="team"))
    child_reserve = moves.ReserveCommand("child", "warm-up", "jev", 1000, 10)
    assert ledger.reserve(child_reserve).admitted
    trips = RoundTrips(postgres_store, monkeypatch)
    clock.advance_us(1_000)
    reserve = dataclasses.replace(child_reserve, reservation_id="r-1")
    assert trips.of(lambda: ledger.reserve(reserve)) <= 5
    clock.advance_us(1_000)
    settle = moves.SettleCommand("child", "r-1", Outcome.SUCCEEDED, 10, 5)
    assert trips.of(lambda: ledger.settle(settle)) <= 5
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

    def pausing(tx: SqlTransaction, lane: str, reservation_id: str = "") -> Any:
        policy = lock_lane(tx, lane, reservation_id)
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
