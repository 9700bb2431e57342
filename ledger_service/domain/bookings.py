"""Bookings: one planned model call from Reserve to its end.

A booking is a projection of its events. `apply` is the fold of the live path
(after each new event) and of a replay; a rebuild's store runs the same rule in
SQL (recovery/store.py), and tests hold the two to the same bookings.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Protocol

from ledger_service.domain.events import Event, EventKind, Outcome
from ledger_service.domain.policies import ExpireCharge
from ledger_service.domain.pricing import ModelPrice


class BookingState(enum.Enum):
    OPEN = "open"
    SETTLED = "settled"
    SETTLED_UNKNOWN = "settled_unknown"
    REFUNDED = "refunded"
    EXPIRED = "expired"
    REJECTED = "rejected"
    RECONCILED = "reconciled"
    CORRECTED = "corrected"


# The states whose charge is an estimate that real usage may still correct.
CORRECTABLE_STATES = frozenset({BookingState.SETTLED_UNKNOWN, BookingState.EXPIRED})
# The states whose charge is real: what the provider said the call cost.
REAL_STATES = frozenset({BookingState.SETTLED, BookingState.RECONCILED, BookingState.CORRECTED})
# The states of a booking that has ended: an operator's correction may replace their charge.
ENDED_STATES = frozenset(
    {
        BookingState.SETTLED,
        BookingState.SETTLED_UNKNOWN,
        BookingState.REFUNDED,
        BookingState.EXPIRED,
        BookingState.RECONCILED,
        BookingState.CORRECTED,
    }
)


@dataclasses.dataclass(frozen=True)
class Booking:
    lane: str
    reservation_id: str
    model: str
    request_bytes: int
    max_output_tokens: int
    estimate_nanos: int | None
    requested_ttl_us: int | None
    cap_nanos: int
    hold_nanos: int
    reserved_at_us: int
    expires_at_us: int
    price: ModelPrice
    expire_charge: ExpireCharge
    state: BookingState
    amount_nanos: int
    # The seq of the reserved/denied event (its answer) and of the latest ending.
    answer_seq: int
    ended_seq: int = 0
    # What the latest ending said, to recognise a repeat of it.
    outcome: Outcome | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    billed_nanos: int | None = None
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0

    @property
    def expire_charge_nanos(self) -> int:
        return self.hold_nanos if self.expire_charge is ExpireCharge.HOLD else 0

    def is_expired_at(self, now_us: int) -> bool:
        """Open past its deadline: expired from that instant, sweeper or not."""
        return self.state is BookingState.OPEN and now_us >= self.expires_at_us

    def is_open_at(self, now_us: int) -> bool:
        return self.state is BookingState.OPEN and now_us < self.expires_at_us

    def amount_at(self, now_us: int) -> int:
        return self.expire_charge_nanos if self.is_expired_at(now_us) else self.amount_nanos

    def contribution(self, now_us: int) -> tuple[int, int]:
        """(held, charged) this booking adds to its window at now_us."""
        if self.is_open_at(now_us):
            return self.amount_nanos, 0
        return 0, self.amount_at(now_us)

    def settle_fingerprint(self) -> tuple[object, ...]:
        """What the Settle that ended this booking said, to recognise a repeat."""
        return settle_fingerprint(self)

    def reserve_fingerprint(self) -> tuple[object, ...]:
        return reserve_fingerprint(
            self.model,
            self.request_bytes,
            self.max_output_tokens,
            self.estimate_nanos,
            self.requested_ttl_us,
        )


class SettleUsage(Protocol):
    """A Settle's report: a SettleCommand, or the Booking it ended."""

    @property
    def outcome(self) -> Outcome | None: ...
    @property
    def input_tokens(self) -> int: ...
    @property
    def output_tokens(self) -> int: ...
    @property
    def billed_nanos(self) -> int | None: ...
    @property
    def cached_input_tokens(self) -> int: ...
    @property
    def cache_write_tokens(self) -> int: ...


def settle_fingerprint(usage: SettleUsage) -> tuple[object, ...]:
    """What identifies a Settle's report, for a booking and a command alike."""
    return (
        usage.outcome,
        usage.input_tokens,
        usage.output_tokens,
        usage.billed_nanos,
        usage.cached_input_tokens,
        usage.cache_write_tokens,
    )


