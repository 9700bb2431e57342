"""The small storage interface the application needs.

SQLAlchemy adapters in `ledger_service.storage` implement it for SQLite and
PostgreSQL; the application knows nothing of SQL.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, Protocol, TypeVar

from ledger_service.domain.bookings import Booking, BookingState
from ledger_service.domain.events import Event
from ledger_service.domain.policies import LanePolicy
from ledger_service.domain.window import Overdue, StoredSums, WindowState, WindowTotals

T = TypeVar("T")
# A half-open range (after, until] of instants, in microseconds.
Range = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class EventQuery:
    lane: str = ""
    reservation_id: str = ""
    kinds: tuple[str, ...] = ()
    after_seq: int = 0
    limit: int = 100
    # The reader holds `lane`'s row lock in a write transaction. Every event of
    # the lane is appended under that lock, so each one is committed or the
    # reader's own: the read need not stop at (nor wait for) the commit
    # horizon, which other lanes' appends in flight and holes hold back.
    lane_locked: bool = False


class EdgeQuery(NamedTuple):
    """One budget's window edges to read: its bookings with after < reserved_at
    <= until for each of the two (after, until] ranges (an empty range sums to
    nothing), and its open holds inside the window at now_us past their deadline."""

    lane: str
    entering: Range
    leaving: Range
    now_us: int
    window_us: int


# What an EdgeQuery reads: the entering and leaving sums, and the overdue holds.
Edges = tuple[StoredSums, StoredSums, Overdue]


@dataclasses.dataclass(frozen=True)
class StateTally:
    """How many of a window's bookings are in one state, and what they count now.

    An open booking past its deadline is tallied as EXPIRED (it is, sweeper or
    not) at its expire charge."""

    state: BookingState
    count: int
    amount_nanos: int


class StoreTransaction(Protocol):
    def lock_configuration(self) -> None:
        """Serializes lane configuration across every process until commit:
        a PutLane checks the budget tree through lanes it does not lock."""
        ...

    def lock_lane(
        self, lane: str, reservation_id: str = "", *, budgets: bool = True
    ) -> LanePolicy | None:
        """The lane's policy, locked until commit so that admissions to one lane
        are serialized across every process sharing the database. With a
        reservation id, the store may read that booking in the same round trip
        (get_booking then answers from it). With `budgets`, the store may also
        lock the lane's ancestors, nearest first, in the same round trip, for
        a caller that locks them next (locks go from a lane upwards): lock_lane
        then answers for them without another."""
        ...

    def get_lane(self, lane: str) -> LanePolicy | None: ...

    def list_lanes(self, after_lane: str, limit: int) -> Sequence[LanePolicy]: ...

    def save_lane(self, policy: LanePolicy) -> None: ...

    def get_booking(self, lane: str, reservation_id: str) -> Booking | None: ...

    def save_booking(self, booking: Booking) -> None: ...

    def subtree(self, lane: str, max_depth: int) -> Sequence[Sequence[str]]:
        """The lane's budget tree by level: [[lane], [children], [grandchildren], ...]."""
        ...

    def window_totals(self, lane: str, now_us: int, window_us: int) -> WindowTotals:
        """Held and charged inside the window of the lane's budget: its own
        bookings and those of every lane below it."""
        ...

    def window_state(self, lane: str) -> WindowState | None:
        """The budget's window sums as last kept, if any."""
        ...

    def save_window_state(self, state: WindowState) -> None: ...

    def drop_window_states(self, lanes: Sequence[str]) -> None:
        """Forgets kept window sums (a window or a lane tree changed)."""
        ...

    def window_edges(self, queries: Sequence[EdgeQuery]) -> list[Edges]:
        """Each query's edges over its lane's budget, in order: all of them in
        one read where the store can."""
        ...

    def aging(self, lane: str, now_us: int, window_us: int) -> Iterator[tuple[int, int]]:
        """(reserved_at_us, amount_at_now) of the budget's window bookings, oldest first."""
        ...

    def append(self, event: Event) -> Event:
        """Appends the event and returns it with its seq."""
        ...

    def get_event(self, seq: int) -> Event | None: ...

    def get_correction(self, lane: str, correction_id: str) -> Event | None:
        """The lane's corrected event with this correction id, if any."""
        ...

    def list_events(self, query: EventQuery) -> Sequence[Event]: ...

    def expired_open_bookings(self, now_us: int, limit: int) -> Sequence[Booking]: ...

    def last_seq(self) -> int: ...

    def last_handed_seq(self) -> int:
        """The highest seq the log has handed out so far, its append committed
        or not: no event yet has a higher one. On PostgreSQL it may be past
        last_seq, which stops at this process's commit horizon."""
        ...

    # Read-only queries of the audit (application/audit.py). `lanes` is the
    # budget: a lane and every lane below it. All of them are bounded.

    def window_tally(
        self, lanes: Sequence[str], now_us: int, window_us: int
    ) -> Sequence[StateTally]:
        """Count and amount at now_us by state of the bookings reserved inside
        the window, REJECTED (denied Reserves) included: one row per state."""
        ...

    def biggest_bookings(
        self, lanes: Sequence[str], now_us: int, window_us: int, limit: int
    ) -> Sequence[Booking]:
        """The window's bookings with the largest amount at now_us (non-zero
        only), largest first, at most `limit`."""
        ...

    def next_release(
        self, lanes: Sequence[str], now_us: int, window_us: int
    ) -> tuple[int, int] | None:
        """(reserved_at_us, amount at now_us) of the oldest window bookings with a
        non-zero amount, summed over those reserved at that same instant: what
        ages out next. None when nothing counts."""
        ...


class Store(Protocol):
    def run(
        self,
        work: Callable[[StoreTransaction], T],
        *,
        write: bool = True,
        in_turn: bool = False,
        snapshot: bool = False,
        replayable: bool = False,
        lane: str = "",
    ) -> T:
        """Runs `work` in one transaction and commits it durably, retrying a
        bounded number of times on serialization failures, and once on a new
        connection when the database ended the one it ran on; raises
        StoreUnavailable when the database cannot answer in time. A read
        `in_turn` sees the kept windows as the moves left them, at one instant:
        on SQLite it takes its turn among the moves and is answered from the
        one writer's memory; on PostgreSQL it reads one snapshot. A read with
        `snapshot` sees one instant in all its statements (SQLite's read
        transactions always do). A write is `replayable` when running it
        again after it was kept is answered as the first run was (a move, by
        its request id): then it is run again even when its connection died
        after its COMMIT was sent."""
        ...

    def ping(self) -> None:
        """Raises StoreUnavailable unless the database answers."""
        ...

    def close(self, timeout_seconds: float = 10.0) -> bool:
        """Waits up to `timeout_seconds` for the commit under way; whether
        nothing was left running."""
        ...
