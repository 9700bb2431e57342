"""The true rolling window and retry_after, with no I/O.

    spent(lane, now) = sum of amount(b) with now - window < reserved_at(b) <= now

A booking counts at reserved_at + window - 1 us and is gone at reserved_at + window.
"""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from ledger_service.domain import bookings
from ledger_service.domain.bookings import Booking
from ledger_service.domain.events import Event, EventKind, Outcome
from ledger_service.domain.policies import ExpireCharge
from ledger_service.domain.window import (
    Balance,
    WindowTotals,
    in_window,
    retry_after_us,
    totals_of,
)

WINDOW_US = 86_400_000_000
START_US = 1_800_000_000_000_000 + 123_456


def reserved(
    reservation_id: str,
    reserved_at_us: int,
    hold_nanos: int,
    *,
    ttl_us: int = 120_000_000,
    expire_charge: ExpireCharge = ExpireCharge.HOLD,
    seq: int = 1,
) -> Booking:
    event = Event(
        kind=EventKind.RESERVED,
        lane="recall",
        occurred_at_us=reserved_at_us,
        reservation_id=reservation_id,
        amount_nanos=hold_nanos,
        model="jev",
        hold_nanos=hold_nanos,
        cap_nanos=hold_nanos,
        reserved_at_us=reserved_at_us,
        expires_at_us=reserved_at_us + ttl_us,
        input_nanos_per_million_tokens=100_000,
        output_nanos_per_million_tokens=400_000,
        expire_charge=expire_charge,
        seq=seq,
    )
    return bookings.apply(event, None)


def settled(booking: Booking, charge_nanos: int, at_us: int, seq: int = 2) -> Booking:
    event = Event(
        kind=EventKind.SETTLED,
        lane=booking.lane,
        occurred_at_us=at_us,
        reservation_id=booking.reservation_id,
        amount_nanos=charge_nanos,
        outcome=Outcome.SUCCEEDED,
        seq=seq,
    )
    return bookings.apply(event, booking)


def test_in_window_is_half_open_to_the_microsecond() -> None:
    assert in_window(START_US, START_US, WINDOW_US)
    assert in_window(START_US, START_US + WINDOW_US - 1, WINDOW_US)
    assert not in_window(START_US, START_US + WINDOW_US, WINDOW_US)
    # A booking dated after `now` (a clock set back) is not in the window either.
    assert not in_window(START_US + 1, START_US, WINDOW_US)


def test_a_booking_ages_out_exactly_one_window_after_it_was_made() -> None:
    booking = settled(reserved("a", START_US, 700), 300, START_US + 5)
    assert totals_of([booking], START_US + WINDOW_US - 1, WINDOW_US).spent_nanos == 300
    assert totals_of([booking], START_US + WINDOW_US, WINDOW_US).spent_nanos == 0


def test_a_charge_stays_dated_at_reserved_at_however_late_it_came() -> None:
    late = START_US + WINDOW_US - 10
    booking = settled(reserved("a", START_US, 700), 900, late)
    assert totals_of([booking], late, WINDOW_US).charged_nanos == 900
    assert totals_of([booking], START_US + WINDOW_US, WINDOW_US).spent_nanos == 0


def test_held_and_charged_are_reported_apart_and_both_count() -> None:
    open_booking = reserved("a", START_US, 700)
    ended = settled(reserved("b", START_US + 1, 500, seq=3), 200, START_US + 2, seq=4)
    totals = totals_of([open_booking, ended], START_US + 10, WINDOW_US)
    assert totals == WindowTotals(held_nanos=700, charged_nanos=200, open_bookings=1)
    assert totals.spent_nanos == 900


def test_an_open_hold_past_its_deadline_counts_as_its_expire_charge() -> None:
    ttl = 30_000_000
    hold = reserved("a", START_US, 700, ttl_us=ttl)
    zero = reserved("z", START_US, 500, ttl_us=ttl, expire_charge=ExpireCharge.ZERO, seq=2)
    before = totals_of([hold, zero], START_US + ttl - 1, WINDOW_US)
    assert before == WindowTotals(held_nanos=1200, charged_nanos=0, open_bookings=2)
    at_deadline = totals_of([hold, zero], START_US + ttl, WINDOW_US)
    assert at_deadline == WindowTotals(held_nanos=0, charged_nanos=700, open_bookings=0)


def test_available_can_be_negative_and_overrun_reports_it() -> None:
    balance = Balance("recall", 1000, WINDOW_US, START_US, WindowTotals(200, 1100, 1))
    assert balance.spent_nanos == 1300
    assert balance.available_nanos == -300
    assert balance.overrun_nanos == 300
    calm = Balance("recall", 1000, WINDOW_US, START_US, WindowTotals(200, 100, 1))
    assert calm.available_nanos == 700
    assert calm.overrun_nanos == 0


def test_retry_after_is_when_enough_of_the_oldest_bookings_age_out() -> None:
    aging = [(START_US, 400), (START_US + 10, 500), (START_US + 20, 100)]
    assert retry_after_us(1, aging, WINDOW_US) == START_US + WINDOW_US
    assert retry_after_us(400, aging, WINDOW_US) == START_US + WINDOW_US
    assert retry_after_us(401, aging, WINDOW_US) == START_US + 10 + WINDOW_US
    assert retry_after_us(900, aging, WINDOW_US) == START_US + 10 + WINDOW_US
    assert retry_after_us(1000, aging, WINDOW_US) == START_US + 20 + WINDOW_US
    # Bookings that charge nothing free nothing when they age out.
    assert retry_after_us(1, [(START_US, 0), (START_US + 7, 3)], WINDOW_US) == (
        START_US + 7 + WINDOW_US
    )


def test_retry_after_is_none_when_aging_can_never_free_enough() -> None:
    assert retry_after_us(1001, [(START_US, 400), (START_US + 1, 600)], WINDOW_US) is None
    assert retry_after_us(1, [], WINDOW_US) is None


@given(
    amounts=st.lists(st.integers(0, 1000), min_size=1, max_size=20),
    gaps=st.lists(st.integers(0, 5_000_000), min_size=20, max_size=20),
    needed=st.integers(1, 20_000),
)
def test_retry_after_is_the_earliest_instant_at_which_the_hold_fits(
    amounts: list[int], gaps: list[int], needed: int
) -> None:
    dates: list[int] = []
    instant = START_US
    for gap in gaps[: len(amounts)]:
        instant += gap
        dates.append(instant)
    aging = list(zip(dates, amounts, strict=True))
    now_us = dates[-1]
    answer = retry_after_us(needed, aging, WINDOW_US)

    def freed_at(instant_us: int) -> int:
        return sum(amount for date, amount in aging if not in_window(date, instant_us, WINDOW_US))

    if answer is None:
        assert sum(amounts) < needed
        return
    assert freed_at(answer) >= needed
    assert answer > now_us
    # One microsecond earlier not enough has aged out yet.
    assert freed_at(answer - 1) < needed


def test_a_rejected_booking_counts_nothing() -> None:
    booking = dataclasses.replace(
        reserved("d", START_US, 700), state=bookings.BookingState.REJECTED, amount_nanos=0
    )
    assert totals_of([booking], START_US + 1, WINDOW_US) == WindowTotals(0, 0, 0)
