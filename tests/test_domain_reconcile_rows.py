"""What one row of a provider's export does to its booking, with no I/O: it
corrects an UNKNOWN or expired charge, flags a real charge that disagrees
(the bill replaces it only with bill_wins), and leaves a refunded, open,
denied or other-model booking alone."""

from __future__ import annotations

import dataclasses

from ledger_service.domain import bookings, moves, reconcile
from ledger_service.domain.bookings import Booking, BookingState
from ledger_service.domain.events import EventKind, Outcome
from ledger_service.domain.policies import LanePolicy
from ledger_service.domain.pricing import ModelPrice
from ledger_service.domain.reconcile import BillWins, ExportRow, RowStatus
from ledger_service.domain.window import WindowTotals

START_US = 1_800_000_000_000_000
TTL_US = 120_000_000
LANE = LanePolicy(
    lane="recall", limit_nanos=500_000_000, prices={"jev": ModelPrice(100_000, 400_000)}
)
# 7,000 bytes at 3.5 bytes a token and 200 output tokens: a cap of 280 nanos.
CAP = 280
BILL_WINS = BillWins("bill-1", "grant-7")


def opened() -> Booking:
    command = moves.ReserveCommand("recall", "r1", "jev", 7_000, 200)
    budget = moves.Budget(LANE, WindowTotals(0, 0, 0), lambda: [])
    event = moves.decide_reserve([budget], command, START_US)
    assert event.kind is EventKind.RESERVED
    return bookings.apply(dataclasses.replace(event, seq=1), None)


def after(booking: Booking, verdict: moves.Verdict) -> Booking:
    assert verdict.event is not None
    return bookings.apply(dataclasses.replace(verdict.event, seq=2), booking)


def settled(outcome: Outcome, **fields: int) -> Booking:
    command = moves.SettleCommand("recall", "r1", outcome, **fields)
    return after(opened(), moves.decide_settle(opened(), command, START_US + 5))


def refunded() -> Booking:
    command = moves.RefundCommand("recall", "r1", 403)
    return after(opened(), moves.decide_refund(opened(), command, START_US + 5))


def row(billed_nanos: int, model: str = "") -> ExportRow:
    return ExportRow(7, "recall", "r1", billed_nanos, 0, 0, model)


NOW_US = START_US + 60_000_000


def test_a_row_corrects_an_unknown_charge() -> None:
    result, event = reconcile.decide(settled(Outcome.UNKNOWN), row(120), NOW_US)
    assert result.status is RowStatus.CORRECTED
    assert (result.before_nanos, result.after_nanos) == (CAP, 120)
    assert event is not None and event.kind is EventKind.RECONCILED
    assert event.amount_nanos == 120 and event.reserved_at_us == START_US


def test_a_real_charge_that_disagrees_is_flagged_and_replaced_only_when_the_bill_wins() -> None:
    real = settled(Outcome.SUCCEEDED, billed_nanos=250)
    result, event = reconcile.decide(real, row(240), NOW_US)
    assert (result.status, result.after_nanos, event) == (RowStatus.DISAGREES, 250, None)
    result, event = reconcile.decide(real, row(240), NOW_US, BILL_WINS)
    assert result.status is RowStatus.REPLACED
    assert event is not None and event.kind is EventKind.CORRECTED
    assert (event.previous_amount_nanos, event.amount_nanos) == (250, 240)
    assert (event.correction_id, event.grant_id) == ("bill-1", "grant-7")


def test_a_refunded_booking_the_provider_billed_stays_flagged_even_when_the_bill_wins() -> None:
    """A refused call costs zero: bill_wins replaces only real charges."""
    for bill_wins in (None, BILL_WINS):
        result, event = reconcile.decide(refunded(), row(90), NOW_US, bill_wins)
        assert (result.status, result.after_nanos, event) == (RowStatus.REFUNDED, 0, None)
    result, event = reconcile.decide(refunded(), row(0), NOW_US, BILL_WINS)
    assert (result.status, event) == (RowStatus.MATCHED, None)


def test_a_row_for_an_open_booking_changes_nothing() -> None:
    result, event = reconcile.decide(opened(), row(120), START_US + TTL_US - 1)
    assert (result.status, result.after_nanos, event) == (RowStatus.OPEN, CAP, None)


def test_a_row_naming_another_model_disagrees_and_changes_nothing() -> None:
    unknown = settled(Outcome.UNKNOWN)
    result, event = reconcile.decide(unknown, row(120, model="jev-2"), NOW_US)
    assert (result.status, result.after_nanos, event) == (RowStatus.DISAGREES, CAP, None)
    result, event = reconcile.decide(unknown, row(120, model="jev"), NOW_US)
    assert result.status is RowStatus.CORRECTED


def test_a_row_billing_a_denied_reserve_disagrees() -> None:
    denied = dataclasses.replace(opened(), state=BookingState.REJECTED, amount_nanos=0)
    result, event = reconcile.decide(denied, row(120), NOW_US)
    assert (result.status, event) == (RowStatus.DISAGREES, None)


def test_a_row_billing_zero_for_a_denied_reserve_matches() -> None:
    denied = dataclasses.replace(opened(), state=BookingState.REJECTED, amount_nanos=0)
    result, event = reconcile.decide(denied, row(0), NOW_US)
    assert (result.status, result.before_nanos, result.after_nanos, event) == (
        RowStatus.MATCHED,
        0,
        0,
        None,
    )


def test_a_bill_is_taken_past_the_charge_multiple_and_the_output_bound() -> None:
    """docs/semantics.md, Reconcile: the bill is the provider's word and the
    remedy a refused Settle points to, so the guards against a lane's misread
    report do not apply to it: a bill 1,000 times the cap, or output tokens
    past the booking's max_output_tokens, correct the charge as they stand."""
    unknown = settled(Outcome.UNKNOWN)
    result, event = reconcile.decide(unknown, row(1_000 * CAP), NOW_US)
    assert result.status is RowStatus.CORRECTED
    assert event is not None and event.amount_nanos == 1_000 * CAP
    tokens = ExportRow(7, "recall", "r1", None, 1_000, 500, "")
    result, event = reconcile.decide(unknown, tokens, NOW_US)
    assert result.status is RowStatus.CORRECTED
    assert event is not None and event.amount_nanos == 100 + 200
