"""The ledger application: each move is one store transaction.

Every move on a lane first locks the lane (so admissions are serialized across
processes), reads the clock (so reserved_at follows commit order), expires a
booking whose deadline has passed, asks the domain what to do, then appends the
event and updates the projection with the same fold a replay uses.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ledger_service.application.budgets import (
    BudgetWindow,
    lane_time,
    open_window,
    open_windows,
    record_windows,
)
from ledger_service.application.ports import EventQuery, Store, StoreTransaction
from ledger_service.domain import bookings, moves
from ledger_service.domain.bookings import Booking, BookingState
from ledger_service.domain.clock import Clock
from ledger_service.domain.errors import (
    BookingNotFound,
    InvalidArgument,
    LaneNotFound,
    RecoveryRequired,
    SumOutOfRange,
)
from ledger_service.domain.events import Event, EventKind, Outcome, evolve
from ledger_service.domain.policies import MAX_BUDGET_DEPTH, LanePolicy, policy_to_dict
from ledger_service.domain.pricing import MAX_WINDOW_SUM_NANOS
from ledger_service.domain.window import Balance, WindowTotals

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class ReserveResult:
    event: Event
    balance: Balance
    # The answer of an earlier Reserve under this id, repeated: this call booked nothing.
    already_reserved: bool = False

    @property
    def admitted(self) -> bool:
        return self.event.kind is EventKind.RESERVED


@dataclasses.dataclass(frozen=True)
class SettleResult:
    charged_nanos: int
    state: BookingState
    balance: Balance


@dataclasses.dataclass(frozen=True)
class RefundResult:
    balance: Balance


@dataclasses.dataclass(frozen=True)
class CorrectResult:
    event: Event
    balance: Balance


def balance_after(event: Event) -> Balance:
    """The balance an event recorded right after itself: any answer can be repeated."""
    return Balance(
        lane=event.lane,
        limit_nanos=event.limit_nanos,
        window_us=event.window_us,
        as_of_us=event.occurred_at_us,
        totals=WindowTotals(
            event.held_after_nanos, event.charged_after_nanos, event.open_bookings_after
        ),
    )


class EventSignal:
    """Wakes event tails in this process when a transaction commits."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._generation = 0

    def notify(self) -> None:
        with self._condition:
            self._generation += 1
            self._condition.notify_all()

    def generation(self) -> int:
        with self._condition:
            return self._generation

    def wait(self, generation: int, timeout_seconds: float) -> None:
        with self._condition:
            self._condition.wait_for(lambda: self._generation != generation, timeout_seconds)


def last_event_at_us(tx: StoreTransaction) -> int:
    """When the last recorded event happened (0 with none): a ledger's time
    never runs back before it (domain.clock.SteadyClock)."""
    last = tx.get_event(tx.last_seq())
    return last.occurred_at_us if last is not None else 0


