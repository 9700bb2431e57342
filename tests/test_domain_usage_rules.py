"""The rules that keep one bad report from jamming a lane, with no I/O: a
SUCCEEDED settle needs evidence, usage no request could have produced is
refused, an operator's correction replaces an ended booking's charge, prices
follow the provider's bill (cache rates), and window sums stay in range."""

from __future__ import annotations

import dataclasses

import pytest

from ledger_service.domain import bookings, moves
from ledger_service.domain.bookings import Booking, BookingState
from ledger_service.domain.errors import (
    BookingAlreadyEnded,
    BookingStillOpen,
    BookingWasDenied,
    ChargeExceedsCapMultiple,
    CorrectionConflict,
    InvalidArgument,
    OutputExceedsMaxTokens,
    SumOutOfRange,
    UsageNotEvidence,
)
from ledger_service.domain.events import Event, EventKind, Outcome
from ledger_service.domain.policies import (
    DEFAULT_MAX_CHARGE_MULTIPLE,
    LanePolicy,
    policy_from_dict,
    policy_to_dict,
)
from ledger_service.domain.pricing import (
    MAX_AMOUNT_NANOS,
    MAX_WINDOW_SUM_NANOS,
    ModelPrice,
    cap_nanos,
)
from ledger_service.domain.window import WindowTotals

START_US = 1_800_000_000_000_000
JEV = ModelPrice(100_000, 400_000)
# 7,000 bytes at 3.5 bytes a token: 2,000 tokens (200 nanos) and 200 output
# tokens (80 nanos): the incident's cap of $0.00028.
CAP_7K_200 = 280
# $3 / $15 per million, cached reads $0.30, cache writes $3.75.
CACHED = ModelPrice(3_000_000, 15_000_000, 300_000, 3_750_000)


def lane(**changes: object) -> LanePolicy:
    base = LanePolicy(lane="recall", limit_nanos=500_000_000, prices={"jev": JEV})
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def booked(policy: LanePolicy | None = None, model: str = "jev") -> Booking:
    command = moves.ReserveCommand("recall", "r1", model, 7_000, 200)
    budget = moves.Budget(policy or lane(), WindowTotals(0, 0, 0), lambda: [])
    event = moves.decide_reserve([budget], command, START_US)
    assert event.kind is EventKind.RESERVED
    return bookings.apply(dataclasses.replace(event, seq=1), None)


def succeeded(**fields: object) -> moves.SettleCommand:
    base = moves.SettleCommand("recall", "r1", Outcome.SUCCEEDED, input_tokens=1_800)
    return dataclasses.replace(base, **fields)  # type: ignore[arg-type]


def settled_event(booking: Booking, command: moves.SettleCommand, multiple: int) -> Event:
    command.validate()
    verdict = moves.decide_settle(booking, command, START_US, multiple)
    assert verdict.event is not None
    return verdict.event


# Evidence -------------------------------------------------------------------


def test_a_succeeded_settle_without_tokens_or_bill_is_refused() -> None:
    with pytest.raises(UsageNotEvidence) as refused:
        moves.decide_settle(booked(), succeeded(input_tokens=0, output_tokens=150), START_US)
    assert refused.value.field == "input_tokens"
    assert refused.value.reason == "SETTLE_WITHOUT_USAGE"


def test_input_tokens_or_a_bill_of_zero_is_evidence() -> None:
    assert settled_event(booked(), succeeded(input_tokens=1), 100).amount_nanos == 1
    assert settled_event(booked(), succeeded(input_tokens=0, billed_nanos=0), 100).amount_nanos == 0
    # An UNKNOWN settle needs no usage: nobody knows it.
    unknown = moves.SettleCommand("recall", "r1", Outcome.UNKNOWN)
    assert settled_event(booked(), unknown, 100).amount_nanos == CAP_7K_200


def test_an_unknown_settle_s_tokens_price_nothing() -> None:
    """docs/semantics.md, Settle UNKNOWN: the charge is the hold, or a lower
    billed figure; tokens it carries are recorded, not priced, above or below
    the hold (partial counts of a cut-off call are no bill). Output above the
    booking's max_output_tokens is refused as for SUCCEEDED."""
    booking = booked()
    above = moves.SettleCommand(
        "recall", "r1", Outcome.UNKNOWN, input_tokens=2_000, output_tokens=200
    )
    event = settled_event(booking, above, 100)
    assert (event.amount_nanos, event.input_tokens) == (CAP_7K_200, 2_000)
    below = dataclasses.replace(above, input_tokens=1, output_tokens=0)
    assert settled_event(booking, below, 100).amount_nanos == CAP_7K_200
    with pytest.raises(OutputExceedsMaxTokens):
        moves.decide_settle(booking, dataclasses.replace(above, output_tokens=201), START_US)


