"""SQLite's one writer keeps admission state in memory (storage/writer.py).

Random walks of moves on nested lanes, alone and in shared batches, with
every window the writer reads from memory checked against a full sum of the
bookings table (verify_windows); a fresh writer on the same file must then
give the same balances. And the hot path reads nothing from the database
but a booking memory does not hold.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger_service.application.ledger import Ledger
from ledger_service.application.ports import StoreTransaction
from ledger_service.domain import moves
from ledger_service.domain.bookings import Booking
from ledger_service.domain.clock import ManualClock
from ledger_service.domain.errors import InvalidArgument, LedgerError
from ledger_service.domain.events import Outcome
from ledger_service.domain.policies import ExpireCharge, LanePolicy
from ledger_service.domain.pricing import ModelPrice
from ledger_service.domain.window import WindowState
from ledger_service.recovery.store import SqlRecoveryStore
from ledger_service.recovery.verify import Verifier
from ledger_service.storage import database, migrate
from ledger_service.storage.sql import SqlStore
from tests.storage.conftest import START_US
from tests.storage.test_group_commit import _together

SECOND_US = 1_000_000
PRICES = {"m": ModelPrice(100_000, 400_000)}
PARENT = LanePolicy("parent", 40_000, PRICES, window_us=10 * SECOND_US, hold_ttl_us=3 * SECOND_US)
CHILD = LanePolicy(
    "child",
    25_000,
    PRICES,
    window_us=6 * SECOND_US,
    hold_ttl_us=2 * SECOND_US,
    parent="parent",
    expire_charge=ExpireCharge.ZERO,
)
OTHER = LanePolicy("other", 30_000, PRICES, window_us=8 * SECOND_US, hold_ttl_us=SECOND_US)
LANES = (PARENT.lane, CHILD.lane, OTHER.lane)


def _open(url: str, clock: ManualClock, *, verify: bool = True) -> tuple[Ledger, SqlStore]:
    engine = database.create(url, database.EngineLimits())
    migrate.upgrade(engine)
    store = SqlStore(engine, request_deadline_seconds=10.0)
    return Ledger(store, clock, verify_windows=verify), store


@dataclasses.dataclass
class Walk:
    url: str
    clock: ManualClock
    ledger: Ledger
    store: SqlStore
    made: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def reopen(self) -> None:
        self.store.close()
        self.ledger, self.store = _open(self.url, self.clock)


def _move(walk: Walk, step: tuple[Any, ...]) -> Any:
    """One step's call, for running alone or in a batch."""
    kind = step[0]
    ledger = walk.ledger
    if kind == "reserve" or not walk.made:
        lane = LANES[step[1] % len(LANES)]
        rid = f"r{len(walk.made)}"
        walk.made.append((lane, rid))
        request_bytes = step[2] if kind == "reserve" else 1_000
        reserve = moves.ReserveCommand(lane, rid, "m", request_bytes, 10)
        return lambda: ledger.reserve(reserve)
    lane, rid = walk.made[step[1] % len(walk.made)]
    if kind == "settle":
        settle = moves.SettleCommand(lane, rid, Outcome.SUCCEEDED, step[2], 1)
        return lambda: ledger.settle(settle)
    if kind == "unknown":
        return lambda: ledger.settle(moves.SettleCommand(lane, rid, Outcome.UNKNOWN))
    if kind == "refund":
        return lambda: ledger.refund(moves.RefundCommand(lane, rid, http_status=429))
    correction = moves.CorrectCommand(lane, rid, step[2], "the bill says so", f"c{step[1]}")
    return lambda: ledger.correct(correction, "operator")


def _attempt(call: Any) -> None:
    # Refusals are the contract's business; a window mismatch is an AssertionError.
    with contextlib.suppress(LedgerError):
        call()


STEPS = st.one_of(
    st.tuples(st.just("reserve"), st.integers(0, 2), st.integers(0, 60_000)),
    st.tuples(st.sampled_from(["settle", "correct"]), st.integers(0, 50), st.integers(0, 900)),
    st.tuples(st.sampled_from(["unknown", "refund"]), st.integers(0, 50)),
    st.tuples(
        st.just("advance"), st.sampled_from([1, 999, SECOND_US, 3 * SECOND_US, 7 * SECOND_US])
    ),
    st.tuples(st.just("reparent"), st.booleans()),
    st.tuples(st.just("sweep")),
    st.tuples(st.just("reopen")),
    st.tuples(
        st.just("batch"),
        st.lists(
            st.tuples(st.just("reserve"), st.integers(0, 2), st.integers(0, 30_000))
            | st.tuples(st.just("settle"), st.integers(0, 50), st.integers(0, 900)),
            min_size=2,
            max_size=5,
        ),
    ),
)


@pytest.mark.slow
@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=st.lists(STEPS, min_size=5, max_size=30))
def test_memory_follows_every_move_and_a_fresh_writer_agrees(
    tmp_path_factory: pytest.TempPathFactory, steps: list[tuple[Any, ...]]
) -> None:
    url = f"sqlite:///{tmp_path_factory.mktemp('walk')}/ledger.db"
    clock = ManualClock(START_US)
    walk = Walk(url, clock, *_open(url, clock))
    try:
        _walk(walk, steps)
    finally:
        walk.store.close()


