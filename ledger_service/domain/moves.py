"""The moves a lane makes (Reserve, Settle, Refund) and the expiry of a hold.

Each `decide_*` function is pure: given the lane's policy, the booking as it
stands and the window totals, it returns the event to append (or says which
earlier answer to repeat) and raises a domain error for a move the contract
refuses. The application layer runs them inside one store transaction.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Sequence

from ledger_service.domain.bookings import (
    CORRECTABLE_STATES,
    ENDED_STATES,
    ENDING_STATES,
    OPENING_STATES,
    REAL_STATES,
    Booking,
    BookingState,
    apply,
    reserve_fingerprint,
    settle_fingerprint,
)
from ledger_service.domain.errors import (
    BookingAlreadyEnded,
    BookingStillOpen,
    BookingWasDenied,
    ChargeExceedsCapMultiple,
    CorrectionConflict,
    InvalidArgument,
    OutputExceedsMaxTokens,
    ReservationConflict,
    SumOutOfRange,
    TtlExceedsLaneHoldTtl,
    UnknownModel,
    UsageNotEvidence,
)
from ledger_service.domain.events import DenialReason, Event, EventKind, Outcome, evolve
from ledger_service.domain.policies import (
    DEFAULT_MAX_CHARGE_MULTIPLE,
    LanePolicy,
    validate_name,
)
from ledger_service.domain.pricing import MAX_AMOUNT_NANOS, MAX_WINDOW_SUM_NANOS, cap_nanos
from ledger_service.domain.window import WindowTotals, retry_after_us

MAX_REQUEST_BYTES = 2**40
MAX_TOKENS = 10**12
MAX_REASON_LENGTH = 1000
MAX_RESERVATION_ID_LENGTH = 200
# Printable ASCII without spaces: ids travel in logs, URLs and CSV exports.
_RESERVATION_ID = re.compile(r"^[\x21-\x7e]+$")


def validate_reservation_id(value: str) -> None:
    if not value:
        raise InvalidArgument("reservation_id", "is required")
    if len(value) > MAX_RESERVATION_ID_LENGTH:
        raise InvalidArgument(
            "reservation_id", f"must be at most {MAX_RESERVATION_ID_LENGTH} characters"
        )
    if not _RESERVATION_ID.fullmatch(value):
        raise InvalidArgument("reservation_id", "must be printable ASCII without spaces")


def cache_part_past_input(
    input_tokens: int, cached_input_tokens: int, cache_write_tokens: int
) -> str:
    """The field to name when the cached and cache-write tokens, parts of
    input_tokens, sum past it ("" when they fit): cached_input_tokens when it
    passes the input alone, else cache_write_tokens, the part that took the
    sum past it."""
    if cached_input_tokens + cache_write_tokens <= input_tokens:
        return ""
    if cached_input_tokens > input_tokens:
        return "cached_input_tokens"
    return "cache_write_tokens"


def _check_range(field: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise InvalidArgument(field, f"must be between {low} and {high}")


@dataclasses.dataclass(frozen=True)
class ReserveCommand:
    lane: str
    reservation_id: str
    model: str
    request_bytes: int
    max_output_tokens: int
    estimate_nanos: int | None = None
    ttl_us: int | None = None

    def validate(self) -> None:
        validate_name("lane", self.lane)
        validate_reservation_id(self.reservation_id)
        validate_name("model", self.model)
        _check_range("request_bytes", self.request_bytes, 0, MAX_REQUEST_BYTES)
        _check_range("max_output_tokens", self.max_output_tokens, 0, MAX_TOKENS)
        if self.estimate_nanos is not None:
            _check_range("estimate_nanos", self.estimate_nanos, 0, MAX_AMOUNT_NANOS)
        if self.ttl_us is not None and self.ttl_us <= 0:
            raise InvalidArgument("ttl", "must be positive")

    def fingerprint(self) -> tuple[object, ...]:
        return reserve_fingerprint(
            self.model, self.request_bytes, self.max_output_tokens, self.estimate_nanos, self.ttl_us
        )


@dataclasses.dataclass(frozen=True)
class SettleCommand:
    lane: str
    reservation_id: str
    outcome: Outcome
    input_tokens: int = 0
    output_tokens: int = 0
    billed_nanos: int | None = None
    http_status: int = 0
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0

    def validate(self) -> None:
        validate_name("lane", self.lane)
        validate_reservation_id(self.reservation_id)
        _check_range("input_tokens", self.input_tokens, 0, MAX_TOKENS)
        _check_range("output_tokens", self.output_tokens, 0, MAX_TOKENS)
        _check_range("cached_input_tokens", self.cached_input_tokens, 0, MAX_TOKENS)
        _check_range("cache_write_tokens", self.cache_write_tokens, 0, MAX_TOKENS)
        past = cache_part_past_input(
            self.input_tokens, self.cached_input_tokens, self.cache_write_tokens
        )
        if past:
            raise InvalidArgument(
                past,
                "cached and cache-write tokens are parts of input_tokens: "
                "together at most input_tokens",
            )
        if self.billed_nanos is not None:
            _check_range("billed_nanos", self.billed_nanos, 0, MAX_AMOUNT_NANOS)
        if self.http_status != 0:
            _check_range("http_status", self.http_status, 100, 599)
            if 400 <= self.http_status <= 499:
                raise InvalidArgument(
                    "http_status", "a 4xx answer is a refused call: use Refund, it costs zero"
                )

    def fingerprint(self) -> tuple[object, ...]:
        return settle_fingerprint(self)

    @property
    def charge_field(self) -> str:
        """The field a SUCCEEDED charge comes from, to name when it is refused."""
        return "billed_nanos" if self.billed_nanos is not None else "input_tokens"


@dataclasses.dataclass(frozen=True)
class RefundCommand:
    lane: str
    reservation_id: str
    http_status: int = 0
    reason: str = ""

    def validate(self) -> None:
        validate_name("lane", self.lane)
        validate_reservation_id(self.reservation_id)
        if self.http_status != 0:
            _check_range("http_status", self.http_status, 400, 499)
        elif not self.reason.strip():
            raise InvalidArgument(
                "reason", "is required when http_status is 0 (a call that was never sent)"
            )
        if len(self.reason) > MAX_REASON_LENGTH:
            raise InvalidArgument("reason", f"must be at most {MAX_REASON_LENGTH} characters")
        if not self.reason.isprintable():
            raise InvalidArgument("reason", "must be printable text")


@dataclasses.dataclass(frozen=True)
class Budget:
    """One budget a Reserve must fit: the lane itself, or one of its ancestors.

    `totals` cover every booking of the budget's subtree inside its window;
    `aging` yields them as (reserved_at_us, amount_nanos), oldest first, and
    is called only for a denial.
    """

    policy: LanePolicy
    totals: WindowTotals
    aging: Callable[[], Iterable[tuple[int, int]]]

    @property
    def available_nanos(self) -> int:
        return self.policy.limit_nanos - self.totals.spent_nanos


def decide_reserve(budgets: Sequence[Budget], command: ReserveCommand, now_us: int) -> Event:
    """The reserved or denied event for a new reservation_id.

    `budgets[0]` is the lane; the rest are its ancestors. The hold is admitted
    only when it fits every one of them.
    """
    policy = budgets[0].policy
    price = policy.price_of(command.model)
    if price is None:
        raise UnknownModel("model", f"lane {policy.lane!r} has no price for {command.model!r}")
    ttl_us = policy.hold_ttl_us if command.ttl_us is None else command.ttl_us
    if ttl_us > policy.hold_ttl_us:
        raise TtlExceedsLaneHoldTtl(
            "ttl", f"must not exceed the lane's hold_ttl of {policy.hold_ttl_us / 1e6:g} s"
        )
    cap = cap_nanos(
        price,
        command.request_bytes,
        command.max_output_tokens,
        policy.bytes_per_token_milli,
        policy.overhead_tokens,
    )
    if cap > MAX_AMOUNT_NANOS:
        # Named by the larger of the cap's two parts: the request's or the output's.
        output_part = price.price_output(command.max_output_tokens)
        field = "max_output_tokens" if 2 * output_part > cap else "request_bytes"
        raise InvalidArgument(field, "prices this request above the largest amount")
    hold = cap if command.estimate_nanos is None else min(command.estimate_nanos, cap)
    base = Event(
        kind=EventKind.RESERVED,
        lane=policy.lane,
        occurred_at_us=now_us,
        reservation_id=command.reservation_id,
        model=command.model,
        request_bytes=command.request_bytes,
        max_output_tokens=command.max_output_tokens,
        estimate_nanos=command.estimate_nanos,
        requested_ttl_us=command.ttl_us,
        hold_nanos=hold,
        cap_nanos=cap,
        reserved_at_us=now_us,
        expires_at_us=now_us + ttl_us,
        input_nanos_per_million_tokens=price.input_nanos_per_million_tokens,
        output_nanos_per_million_tokens=price.output_nanos_per_million_tokens,
        cached_input_nanos_per_million_tokens=price.cached_input_nanos_per_million_tokens,
        cache_write_nanos_per_million_tokens=price.cache_write_nanos_per_million_tokens,
        expire_charge=policy.expire_charge,
        limit_nanos=policy.limit_nanos,
        window_us=policy.window_us,
    )
    for budget in budgets:
        if hold > budget.policy.limit_nanos:
            return evolve(
                base,
                kind=EventKind.DENIED,
                denial_reason=DenialReason.HOLD_EXCEEDS_LIMIT,
                denied_by=budget.policy.lane,
                reason=f"the hold of {hold} nanos is larger than the limit of budget "
                f"{budget.policy.lane!r} ({budget.policy.limit_nanos} nanos) and can never fit",
            )
    short = [budget for budget in budgets if hold > budget.available_nanos]
    if not short:
        return evolve(base, amount_nanos=hold)
    return _denied_for_budget(base, hold, short)


def _denied_for_budget(base: Event, hold: int, short: Sequence[Budget]) -> Event:
    """Denied: the hold fits once every short budget has aged enough.

    Aging alone only lowers a budget's spend, so the earliest instant at which
    all of them fit is the latest of each one's own earliest instant.
    """
    binding = short[0]
    retry_at: int | None = 0
    for budget in short:
        instant = retry_after_us(
            hold - budget.available_nanos, budget.aging(), budget.policy.window_us
        )
        if instant is None:
            binding, retry_at = budget, None
            break
        assert retry_at is not None
        if instant > retry_at:
            binding, retry_at = budget, instant
    return evolve(
        base,
        kind=EventKind.DENIED,
        denial_reason=DenialReason.BUDGET_EXHAUSTED,
        retry_after_us=retry_at,
        denied_by=binding.policy.lane,
        reason=f"the hold of {hold} nanos does not fit the {binding.available_nanos} nanos "
        f"available in budget {binding.policy.lane!r}",
    )


def check_reserve_repeat(booking: Booking, command: ReserveCommand) -> None:
    """A repeated Reserve must carry the same arguments as the first."""
    if booking.reserve_fingerprint() != command.fingerprint():
        raise ReservationConflict(command.reservation_id)


def expire(booking: Booking, now_us: int) -> Event:
    """The expired event of a booking still open at its deadline."""
    assert booking.is_expired_at(now_us)
    return Event(
        kind=EventKind.EXPIRED,
        lane=booking.lane,
        occurred_at_us=now_us,
        reservation_id=booking.reservation_id,
        amount_nanos=booking.expire_charge_nanos,
        previous_amount_nanos=booking.amount_nanos,
        model=booking.model,
        hold_nanos=booking.hold_nanos,
        cap_nanos=booking.cap_nanos,
        reserved_at_us=booking.reserved_at_us,
        expires_at_us=booking.expires_at_us,
        expire_charge=booking.expire_charge,
        reason="not ended by its deadline",
    )


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a Settle or Refund does: append `event`, or repeat an answer.

    With no event, `repeat_seq` names the event whose answer is repeated, or is
    0 when the move changes nothing and the current charge is the answer.
    """

    event: Event | None = None
    repeat_seq: int = 0