def test_cached_tokens_are_parts_of_the_input() -> None:
    with pytest.raises(InvalidArgument) as refused:
        succeeded(input_tokens=10, cached_input_tokens=11, cache_write_tokens=0).validate()
    assert refused.value.field == "cached_input_tokens"
    succeeded(input_tokens=11, cached_input_tokens=6, cache_write_tokens=5).validate()


@pytest.mark.parametrize(("cached", "written"), [(0, 11), (6, 5)])
def test_cache_write_tokens_that_take_the_parts_past_the_input_are_named(
    cached: int, written: int
) -> None:
    """The field named is the one past the bound: with no cached tokens, or
    fewer than the input, it is the cache-write count that passes it, and a
    lane told `cached_input_tokens` would look for its fault where none is."""
    with pytest.raises(InvalidArgument) as refused:
        succeeded(
            input_tokens=10, cached_input_tokens=cached, cache_write_tokens=written
        ).validate()
    assert refused.value.field == "cache_write_tokens"


# Usage no request could have produced ----------------------------------------------


def test_output_above_the_booking_max_output_tokens_is_refused() -> None:
    booking = booked()
    with pytest.raises(OutputExceedsMaxTokens) as refused:
        moves.decide_settle(booking, succeeded(output_tokens=201), START_US)
    assert refused.value.field == "output_tokens"
    assert settled_event(booking, succeeded(output_tokens=200), 100).amount_nanos == 180 + 80


def test_the_incident_usage_is_refused_by_the_output_bound_first() -> None:
    with pytest.raises(OutputExceedsMaxTokens):
        moves.decide_settle(booked(), succeeded(input_tokens=10**9, output_tokens=10**9), START_US)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"billed_nanos": 100 * CAP_7K_200 + 1}, "billed_nanos"),
        ({"input_tokens": 280_001}, "input_tokens"),
    ],
)
def test_a_charge_above_the_multiple_of_the_cap_is_refused(
    fields: dict[str, int], field: str
) -> None:
    with pytest.raises(ChargeExceedsCapMultiple) as refused:
        moves.decide_settle(booked(), succeeded(**fields), START_US, 100)
    assert refused.value.field == field
    assert refused.value.reason == "CHARGE_EXCEEDS_CAP_MULTIPLE"
    assert "100 times" in refused.value.message


def test_a_charge_at_the_multiple_of_the_cap_is_booked() -> None:
    event = settled_event(booked(), succeeded(billed_nanos=100 * CAP_7K_200), 100)
    assert event.amount_nanos == 28_000


def test_a_multiple_of_zero_sets_no_bound() -> None:
    event = settled_event(booked(), succeeded(billed_nanos=500_000_000_000), 0)
    assert event.amount_nanos == 500_000_000_000


def test_the_default_multiple_is_recorded_with_the_policy() -> None:
    policy = lane()
    assert policy.max_charge_multiple == DEFAULT_MAX_CHARGE_MULTIPLE == 100
    stored = policy_to_dict(dataclasses.replace(policy, max_charge_multiple=7))
    assert stored["max_charge_multiple"] == 7
    assert policy_from_dict(stored, 1, 0).max_charge_multiple == 7
    # A policy recorded before the field existed reads as the default.
    del stored["max_charge_multiple"]
    assert policy_from_dict(stored, 1, 0).max_charge_multiple == 100


def test_the_multiple_is_bounded() -> None:
    with pytest.raises(InvalidArgument) as refused:
        lane(max_charge_multiple=-1).validate()
    assert refused.value.field == "lane.max_charge_multiple"
    lane(max_charge_multiple=0).validate()


# Prices as providers bill them -----------------------------------------------------


def test_each_kind_of_token_is_priced_at_its_own_rate() -> None:
    # 2,000 uncached at $3, 6,000 cached at $0.30, 2,000 written at $3.75, 500 out at $15.
    assert CACHED.real_cost(10_000, 500, 6_000, 2_000) == 6_000 + 1_800 + 7_500 + 7_500


def test_a_model_without_cache_rates_prices_cached_tokens_as_input() -> None:
    assert JEV.real_cost(1_800, 150, 1_000, 300) == JEV.real_cost(1_800, 150) == 240