def _walk(walk: Walk, steps: list[tuple[Any, ...]]) -> None:
    clock = walk.clock
    for policy in (PARENT, CHILD, OTHER):
        walk.ledger.put_lane(policy)
    for step in steps:
        kind = step[0]
        if kind == "advance":
            clock.advance_us(step[1])
        elif kind == "reparent":
            moved = dataclasses.replace(OTHER, parent="parent" if step[1] else None)
            _attempt(functools.partial(walk.ledger.put_lane, moved))
        elif kind == "sweep":
            walk.ledger.sweep(100)
        elif kind == "reopen":
            walk.reopen()
        elif kind == "batch":
            calls = [functools.partial(_attempt, _move(walk, inner)) for inner in step[1]]
            _together(walk.store, calls)
        else:
            _attempt(_move(walk, step))
    before = {lane: walk.ledger.balance(lane) for lane in LANES}
    walk.reopen()
    # The fresh writer reads every window from the table, checked by a full sum.
    for lane in LANES:
        _attempt(
            lambda lane=lane: walk.ledger.reserve(moves.ReserveCommand(lane, "last", "m", 1, 1))
        )
    assert {lane: walk.ledger.balance(lane) for lane in LANES} == before | {
        lane: walk.ledger.balance(lane) for lane in LANES
    }
    report = Verifier(SqlRecoveryStore(walk.store.engine)).verify(clock.now_us())
    assert report.ok, report


def _refused_after_writing(booking: Booking, state: WindowState) -> Any:
    def work(tx: StoreTransaction) -> None:
        tx.save_booking(dataclasses.replace(booking, amount_nanos=booking.amount_nanos + 7))
        tx.save_window_state(state)
        raise InvalidArgument("lane", "refused after writing")

    return work


def test_a_move_refused_after_writing_leaves_memory_as_it_was(tmp_path: Path) -> None:
    clock = ManualClock(START_US)
    ledger, store = _open(f"sqlite:///{tmp_path}/refused.db", clock)
    try:
        ledger.put_lane(OTHER)
        ledger.reserve(moves.ReserveCommand(OTHER.lane, "a", "m", 4_000, 10))
        booking, _, _ = ledger.booking(OTHER.lane, "a")
        state = WindowState(OTHER.lane, OTHER.window_us, clock.now_us(), sums=_sums(99))
        with pytest.raises(InvalidArgument):
            store.run(_refused_after_writing(booking, state))
        clock.advance_us(1)
        # verify_windows: the next move's window from memory equals a full sum.
        ledger.reserve(moves.ReserveCommand(OTHER.lane, "b", "m", 4_000, 10))
        assert ledger.booking(OTHER.lane, "a")[0] == booking
    finally:
        store.close()


def _sums(amount: int) -> Any:
    from ledger_service.domain.window import StoredSums

    return StoredSums(amount, amount, 1)


def _traced(store: SqlStore) -> list[str]:
    """Every statement the store's connections run from now on, as SQLite traces them."""
    statements: list[str] = []

    @sa.event.listens_for(store.engine, "connect")
    def trace(driver: sqlite3.Connection, _record: object) -> None:
        driver.set_trace_callback(statements.append)

    store.engine.dispose()  # every next connection is traced
    return statements


def test_a_warm_move_reads_only_a_booking_memory_does_not_hold(tmp_path: Path) -> None:
    """After the first move, a Reserve of a new id reads one booking by primary
    key (memory cannot know an id never seen) and a Settle reads nothing."""
    clock = ManualClock(START_US)
    # Without the pair assertion's full sums, which are reads of their own.
    ledger, store = _open(f"sqlite:///{tmp_path}/reads.db", clock, verify=False)
    statements = _traced(store)
    try:
        ledger.put_lane(OTHER)
        ledger.reserve(moves.ReserveCommand(OTHER.lane, "warm", "m", 4_000, 10))
        clock.advance_us(1)
        statements.clear()
        ledger.reserve(moves.ReserveCommand(OTHER.lane, "new", "m", 4_000, 10))
        reads = [sql for sql in statements if sql.lstrip().upper().startswith("SELECT")]
        assert len(reads) == 1 and "FROM bookings" in reads[0], reads
        statements.clear()
        clock.advance_us(1)
        ledger.settle(moves.SettleCommand(OTHER.lane, "new", Outcome.SUCCEEDED, 10, 1))
        reads = [sql for sql in statements if sql.lstrip().upper().startswith("SELECT")]
        assert reads == [], reads
    finally:
        store.close()


