"""Conversions between table rows and domain values."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ledger_service.domain.bookings import Booking, BookingState
from ledger_service.domain.events import DenialReason, Event, EventKind, Outcome
from ledger_service.domain.policies import ExpireCharge, LanePolicy
from ledger_service.domain.pricing import ModelPrice


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def event_values(event: Event) -> dict[str, Any]:
    return {
        "kind": event.kind.value,
        "lane": event.lane,
        "occurred_at_us": event.occurred_at_us,
        "reservation_id": event.reservation_id,
        "amount_nanos": event.amount_nanos,
        "previous_amount_nanos": event.previous_amount_nanos,
        "model": event.model,
        "request_bytes": event.request_bytes,
        "max_output_tokens": event.max_output_tokens,
        "estimate_nanos": event.estimate_nanos,
        "requested_ttl_us": event.requested_ttl_us,
        "hold_nanos": event.hold_nanos,
        "cap_nanos": event.cap_nanos,
        "reserved_at_us": event.reserved_at_us,
        "expires_at_us": event.expires_at_us,
        "retry_after_us": event.retry_after_us,
        "denial_reason": event.denial_reason.value if event.denial_reason else None,
        "input_nanos_per_million_tokens": event.input_nanos_per_million_tokens,
        "output_nanos_per_million_tokens": event.output_nanos_per_million_tokens,
        "expire_charge": event.expire_charge.value if event.expire_charge else None,
        "outcome": event.outcome.value if event.outcome else None,
        "input_tokens": event.input_tokens,
        "output_tokens": event.output_tokens,
        "billed_nanos": event.billed_nanos,
        "http_status": event.http_status,
        "reason": event.reason,
        "policy_json": _dumps(event.policy) if event.policy is not None else None,
        "trace_id": event.trace_id,
        "spent_after_nanos": event.spent_after_nanos,
        "held_after_nanos": event.held_after_nanos,
        "charged_after_nanos": event.charged_after_nanos,
        "limit_nanos": event.limit_nanos,
        "window_us": event.window_us,
        "open_bookings_after": event.open_bookings_after,
        "denied_by": event.denied_by,
        "hash": event.hash,
        "previous_hash": event.previous_hash,
    }


def event_from_row(row: Mapping[Any, Any]) -> Event:
    return Event(
        seq=row["seq"],
        kind=EventKind(row["kind"]),
        lane=row["lane"],
        occurred_at_us=row["occurred_at_us"],
        reservation_id=row["reservation_id"],
        amount_nanos=row["amount_nanos"],
        previous_amount_nanos=row["previous_amount_nanos"],
        model=row["model"],
        request_bytes=row["request_bytes"],
        max_output_tokens=row["max_output_tokens"],
        estimate_nanos=row["estimate_nanos"],
        requested_ttl_us=row["requested_ttl_us"],
        hold_nanos=row["hold_nanos"],
        cap_nanos=row["cap_nanos"],
        reserved_at_us=row["reserved_at_us"],
        expires_at_us=row["expires_at_us"],
        retry_after_us=row["retry_after_us"],
        denial_reason=DenialReason(row["denial_reason"]) if row["denial_reason"] else None,
        input_nanos_per_million_tokens=row["input_nanos_per_million_tokens"],
        output_nanos_per_million_tokens=row["output_nanos_per_million_tokens"],
        expire_charge=ExpireCharge(row["expire_charge"]) if row["expire_charge"] else None,
        outcome=Outcome(row["outcome"]) if row["outcome"] else None,
        input_tokens=row["input_tokens"],
        output_tokens=row["output_tokens"],
        billed_nanos=row["billed_nanos"],
        http_status=row["http_status"],
        reason=row["reason"],
        policy=json.loads(row["policy_json"]) if row["policy_json"] else None,
        trace_id=row["trace_id"],
        spent_after_nanos=row["spent_after_nanos"],
        held_after_nanos=row["held_after_nanos"],
        charged_after_nanos=row["charged_after_nanos"],
        limit_nanos=row["limit_nanos"],
        window_us=row["window_us"],
        open_bookings_after=row["open_bookings_after"],
        denied_by=row["denied_by"],
        hash=row["hash"],
        previous_hash=row["previous_hash"],
    )


def lane_values(policy: LanePolicy) -> dict[str, Any]:
    return {
        "lane": policy.lane,
        "limit_nanos": policy.limit_nanos,
        "window_us": policy.window_us,
        "hold_ttl_us": policy.hold_ttl_us,
        "bytes_per_token_milli": policy.bytes_per_token_milli,
        "overhead_tokens": policy.overhead_tokens,
        "expire_charge": policy.expire_charge.value,
        "prices_json": _dumps(
            {
                model: [price.input_nanos_per_million_tokens, price.output_nanos_per_million_tokens]
                for model, price in policy.prices.items()
            }
        ),
        "version": policy.version,
        "updated_at_us": policy.updated_at_us,
        "parent": policy.parent,
    }


def lane_from_row(row: Mapping[Any, Any]) -> LanePolicy:
    prices = json.loads(row["prices_json"])
    return LanePolicy(
        lane=row["lane"],
        limit_nanos=row["limit_nanos"],
        window_us=row["window_us"],
        hold_ttl_us=row["hold_ttl_us"],
        bytes_per_token_milli=row["bytes_per_token_milli"],
        overhead_tokens=row["overhead_tokens"],
        expire_charge=ExpireCharge(row["expire_charge"]),
        prices={model: ModelPrice(int(pair[0]), int(pair[1])) for model, pair in prices.items()},
        version=row["version"],
        updated_at_us=row["updated_at_us"],
        parent=row["parent"],
    )


def booking_values(booking: Booking) -> dict[str, Any]:
    return {
        "lane": booking.lane,
        "reservation_id": booking.reservation_id,
        "model": booking.model,
        "request_bytes": booking.request_bytes,
        "max_output_tokens": booking.max_output_tokens,
        "estimate_nanos": booking.estimate_nanos,
        "requested_ttl_us": booking.requested_ttl_us,
        "cap_nanos": booking.cap_nanos,
        "hold_nanos": booking.hold_nanos,
        "reserved_at_us": booking.reserved_at_us,
        "expires_at_us": booking.expires_at_us,
        "input_nanos_per_million_tokens": booking.price.input_nanos_per_million_tokens,
        "output_nanos_per_million_tokens": booking.price.output_nanos_per_million_tokens,
        "expire_charge": booking.expire_charge.value,
        "state": booking.state.value,
        "amount_nanos": booking.amount_nanos,
        "answer_seq": booking.answer_seq,
        "ended_seq": booking.ended_seq,
        "outcome": booking.outcome.value if booking.outcome else None,
        "input_tokens": booking.input_tokens,
        "output_tokens": booking.output_tokens,
        "billed_nanos": booking.billed_nanos,
    }


def booking_from_row(row: Mapping[Any, Any]) -> Booking:
    return Booking(
        lane=row["lane"],
        reservation_id=row["reservation_id"],
        model=row["model"],
        request_bytes=row["request_bytes"],
        max_output_tokens=row["max_output_tokens"],
        estimate_nanos=row["estimate_nanos"],
        requested_ttl_us=row["requested_ttl_us"],
        cap_nanos=row["cap_nanos"],
        hold_nanos=row["hold_nanos"],
        reserved_at_us=row["reserved_at_us"],
        expires_at_us=row["expires_at_us"],
        price=ModelPrice(
            row["input_nanos_per_million_tokens"], row["output_nanos_per_million_tokens"]
        ),
        expire_charge=ExpireCharge(row["expire_charge"]),
        state=BookingState(row["state"]),
        amount_nanos=row["amount_nanos"],
        answer_seq=row["answer_seq"],
        ended_seq=row["ended_seq"],
        outcome=Outcome(row["outcome"]) if row["outcome"] else None,
        input_tokens=row["input_tokens"],
        output_tokens=row["output_tokens"],
        billed_nanos=row["billed_nanos"],
    )