def test_the_cap_prices_every_request_token_at_the_dearest_input_rate() -> None:
    # 2,000 tokens at the cache-write rate ($3.75) and 200 out at $15.
    assert cap_nanos(CACHED, 7_000, 200, 3500, 0) == 7_500 + 3_000
    cheap_writes = ModelPrice(3_000_000, 15_000_000, 300_000, 1_000_000)
    assert cap_nanos(cheap_writes, 7_000, 200, 3500, 0) == 6_000 + 3_000


def test_the_cap_bounds_any_usage_of_that_request() -> None:
    booking = booked(lane(prices={"jev": CACHED}))
    assert booking.price == CACHED
    for cached, written in ((0, 0), (2_000, 0), (0, 2_000), (1_000, 1_000)):
        command = succeeded(
            input_tokens=2_000, output_tokens=200, cached_input_tokens=cached,
            cache_write_tokens=written,
        )  # fmt: skip
        assert settled_event(booking, command, 1).amount_nanos <= booking.cap_nanos


def test_a_settle_records_its_cache_tokens() -> None:
    event = settled_event(booked(), succeeded(cached_input_tokens=800, cache_write_tokens=100), 100)
    after = bookings.apply(dataclasses.replace(event, seq=2), booked())
    assert (after.cached_input_tokens, after.cache_write_tokens) == (800, 100)
    # A retry with other cache counts is other usage, not a repeat.
    other = succeeded(cached_input_tokens=700, cache_write_tokens=100)
    assert other.fingerprint() != after.settle_fingerprint()
    # Cached reads and cache writes are both the Settle's content: a report
    # that differs in either one is other usage, refused.
    moves.decide_settle(after, succeeded(cached_input_tokens=800, cache_write_tokens=100), START_US)
    for changed in ({"cached_input_tokens": 700}, {"cache_write_tokens": 50}):
        different = succeeded(**{"cached_input_tokens": 800, "cache_write_tokens": 100, **changed})
        with pytest.raises(BookingAlreadyEnded):
            moves.decide_settle(after, different, START_US)


# Corrections ------------------------------------------------------------------------


def correction(**fields: object) -> moves.CorrectCommand:
    base = moves.CorrectCommand("recall", "r1", 240, "the provider's bill says $0.00024", "c-1")
    return dataclasses.replace(base, **fields)  # type: ignore[arg-type]


def ended(booking: Booking, charge_nanos: int) -> Booking:
    event = settled_event(booking, succeeded(billed_nanos=charge_nanos), 0)
    return bookings.apply(dataclasses.replace(event, seq=2), booking)


def test_a_correction_replaces_an_ended_charge_and_records_who() -> None:
    jammed = ended(booked(), 500_000_000_000)
    event = moves.decide_correct(jammed, correction(), START_US + 5, "grant-7")
    assert event.kind is EventKind.CORRECTED
    assert (event.previous_amount_nanos, event.amount_nanos) == (500_000_000_000, 240)
    assert (event.reason, event.correction_id, event.grant_id) == (
        "the provider's bill says $0.00024",
        "c-1",
        "grant-7",
    )
    assert event.reserved_at_us == START_US, "the booking keeps its date"
    after = bookings.apply(dataclasses.replace(event, seq=3), jammed)
    assert (after.state, after.amount_nanos) == (BookingState.CORRECTED, 240)


def test_a_correction_may_correct_a_refund_or_a_correction() -> None:
    booking = booked()
    refund = moves.decide_refund(booking, moves.RefundCommand("recall", "r1", 403), START_US).event
    assert refund is not None
    refunded = bookings.apply(dataclasses.replace(refund, seq=2), booking)
    event = moves.decide_correct(refunded, correction(charge_nanos=99), START_US, "g")
    corrected = bookings.apply(dataclasses.replace(event, seq=3), refunded)
    again = moves.decide_correct(corrected, correction(correction_id="c-2"), START_US, "g")
    assert (again.previous_amount_nanos, again.amount_nanos) == (99, 240)