def decide_settle(
    booking: Booking,
    command: SettleCommand,
    now_us: int,
    max_charge_multiple: int = DEFAULT_MAX_CHARGE_MULTIPLE,
    lane_left: LaneLeft | None = None,
) -> Verdict:
    """`booking` has already been expired if it was past its deadline;
    `max_charge_multiple` is its lane's as it stands now. A usage no request
    could have produced is refused, and then nothing is written: the booking
    stays as it was. `lane_left` is read only once a bill or an operator has
    replaced the charge (see `as_the_lane_left_it`)."""
    if booking.state in REPLACED_STATES:
        left = lane_left() if lane_left is not None else None
        if left is not None and _repeats_settle(left, command):
            return Verdict(repeat_seq=left.ended_seq)
        raise BookingAlreadyEnded(_replaced(booking, "settled"))
    state = booking.state
    if state is BookingState.REJECTED:
        raise BookingWasDenied(booking.reservation_id)
    if state is BookingState.REFUNDED:
        raise BookingAlreadyEnded(
            f"booking {booking.reservation_id!r} was refunded; it cannot be settled"
        )
    if _repeats_settle(booking, command):
        return Verdict(repeat_seq=booking.ended_seq)
    if state in REAL_STATES:
        raise BookingAlreadyEnded(
            f"booking {booking.reservation_id!r} already holds a real charge from other usage"
        )
    if command.outcome is Outcome.UNKNOWN and state in CORRECTABLE_STATES:
        # An unknown outcome adds nothing to what the ledger already holds.
        return Verdict()
    _check_plausible(booking, command)
    return Verdict(event=_settled_event(booking, command, now_us, max_charge_multiple))


