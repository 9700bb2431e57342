"""The one place protobuf messages become domain values and back.

Protobuf stops here: the application and domain see frozen dataclasses only.
"""

from __future__ import annotations

from google.protobuf import duration_pb2, timestamp_pb2

from ledger_service.application.audit import Audit
from ledger_service.application.ledger import CorrectResult, RefundResult, SettleResult
from ledger_service.application.ports import EventQuery
from ledger_service.application.reconciliation import ReconcileReport
from ledger_service.domain import policies
from ledger_service.domain.bookings import Booking, BookingState
from ledger_service.domain.errors import InvalidArgument
from ledger_service.domain.events import DenialReason, Event, EventKind, Outcome
from ledger_service.domain.moves import (
    CorrectCommand,
    RefundCommand,
    ReserveCommand,
    SettleCommand,
)
from ledger_service.domain.policies import ExpireCharge, LanePolicy
from ledger_service.domain.pricing import ModelPrice
from ledger_service.domain.reconcile import ExportFormat, RowResult, RowStatus
from ledger_service.domain.window import Balance
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb

MAX_DURATION_SECONDS = 10 * 366 * 86_400

_OUTCOMES = {pb.SUCCEEDED: Outcome.SUCCEEDED, pb.UNKNOWN: Outcome.UNKNOWN}
_OUTCOMES_OUT = {value: key for key, value in _OUTCOMES.items()}
_EXPIRE_CHARGES = {
    pb.EXPIRE_CHARGE_UNSPECIFIED: ExpireCharge.HOLD,
    pb.HOLD: ExpireCharge.HOLD,
    pb.ZERO: ExpireCharge.ZERO,
}
_EXPIRE_CHARGES_OUT = {ExpireCharge.HOLD: pb.HOLD, ExpireCharge.ZERO: pb.ZERO}
_DENIAL_REASONS_OUT = {
    DenialReason.BUDGET_EXHAUSTED: pb.BUDGET_EXHAUSTED,
    DenialReason.HOLD_EXCEEDS_LIMIT: pb.HOLD_EXCEEDS_LIMIT,
}
_STATES_OUT = {
    BookingState.OPEN: pb.OPEN,
    BookingState.SETTLED: pb.SETTLED,
    BookingState.SETTLED_UNKNOWN: pb.SETTLED_UNKNOWN,
    BookingState.REFUNDED: pb.REFUNDED,
    BookingState.EXPIRED: pb.EXPIRED,
    BookingState.REJECTED: pb.REJECTED,
    BookingState.RECONCILED: pb.RECONCILED,
    BookingState.CORRECTED: pb.CORRECTED,
}
# Every kind of the one enum can be asked for by its name.
EVENT_KINDS = frozenset(kind.value for kind in EventKind)


# Time ----------------------------------------------------------------------


def timestamp(instant_us: int) -> timestamp_pb2.Timestamp:
    seconds, micros = divmod(instant_us, 1_000_000)
    return timestamp_pb2.Timestamp(seconds=seconds, nanos=micros * 1000)


def duration(length_us: int) -> duration_pb2.Duration:
    seconds, micros = divmod(length_us, 1_000_000)
    return duration_pb2.Duration(seconds=seconds, nanos=micros * 1000)


def _set_micros(field: timestamp_pb2.Timestamp | duration_pb2.Duration, micros: int) -> None:
    """Fills a Timestamp or Duration field of a message in place, as `timestamp` and
    `duration` would build it: cheaper than building one and copying it in, which
    counts on the answers of every move."""
    seconds, rest_us = divmod(micros, 1_000_000)
    field.seconds = seconds
    field.nanos = rest_us * 1000