class Ledger:
    def __init__(
        self,
        store: Store,
        clock: Clock,
        *,
        max_page_size: int = 1000,
        verify_windows: bool = False,
    ) -> None:
        self._store = store
        self._clock = clock
        self._max_page_size = max_page_size
        self._verify_windows = verify_windows
        self.signal = EventSignal()

    @property
    def clock(self) -> Clock:
        return self._clock

    # Lanes -----------------------------------------------------------------

    def put_lane(self, policy: LanePolicy, trace_id: str = "") -> LanePolicy:
        policy.validate()

        def work(tx: StoreTransaction) -> LanePolicy:
            tx.lock_configuration()
            # The lane alone: its old budgets are locked after the checks, next
            # to its new ones, so a busy root is not held while it checks.
            existing = tx.lock_lane(policy.lane, budgets=False)
            if existing is not None and policy_to_dict(existing) == policy_to_dict(policy):
                return existing
            new_chain = _check_nesting(tx, policy)
            # Every budget whose window or members may change keeps its sums no more.
            _lock_apart_from_shared(tx, existing, policy, new_chain)
            stale = {policy.lane: policy}
            for chain_of in (existing, policy):
                if chain_of is not None:
                    for ancestor in locked_ancestors(tx, chain_of):
                        stale.setdefault(ancestor.lane, ancestor)
            # Dated no earlier than any of those windows was moved to, by this
            # replica or a faster one, and they are kept again at that instant
            # below: dropped, a lagging replica's next move would be dated at its
            # own clock and leave out what the faster one booked ahead of it.
            now_us = lane_time(tx, list(stale.values()), self._clock.now_us())
            tx.drop_window_states(sorted(stale))
            # A longer window brings older bookings back into the lane's sums.
            totals = _checked_totals(tx, policy.lane, now_us, policy.window_us, "lane.window")
            joins_parent = policy.parent is not None and (
                existing is None or existing.parent != policy.parent
            )
            if joins_parent:
                _check_parent_sums(tx, policy, now_us)
            event = with_balance(
                Event(
                    kind=EventKind.LANE_CONFIGURED,
                    lane=policy.lane,
                    occurred_at_us=now_us,
                    policy=policy_to_dict(policy),
                    trace_id=trace_id,
                ),
                policy,
                totals,
            )
            stored = tx.append(event)
            saved = dataclasses.replace(policy, version=stored.seq, updated_at_us=now_us)
            tx.save_lane(saved)
            budgets = [saved, *(budget for lane, budget in stale.items() if lane != saved.lane)]
            record_windows(tx, open_windows(tx, budgets, now_us, verify=self._verify_windows))
            return saved

        return self._write(work, replayable=True)

    def get_lane(self, lane: str) -> LanePolicy:
        # One snapshot for the row and the log, so a PutLane committing
        # between the two reads is not taken for a lost row.
        return self._store.run(
            lambda tx: lane_row(tx, tx.get_lane(lane), lane), write=False, snapshot=True
        )

    def check_lane(self, lane: str) -> None:
        """LaneNotFound unless the lane has a row or the log has it: the log
        reads (ListEvents, WatchEvents) serve a lane whose row was lost, the
        log being the authority."""

        def work(tx: StoreTransaction) -> None:
            if tx.get_lane(lane) is None and not _in_the_log(tx, lane, locked=False):
                raise LaneNotFound(lane)

        self._store.run(work, write=False, snapshot=True)

    def list_lanes(self, after_lane: str, limit: int) -> Sequence[LanePolicy]:
        # One more than a page, so a caller can tell whether another page follows.
        limit = max(1, min(limit, self._max_page_size + 1))
        return self._store.run(lambda tx: tx.list_lanes(after_lane, limit), write=False)

    # Moves -----------------------------------------------------------------

    def reserve(self, command: moves.ReserveCommand, trace_id: str = "") -> ReserveResult:
        command.validate()
        # The event an earlier run of this same call wrote: the store runs the
        # work again when it cannot tell whether that run's commit was kept
        # (a lost connection), and finding it then is no earlier Reserve's.
        written: list[Event] = []

        def work(tx: StoreTransaction) -> ReserveResult:
            policy = _locked_lane(tx, command.lane, command.reservation_id)
            existing = tx.get_booking(command.lane, command.reservation_id)
            if existing is not None:
                moves.check_reserve_repeat(existing, command)
                first = _event(tx, existing.answer_seq)
                ours = any((e.seq, e.trace_id) == (first.seq, first.trace_id) for e in written)
                return ReserveResult(first, balance_after(first), already_reserved=not ours)
            now_us, windows = self._budget_windows(tx, policy)
            budgets = [
                moves.Budget(
                    window.policy,
                    window.totals,
                    functools.partial(
                        tx.aging, window.policy.lane, now_us, window.policy.window_us
                    ),
                )
                for window in windows
            ]
            event = moves.decide_reserve(budgets, command, now_us)
            stored, _ = record_booking_event(tx, windows, None, event, now_us, trace_id)
            written.append(stored)
            return ReserveResult(stored, balance_after(stored))

        return self._write(work, replayable=True, lane=command.lane)

    def settle(self, command: moves.SettleCommand, trace_id: str = "") -> SettleResult:
        command.validate()

        def work(tx: StoreTransaction) -> SettleResult:
            booking, windows, now_us = self._open_booking(tx, command, trace_id)
            verdict = moves.decide_settle(
                booking,
                command,
                now_us,
                windows[0].policy.max_charge_multiple,
                functools.partial(_as_the_lane_left_it, tx, booking),
            )
            if verdict.event is not None:
                stored, after = record_booking_event(
                    tx, windows, booking, verdict.event, now_us, trace_id, command.charge_field
                )
                return SettleResult(stored.amount_nanos, after.state, balance_after(stored))
            if verdict.repeat_seq:
                first = _event(tx, verdict.repeat_seq)
                state = (
                    BookingState.SETTLED
                    if first.outcome is Outcome.SUCCEEDED
                    else BookingState.SETTLED_UNKNOWN
                )
                return SettleResult(first.amount_nanos, state, balance_after(first))
            policy = windows[0].policy
            balance = Balance(
                policy.lane, policy.limit_nanos, policy.window_us, now_us, windows[0].totals
            )
            return SettleResult(booking.amount_at(now_us), booking.state, balance)

        return self._write(work, replayable=True, lane=command.lane)

    def refund(self, command: moves.RefundCommand, trace_id: str = "") -> RefundResult:
        command.validate()

        def work(tx: StoreTransaction) -> RefundResult:
            booking, windows, now_us = self._open_booking(tx, command, trace_id)
            verdict = moves.decide_refund(
                booking, command, now_us, functools.partial(_as_the_lane_left_it, tx, booking)
            )
            if verdict.event is not None:
                stored, _ = record_booking_event(
                    tx, windows, booking, verdict.event, now_us, trace_id
                )
                return RefundResult(balance_after(stored))
            return RefundResult(balance_after(_event(tx, verdict.repeat_seq)))

        return self._write(work, replayable=True, lane=command.lane)

    def correct(
        self, command: moves.CorrectCommand, grant_id: str, trace_id: str = ""
    ) -> CorrectResult:
        """An operator's correction of an ended booking's charge; a repeat of the
        same correction id returns the first answer."""
        command.validate()

        def work(tx: StoreTransaction) -> CorrectResult:
            _locked_lane(tx, command.lane)
            first = tx.get_correction(command.lane, command.correction_id)
            if first is not None:
                moves.check_correction_repeat(first, command)
                return CorrectResult(first, balance_after(first))
            booking, windows, now_us = self._open_booking(tx, command, trace_id)
            event = moves.decide_correct(booking, command, now_us, grant_id)
            stored, _ = record_booking_event(
                tx, windows, booking, event, now_us, trace_id, "charge_nanos"
            )
            return CorrectResult(stored, balance_after(stored))

        return self._write(work, replayable=True)

    def _open_booking(
        self,
        tx: StoreTransaction,
        command: moves.SettleCommand | moves.RefundCommand | moves.CorrectCommand,
        trace_id: str,
    ) -> tuple[Booking, list[BudgetWindow], int]:
        """Locks the lane and its budgets, finds the booking and expires it first
        if its deadline passed."""
        policy = _locked_lane(tx, command.lane, command.reservation_id)
        found = tx.get_booking(command.lane, command.reservation_id)
        booking = _booking_row(tx, found, command.lane, command.reservation_id, locked=True)
        now_us, windows = self._budget_windows(tx, policy)
        if booking.is_expired_at(now_us):
            event = moves.expire(booking, now_us)
            _, booking = record_booking_event(tx, windows, booking, event, now_us, trace_id)
        return booking, windows, now_us

    def _budget_windows(
        self, tx: StoreTransaction, policy: LanePolicy
    ) -> tuple[int, list[BudgetWindow]]:
        """Locks the lane's ancestors (the lane is locked already), then reads the
        clock and each budget's window at that instant."""
        budgets = [policy, *locked_ancestors(tx, policy)]
        now_us = lane_time(tx, budgets, self._clock.now_us())
        return now_us, open_windows(tx, budgets, now_us, verify=self._verify_windows)

    def sweep(self, batch_size: int) -> int:
        """Records an expired event for every hold past its deadline; returns how many."""
        now_us = self._clock.now_us()
        due = self._store.run(lambda tx: tx.expired_open_bookings(now_us, batch_size), write=False)
        lanes = sorted({booking.lane for booking in due})
        wanted = {(booking.lane, booking.reservation_id) for booking in due}
        expired = 0
        for lane in lanes:
            expired += self._write(
                functools.partial(self._expire_lane, lane=lane, wanted=wanted), lane=lane
            )
        return expired

    def _expire_lane(self, tx: StoreTransaction, lane: str, wanted: set[tuple[str, str]]) -> int:
        policy = tx.lock_lane(lane)
        if policy is None:
            return 0
        now_us, windows = self._budget_windows(tx, policy)
        count = 0
        for key_lane, reservation_id in sorted(wanted):
            if key_lane != lane:
                continue
            booking = tx.get_booking(lane, reservation_id)
            if booking is None or not booking.is_expired_at(now_us):
                continue  # ended meanwhile
            event = moves.expire(booking, now_us)
            record_booking_event(tx, windows, booking, event, now_us, "")
            count += 1
        return count

    # Reads -----------------------------------------------------------------

    def balance(self, lane: str) -> Balance:
        def work(tx: StoreTransaction) -> Balance:
            policy = lane_row(tx, tx.get_lane(lane), lane)
            now_us = lane_time(tx, [policy], self._clock.now_us())
            window = open_window(tx, policy, now_us, verify=self._verify_windows)
            return Balance(lane, policy.limit_nanos, policy.window_us, now_us, window.totals)

        return self._store.run(work, write=False, in_turn=True)

    def booking(self, lane: str, reservation_id: str) -> tuple[Booking, int, int]:
        """The booking, the instant it was read at, and the lane's window."""

        def work(tx: StoreTransaction) -> tuple[Booking, int, int]:
            policy = lane_row(tx, tx.get_lane(lane), lane)
            booking = _booking_row(tx, tx.get_booking(lane, reservation_id), lane, reservation_id)
            # The lane's time, as a balance reads it, so both agree on its deadline.
            return booking, lane_time(tx, [policy], self._clock.now_us()), policy.window_us

        return self._store.run(work, write=False, snapshot=True)

    def list_events(self, query: EventQuery) -> Sequence[Event]:
        query = dataclasses.replace(query, limit=max(1, min(query.limit, self._max_page_size + 1)))
        if query.lane:
            self.check_lane(query.lane)
        return self.read_events(query)

    def read_events(self, query: EventQuery) -> Sequence[Event]:
        """A page of the log as the store gives it, unchecked (the event feed's read)."""
        return self._store.run(lambda tx: tx.list_events(query), write=False)

    def last_seq(self) -> int:
        return self._store.run(lambda tx: tx.last_seq(), write=False)

    def watch_after(self, after_seq: int) -> int:
        """`after_seq` as the start of an event stream. Refused past the highest
        seq the log ever handed out: such a cursor comes from another ledger
        or from before a restore, and its stream would wait, silent, until
        this log caught up (a page of ListEvents is just empty)."""
        handed = self._store.run(lambda tx: tx.last_handed_seq(), write=False)
        if after_seq > handed:
            raise InvalidArgument(
                "after_seq",
                f"{after_seq} is past the end of this ledger's log, whose last seq is "
                f"{handed}: likely a cursor from another ledger, or from before a restore",
            )
        return after_seq

    def last_event_at_us(self) -> int:
        """When the last recorded event happened (0 with none)."""
        return self._store.run(last_event_at_us, write=False)

    def write(self, work: Callable[[StoreTransaction], _T]) -> _T:
        """Runs `work` in one write transaction and wakes the event tails."""
        return self._write(work)

    def _write(
        self, work: Callable[[StoreTransaction], _T], *, replayable: bool = False, lane: str = ""
    ) -> _T:
        """`replayable`: a move or a PutLane, whose repeat is answered as the
        first was (docs/semantics.md, Idempotency), so the store may run it
        again when it cannot tell whether its commit was kept."""
        result = self._store.run(work, replayable=replayable, lane=lane)
        self.signal.notify()
        return result