def _check_plausible(booking: Booking, command: SettleCommand) -> None:
    """Refuses a usage no call of this booking could have produced."""
    if (
        command.outcome is Outcome.SUCCEEDED
        and command.input_tokens == 0
        and command.billed_nanos is None
    ):
        # A call that succeeded read its prompt: no input tokens and no bill
        # is a report that says nothing, not a free call.
        raise UsageNotEvidence(
            "input_tokens",
            "a SUCCEEDED settle needs its usage: input_tokens above 0, or billed_nanos",
        )
    if command.output_tokens > booking.max_output_tokens:
        # The provider stops at the max_output_tokens it was sent.
        raise OutputExceedsMaxTokens(
            "output_tokens",
            f"{command.output_tokens} is more than the {booking.max_output_tokens} "
            "max_output_tokens the booking was reserved for",
        )


def _settled_event(
    booking: Booking, command: SettleCommand, now_us: int, max_charge_multiple: int
) -> Event:
    if command.outcome is Outcome.SUCCEEDED:
        # Real data wins, even above the hold: that is an overrun, reported.
        charge = (
            command.billed_nanos
            if command.billed_nanos is not None
            else booking.price.real_cost(
                command.input_tokens,
                command.output_tokens,
                command.cached_input_tokens,
                command.cache_write_tokens,
            )
        )
        if max_charge_multiple and charge > max_charge_multiple * booking.cap_nanos:
            raise ChargeExceedsCapMultiple(
                command.charge_field,
                f"a charge of {charge} nanos is more than {max_charge_multiple} times "
                f"the booking's cap of {booking.cap_nanos} nanos (the lane's "
                "max_charge_multiple): no request of its size could cost that; nothing "
                "was written",
            )
        if charge > MAX_AMOUNT_NANOS:
            # A single amount, as a cap or a bill is: a booking out of every
            # window (aged out, or a window made shorter) meets no sum check.
            raise InvalidArgument(
                command.charge_field, "prices this usage above the largest amount"
            )
    else:
        # Never more than the hold, which is never more than the cap.
        charge = booking.hold_nanos
        if command.billed_nanos is not None:
            charge = min(charge, command.billed_nanos)
    return ending_event(booking, EventKind.SETTLED, charge, now_us, command=command)


