"""The small storage interface the application needs.

SQLAlchemy adapters in `ledger_service.storage` implement it for SQLite and
PostgreSQL; the application knows nothing of SQL.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, TypeVar

from ledger_service.domain.bookings import Booking
from ledger_service.domain.events import Event
from ledger_service.domain.policies import LanePolicy
from ledger_service.domain.window import WindowTotals

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class EventQuery:
    lane: str = ""
    reservation_id: str = ""
    kinds: tuple[str, ...] = ()
    after_seq: int = 0
    limit: int = 100


class StoreTransaction(Protocol):
    def lock_lane(self, lane: str) -> LanePolicy | None:
        """The lane's policy, locked until commit so that admissions to one lane
        are serialized across every process sharing the database."""
        ...

    def get_lane(self, lane: str) -> LanePolicy | None: ...

    def list_lanes(self, after_lane: str, limit: int) -> Sequence[LanePolicy]: ...

    def save_lane(self, policy: LanePolicy) -> None: ...

    def get_booking(self, lane: str, reservation_id: str) -> Booking | None: ...

    def save_booking(self, booking: Booking) -> None: ...

    def window_totals(self, lane: str, now_us: int, window_us: int) -> WindowTotals: ...

    def aging(self, lane: str, now_us: int, window_us: int) -> Iterator[tuple[int, int]]:
        """(reserved_at_us, amount_at_now) of the window's bookings, oldest first."""
        ...

    def append(self, event: Event) -> Event:
        """Appends the event and returns it with its seq."""
        ...

    def get_event(self, seq: int) -> Event | None: ...

    def list_events(self, query: EventQuery) -> Sequence[Event]: ...

    def expired_open_bookings(self, now_us: int, limit: int) -> Sequence[Booking]: ...

    def last_seq(self) -> int: ...


class Store(Protocol):
    def run(self, work: Callable[[StoreTransaction], T], *, write: bool = True) -> T:
        """Runs `work` in one transaction and commits it durably, retrying a
        bounded number of times on serialization failures; raises
        StoreUnavailable when the database cannot answer in time."""
        ...

    def ping(self) -> None:
        """Raises StoreUnavailable unless the database answers."""
        ...

    def close(self) -> None: ...
