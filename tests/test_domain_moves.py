"""Each branch of decide_reserve / decide_settle / decide_refund / expire, and the
booking fold, with no I/O."""

from __future__ import annotations

import dataclasses

import pytest

from ledger_service.domain import bookings, moves
from ledger_service.domain.bookings import Booking, BookingState
from ledger_service.domain.errors import (
    BookingAlreadyEnded,
    BookingWasDenied,
    InvalidArgument,
    ReservationConflict,
    TtlExceedsLaneHoldTtl,
    UnknownModel,
)
from ledger_service.domain.events import DenialReason, Event, EventKind, Outcome
from ledger_service.domain.policies import ExpireCharge, LanePolicy
from ledger_service.domain.pricing import MAX_AMOUNT_NANOS, ModelPrice
from ledger_service.domain.window import WindowTotals

START_US = 1_800_000_000_000_000 + 123_456
WINDOW_US = 3_600_000_000
HOLD_TTL_US = 120_000_000
JEV = ModelPrice(100_000, 400_000)
# 10_000 bytes at 3.5 bytes per token: 2858 tokens, ceil(285.8) = 286 nanos in;
# 500 output tokens: 200 nanos out.
CAP_10K_500 = 486


def policy(**changes: object) -> LanePolicy:
    base = LanePolicy(
        lane="recall",
        limit_nanos=10_000,
        prices={"jev": JEV},
        window_us=WINDOW_US,
        hold_ttl_us=HOLD_TTL_US,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def reserve_command(reservation_id: str = "r1", **changes: object) -> moves.ReserveCommand:
    base = moves.ReserveCommand(
        lane="recall",
        reservation_id=reservation_id,
        model="jev",
        request_bytes=10_000,
        max_output_tokens=500,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def no_aging() -> list[tuple[int, int]]:
    raise AssertionError("aging is only read for a budget denial")


def decide(
    command: moves.ReserveCommand | None = None,
    *,
    lane: LanePolicy | None = None,
    spent_nanos: int = 0,
    aging: list[tuple[int, int]] | None = None,
    now_us: int = START_US,
) -> Event:
    budget = moves.Budget(
        policy=lane or policy(),
        totals=WindowTotals(0, spent_nanos, 0),
        aging=(lambda: aging) if aging is not None else no_aging,
    )
    return moves.decide_reserve([budget], command or reserve_command(), now_us)


def open_booking(command: moves.ReserveCommand | None = None, **policy_changes: object) -> Booking:
    event = decide(command, lane=policy(**policy_changes))
    assert event.kind is EventKind.RESERVED
    return bookings.apply(dataclasses.replace(event, seq=1), None)


def ended(booking: Booking, verdict: moves.Verdict, seq: int) -> Booking:
    assert verdict.event is not None
    return bookings.apply(dataclasses.replace(verdict.event, seq=seq), booking)


def settle(outcome: Outcome = Outcome.SUCCEEDED, **fields: object) -> moves.SettleCommand:
    return moves.SettleCommand("recall", "r1", outcome, **fields)  # type: ignore[arg-type]


def refund(http_status: int = 403, reason: str = "") -> moves.RefundCommand:
    return moves.RefundCommand("recall", "r1", http_status, reason)


# decide_reserve -------------------------------------------------------------


def test_reserve_without_estimate_holds_the_cap_and_keeps_the_lane_policy() -> None:
    event = decide(lane=policy(expire_charge=ExpireCharge.ZERO))
    assert event.kind is EventKind.RESERVED
    assert event.cap_nanos == CAP_10K_500
    assert event.hold_nanos == CAP_10K_500
    assert event.amount_nanos == CAP_10K_500
    assert event.reserved_at_us == START_US
    assert event.expires_at_us == START_US + HOLD_TTL_US
    assert (event.input_nanos_per_million_tokens, event.output_nanos_per_million_tokens) == (
        100_000,
        400_000,
    )
    assert event.expire_charge is ExpireCharge.ZERO


def test_hold_is_min_of_estimate_and_cap() -> None:
    assert decide(reserve_command(estimate_nanos=100)).hold_nanos == 100
    assert decide(reserve_command(estimate_nanos=CAP_10K_500 + 1)).hold_nanos == CAP_10K_500
    assert decide(reserve_command(estimate_nanos=0)).hold_nanos == 0


def test_reserve_asks_a_shorter_ttl_never_a_longer_one() -> None:
    assert decide(reserve_command(ttl_us=1_000_000)).expires_at_us == START_US + 1_000_000
    assert decide(reserve_command(ttl_us=HOLD_TTL_US)).expires_at_us == START_US + HOLD_TTL_US
    with pytest.raises(TtlExceedsLaneHoldTtl) as caught:
        decide(reserve_command(ttl_us=HOLD_TTL_US + 1))
    assert caught.value.field == "ttl"


def test_reserve_of_an_unpriced_model_names_the_model_field() -> None:
    with pytest.raises(UnknownModel) as caught:
        decide(reserve_command(model="gpt-unpriced"))
    assert caught.value.field == "model"


@pytest.mark.parametrize(
    ("request_bytes", "max_output_tokens", "field"),
    [(0, 10**12, "max_output_tokens"), (10**12, 0, "request_bytes")],
)
def test_a_cap_past_the_largest_amount_names_the_part_that_made_it(
    request_bytes: int, max_output_tokens: int, field: str
) -> None:
    dear = policy(prices={"jev": ModelPrice(10**15, 10**15)})
    command = reserve_command(request_bytes=request_bytes, max_output_tokens=max_output_tokens)
    with pytest.raises(InvalidArgument) as caught:
        decide(command, lane=dear)
    assert caught.value.field == field


def test_a_hold_equal_to_available_is_admitted() -> None:
    event = decide(reserve_command(estimate_nanos=400), spent_nanos=9_600)
    assert event.kind is EventKind.RESERVED


def test_a_hold_one_nano_above_available_is_denied_with_exact_retry_after() -> None:
    aging = [(START_US - 500, 300), (START_US - 400, 9_000), (START_US - 300, 301)]
    event = decide(
        reserve_command(estimate_nanos=401),
        spent_nanos=9_601,
        aging=aging,
        now_us=START_US,
    )
    assert event.kind is EventKind.DENIED
    assert event.denial_reason is DenialReason.BUDGET_EXHAUSTED
    assert event.amount_nanos == 0
    # Needs 2 nanos: the first booking (300) frees them when it ages out.
    assert event.retry_after_us == START_US - 500 + WINDOW_US
    assert event.reason


def test_a_hold_above_the_limit_is_denied_for_ever_without_retry_after() -> None:
    event = decide(reserve_command(request_bytes=1_000_000), lane=policy(limit_nanos=10_000))
    assert event.kind is EventKind.DENIED
    assert event.denial_reason is DenialReason.HOLD_EXCEEDS_LIMIT
    assert event.retry_after_us is None
    assert "never" in event.reason


def test_a_hold_equal_to_the_limit_fits_an_empty_budget() -> None:
    """Only a hold *larger* than a limit can never fit."""
    event = decide(reserve_command(estimate_nanos=400), lane=policy(limit_nanos=400))
    assert event.kind is EventKind.RESERVED
    assert event.amount_nanos == 400


def test_the_largest_amount_is_a_cap_the_ledger_takes() -> None:
    # 427,387,904 request tokens at 1 nano each and 4,611,686,018 output tokens
    # at 10^9 nanos each: a cap of exactly 2^62 nanos, the largest amount.
    lane = policy(
        limit_nanos=MAX_AMOUNT_NANOS,
        prices={"jev": ModelPrice(1_000_000, 10**15)},
        bytes_per_token_milli=1000,
    )
    command = reserve_command(request_bytes=427_387_904, max_output_tokens=4_611_686_018)
    command.validate()
    event = decide(command, lane=lane)
    assert event.kind is EventKind.RESERVED
    assert event.cap_nanos == event.hold_nanos == MAX_AMOUNT_NANOS


@pytest.mark.parametrize(
    ("request_bytes", "max_output_tokens", "field"),
    [(2**40, 0, "request_bytes"), (0, 10**12, "max_output_tokens")],
)
def test_a_cap_past_the_largest_amount_names_its_larger_part(
    request_bytes: int, max_output_tokens: int, field: str
) -> None:
    """docs/semantics.md, Bounds: the field that priced the cap past 2^62, whatever
    the estimate."""
    dear = ModelPrice(10**15, 10**15)
    lane = policy(limit_nanos=MAX_AMOUNT_NANOS, prices={"jev": dear})
    command = reserve_command(
        request_bytes=request_bytes, max_output_tokens=max_output_tokens, estimate_nanos=1
    )
    command.validate()
    with pytest.raises(InvalidArgument) as refused:
        decide(command, lane=lane)
    assert refused.value.field == field


def budget(
    name: str, limit_nanos: int, spent_nanos: int = 0, aging: list[tuple[int, int]] | None = None
) -> moves.Budget:
    return moves.Budget(
        policy=policy(lane=name, limit_nanos=limit_nanos),
        totals=WindowTotals(0, spent_nanos, 0),
        aging=(lambda: aging) if aging is not None else no_aging,
    )


def test_a_hold_above_several_limits_is_denied_by_the_nearest() -> None:
    budgets = [budget("recall", 10_000), budget("agents", 300), budget("org", 200)]
    event = moves.decide_reserve(budgets, reserve_command(estimate_nanos=400), START_US)
    assert event.denial_reason is DenialReason.HOLD_EXCEEDS_LIMIT
    assert event.denied_by == "agents"
    assert event.retry_after_us is None


def test_short_budgets_freeing_room_at_the_same_instant_deny_by_the_nearest() -> None:
    """Several budgets say no and free room at one instant: the tie goes to the
    budget nearest the lane."""
    aging = [(START_US - 500, 1_000)]
    budgets = [
        budget("recall", 10_000),
        budget("agents", 1_000, 1_000, aging),
        budget("org", 1_000, 1_000, aging),
    ]
    event = moves.decide_reserve(budgets, reserve_command(estimate_nanos=400), START_US)
    assert event.denial_reason is DenialReason.BUDGET_EXHAUSTED
    assert event.retry_after_us == START_US - 500 + WINDOW_US
    assert event.denied_by == "agents"


def test_short_budgets_deny_by_the_one_that_frees_room_last() -> None:
    budgets = [
        budget("recall", 10_000),
        budget("agents", 1_000, 1_000, [(START_US - 300, 1_000)]),
        budget("org", 1_000, 1_000, [(START_US - 500, 1_000)]),
    ]
    event = moves.decide_reserve(budgets, reserve_command(estimate_nanos=400), START_US)
    assert event.retry_after_us == START_US - 300 + WINDOW_US
    assert event.denied_by == "agents"


def test_a_denied_reserve_folds_into_a_rejected_booking_that_counts_nothing() -> None:
    event = decide(reserve_command(request_bytes=1_000_000))
    booking = bookings.apply(dataclasses.replace(event, seq=1), None)
    assert booking.state is BookingState.REJECTED
    assert booking.amount_at(START_US + 1) == 0
    assert booking.contribution(START_US + 1) == (0, 0)


def test_a_repeated_reserve_must_carry_the_same_arguments() -> None:
    booking = open_booking(reserve_command(estimate_nanos=100, ttl_us=5_000_000))
    moves.check_reserve_repeat(booking, reserve_command(estimate_nanos=100, ttl_us=5_000_000))
    for change in (
        {"estimate_nanos": 101},
        {"estimate_nanos": None},
        {"ttl_us": 6_000_000},
        {"request_bytes": 10_001},
        {"max_output_tokens": 501},
        {"model": "jev-2"},
    ):
        different = reserve_command(**{"estimate_nanos": 100, "ttl_us": 5_000_000, **change})
        with pytest.raises(ReservationConflict):
            moves.check_reserve_repeat(booking, different)


# Booking fold and expiry ----------------------------------------------------


def test_an_open_booking_expires_exactly_at_its_deadline() -> None:
    booking = open_booking()
    deadline = START_US + HOLD_TTL_US
    assert booking.is_open_at(deadline - 1)
    assert not booking.is_expired_at(deadline - 1)
    assert booking.is_expired_at(deadline)
    assert booking.contribution(deadline - 1) == (CAP_10K_500, 0)
    assert booking.contribution(deadline) == (0, CAP_10K_500)


@pytest.mark.parametrize(
    ("expire_charge", "charge"), [(ExpireCharge.HOLD, CAP_10K_500), (ExpireCharge.ZERO, 0)]
)
def test_expire_charges_per_the_policy_the_booking_was_reserved_under(
    expire_charge: ExpireCharge, charge: int
) -> None:
    booking = open_booking(expire_charge=expire_charge)
    deadline = START_US + HOLD_TTL_US
    assert booking.amount_at(deadline) == charge
    event = moves.expire(booking, deadline)
    assert event.kind is EventKind.EXPIRED
    assert event.amount_nanos == charge
    assert event.previous_amount_nanos == CAP_10K_500
    after = bookings.apply(dataclasses.replace(event, seq=2), booking)
    assert after.state is BookingState.EXPIRED
    assert after.amount_nanos == charge
    assert after.reserved_at_us == START_US


def test_expire_before_the_deadline_is_a_programming_error() -> None:
    with pytest.raises(AssertionError):
        moves.expire(open_booking(), START_US + HOLD_TTL_US - 1)


# decide_settle ----------------------------------------------------------------


def test_succeeded_charges_the_real_cost_at_the_booking_prices() -> None:
    booking = open_booking()
    verdict = moves.decide_settle(booking, settle(input_tokens=1_000, output_tokens=101), START_US)
    assert verdict.event is not None
    # ceil(100) + ceil(40.4) = 100 + 41.
    assert verdict.event.amount_nanos == 141
    assert verdict.event.previous_amount_nanos == CAP_10K_500
    after = ended(booking, verdict, 2)
    assert after.state is BookingState.SETTLED
    assert after.reserved_at_us == START_US


def test_succeeded_above_the_hold_charges_the_real_cost() -> None:
    booking = open_booking(reserve_command(estimate_nanos=10))
    verdict = moves.decide_settle(booking, settle(input_tokens=100_000), START_US)
    assert verdict.event is not None
    assert verdict.event.amount_nanos == 10_000 > booking.hold_nanos


def test_succeeded_with_a_billed_amount_charges_the_bill() -> None:
    verdict = moves.decide_settle(
        open_booking(), settle(input_tokens=5, output_tokens=5, billed_nanos=7_777), START_US
    )
    assert verdict.event is not None
    assert verdict.event.amount_nanos == 7_777


@pytest.mark.parametrize(("billed", "charge"), [(None, 300), (120, 120), (301, 300), (0, 0)])
def test_unknown_charges_the_hold_or_a_lower_bill_never_more(
    billed: int | None, charge: int
) -> None:
    booking = open_booking(reserve_command(estimate_nanos=300))
    verdict = moves.decide_settle(booking, settle(Outcome.UNKNOWN, billed_nanos=billed), START_US)
    assert verdict.event is not None
    assert verdict.event.amount_nanos == charge
    assert ended(booking, verdict, 2).state is BookingState.SETTLED_UNKNOWN


def test_a_repeated_settle_names_the_first_answer() -> None:
    first = moves.decide_settle(open_booking(), settle(input_tokens=10), START_US)
    booking = ended(open_booking(), first, 2)
    verdict = moves.decide_settle(booking, settle(input_tokens=10), START_US + 5)
    assert verdict == moves.Verdict(event=None, repeat_seq=2)
    # http_status is for the audit and does not make a settle different.
    repeat = moves.decide_settle(booking, settle(input_tokens=10, http_status=200), START_US + 5)
    assert repeat.repeat_seq == 2


def test_a_different_succeeded_usage_after_success_is_refused() -> None:
    first = open_booking()
    booking = ended(first, moves.decide_settle(first, settle(input_tokens=10), START_US), 2)
    with pytest.raises(BookingAlreadyEnded):
        moves.decide_settle(booking, settle(input_tokens=11), START_US)
    with pytest.raises(BookingAlreadyEnded):
        moves.decide_settle(booking, settle(input_tokens=10, billed_nanos=1), START_US)


def test_settle_after_refund_is_refused() -> None:
    first = open_booking()
    booking = ended(first, moves.decide_refund(first, refund(), START_US), 2)
    for outcome in (Outcome.SUCCEEDED, Outcome.UNKNOWN):
        with pytest.raises(BookingAlreadyEnded):
            moves.decide_settle(booking, settle(outcome), START_US)


def test_settle_of_a_denied_reservation_is_refused() -> None:
    denied = bookings.apply(
        dataclasses.replace(decide(reserve_command(request_bytes=1_000_000)), seq=1), None
    )
    with pytest.raises(BookingWasDenied):
        moves.decide_settle(denied, settle(), START_US)
    with pytest.raises(BookingWasDenied):
        moves.decide_refund(denied, refund(), START_US)


def test_unknown_after_unknown_or_expiry_changes_nothing() -> None:
    first = open_booking(reserve_command(estimate_nanos=300))
    unknown = ended(first, moves.decide_settle(first, settle(Outcome.UNKNOWN), START_US), 2)
    assert moves.decide_settle(unknown, settle(Outcome.UNKNOWN, billed_nanos=5), START_US) == (
        moves.Verdict()
    )
    deadline = START_US + HOLD_TTL_US
    expired = bookings.apply(dataclasses.replace(moves.expire(first, deadline), seq=2), first)
    assert moves.decide_settle(expired, settle(Outcome.UNKNOWN), deadline) == moves.Verdict()


def test_a_late_success_replaces_an_unknown_or_expired_charge() -> None:
    first = open_booking(reserve_command(estimate_nanos=300))
    unknown = ended(first, moves.decide_settle(first, settle(Outcome.UNKNOWN), START_US), 2)
    deadline = START_US + HOLD_TTL_US
    expired = bookings.apply(dataclasses.replace(moves.expire(first, deadline), seq=2), first)
    for booking in (unknown, expired):
        verdict = moves.decide_settle(booking, settle(input_tokens=1_000), deadline + 1)
        assert verdict.event is not None
        assert verdict.event.amount_nanos == 100
        assert verdict.event.previous_amount_nanos == 300
        after = ended(booking, verdict, 3)
        assert after.state is BookingState.SETTLED
        assert after.reserved_at_us == START_US


# decide_refund ----------------------------------------------------------------


def test_refund_zeroes_an_open_or_expired_booking() -> None:
    first = open_booking(reserve_command(estimate_nanos=300))
    deadline = START_US + HOLD_TTL_US
    expired = bookings.apply(dataclasses.replace(moves.expire(first, deadline), seq=2), first)
    for booking in (first, expired):
        verdict = moves.decide_refund(booking, refund(429), deadline)
        assert verdict.event is not None
        assert verdict.event.kind is EventKind.REFUNDED
        assert verdict.event.amount_nanos == 0
        assert verdict.event.http_status == 429
        assert ended(booking, verdict, 3).state is BookingState.REFUNDED


def test_refund_after_an_unknown_settle_is_refused() -> None:
    """The contract lists "refund after settle" as a contradiction; an UNKNOWN settle
    is a settle. Only an expired booking (nobody said anything) may still learn
    that its call was refused."""
    first = open_booking(reserve_command(estimate_nanos=300))
    unknown = ended(first, moves.decide_settle(first, settle(Outcome.UNKNOWN), START_US), 2)
    with pytest.raises(BookingAlreadyEnded):
        moves.decide_refund(unknown, refund(403), START_US + 1)


def test_a_repeated_refund_names_the_first_answer_whatever_its_reason() -> None:
    first = open_booking()
    booking = ended(first, moves.decide_refund(first, refund(403), START_US), 2)
    assert moves.decide_refund(booking, refund(404), START_US).repeat_seq == 2
    assert moves.decide_refund(booking, refund(0, "never sent"), START_US).repeat_seq == 2


def test_refund_after_a_real_settle_is_refused() -> None:
    first = open_booking()
    booking = ended(first, moves.decide_settle(first, settle(input_tokens=1), START_US), 2)
    with pytest.raises(BookingAlreadyEnded):
        moves.decide_refund(booking, refund(), START_US)
