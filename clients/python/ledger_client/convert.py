"""The one place protobuf messages become the client's values and back."""

from __future__ import annotations

import datetime
from typing import Any

from google.protobuf import duration_pb2, timestamp_pb2

from ledger_client.bookings import (
    Balance,
    BookingState,
    DenialReason,
    Refunded,
    Reservation,
    ReserveArguments,
    Settled,
)
from ledger_client.events import LanePolicy, LedgerEvent
from ledger_client.generated.ledger.v1 import ledger_pb2 as pb
from ledger_client.outcomes import Ending, Settlement
from ledger_client.pricing import ModelPrice

_DENIAL_REASONS = {
    pb.BUDGET_EXHAUSTED: DenialReason.BUDGET_EXHAUSTED,
    pb.HOLD_EXCEEDS_LIMIT: DenialReason.HOLD_EXCEEDS_LIMIT,
}
_STATES = {
    pb.BOOKING_STATE_UNSPECIFIED: BookingState.UNSPECIFIED,
    pb.OPEN: BookingState.OPEN,
    pb.SETTLED: BookingState.SETTLED,
    pb.SETTLED_UNKNOWN: BookingState.SETTLED_UNKNOWN,
    pb.REFUNDED: BookingState.REFUNDED,
    pb.EXPIRED: BookingState.EXPIRED,
    pb.REJECTED: BookingState.REJECTED,
    pb.RECONCILED: BookingState.RECONCILED,
    pb.CORRECTED: BookingState.CORRECTED,
}
_OUTCOMES = {
    Settlement.SETTLE_SUCCEEDED: pb.SUCCEEDED,
    Settlement.SETTLE_UNKNOWN: pb.UNKNOWN,
}