def reserve_fingerprint(
    model: str,
    request_bytes: int,
    max_output_tokens: int,
    estimate_nanos: int | None,
    ttl_us: int | None,
) -> tuple[object, ...]:
    """What identifies a Reserve, for a booking and a command alike."""
    return (model, request_bytes, max_output_tokens, estimate_nanos, ttl_us)


# The fold's rule, as data (a rebuild's store applies it in SQL as well:
# recovery/store.py). A booking is its opening event's fields (the answer to
# its Reserve) with the fields of its latest ending, and the state below.
OPENING_STATES = {EventKind.RESERVED: BookingState.OPEN, EventKind.DENIED: BookingState.REJECTED}
ENDING_STATES = {
    EventKind.SETTLED: BookingState.SETTLED_UNKNOWN,
    EventKind.REFUNDED: BookingState.REFUNDED,
    EventKind.EXPIRED: BookingState.EXPIRED,
    EventKind.RECONCILED: BookingState.RECONCILED,
    EventKind.CORRECTED: BookingState.CORRECTED,
}
# ... except a settled event that says the call succeeded: its charge is real.
SETTLED_SUCCEEDED_STATE = BookingState.SETTLED


def ending_state(event: Event) -> BookingState:
    if event.kind is EventKind.SETTLED and event.outcome is Outcome.SUCCEEDED:
        return SETTLED_SUCCEEDED_STATE
    state = ENDING_STATES.get(event.kind)
    if state is None:
        raise AssertionError(f"event kind {event.kind.value} is not about a booking")
    return state


def apply(event: Event, booking: Booking | None) -> Booking:
    """The booking after `event`. The one fold for live moves and replays."""
    if event.kind in OPENING_STATES:
        assert booking is None, f"second {event.kind.value} for {event.reservation_id!r}"
        return _opened(event)
    assert booking is not None, f"{event.kind.value} before reserve of {event.reservation_id!r}"
    return _ended(booking, event, ending_state(event))


def _opened(event: Event) -> Booking:
    assert event.expire_charge is not None
    price: ModelPrice = object.__new__(ModelPrice)
    price.__dict__.update(
        input_nanos_per_million_tokens=event.input_nanos_per_million_tokens,
        output_nanos_per_million_tokens=event.output_nanos_per_million_tokens,
        cached_input_nanos_per_million_tokens=event.cached_input_nanos_per_million_tokens,
        cache_write_nanos_per_million_tokens=event.cache_write_nanos_per_million_tokens,
    )
    # Booking(...) with these fields, built directly (see _ended).
    opened: Booking = object.__new__(Booking)
    opened.__dict__.update(
        lane=event.lane,
        reservation_id=event.reservation_id,
        model=event.model,
        request_bytes=event.request_bytes,
        max_output_tokens=event.max_output_tokens,
        estimate_nanos=event.estimate_nanos,
        requested_ttl_us=event.requested_ttl_us,
        cap_nanos=event.cap_nanos,
        hold_nanos=event.hold_nanos,
        reserved_at_us=event.reserved_at_us,
        expires_at_us=event.expires_at_us,
        price=price,
        expire_charge=event.expire_charge,
        state=OPENING_STATES[event.kind],
        amount_nanos=event.amount_nanos,
        answer_seq=event.seq,
        ended_seq=0,
        outcome=None,
        input_tokens=0,
        output_tokens=0,
        billed_nanos=None,
        cached_input_tokens=0,
        cache_write_tokens=0,
    )
    return opened


def _ended(booking: Booking, event: Event, state: BookingState) -> Booking:
    """dataclasses.replace(booking, ...) with the ending's fields, built directly:
    a rebuild ends millions of bookings, and replace, like a frozen dataclass's
    __init__, spends most of its time on the fields that do not change."""
    ended: Booking = object.__new__(Booking)
    ended.__dict__.update(
        booking.__dict__,
        state=state,
        amount_nanos=event.amount_nanos,
        ended_seq=event.seq,
        outcome=event.outcome,
        input_tokens=event.input_tokens,
        output_tokens=event.output_tokens,
        billed_nanos=event.billed_nanos,
        cached_input_tokens=event.cached_input_tokens,
        cache_write_tokens=event.cache_write_tokens,
    )
    return ended


# _opened and _ended hold only while __init__ does nothing but store every field.
assert not any(
    hasattr(kind, "__post_init__") or hasattr(kind, "__slots__") for kind in (Booking, ModelPrice)
)