def _locked_lane(tx: StoreTransaction, lane: str, reservation_id: str = "") -> LanePolicy:
    return lane_row(tx, tx.lock_lane(lane, reservation_id), lane, locked=True)


def lane_row(
    tx: StoreTransaction, policy: LanePolicy | None, lane: str, *, locked: bool = False
) -> LanePolicy:
    """The lane's row a move or a read found, or its refusal when it found none."""
    if policy is None:
        if _in_the_log(tx, lane, locked=locked):
            raise RecoveryRequired()  # its row was lost: the projections are not whole
        raise LaneNotFound(lane)
    return policy


def _booking_row(
    tx: StoreTransaction,
    booking: Booking | None,
    lane: str,
    reservation_id: str,
    *,
    locked: bool = False,
) -> Booking:
    """The booking's row a move or a read found, or its refusal when it found none."""
    if booking is None:
        if _in_the_log(tx, lane, reservation_id, locked=locked):
            raise RecoveryRequired()  # its row was lost: the projections are not whole
        raise BookingNotFound(lane, reservation_id)
    return booking


def _in_the_log(tx: StoreTransaction, lane: str, reservation_id: str = "", *, locked: bool) -> bool:
    """Whether the log has an event of the lane (of the booking): asked only
    where a move or a read found no row for it. A row deleted by hand must
    not be answered LANE_NOT_FOUND or BOOKING_NOT_FOUND, final answers, until
    the next consistency check sees it (docs/recovery.md). `locked`: the
    caller holds the lane's lock, so the read need not stop at the horizon."""
    query = EventQuery(lane=lane, reservation_id=reservation_id, limit=1, lane_locked=locked)
    return bool(tx.list_events(query))