def micros_of_duration(field: str, value: duration_pb2.Duration) -> int:
    if not -MAX_DURATION_SECONDS <= value.seconds <= MAX_DURATION_SECONDS:
        raise InvalidArgument(field, "is out of range")
    if not -999_999_999 <= value.nanos <= 999_999_999 or (value.seconds * value.nanos < 0):
        raise InvalidArgument(field, "is not a valid duration")
    if value.nanos % 1000:
        # Cut, it would be another duration than the one asked for.
        raise InvalidArgument(field, "must be whole microseconds: the ledger counts time in them")
    return value.seconds * 1_000_000 + value.nanos // 1000


def micros_of_timestamp(field: str, value: timestamp_pb2.Timestamp) -> int:
    # google.protobuf.Timestamp's valid range: 0001-01-01 to 9999-12-31.
    if (
        not -62_135_596_800 <= value.seconds <= 253_402_300_799
        or not 0 <= value.nanos <= 999_999_999
    ):
        raise InvalidArgument(field, "is not a valid timestamp")
    return value.seconds * 1_000_000 + value.nanos // 1000


# Requests ------------------------------------------------------------------


def reserve_command(request: pb.ReserveRequest) -> ReserveCommand:
    return ReserveCommand(
        lane=request.lane,
        reservation_id=request.reservation_id,
        model=request.model,
        request_bytes=request.request_bytes,
        max_output_tokens=request.max_output_tokens,
        estimate_nanos=request.estimate_nanos if request.HasField("estimate_nanos") else None,
        ttl_us=micros_of_duration("ttl", request.ttl) if request.HasField("ttl") else None,
    )


def settle_command(request: pb.SettleRequest) -> SettleCommand:
    outcome = _OUTCOMES.get(request.outcome)
    if outcome is None:
        raise InvalidArgument("outcome", "must be SUCCEEDED or UNKNOWN")
    return SettleCommand(
        lane=request.lane,
        reservation_id=request.reservation_id,
        outcome=outcome,
        input_tokens=request.input_tokens,
        output_tokens=request.output_tokens,
        billed_nanos=request.billed_nanos if request.HasField("billed_nanos") else None,
        http_status=request.http_status,
        cached_input_tokens=request.cached_input_tokens,
        cache_write_tokens=request.cache_write_tokens,
    )


def correct_command(request: pb.CorrectRequest) -> CorrectCommand:
    return CorrectCommand(
        lane=request.lane,
        reservation_id=request.reservation_id,
        charge_nanos=request.charge_nanos,
        reason=request.reason,
        correction_id=request.correction_id,
    )


def refund_command(request: pb.RefundRequest) -> RefundCommand:
    return RefundCommand(
        lane=request.lane,
        reservation_id=request.reservation_id,
        http_status=request.http_status,
        reason=request.reason,
    )


def lane_policy(message: pb.Lane) -> LanePolicy:
    expire_charge = _EXPIRE_CHARGES.get(message.expire_charge)
    if expire_charge is None:
        raise InvalidArgument("lane.expire_charge", "must be HOLD or ZERO")
    return LanePolicy(
        lane=message.lane,
        limit_nanos=message.limit_nanos,
        prices={model: model_price(price) for model, price in message.prices.items()},
        window_us=(
            micros_of_duration("lane.window", message.window)
            if message.HasField("window")
            else policies.DEFAULT_WINDOW_US
        ),
        hold_ttl_us=(
            micros_of_duration("lane.hold_ttl", message.hold_ttl)
            if message.HasField("hold_ttl")
            else policies.DEFAULT_HOLD_TTL_US
        ),
        bytes_per_token_milli=(
            policies.bytes_per_token_milli(message.bytes_per_token)
            if message.HasField("bytes_per_token")
            else policies.DEFAULT_BYTES_PER_TOKEN_MILLI
        ),
        overhead_tokens=(
            message.overhead_tokens
            if message.HasField("overhead_tokens")
            else policies.DEFAULT_OVERHEAD_TOKENS
        ),
        expire_charge=expire_charge,
        parent=message.parent or None,
        max_charge_multiple=(
            message.max_charge_multiple
            if message.HasField("max_charge_multiple")
            else policies.DEFAULT_MAX_CHARGE_MULTIPLE
        ),
    )