def _repeats_settle(booking: Booking, command: SettleCommand) -> bool:
    return booking.outcome is not None and booking.settle_fingerprint() == command.fingerprint()


def decide_refund(
    booking: Booking, command: RefundCommand, now_us: int, lane_left: LaneLeft | None = None
) -> Verdict:
    """A refused call costs zero, however late the news; a repeat returns the first answer."""
    if booking.state in REPLACED_STATES:
        left = lane_left() if lane_left is not None else None
        if left is not None and left.state is BookingState.REFUNDED:
            return Verdict(repeat_seq=left.ended_seq)
        raise BookingAlreadyEnded(_replaced(booking, "refunded"))
    state = booking.state
    if state is BookingState.REJECTED:
        raise BookingWasDenied(booking.reservation_id)
    if state is BookingState.REFUNDED:
        return Verdict(repeat_seq=booking.ended_seq)
    if state in REAL_STATES or state is BookingState.SETTLED_UNKNOWN:
        # The contract: a refund after a settle contradicts it. Only an expired
        # booking (nobody said anything) may still learn it was refused.
        raise BookingAlreadyEnded(
            f"booking {booking.reservation_id!r} was already settled; it cannot be refunded"
        )
    event = ending_event(booking, EventKind.REFUNDED, 0, now_us)
    return Verdict(event=evolve(event, http_status=command.http_status, reason=command.reason))


# A bill or an operator set these charges: no Settle or Refund changes them.
# A repeat of the lane's own last Settle or Refund still returns its answer.
REPLACED_STATES = frozenset({BookingState.RECONCILED, BookingState.CORRECTED})
REPLACING_KINDS = frozenset({EventKind.RECONCILED, EventKind.CORRECTED})
# The kinds a lane's own moves and its deadline write about a booking.
LANE_KINDS = tuple(
    kind for kind in (*OPENING_STATES, *ENDING_STATES) if kind not in REPLACING_KINDS
)
# Gives the booking as the lane's own moves left it, read only when needed.
LaneLeft = Callable[[], Booking]