def locked_ancestors(tx: StoreTransaction, policy: LanePolicy) -> list[LanePolicy]:
    """The lane's parent budgets, nearest first, each locked until commit.

    Locks are always taken from a lane upwards, so two Reserves on sibling
    lanes queue on their shared parent instead of deadlocking.
    """
    ancestors: list[LanePolicy] = []
    seen = {policy.lane}
    parent = policy.parent
    while parent is not None and len(ancestors) < MAX_BUDGET_DEPTH - 1:
        if parent in seen:
            break  # a cycle cannot be configured; never loop on one
        seen.add(parent)
        ancestor = tx.lock_lane(parent)
        if ancestor is None:
            break
        ancestors.append(ancestor)
        parent = ancestor.parent
    return ancestors


def locked_trees(tx: StoreTransaction, lanes: Sequence[str]) -> dict[str, LanePolicy]:
    """Locks each of `lanes` that exists and every budget above it, for work on
    several lanes in one transaction (a reconcile); the locked policies by name.

    The locks go deepest first, by name within a depth. A move takes its
    locks at strictly falling depth (its lane, then each parent), so no move
    and no other caller of this can hold a lock this wants while waiting for
    one this holds. Depths are read before the locks, so the configuration
    lock comes first: no PutLane changes the tree until commit, and none
    holds a row lock this waits for (each takes that lock before any row's).
    """
    tx.lock_configuration()
    trees = _read_trees(tx, lanes)
    locked: dict[str, LanePolicy] = {}
    for name in sorted(trees, key=lambda name: (-trees[name][1], name)):
        policy = tx.lock_lane(name, budgets=False)
        if policy is None or policy.parent != trees[name][0].parent:
            raise RuntimeError(f"lane {name!r} changed under the configuration lock")
        locked[name] = policy
    return locked