def model_price(message: pb.ModelPrice) -> ModelPrice:
    return ModelPrice(
        message.input_nanos_per_million_tokens,
        message.output_nanos_per_million_tokens,
        (
            message.cached_input_nanos_per_million_tokens
            if message.HasField("cached_input_nanos_per_million_tokens")
            else None
        ),
        (
            message.cache_write_nanos_per_million_tokens
            if message.HasField("cache_write_nanos_per_million_tokens")
            else None
        ),
    )


def model_price_message(price: ModelPrice) -> pb.ModelPrice:
    message = pb.ModelPrice(
        input_nanos_per_million_tokens=price.input_nanos_per_million_tokens,
        output_nanos_per_million_tokens=price.output_nanos_per_million_tokens,
    )
    if price.cached_input_nanos_per_million_tokens is not None:
        message.cached_input_nanos_per_million_tokens = price.cached_input_nanos_per_million_tokens
    if price.cache_write_nanos_per_million_tokens is not None:
        message.cache_write_nanos_per_million_tokens = price.cache_write_nanos_per_million_tokens
    return message


def event_query(request: pb.ListEventsRequest, page_size: int, after_seq: int) -> EventQuery:
    for kind in request.kinds:
        if kind not in EVENT_KINDS:
            raise InvalidArgument(
                "kinds",
                f"unknown event kind {kind[:40]!r}; the kinds are {', '.join(sorted(EVENT_KINDS))}",
            )
    return EventQuery(
        lane=request.lane,
        reservation_id=request.reservation_id,
        # Each kind once: a list of 65,536 repeats would pass every check and
        # then break PostgreSQL's limit on a statement's parameters.
        kinds=tuple(sorted(set(request.kinds))),
        after_seq=after_seq,
        limit=page_size,
    )


# Responses -----------------------------------------------------------------


def balance(value: Balance) -> pb.Balance:
    message = pb.Balance()
    fill_balance(message, value)
    return message


def fill_balance(message: pb.Balance, value: Balance) -> None:
    """Writes `value` into an empty Balance, such as a response's own field."""
    totals = value.totals
    message.lane = value.lane
    message.limit_nanos = value.limit_nanos
    message.spent_nanos = value.spent_nanos
    message.held_nanos = totals.held_nanos
    message.charged_nanos = totals.charged_nanos
    message.available_nanos = value.available_nanos
    _set_micros(message.window, value.window_us)
    _set_micros(message.as_of, value.as_of_us)
    message.overrun_nanos = value.overrun_nanos
    message.open_bookings = totals.open_bookings


def lane(policy: LanePolicy) -> pb.Lane:
    return pb.Lane(
        lane=policy.lane,
        limit_nanos=policy.limit_nanos,
        window=duration(policy.window_us),
        hold_ttl=duration(policy.hold_ttl_us),
        bytes_per_token=policy.bytes_per_token_milli / 1000,
        overhead_tokens=policy.overhead_tokens,
        prices={model: model_price_message(price) for model, price in policy.prices.items()},
        expire_charge=_EXPIRE_CHARGES_OUT[policy.expire_charge],
        version=policy.version,
        updated_at=timestamp(policy.updated_at_us),
        parent=policy.parent or "",
        max_charge_multiple=policy.max_charge_multiple,
    )


def reserve_response(
    event: Event, value: Balance, already_reserved: bool = False
) -> pb.ReserveResponse:
    admitted = event.kind.value == "reserved"
    response = pb.ReserveResponse(
        decision=pb.ADMITTED if admitted else pb.DENIED,
        hold_nanos=event.hold_nanos,
        cap_nanos=event.cap_nanos,
        reason=event.reason,
        denied_by=event.denied_by,
        already_reserved=already_reserved,
    )
    fill_balance(response.balance, value)
    _set_micros(response.reserved_at, event.reserved_at_us)
    if admitted:
        _set_micros(response.expires_at, event.expires_at_us)
    if event.denial_reason is not None:
        response.denial_reason = _DENIAL_REASONS_OUT[event.denial_reason]
    if event.retry_after_us is not None:
        _set_micros(response.retry_after, event.retry_after_us)
    return response


