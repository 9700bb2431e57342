"""Rebuilding the projections from the event log alone.

The same folds the live path uses (`bookings.apply`, `policy_from_dict`) are
applied to every event in seq order. Tests and `ledger verify` compare the
result with what the store kept incrementally: the pair assertion.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from ledger_service.domain import bookings, policies
from ledger_service.domain.bookings import Booking
from ledger_service.domain.events import Event, EventKind
from ledger_service.domain.policies import LanePolicy, policy_from_dict
from ledger_service.domain.window import WindowTotals, totals_of


@dataclasses.dataclass
class Projection:
    lanes: dict[str, LanePolicy] = dataclasses.field(default_factory=dict)
    bookings: dict[tuple[str, str], Booking] = dataclasses.field(default_factory=dict)
    last_seq: int = 0

    def apply(self, event: Event) -> None:
        assert event.seq > self.last_seq, f"event {event.seq} out of order after {self.last_seq}"
        self.last_seq = event.seq
        if event.kind is EventKind.LANE_CONFIGURED:
            assert event.policy is not None
            self.lanes[event.lane] = policy_from_dict(event.policy, event.seq, event.occurred_at_us)
            return
        key = (event.lane, event.reservation_id)
        self.bookings[key] = bookings.apply(event, self.bookings.get(key))

    def totals(self, lane: str, now_us: int) -> WindowTotals:
        """The lane's budget at now_us: its own bookings and its descendants'."""
        policy = self.lanes[lane]
        budget_lanes = set(policies.members(lane, self._children))
        budget = (b for (name, _), b in self.bookings.items() if name in budget_lanes)
        return totals_of(budget, now_us, policy.window_us)

    def _children(self, lane: str) -> list[str]:
        return [name for name, policy in self.lanes.items() if policy.parent == lane]


def replay(events: Iterable[Event]) -> Projection:
    projection = Projection()
    for event in events:
        projection.apply(event)
    return projection
