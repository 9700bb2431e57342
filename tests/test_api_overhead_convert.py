"""The answers of the moves, filled in place, are the messages the plain
construction gives: same fields, same presence, same bytes."""

from __future__ import annotations

import pytest
from google.protobuf.message import Message

from ledger_service.api import convert
from ledger_service.application.ledger import RefundResult, SettleResult
from ledger_service.domain.bookings import BookingState
from ledger_service.domain.events import DenialReason, Event, EventKind
from ledger_service.domain.window import Balance, WindowTotals
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb

BALANCES = (
    Balance(
        "recall", 500_000_000, 86_400_000_000, 1_790_000_000_123_456, WindowTotals(280, 240, 1)
    ),
    # Zero window and instant: the fields are still present, as a built message's are.
    Balance("idle", 0, 0, 0, WindowTotals(0, 0, 0)),
    Balance("over", 10, 1_500_000, 7, WindowTotals(20, 5, 3)),
)
EVENTS = (
    Event(
        EventKind.RESERVED,
        "recall",
        1_790_000_000_123_456,
        reservation_id="r-1",
        hold_nanos=280,
        cap_nanos=280,
        reserved_at_us=1_790_000_000_123_456,
        expires_at_us=1_790_000_120_123_456,
    ),
    Event(
        EventKind.DENIED,
        "recall",
        1_790_000_000_000_001,
        reservation_id="r-2",
        hold_nanos=900,
        cap_nanos=900,
        reserved_at_us=1_790_000_000_000_001,
        retry_after_us=1_790_000_060_000_000,
        denial_reason=DenialReason.BUDGET_EXHAUSTED,
        reason="budget exhausted",
        denied_by="parent",
    ),
)


def plain_balance(value: Balance) -> pb.Balance:
    return pb.Balance(
        lane=value.lane,
        limit_nanos=value.limit_nanos,
        spent_nanos=value.spent_nanos,
        held_nanos=value.totals.held_nanos,
        charged_nanos=value.totals.charged_nanos,
        available_nanos=value.available_nanos,
        window=convert.duration(value.window_us),
        as_of=convert.timestamp(value.as_of_us),
        overrun_nanos=value.overrun_nanos,
        open_bookings=value.totals.open_bookings,
    )


def plain_reserve_response(event: Event, value: Balance) -> pb.ReserveResponse:
    admitted = event.kind is EventKind.RESERVED
    response = pb.ReserveResponse(
        decision=pb.ADMITTED if admitted else pb.DENIED,
        hold_nanos=event.hold_nanos,
        cap_nanos=event.cap_nanos,
        balance=plain_balance(value),
        reason=event.reason,
        reserved_at=convert.timestamp(event.reserved_at_us),
        denied_by=event.denied_by,
    )
    if admitted:
        response.expires_at.CopyFrom(convert.timestamp(event.expires_at_us))
    if event.denial_reason is not None:
        response.denial_reason = pb.BUDGET_EXHAUSTED
    if event.retry_after_us is not None:
        response.retry_after.CopyFrom(convert.timestamp(event.retry_after_us))
    return response


def same(made: Message, plain: Message) -> None:
    assert made == plain
    assert made.SerializeToString(deterministic=True) == plain.SerializeToString(deterministic=True)
    assert made.ListFields() == plain.ListFields()


@pytest.mark.parametrize("value", BALANCES)
def test_balance_is_the_plain_message(value: Balance) -> None:
    same(convert.balance(value), plain_balance(value))


@pytest.mark.parametrize("value", BALANCES)
@pytest.mark.parametrize("event", EVENTS)
def test_reserve_response_is_the_plain_message(event: Event, value: Balance) -> None:
    same(convert.reserve_response(event, value), plain_reserve_response(event, value))


@pytest.mark.parametrize("value", BALANCES)
def test_settle_and_refund_responses_are_the_plain_messages(value: Balance) -> None:
    settled = SettleResult(240, BookingState.SETTLED_UNKNOWN, value)
    same(
        convert.settle_response(settled),
        pb.SettleResponse(
            charged_nanos=240, balance=plain_balance(value), state=pb.SETTLED_UNKNOWN
        ),
    )
    same(
        convert.refund_response(RefundResult(value)),
        pb.RefundResponse(balance=plain_balance(value)),
    )