def settle_response(result: SettleResult) -> pb.SettleResponse:
    response = pb.SettleResponse(
        charged_nanos=result.charged_nanos, state=booking_state(result.state)
    )
    fill_balance(response.balance, result.balance)
    return response


def refund_response(result: RefundResult) -> pb.RefundResponse:
    response = pb.RefundResponse()
    fill_balance(response.balance, result.balance)
    return response


def correct_response(result: CorrectResult) -> pb.CorrectResponse:
    response = pb.CorrectResponse(
        previous_charge_nanos=result.event.previous_amount_nanos,
        charged_nanos=result.event.amount_nanos,
        state=pb.CORRECTED,
        seq=result.event.seq,
    )
    fill_balance(response.balance, result.balance)
    return response


def booking_state(state: BookingState) -> pb.BookingState.ValueType:
    return _STATES_OUT[state]


def booking(value: Booking, now_us: int, window_us: int) -> pb.Booking:
    state = BookingState.EXPIRED if value.is_expired_at(now_us) else value.state
    message = pb.Booking(
        lane=value.lane,
        reservation_id=value.reservation_id,
        model=value.model,
        state=_STATES_OUT[state],
        request_bytes=value.request_bytes,
        max_output_tokens=value.max_output_tokens,
        hold_nanos=value.hold_nanos,
        cap_nanos=value.cap_nanos,
        amount_nanos=value.amount_at(now_us),
        reserved_at=timestamp(value.reserved_at_us),
    )
    # A denied booking never held nor counted: it has no deadline and never ages out.
    if state is not BookingState.REJECTED:
        message.expires_at.CopyFrom(timestamp(value.expires_at_us))
        message.ages_out_at.CopyFrom(timestamp(value.reserved_at_us + window_us))
    return message


def event(value: Event) -> pb.Event:
    message = pb.Event(
        seq=value.seq,
        lane=value.lane,
        kind=value.kind.value,
        reservation_id=value.reservation_id,
        amount_nanos=value.amount_nanos,
        occurred_at=timestamp(value.occurred_at_us),
        outcome=_OUTCOMES_OUT.get(value.outcome, pb.OUTCOME_UNSPECIFIED)
        if value.outcome
        else pb.OUTCOME_UNSPECIFIED,
        http_status=value.http_status,
        model=value.model,
        request_bytes=value.request_bytes,
        max_output_tokens=value.max_output_tokens,
        input_tokens=value.input_tokens,
        output_tokens=value.output_tokens,
        hold_nanos=value.hold_nanos,
        cap_nanos=value.cap_nanos,
        previous_amount_nanos=value.previous_amount_nanos,
        reason=value.reason,
        trace_id=value.trace_id,
        spent_after_nanos=value.spent_after_nanos,
        limit_nanos=value.limit_nanos,
        denied_by=value.denied_by,
        hash=value.hash,
        previous_hash=value.previous_hash,
        cached_input_tokens=value.cached_input_tokens,
        cache_write_tokens=value.cache_write_tokens,
        correction_id=value.correction_id,
        grant_id=value.grant_id,
    )
    if value.billed_nanos is not None:
        message.billed_nanos = value.billed_nanos
    if value.estimate_nanos is not None:
        message.estimate_nanos = value.estimate_nanos
    if value.reserved_at_us:
        message.reserved_at.CopyFrom(timestamp(value.reserved_at_us))
    if value.expires_at_us:
        message.expires_at.CopyFrom(timestamp(value.expires_at_us))
    if value.retry_after_us is not None:
        message.retry_after.CopyFrom(timestamp(value.retry_after_us))
    if value.denial_reason is not None:
        message.denial_reason = _DENIAL_REASONS_OUT[value.denial_reason]
    if value.policy is not None:
        message.policy.CopyFrom(
            lane(policies.policy_from_dict(value.policy, value.seq, value.occurred_at_us))
        )
    return message


