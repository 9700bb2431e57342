"""A lane's budgets (the lane and its ancestors) and their windows, within one move.

Each budget's window is kept incrementally (domain/window.py's WindowState):
reading it at `now` only touches the bookings that crossed an edge of the
window since it was last moved, so admission costs the same with a hundred
bookings in the window as with a million. With `verify` on (tests, and
`LEDGER_VERIFY_WINDOWS=1`), every incremental read is checked against a full
sum of the window: the pair assertion.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence

from ledger_service.application.ports import EdgeQuery, StoreTransaction
from ledger_service.domain.bookings import Booking
from ledger_service.domain.policies import LanePolicy
from ledger_service.domain.window import Overdue, WindowState, WindowTotals, in_window


@dataclasses.dataclass
class BudgetWindow:
    """One budget's window at `now`, updated in place as the move changes bookings."""

    policy: LanePolicy
    state: WindowState
    overdue: Overdue

    @property
    def totals(self) -> WindowTotals:
        return self.state.totals(self.overdue)

    def change(self, before: Booking | None, after: Booking, now_us: int) -> None:
        """Follows one booking of this budget from `before` to `after`."""
        if (
            before is not None
            and before.is_expired_at(now_us)
            and in_window(before.reserved_at_us, now_us, self.state.window_us)
        ):
            # It was counted as overdue (expired, sweeper or not); now its event says so.
            self.overdue = Overdue(
                self.overdue.held_nanos - before.amount_nanos,
                self.overdue.expire_charge_nanos - before.expire_charge_nanos,
                self.overdue.bookings - 1,
            )
        self.state = self.state.changed(before, after)


log = logging.getLogger(__name__)

# A clock this far behind a lane's time is told in the log, at most once a
# minute: another replica's clock runs ahead, or this one stepped back, and the
# skew is the error of every deadline and window edge (docs/postgresql.md).
CLOCK_BEHIND_WARNING_US = 1_000_000
CLOCK_BEHIND_LOG_SECONDS = 60.0


class _BehindLog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._logged_at: float | None = None

    def note(self, lane: str, behind_us: int) -> None:
        now = time.monotonic()
        with self._lock:
            if self._logged_at is not None and now - self._logged_at < CLOCK_BEHIND_LOG_SECONDS:
                return
            self._logged_at = now
        log.warning(
            "this server's clock is %.3f s behind the time of lane %r, which another replica "
            "(or this one, before its clock stepped back) moved it to: moves are dated at the "
            "lane's time, and holds expire and bookings age out by the fastest clock; keep the "
            "replicas' clocks within a small part of the shortest hold ttl (docs/postgresql.md)",
            behind_us / 1_000_000,
            lane,
        )


_behind = _BehindLog()


def lane_time(tx: StoreTransaction, budgets: Sequence[LanePolicy], clock_us: int) -> int:
    """The clock's instant, or, if later, the latest any budget's kept window was
    moved to. Replicas' clocks disagree: one that lags must not date a move
    before what a faster one recorded, or the bookings dated ahead would leave
    the window it reads and the budget would be spent twice."""
    now_us, ahead = clock_us, ""
    for budget in budgets:
        state = tx.window_state(budget.lane)
        if state is not None and state.as_of_us > now_us:
            now_us, ahead = state.as_of_us, budget.lane
    if now_us - clock_us > CLOCK_BEHIND_WARNING_US:
        _behind.note(ahead, now_us - clock_us)
    return now_us


def open_windows(
    tx: StoreTransaction, budgets: Sequence[LanePolicy], now_us: int, *, verify: bool = False
) -> list[BudgetWindow]:
    """Each budget's window at now_us, moved incrementally from where it was
    kept; the edges of all of them in one read."""
    kept = [_kept(tx, policy) for policy in budgets]
    queries = [
        _edges_to(policy, state, now_us) for policy, state in zip(budgets, kept, strict=True)
    ]
    windows = []
    for policy, state, (entered, left, overdue) in zip(
        budgets, kept, tx.window_edges(queries), strict=True
    ):
        if state is None:
            state = WindowState(policy.lane, policy.window_us, now_us, entered)
        elif state.as_of_us != now_us:
            state = state.moved_to(now_us, entered, left)
        window = BudgetWindow(policy, state, overdue)
        if verify:
            full = tx.window_totals(policy.lane, now_us, policy.window_us)
            assert window.totals == full, (
                f"incremental window of {policy.lane!r} says {window.totals}, a full sum {full}"
            )
        windows.append(window)
    return windows


def open_window(
    tx: StoreTransaction, policy: LanePolicy, now_us: int, *, verify: bool = False
) -> BudgetWindow:
    return open_windows(tx, [policy], now_us, verify=verify)[0]


def _kept(tx: StoreTransaction, policy: LanePolicy) -> WindowState | None:
    """The budget's kept window, unless it was kept for another window length."""
    kept = tx.window_state(policy.lane)
    return kept if kept is not None and kept.window_us == policy.window_us else None


def _edges_to(policy: LanePolicy, kept: WindowState | None, now_us: int) -> EdgeQuery:
    """What moves the kept window to now_us; with none kept, the whole window enters."""
    window_us = policy.window_us
    nothing = (now_us, now_us)
    if kept is None:
        entering, leaving = (now_us - window_us, now_us), nothing
    elif kept.as_of_us == now_us:
        entering, leaving = nothing, nothing
    else:
        entering, leaving = kept.edges_to(now_us)
    return EdgeQuery(policy.lane, entering, leaving, now_us, window_us)


def record_windows(tx: StoreTransaction, windows: list[BudgetWindow]) -> None:
    for window in windows:
        tx.save_window_state(window.state)
