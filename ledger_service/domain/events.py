"""Events: immutable facts about a booking or a lane, appended and never changed.

One flat record serves every kind so that the event table is one append-only
table an auditor can query with plain SQL. Fields a kind does not use keep their
zero value.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from ledger_service.domain.policies import ExpireCharge


class EventKind(enum.Enum):
    RESERVED = "reserved"
    DENIED = "denied"
    SETTLED = "settled"
    REFUNDED = "refunded"
    EXPIRED = "expired"
    LANE_CONFIGURED = "lane_configured"
    # The provider's bill corrected an estimated (UNKNOWN or expired) charge.
    RECONCILED = "reconciled"
    # An operator replaced the charge of an ended booking (Correct, or a
    # Reconcile that lets the bill win).
    CORRECTED = "corrected"


class Outcome(enum.Enum):
    SUCCEEDED = "succeeded"
    UNKNOWN = "unknown"


class DenialReason(enum.Enum):
    BUDGET_EXHAUSTED = "budget_exhausted"
    HOLD_EXCEEDS_LIMIT = "hold_exceeds_limit"


@dataclasses.dataclass(frozen=True)
class Event:
    kind: EventKind
    lane: str
    occurred_at_us: int
    reservation_id: str = ""
    # What the booking counts in its window after this event, and before it.
    amount_nanos: int = 0
    previous_amount_nanos: int = 0
    # The Reserve's arguments (reserved, denied).
    model: str = ""
    request_bytes: int = 0
    max_output_tokens: int = 0
    estimate_nanos: int | None = None
    requested_ttl_us: int | None = None
    hold_nanos: int = 0
    cap_nanos: int = 0
    reserved_at_us: int = 0
    expires_at_us: int = 0
    retry_after_us: int | None = None
    denial_reason: DenialReason | None = None
    # The part of the policy a booking keeps for its whole life (reserved).
    input_nanos_per_million_tokens: int = 0
    output_nanos_per_million_tokens: int = 0
    # None: the model has no such rate, and those tokens cost the input rate.
    cached_input_nanos_per_million_tokens: int | None = None
    cache_write_nanos_per_million_tokens: int | None = None
    expire_charge: ExpireCharge | None = None
    # The ending (settled, refunded).
    outcome: Outcome | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    billed_nanos: int | None = None
    # The parts of input_tokens read from and written to the prompt cache.
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0
    http_status: int = 0
    reason: str = ""
    # lane_configured: the new policy, as policies.policy_to_dict.
    policy: Mapping[str, Any] | None = None
    trace_id: str = ""
    # The lane's balance right after this event, so any answer can be replayed.
    spent_after_nanos: int = 0
    held_after_nanos: int = 0
    charged_after_nanos: int = 0
    limit_nanos: int = 0
    window_us: int = 0
    open_bookings_after: int = 0
    # For denied: the budget that said no (this lane or an ancestor).
    denied_by: str = ""
    # For corrected: the correction's id (unique within the lane) and the id
    # of the grant that made it; for reconciled, that grant's id too.
    correction_id: str = ""
    grant_id: str = ""
    # Tamper evidence (domain/chain.py), set by the store when it appends the event:
    # the hash of the lane's previous event ("" for its first) and this event's.
    previous_hash: str = ""
    hash: str = ""
    # Assigned by the store when the event is appended; 0 before.
    seq: int = 0


_FIELD_NAMES = frozenset(field.name for field in dataclasses.fields(Event))
# evolve() holds only while Event's __init__ does nothing but store every field.
assert not hasattr(Event, "__post_init__") and not hasattr(Event, "__slots__")


def evolve(event: Event, **changes: Any) -> Event:
    """dataclasses.replace(event, **changes), built directly: replace calls
    __init__ with all 40 fields, and a move makes several copies."""
    unknown = changes.keys() - _FIELD_NAMES
    if unknown:
        raise TypeError(f"Event has no fields {sorted(unknown)}")
    copy: Event = object.__new__(Event)
    copy.__dict__.update(event.__dict__, **changes)
    return copy