def instant(value: timestamp_pb2.Timestamp) -> datetime.datetime:
    epoch = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
    return epoch + datetime.timedelta(seconds=value.seconds, microseconds=value.nanos // 1000)


def optional_instant(message: Any, field: str) -> datetime.datetime | None:
    """The instant in `message`'s `field`, None when the message has none."""
    return instant(getattr(message, field)) if message.HasField(field) else None


def length(value: duration_pb2.Duration) -> datetime.timedelta:
    return datetime.timedelta(seconds=value.seconds, microseconds=value.nanos // 1000)


def duration_of_micros(micros: int) -> duration_pb2.Duration:
    seconds, rest = divmod(micros, 1_000_000)
    return duration_pb2.Duration(seconds=seconds, nanos=rest * 1000)


def reserve_request(lane: str, arguments: ReserveArguments) -> pb.ReserveRequest:
    request = pb.ReserveRequest(
        lane=lane,
        reservation_id=arguments.reservation_id,
        model=arguments.model,
        request_bytes=arguments.request_bytes,
        max_output_tokens=arguments.max_output_tokens,
    )
    if arguments.estimate_nanos is not None:
        request.estimate_nanos = arguments.estimate_nanos
    if arguments.ttl_us is not None:
        request.ttl.CopyFrom(duration_of_micros(arguments.ttl_us))
    return request


def settle_request(lane: str, reservation_id: str, ending: Ending) -> pb.SettleRequest:
    assert ending.settlement is not Settlement.REFUND
    request = pb.SettleRequest(
        lane=lane,
        reservation_id=reservation_id,
        outcome=_OUTCOMES[ending.settlement],
        http_status=ending.http_status,
    )
    if ending.usage is not None:
        request.input_tokens = ending.usage.input_tokens
        request.output_tokens = ending.usage.output_tokens
        request.cached_input_tokens = ending.usage.cached_input_tokens
        request.cache_write_tokens = ending.usage.cache_write_tokens
        if ending.usage.billed_nanos is not None:
            request.billed_nanos = ending.usage.billed_nanos
    return request


def refund_request(lane: str, reservation_id: str, ending: Ending) -> pb.RefundRequest:
    assert ending.settlement is Settlement.REFUND
    return pb.RefundRequest(
        lane=lane,
        reservation_id=reservation_id,
        http_status=ending.http_status,
        reason=ending.reason,
    )


def balance(message: pb.Balance) -> Balance:
    return Balance(
        lane=message.lane,
        limit_nanos=message.limit_nanos,
        spent_nanos=message.spent_nanos,
        held_nanos=message.held_nanos,
        charged_nanos=message.charged_nanos,
        available_nanos=message.available_nanos,
        overrun_nanos=message.overrun_nanos,
        open_bookings=message.open_bookings,
        window=length(message.window),
        as_of=instant(message.as_of),
    )


def reservation(reservation_id: str, message: pb.ReserveResponse) -> Reservation:
    admitted = message.decision == pb.ADMITTED
    return Reservation(
        reservation_id=reservation_id,
        admitted=admitted,
        hold_nanos=message.hold_nanos,
        cap_nanos=message.cap_nanos,
        reserved_at=instant(message.reserved_at),
        expires_at=optional_instant(message, "expires_at"),
        retry_after=optional_instant(message, "retry_after"),
        denial_reason=None
        if admitted
        else _DENIAL_REASONS.get(message.denial_reason, DenialReason.BUDGET_EXHAUSTED),
        reason=message.reason,
        balance=balance(message.balance),
        denied_by="" if admitted else message.denied_by,
        already_reserved=message.already_reserved,
    )


def settled(message: pb.SettleResponse) -> Settled:
    return Settled(
        charged_nanos=message.charged_nanos,
        state=booking_state(message.state),
        balance=balance(message.balance),
    )


def refunded(message: pb.RefundResponse) -> Refunded:
    return Refunded(balance=balance(message.balance))


def booking_state(state: pb.BookingState.ValueType) -> BookingState:
    return _STATES.get(state, BookingState.UNSPECIFIED)


def event(message: pb.Event) -> LedgerEvent:
    denied = message.kind == "denied"
    return LedgerEvent(
        seq=message.seq,
        lane=message.lane,
        kind=message.kind,
        reservation_id=message.reservation_id,
        amount_nanos=message.amount_nanos,
        previous_amount_nanos=message.previous_amount_nanos,
        occurred_at=instant(message.occurred_at),
        outcome=""
        if message.outcome == pb.OUTCOME_UNSPECIFIED
        else pb.Outcome.Name(message.outcome),
        http_status=message.http_status,
        model=message.model,
        request_bytes=message.request_bytes,
        max_output_tokens=message.max_output_tokens,
        input_tokens=message.input_tokens,
        output_tokens=message.output_tokens,
        cached_input_tokens=message.cached_input_tokens,
        cache_write_tokens=message.cache_write_tokens,
        billed_nanos=_optional_int(message, "billed_nanos"),
        estimate_nanos=_optional_int(message, "estimate_nanos"),
        hold_nanos=message.hold_nanos,
        cap_nanos=message.cap_nanos,
        reserved_at=optional_instant(message, "reserved_at"),
        expires_at=optional_instant(message, "expires_at"),
        retry_after=optional_instant(message, "retry_after"),
        denial_reason=_DENIAL_REASONS.get(message.denial_reason) if denied else None,
        denied_by=message.denied_by,
        reason=message.reason,
        trace_id=message.trace_id,
        spent_after_nanos=message.spent_after_nanos,
        limit_nanos=message.limit_nanos,
        correction_id=message.correction_id,
        grant_id=message.grant_id,
        hash=message.hash,
        previous_hash=message.previous_hash,
        policy=lane_policy(message.policy) if message.HasField("policy") else None,
    )


def _optional_int(message: Any, field: str) -> int | None:
    value: int = getattr(message, field)
    return value if message.HasField(field) else None


def model_price(message: pb.ModelPrice) -> ModelPrice:
    return ModelPrice(
        message.input_nanos_per_million_tokens,
        message.output_nanos_per_million_tokens,
        _optional_int(message, "cached_input_nanos_per_million_tokens"),
        _optional_int(message, "cache_write_nanos_per_million_tokens"),
    )


def lane_policy(message: pb.Lane) -> LanePolicy:
    # The ledger sends bytes per token as thousandths / 1000: round() gives
    # back the integer it keeps.
    milli = round(message.bytes_per_token * 1000) if message.HasField("bytes_per_token") else None
    unset = message.expire_charge == pb.EXPIRE_CHARGE_UNSPECIFIED
    return LanePolicy(
        lane=message.lane,
        limit_nanos=message.limit_nanos,
        window=length(message.window) if message.HasField("window") else None,
        hold_ttl=length(message.hold_ttl) if message.HasField("hold_ttl") else None,
        bytes_per_token_milli=milli,
        overhead_tokens=_optional_int(message, "overhead_tokens"),
        prices={model: model_price(price) for model, price in message.prices.items()},
        expire_charge="" if unset else pb.ExpireCharge.Name(message.expire_charge),
        version=message.version,
        updated_at=optional_instant(message, "updated_at"),
        parent=message.parent,
        max_charge_multiple=_optional_int(message, "max_charge_multiple"),
    )
