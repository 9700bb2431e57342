"""The true rolling window.

    spent(lane, now) = sum of amount(b) for every booking b of the lane
                       with now - window < reserved_at(b) <= now

A booking's amount is dated at reserved_at for its whole life, so it ages out
exactly window_us after it was made, to the microsecond.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from ledger_service.domain.bookings import Booking, BookingState


def in_window(reserved_at_us: int, now_us: int, window_us: int) -> bool:
    return now_us - window_us < reserved_at_us <= now_us


@dataclasses.dataclass(frozen=True)
class WindowTotals:
    """held + charged of the bookings inside one lane's window at one instant."""

    held_nanos: int = 0
    charged_nanos: int = 0
    open_bookings: int = 0

    @property
    def spent_nanos(self) -> int:
        return self.held_nanos + self.charged_nanos


@dataclasses.dataclass(frozen=True)
class Balance:
    lane: str
    limit_nanos: int
    window_us: int
    as_of_us: int
    totals: WindowTotals

    @property
    def spent_nanos(self) -> int:
        return self.totals.spent_nanos

    @property
    def available_nanos(self) -> int:
        return self.limit_nanos - self.totals.spent_nanos

    @property
    def overrun_nanos(self) -> int:
        return max(0, self.totals.spent_nanos - self.limit_nanos)


def totals_of(bookings: Iterable[Booking], now_us: int, window_us: int) -> WindowTotals:
    """Sums a lane's window from bookings: the replay side of the pair assertion."""
    held = charged = open_count = 0
    for booking in bookings:
        if not in_window(booking.reserved_at_us, now_us, window_us):
            continue
        held_part, charged_part = booking.contribution(now_us)
        held += held_part
        charged += charged_part
        open_count += int(booking.is_open_at(now_us))
    return WindowTotals(held, charged, open_count)


def retry_after_us(
    needed_nanos: int, aging: Iterable[tuple[int, int]], window_us: int
) -> int | None:
    """The earliest instant at which enough bookings age out to free `needed_nanos`.

    `aging` yields (reserved_at_us, amount_nanos) of the bookings now inside the
    window, oldest first. Only aging counts, never hoped-for settlements. None
    when the window's bookings together cannot free that much.
    """
    if needed_nanos <= 0:
        return None
    freed = 0
    for reserved_at_us, amount_nanos in aging:
        freed += amount_nanos
        if freed >= needed_nanos:
            # At reserved_at + window the booking is out: the window is half-open.
            return reserved_at_us + window_us
    return None


# The incremental window -------------------------------------------------------
#
# Summing a window on every Reserve costs O(bookings in the window). Instead a
# budget keeps the sums of its window as of one instant, and moving that
# instant only touches the bookings that cross an edge: each booking enters
# once and ages out once, so admission is O(1) amortised however long the
# window's history. The sums are of *stored* amounts (as the last event left
# them); open holds past their deadline are corrected at read time, since
# they count as expired from that instant whether or not the sweeper ran.


@dataclasses.dataclass(frozen=True)
class StoredSums:
    """Stored amounts of a set of bookings: all of them, and those still open."""

    amount_nanos: int = 0
    open_amount_nanos: int = 0
    open_bookings: int = 0

    def __add__(self, other: StoredSums) -> StoredSums:
        return StoredSums(
            self.amount_nanos + other.amount_nanos,
            self.open_amount_nanos + other.open_amount_nanos,
            self.open_bookings + other.open_bookings,
        )

    def __sub__(self, other: StoredSums) -> StoredSums:
        return StoredSums(
            self.amount_nanos - other.amount_nanos,
            self.open_amount_nanos - other.open_amount_nanos,
            self.open_bookings - other.open_bookings,
        )

    @classmethod
    def of(cls, booking: Booking | None) -> StoredSums:
        if booking is None:
            return cls()
        is_open = booking.state is BookingState.OPEN
        return cls(
            booking.amount_nanos, booking.amount_nanos if is_open else 0, 1 if is_open else 0
        )


@dataclasses.dataclass(frozen=True)
class Overdue:
    """Open holds inside the window whose deadline has passed: stored, and as expired."""

    held_nanos: int = 0
    expire_charge_nanos: int = 0
    bookings: int = 0


@dataclasses.dataclass(frozen=True)
class WindowState:
    """One budget's window sums as of `as_of_us`, kept incrementally."""

    lane: str
    window_us: int
    as_of_us: int
    sums: StoredSums

    def edges_to(self, now_us: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The two half-open ranges (after, until] of reserved_at whose bookings
        change sides when the window moves from as_of to now: the first is
        added, the second removed (either may be empty)."""
        then, window = self.as_of_us, self.window_us
        if now_us >= then:
            return (then, now_us), (then - window, now_us - window)
        return (now_us - window, then - window), (now_us, then)

    def moved_to(self, now_us: int, entering: StoredSums, leaving: StoredSums) -> WindowState:
        return dataclasses.replace(self, as_of_us=now_us, sums=self.sums + entering - leaving)

    def changed(self, before: Booking | None, after: Booking) -> WindowState:
        """The state after one booking of this budget changed from `before` to `after`."""
        if not in_window(after.reserved_at_us, self.as_of_us, self.window_us):
            return self
        return dataclasses.replace(
            self, sums=self.sums - StoredSums.of(before) + StoredSums.of(after)
        )

    def totals(self, overdue: Overdue) -> WindowTotals:
        held = self.sums.open_amount_nanos - overdue.held_nanos
        charged = self.sums.amount_nanos - self.sums.open_amount_nanos
        return WindowTotals(
            held, charged + overdue.expire_charge_nanos, self.sums.open_bookings - overdue.bookings
        )