def test_a_balance_is_answered_from_the_writers_memory(tmp_path: Path) -> None:
    """SQLite keeps no windows table: a balance takes its turn among the moves
    and reads neither the lane nor its bookings from the database."""
    clock = ManualClock(START_US)
    ledger, store = _open(f"sqlite:///{tmp_path}/balance.db", clock, verify=False)
    statements = _traced(store)
    try:
        ledger.put_lane(OTHER)
        reserved = ledger.reserve(moves.ReserveCommand(OTHER.lane, "held", "m", 4_000, 10))
        clock.advance_us(1)
        statements.clear()
        balance = ledger.balance(OTHER.lane)
        reads = [sql for sql in statements if sql.lstrip().upper().startswith("SELECT")]
        assert reads == [], reads
        assert balance.totals == reserved.balance.totals
    finally:
        store.close()


def test_a_settled_booking_ages_out_of_memory_at_its_settled_amount(tmp_path: Path) -> None:
    clock = ManualClock(START_US)
    ledger, store = _open(f"sqlite:///{tmp_path}/aged.db", clock)
    try:
        for policy in (PARENT, CHILD):
            ledger.put_lane(policy)
        ledger.reserve(moves.ReserveCommand(CHILD.lane, "a", "m", 40_000, 10))
        clock.advance_us(SECOND_US)
        ledger.reserve(moves.ReserveCommand(CHILD.lane, "b", "m", 40_000, 10))
        ledger.settle(moves.SettleCommand(CHILD.lane, "a", Outcome.SUCCEEDED, 3, 1))
        ledger.refund(moves.RefundCommand(CHILD.lane, "b", http_status=400))
        # Past the child's window, inside the parent's: each ages out on its own edge.
        for step_us in (CHILD.window_us - SECOND_US, SECOND_US, PARENT.window_us):
            clock.advance_us(step_us)
            ledger.reserve(moves.ReserveCommand(CHILD.lane, f"at-{step_us}", "m", 100, 1))
        assert ledger.balance(PARENT.lane) == ledger.balance(PARENT.lane)
    finally:
        store.close()


def _writer_entries(store: SqlStore) -> dict[str, int]:
    """How much the writer holds (a count of entries, not bytes)."""
    writer = store._writer
    return {
        "open": sum(len(found) for found in writer.open.values()),
        "open lanes": len(writer.open),
        "deadlines": sum(len(heap) for heap in writer.deadlines.values()),
        "queues": len(writer.queues),
        "queue entries": sum(len(queue.entries) for queue in writer.queues.values()),
    }


def _churn_then_idle(ledger: Ledger, clock: ManualClock) -> None:
    """Forty lanes used for a while, each with holds settled, refunded and
    left to expire, then left idle past every window while another lane's
    moves go on, a second apart."""
    ledger.put_lane(PARENT)
    for index in range(40):
        lane = f"idle-{index}"
        ledger.put_lane(dataclasses.replace(CHILD, lane=lane))
        for number in range(10):
            rid = f"r{number}"
            ledger.reserve(moves.ReserveCommand(lane, rid, "m", 100, 1))
            if number % 3 == 0:
                ledger.settle(moves.SettleCommand(lane, rid, Outcome.SUCCEEDED, 10, 1))
            elif number % 3 == 1:
                ledger.refund(moves.RefundCommand(lane, rid, http_status=429))
            # else left open: expired by the sweep below
            clock.advance_us(1_000)
    # Every hold's deadline and every window (the parent's too) passes.
    clock.advance_us(PARENT.window_us + SECOND_US)
    while ledger.sweep(100):
        pass
    ledger.put_lane(OTHER)
    for number in range(3):
        clock.advance_us(SECOND_US)
        ledger.reserve(moves.ReserveCommand(OTHER.lane, f"o{number}", "m", 100, 1))
        ledger.settle(moves.SettleCommand(OTHER.lane, f"o{number}", Outcome.SUCCEEDED, 1, 1))


def test_holds_that_ended_leave_the_writers_memory(tmp_path: Path) -> None:
    """A server that runs for months: a lane left idle must not keep, for
    ever, the deadlines of its holds that ended (nor an empty table of them)."""
    clock = ManualClock(START_US)
    ledger, store = _open(f"sqlite:///{tmp_path}/holds.db", clock, verify=False)
    try:
        _churn_then_idle(ledger, clock)
        held = _writer_entries(store)
        assert (held["open"], held["open lanes"], held["deadlines"]) == (0, 0, 0), held
    finally:
        store.close()


def test_bookings_that_aged_out_leave_the_writers_memory(tmp_path: Path) -> None:
    """Nor the bookings that left its windows: once every window has passed,
    the writer holds nothing of them, however many there were. Every window
    a move reads is checked against a full sum (verify_windows), so a budget
    forgotten and read again must give the same sums."""
    clock = ManualClock(START_US)
    ledger, store = _open(f"sqlite:///{tmp_path}/aged.db", clock)
    try:
        _churn_then_idle(ledger, clock)
        held = _writer_entries(store)
        # OTHER's own queue, with its window's three bookings; nothing else.
        assert (held["queues"], held["queue entries"]) == (1, 3), held
        # What was dropped is read again when a lane is used again.
        clock.advance_us(SECOND_US)
        again = ledger.reserve(moves.ReserveCommand("idle-0", "again", "m", 100, 1))
        assert again.balance.totals == ledger.balance("idle-0").totals
    finally:
        store.close()