def _read_trees(tx: StoreTransaction, lanes: Sequence[str]) -> dict[str, tuple[LanePolicy, int]]:
    """Each existing lane of `lanes` and each budget above it (as far as
    locked_ancestors goes), with its depth (how many budgets are above it),
    read without locks: one read a lane."""
    read: dict[str, LanePolicy | None] = {}

    def lane(name: str) -> LanePolicy | None:
        if name not in read:
            read[name] = tx.get_lane(name)
        return read[name]

    def chain(policy: LanePolicy) -> list[LanePolicy]:
        found = [policy]
        parent = policy.parent
        while parent is not None and len(found) < MAX_BUDGET_DEPTH:
            ancestor = lane(parent)
            if ancestor is None or any(seen.lane == parent for seen in found):
                break  # a cycle cannot be configured; never loop on one
            found.append(ancestor)
            parent = ancestor.parent
        return found

    trees: dict[str, tuple[LanePolicy, int]] = {}
    for name in lanes:
        policy = lane(name)
        for budget in chain(policy) if policy is not None else []:
            if budget.lane not in trees:
                trees[budget.lane] = (budget, len(chain(budget)) - 1)
    return trees


def _lock_apart_from_shared(
    tx: StoreTransaction, before: LanePolicy | None, after: LanePolicy, new: list[str]
) -> None:
    """A PutLane that changes a lane's parent locks the lanes that only one of
    its two chains holds, each chain from below, before the ancestors both
    share: so it takes its locks in the order every move does, a lane before
    any lane above it (the old chain's root first would deadlock with a move
    under the new parent that holds the parent and waits for that root). The
    chains are read without locks: only PutLanes change them, one at a time.
    `new`: the new parent's chain, as _check_nesting walked it."""
    if before is None or before.parent == after.parent:
        return
    old = _ancestor_names(tx, before)
    for lane in [*old, *new]:
        if lane not in old or lane not in new:
            tx.lock_lane(lane, budgets=False)


def _ancestor_names(tx: StoreTransaction, policy: LanePolicy) -> list[str]:
    names: list[str] = []
    parent = policy.parent
    while parent is not None and parent not in names and len(names) < MAX_BUDGET_DEPTH - 1:
        names.append(parent)
        ancestor = tx.get_lane(parent)
        parent = ancestor.parent if ancestor is not None else None
    return names


