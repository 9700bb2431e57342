"""GetAudit: how a lane's window splits into real charges, estimates, holds and
refusals, and the flags and sentence that would have caught the recall jam."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from ledger_service.application.audit import MOSTLY_ESTIMATES_FLOOR_PERCENT, Flag, summarize
from ledger_service.application.ports import StateTally
from ledger_service.domain.bookings import BookingState
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from tests.observability.jam import HOLD_NANOS, LIMIT_NANOS, make_jam

DAY_US = 86_400 * 1_000_000
MICROS_PER_SECOND = 1_000_000


def micros(value: Any) -> int:
    return int(value.seconds) * MICROS_PER_SECOND + int(value.nanos) // 1000


def test_the_recall_jam_in_figures_is_mostly_estimates() -> None:
    """The incident's own numbers: $0.4989 booked against $0.50, $0.0014 real,
    1,539 of 1,685 calls denied."""
    tallies = [
        StateTally(BookingState.SETTLED, 20, 1_400_000),
        StateTally(BookingState.SETTLED_UNKNOWN, 90, 400_000_000),
        StateTally(BookingState.EXPIRED, 36, 97_500_000),
        StateTally(BookingState.REJECTED, 1_539, 0),
    ]
    audit = summarize("recall", 500_000_000, DAY_US, 5 * DAY_US, tallies, (), (4 * DAY_US, 7))
    assert audit.balance.spent_nanos == 498_900_000
    assert (audit.real_charged_nanos, audit.estimated_charged_nanos) == (1_400_000, 497_500_000)
    assert audit.reserve_count == 1_685
    assert audit.denied_count == 1_539
    assert round(audit.denial_rate, 4) == 0.9134
    assert round(audit.estimated_to_real_ratio, 1) == 355.4
    assert audit.flags == (Flag.MOSTLY_ESTIMATES, Flag.NEAR_LIMIT, Flag.HIGH_DENIAL_RATE)
    assert (audit.next_release_at_us, audit.next_release_nanos) == (5 * DAY_US, 7)
    assert audit.summary == (
        "Lane recall has spent $0.4989 of $0.50 in its 1d window, mostly estimates, "
        "355 times the real charges: $0.0014 real charges, $0.4975 estimates "
        "(90 UNKNOWN, 36 expired) and $0.00 in 0 open holds; 1539 of 1685 Reserves (91%) "
        "were denied; check the lane's timeouts and expired holds before blaming the provider."
    )


def test_a_healthy_window_raises_no_flag() -> None:
    tallies = [
        StateTally(BookingState.SETTLED, 50, 2_000_000),
        StateTally(BookingState.SETTLED_UNKNOWN, 1, 30_000),
        StateTally(BookingState.OPEN, 2, 40_000),
        StateTally(BookingState.REFUNDED, 3, 0),
        StateTally(BookingState.RECONCILED, 4, 60_000),
        StateTally(BookingState.REJECTED, 1, 0),
    ]
    audit = summarize("filter", 500_000_000, DAY_US, DAY_US, tallies)
    assert audit.flags == ()
    assert audit.real_charged_nanos == 2_060_000
    assert (audit.balance.totals.held_nanos, audit.balance.totals.charged_nanos) == (
        40_000,
        2_090_000,
    )
    assert audit.balance.totals.open_bookings == 2
    assert audit.reserve_count == 61
    assert audit.next_release_at_us is None
    assert "mostly estimates" not in audit.summary
    assert audit.summary.startswith("Lane filter has spent $0.00213 of $0.50 in its 1d window: ")
    assert "in 2 open holds" in audit.summary
    one_open = [StateTally(BookingState.OPEN, 1, 40_000), *tallies[:2]]
    assert "in 1 open hold;" in summarize("filter", 500_000_000, DAY_US, DAY_US, one_open).summary


def test_an_empty_window() -> None:
    audit = summarize("quiet", 1_000, 3_600_000_000, DAY_US, [])
    assert (audit.reserve_count, audit.denial_rate, audit.estimated_to_real_ratio) == (0, 0.0, 0.0)
    assert audit.flags == ()
    assert audit.summary == "Lane quiet booked nothing in its 1h window."


def test_the_audit_of_a_jammed_lane_over_grpc(ledger: Any) -> None:
    check_the_jam(ledger)


@pytest.mark.postgres
def test_the_audit_of_a_jammed_lane_on_postgresql(
    postgres_url: str, server_with: Any, telemetry: Any, connect: Any
) -> None:
    check_the_jam(connect(server_with(telemetry, database_url=postgres_url)))


def check_the_jam(ledger: Any) -> None:
    make_jam(ledger)
    audit = ledger.audit(biggest=5)
    start_us = micros(audit.balance.as_of) - 5 * MICROS_PER_SECOND

    assert (audit.succeeded_count, audit.succeeded_charged_nanos) == (3, 30)
    assert (audit.unknown_count, audit.unknown_charged_nanos) == (10, 10 * HOLD_NANOS)
    assert (audit.expired_count, audit.expired_charged_nanos) == (8, 8 * HOLD_NANOS)
    assert (audit.open_count, audit.open_held_nanos) == (1, HOLD_NANOS)
    assert audit.refunded_count == 2
    assert (audit.reconciled_count, audit.reconciled_charged_nanos) == (0, 0)
    assert (audit.reserve_count, audit.denied_count) == (29, 5)
    assert audit.denial_rate == pytest.approx(5 / 29)
    assert (audit.estimated_charged_nanos, audit.real_charged_nanos) == (8_748, 30)
    assert audit.estimated_to_real_ratio == pytest.approx(8_748 / 30)
    assert list(audit.flags) == ["MOSTLY_ESTIMATES", "NEAR_LIMIT", "HIGH_DENIAL_RATE"]
    assert "mostly estimates" in audit.summary
    assert "291.6 times" not in audit.summary and "292 times the real charges" in audit.summary

    balance = ledger.ledger.GetBalance(pb.GetBalanceRequest(lane="recall"), timeout=10)
    assert audit.balance == balance
    assert (balance.spent_nanos, balance.limit_nanos) == (9_264, LIMIT_NANOS)

    # Ties at 486 go oldest first, then by reservation id.
    assert [b.reservation_id for b in audit.biggest_bookings] == ["u0", "u1", "u2", "u3", "u4"]
    assert {b.state for b in audit.biggest_bookings} == {pb.SETTLED_UNKNOWN}
    assert micros(audit.next_release_at) == start_us + 86_400 * MICROS_PER_SECOND
    assert audit.next_release_nanos == 30


def test_biggest_defaults_to_five_and_is_bounded(ledger: Any) -> None:
    make_jam(ledger)
    assert len(ledger.audit().biggest_bookings) == 5
    # 3 + 10 + 8 + 1 bookings count (refunds and denials are zero).
    assert len(ledger.audit(biggest=100).biggest_bookings) == 22
    with pytest.raises(grpc.RpcError) as too_many:
        ledger.audit(biggest=101)
    assert too_many.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert dict(too_many.value.trailing_metadata())["ledger-field"] == "biggest"
    with pytest.raises(grpc.RpcError) as unknown:
        ledger.audit(lane="nobody")
    assert unknown.value.code() is grpc.StatusCode.NOT_FOUND


def test_many_denials_far_from_the_limit_are_not_called_close_to_it() -> None:
    # A lane unjammed by a correction: its window spent 0.05%, but 2 of 3 Reserves denied.
    tallies = [
        StateTally(BookingState.CORRECTED, 1, 240_000),
        StateTally(BookingState.REJECTED, 2, 0),
    ]
    audit = summarize("recall", 500_000_000, DAY_US, DAY_US, tallies)
    assert audit.flags == (Flag.HIGH_DENIAL_RATE,)
    assert "close to its limit" not in audit.summary
    assert "with many Reserves denied" in audit.summary
    near = summarize("recall", 250_000, DAY_US, DAY_US, tallies)
    assert Flag.NEAR_LIMIT in near.flags and "close to its limit" in near.summary


def test_a_lane_past_its_limit_is_said_to_be_over_it_not_close() -> None:
    # A correction (or a lower limit) took the window past its limit: overrun_nanos.
    tallies = [StateTally(BookingState.CORRECTED, 1, 240_000)]
    over = summarize("recall", 200_000, DAY_US, DAY_US, tallies)
    assert Flag.NEAR_LIMIT in over.flags
    assert over.balance.overrun_nanos == 40_000
    assert "close to its limit" not in over.summary
    assert over.summary.startswith(
        "Lane recall has spent $0.00024 of $0.0002 in its 1d window, over its limit by $0.00004: "
    )
    at_limit = summarize("recall", 240_000, DAY_US, DAY_US, tallies)
    assert "close to its limit" in at_limit.summary


def test_a_few_estimates_in_a_large_budget_are_not_mostly_estimates() -> None:
    """Issue 26: estimates at 0.2% of the limit flagged the lane. The flag needs
    the estimates to be at least MOSTLY_ESTIMATES_FLOOR_PERCENT (5%) of the limit."""
    assert MOSTLY_ESTIMATES_FLOOR_PERCENT == 5
    limit = 500_000_000

    def flags(estimated_nanos: int) -> tuple[Flag, ...]:
        tallies = [
            StateTally(BookingState.SETTLED, 1, 10),
            StateTally(BookingState.SETTLED_UNKNOWN, 3, estimated_nanos),
        ]
        return summarize("recall", limit, DAY_US, DAY_US, tallies).flags

    assert flags(limit // 500) == ()  # 0.2% of the limit
    assert flags(limit // 20 - 1) == ()  # just under 5%
    assert flags(limit // 20) == (Flag.MOSTLY_ESTIMATES,)  # 5%
    under = summarize("recall", limit, DAY_US, DAY_US, [StateTally(BookingState.EXPIRED, 1, 99)])
    assert "mostly estimates" not in under.summary