def as_the_lane_left_it(history: Iterable[Event]) -> Booking:
    """A booking folded from its events of LANE_KINDS alone, without the charges
    a bill or an operator set since: what a repeated Settle or Refund is
    compared with, and whose answer it gets back."""
    booking: Booking | None = None
    for event in history:
        if event.kind not in REPLACING_KINDS:
            booking = apply(event, booking)
    assert booking is not None, "a booking's history starts with its Reserve"
    return booking


def _replaced(booking: Booking, move: str) -> str:
    by = "the provider's bill" if booking.state is BookingState.RECONCILED else "a correction"
    return (
        f"booking {booking.reservation_id!r} has the charge {by} set; "
        f"it cannot be {move} any more (the charge an operator or a bill sets stands)"
    )


def ending_event(
    booking: Booking,
    kind: EventKind,
    charge_nanos: int,
    now_us: int,
    command: SettleCommand | None = None,
) -> Event:
    """The event that changes a booking's charge to `charge_nanos` (an ending, a
    reconcile, a correction), carrying what every such event carries."""
    event = Event(
        kind=kind,
        lane=booking.lane,
        occurred_at_us=now_us,
        reservation_id=booking.reservation_id,
        amount_nanos=charge_nanos,
        previous_amount_nanos=booking.amount_at(now_us),
        model=booking.model,
        hold_nanos=booking.hold_nanos,
        cap_nanos=booking.cap_nanos,
        reserved_at_us=booking.reserved_at_us,
        expires_at_us=booking.expires_at_us,
    )
    if command is None:
        return event
    return evolve(
        event,
        outcome=command.outcome,
        input_tokens=command.input_tokens,
        output_tokens=command.output_tokens,
        billed_nanos=command.billed_nanos,
        http_status=command.http_status,
        cached_input_tokens=command.cached_input_tokens,
        cache_write_tokens=command.cache_write_tokens,
    )


@dataclasses.dataclass(frozen=True)
class CorrectCommand:
    """An operator's correction: the booking's charge becomes `charge_nanos`."""

    lane: str
    reservation_id: str
    charge_nanos: int
    reason: str
    correction_id: str

    def validate(self) -> None:
        validate_name("lane", self.lane)
        validate_reservation_id(self.reservation_id)
        _check_range("charge_nanos", self.charge_nanos, 0, MAX_AMOUNT_NANOS)
        if not self.reason.strip():
            raise InvalidArgument("reason", "is required: say why the charge is corrected")
        if len(self.reason) > MAX_REASON_LENGTH:
            raise InvalidArgument("reason", f"must be at most {MAX_REASON_LENGTH} characters")
        if not self.reason.isprintable():
            raise InvalidArgument("reason", "must be printable text")
        try:
            validate_reservation_id(self.correction_id)
        except InvalidArgument as error:
            raise InvalidArgument("correction_id", error.message.partition(": ")[2]) from error

    def fingerprint(self) -> tuple[object, ...]:
        return (self.reservation_id, self.charge_nanos, self.reason)


def check_correction_repeat(first: Event, command: CorrectCommand) -> None:
    """A repeated correction id must carry the same content as the first."""
    if (first.reservation_id, first.amount_nanos, first.reason) != command.fingerprint():
        raise CorrectionConflict(command.correction_id)


def decide_correct(booking: Booking, command: CorrectCommand, now_us: int, grant_id: str) -> Event:
    """The corrected event that replaces an ended booking's charge. `booking`
    has already been expired if it was past its deadline."""
    if booking.state is BookingState.REJECTED:
        raise BookingWasDenied(booking.reservation_id)
    if booking.state not in ENDED_STATES:
        raise BookingStillOpen(booking.reservation_id)
    event = ending_event(booking, EventKind.CORRECTED, command.charge_nanos, now_us)
    return evolve(
        event, reason=command.reason, correction_id=command.correction_id, grant_id=grant_id
    )


def check_window_sums(sums_nanos: Iterable[int], field: str) -> None:
    """Every sum the ledger keeps (a budget's window after a move, a report's
    total) must stay within the largest it keeps; `field` is the request field
    whose amounts raised it."""
    for total in sums_nanos:
        if total > MAX_WINDOW_SUM_NANOS:
            raise sum_out_of_range(field)


def sum_out_of_range(field: str) -> SumOutOfRange:
    """The refusal of a request that would take a sum the ledger keeps past
    the largest (`field`: the request's field that raised it, "" when unknown)."""
    return SumOutOfRange(
        field,
        f"would take a sum past {MAX_WINDOW_SUM_NANOS} nanos, "
        "the largest the ledger keeps (a budget's window, a report's total)",
    )