# Reconcile -------------------------------------------------------------------

_EXPORT_FORMATS: dict[int, ExportFormat] = {
    pb.ReconcileRequest.CSV: ExportFormat.CSV,
    pb.ReconcileRequest.JSONL: ExportFormat.JSONL,
}


def export_format(value: int) -> ExportFormat:
    chosen = _EXPORT_FORMATS.get(value)
    if chosen is None:
        raise InvalidArgument("format", "must be CSV or JSONL")
    return chosen


# Keep a 10,000-row report well inside the 1 MiB message limit.
MAX_ROUTINE_RECONCILE_ROWS = 1000
MAX_RECONCILE_ROWS = 4000
_ROUTINE_ROWS = frozenset({RowStatus.CORRECTED, RowStatus.MATCHED, RowStatus.NOT_APPLIED})


def reconcile_response(report: ReconcileReport) -> pb.ReconcileResponse:
    before, after = report.estimated_before_nanos, report.real_after_nanos
    shown: list[RowResult] = []
    routine = 0
    for row in report.rows:
        if len(shown) >= MAX_RECONCILE_ROWS:
            break
        if row.status in _ROUTINE_ROWS:
            routine += 1
            if routine > MAX_ROUTINE_RECONCILE_ROWS:
                continue
        shown.append(row)
    return pb.ReconcileResponse(
        applied=report.applied,
        corrected_count=report.count(RowStatus.CORRECTED),
        matched_count=report.count(RowStatus.MATCHED),
        unmatched_count=report.count(RowStatus.UNMATCHED),
        disagreement_count=report.count(RowStatus.DISAGREES, RowStatus.REFUNDED),
        bad_count=report.count(RowStatus.BAD),
        estimated_before_nanos=before,
        real_after_nanos=after,
        difference_nanos=after - before,
        rows=[
            pb.ReconcileRow(
                line=row.line,
                lane=row.lane,
                reservation_id=row.reservation_id,
                status=row.status.value,
                before_nanos=row.before_nanos,
                after_nanos=row.after_nanos,
                field=row.field,
                message=row.message,
            )
            for row in shown
        ],
        rows_omitted=len(report.rows) - len(shown),
        replaced_count=report.count(RowStatus.REPLACED),
    )


# Audit -----------------------------------------------------------------------


def audit(value: Audit) -> pb.Audit:
    now_us, window_us = value.balance.as_of_us, value.balance.window_us
    message = pb.Audit(
        lane=value.lane,
        balance=balance(value.balance),
        succeeded_count=value.succeeded.count,
        succeeded_charged_nanos=value.succeeded.amount_nanos,
        unknown_count=value.unknown.count,
        unknown_charged_nanos=value.unknown.amount_nanos,
        expired_count=value.expired.count,
        expired_charged_nanos=value.expired.amount_nanos,
        open_count=value.open.count,
        open_held_nanos=value.open.amount_nanos,
        refunded_count=value.refunded_count,
        reconciled_count=value.reconciled.count,
        reconciled_charged_nanos=value.reconciled.amount_nanos,
        corrected_count=value.corrected.count,
        corrected_charged_nanos=value.corrected.amount_nanos,
        reserve_count=value.reserve_count,
        denied_count=value.denied_count,
        denial_rate=value.denial_rate,
        estimated_charged_nanos=value.estimated_charged_nanos,
        real_charged_nanos=value.real_charged_nanos,
        estimated_to_real_ratio=value.estimated_to_real_ratio,
        biggest_bookings=[booking(item, now_us, window_us) for item in value.biggest],
        next_release_nanos=value.next_release_nanos,
        flags=[flag.value for flag in value.flags],
        summary=value.summary,
    )
    if value.next_release_at_us is not None:
        message.next_release_at.CopyFrom(timestamp(value.next_release_at_us))
    return message