def _check_nesting(tx: StoreTransaction, policy: LanePolicy) -> list[str]:
    """A parent must exist, make no cycle, and nest budgets at most MAX_BUDGET_DEPTH
    deep. Returns the lanes above the lane, nearest first."""
    if policy.parent is None:
        return []
    above: list[str] = []
    parent: str | None = policy.parent
    while parent is not None:
        if parent == policy.lane:
            raise InvalidArgument("lane.parent", f"{policy.parent!r} would make a cycle")
        ancestor = tx.get_lane(parent)
        if ancestor is None:
            raise InvalidArgument(
                "lane.parent",
                f"there is no lane named {parent!r}: "
                "create the parent first, as a lane with its own limit",
            )
        above.append(parent)
        if len(above) >= MAX_BUDGET_DEPTH:
            break
        parent = ancestor.parent
    levels = len(tx.subtree(policy.lane, MAX_BUDGET_DEPTH))
    if len(above) + levels > MAX_BUDGET_DEPTH:
        raise InvalidArgument(
            "lane.parent", f"budgets may nest at most {MAX_BUDGET_DEPTH} lanes deep"
        )
    return above


def _check_parent_sums(tx: StoreTransaction, policy: LanePolicy, now_us: int) -> None:
    """A lane put under a new parent brings its bookings into every ancestor's
    window: each must stay within the largest sum the ledger keeps. (Counted as
    if the lane were new to each ancestor, so the check can only err on the
    safe side.)"""
    for ancestor in locked_ancestors(tx, policy):
        field = "lane.parent"
        joined = _checked_totals(tx, policy.lane, now_us, ancestor.window_us, field)
        already = _checked_totals(tx, ancestor.lane, now_us, ancestor.window_us, field)
        moves.check_window_sums([joined.spent_nanos + already.spent_nanos], field)


def _checked_totals(
    tx: StoreTransaction, lane: str, now_us: int, window_us: int, field: str
) -> WindowTotals:
    """The budget's totals over a window a request sets, refused naming
    `field` when they pass the largest sum the ledger keeps (a sum the
    database itself could not hold included)."""
    try:
        totals = tx.window_totals(lane, now_us, window_us)
    except SumOutOfRange:
        raise moves.sum_out_of_range(field) from None
    moves.check_window_sums([totals.spent_nanos], field)
    return totals


def _as_the_lane_left_it(tx: StoreTransaction, booking: Booking) -> Booking:
    # A booking's own moves are a handful (reserve, expiry, an unknown and a
    # late settle, a refund); the page bound is far above them.
    query = EventQuery(
        lane=booking.lane,
        reservation_id=booking.reservation_id,
        kinds=tuple(kind.value for kind in moves.LANE_KINDS),
        lane_locked=True,  # the move holds the lane's lock: read past the horizon
    )
    history = tx.list_events(query)
    assert len(history) < query.limit, "a booking's own moves fill a page"
    return moves.as_the_lane_left_it(history)


def _event(tx: StoreTransaction, seq: int) -> Event:
    event = tx.get_event(seq)
    assert event is not None, f"event {seq} named by a booking is missing"
    return event


def with_balance(event: Event, policy: LanePolicy, totals: WindowTotals, **changes: Any) -> Event:
    """The event with its lane's balance right after it (and `changes`)."""
    return evolve(
        event,
        **changes,
        spent_after_nanos=totals.spent_nanos,
        held_after_nanos=totals.held_nanos,
        charged_after_nanos=totals.charged_nanos,
        open_bookings_after=totals.open_bookings,
        limit_nanos=policy.limit_nanos,
        window_us=policy.window_us,
    )


def record_booking_event(
    tx: StoreTransaction,
    windows: list[BudgetWindow],
    before: Booking | None,
    event: Event,
    now_us: int,
    trace_id: str,
    amount_field: str = "",
) -> tuple[Event, Booking]:
    """Appends one booking event and projects it: the booking, and the windows
    of every budget it belongs to (`windows[0]` is its lane's). Returns the
    stored event and the booking after it.

    A move that may raise an amount past its hold (a SUCCEEDED settle, a
    reconcile, a correction) names the request field it came from, so that a
    window it would take past the largest sum is refused naming that field.
    """
    preview = bookings.apply(event, before)
    for window in windows:
        window.change(before, preview, now_us)
    spent = [window.totals.spent_nanos for window in windows]
    if amount_field:
        moves.check_window_sums(spent, amount_field)
    else:
        assert all(value <= MAX_WINDOW_SUM_NANOS for value in spent), spent
    lane = windows[0]
    stored = tx.append(with_balance(event, lane.policy, lane.totals, trace_id=trace_id))
    after = bookings.apply(stored, before)
    tx.save_booking(after)
    record_windows(tx, windows)
    return stored, after