def test_a_repeat_after_a_correction_gets_the_lane_s_own_last_answer() -> None:
    """An UNKNOWN settle, a late SUCCEEDED one, then a correction: a repeat of
    the late one returns its answer, the earlier UNKNOWN is not repeated, and
    without its history a replaced booking refuses every move."""
    command = moves.ReserveCommand("recall", "r1", "jev", 7_000, 200)
    budget = moves.Budget(lane(), WindowTotals(0, 0, 0), lambda: [])
    history = [dataclasses.replace(moves.decide_reserve([budget], command, START_US), seq=1)]
    opened = bookings.apply(history[0], None)
    unknown = moves.SettleCommand("recall", "r1", Outcome.UNKNOWN)
    late = succeeded(billed_nanos=250)
    booking = opened
    for seq, command in ((2, unknown), (3, late)):
        event = dataclasses.replace(settled_event(booking, command, 0), seq=seq)
        history.append(event)
        booking = bookings.apply(event, booking)
    fixed = moves.decide_correct(booking, correction(), START_US, "g")
    history.append(dataclasses.replace(fixed, seq=4))
    corrected = bookings.apply(history[-1], booking)

    def lane_left() -> Booking:
        return moves.as_the_lane_left_it(history)

    assert moves.decide_settle(corrected, late, START_US, 0, lane_left).repeat_seq == 3
    for other in (unknown, succeeded(billed_nanos=251)):
        with pytest.raises(BookingAlreadyEnded):
            moves.decide_settle(corrected, other, START_US, 0, lane_left)
    with pytest.raises(BookingAlreadyEnded):
        moves.decide_refund(
            corrected, moves.RefundCommand("recall", "r1", 403), START_US, lane_left
        )
    with pytest.raises(BookingAlreadyEnded):
        moves.decide_settle(corrected, late, START_US, 0)


def test_an_open_booking_cannot_be_corrected() -> None:
    with pytest.raises(BookingStillOpen):
        moves.decide_correct(booked(), correction(), START_US, "g")


def test_a_denied_reservation_cannot_be_corrected() -> None:
    denied = dataclasses.replace(booked(), state=BookingState.REJECTED, amount_nanos=0)
    with pytest.raises(BookingWasDenied):
        moves.decide_correct(denied, correction(), START_US, "g")


def test_a_correction_id_is_reused_only_with_the_same_content() -> None:
    first = moves.decide_correct(ended(booked(), 10**6), correction(), START_US, "g")
    moves.check_correction_repeat(first, correction())
    for changed in ({"charge_nanos": 241}, {"reason": "other"}, {"reservation_id": "r2"}):
        with pytest.raises(CorrectionConflict):
            moves.check_correction_repeat(first, correction(**changed))


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"reason": "  "}, "reason"),
        ({"reason": "x" * 1001}, "reason"),
        ({"charge_nanos": -1}, "charge_nanos"),
        ({"charge_nanos": MAX_AMOUNT_NANOS + 1}, "charge_nanos"),
        ({"correction_id": ""}, "correction_id"),
        ({"correction_id": "has space"}, "correction_id"),
    ],
)
def test_a_bad_correction_names_its_field(fields: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        correction(**fields).validate()
    assert refused.value.field == field


# Sums -------------------------------------------------------------------------------


def test_a_window_past_the_largest_sum_is_refused_naming_the_field() -> None:
    moves.check_window_sums([0, MAX_WINDOW_SUM_NANOS], "billed_nanos")
    with pytest.raises(SumOutOfRange) as refused:
        moves.check_window_sums([1, MAX_WINDOW_SUM_NANOS + 1], "billed_nanos")
    assert refused.value.field == "billed_nanos"
    # Two of the largest single amounts do not fit one window.
    assert 2 * MAX_AMOUNT_NANOS > MAX_WINDOW_SUM_NANOS


def test_a_charge_priced_past_the_largest_amount_is_refused_naming_its_field() -> None:
    # A lane with no charge bound, at the dearest price: 10^12 input tokens
    # cost 10^21 nanos, past int64. Out of every window (aged out, or a window
    # made shorter) no window sum refuses it: the domain must, as it does a cap.
    dearest = ModelPrice(10**15, 10**15)
    booking = booked(lane(prices={"jev": dearest}, max_charge_multiple=0, limit_nanos=2**62))
    with pytest.raises(InvalidArgument) as refused:
        settled_event(booking, succeeded(input_tokens=10**12, output_tokens=0), 0)
    assert refused.value.field == "input_tokens"
    # The largest amount itself is a charge like any other.
    tokens = MAX_AMOUNT_NANOS // 10**9
    largest = settled_event(booking, succeeded(input_tokens=tokens, output_tokens=0), 0)
    assert largest.amount_nanos == tokens * 10**9 <= MAX_AMOUNT_NANOS
    with pytest.raises(InvalidArgument):
        settled_event(booking, succeeded(input_tokens=tokens + 1, output_tokens=0), 0)
