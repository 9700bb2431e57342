"""Reserve, Settle and Refund through real gRPC stubs, with every error code the
contract lists and the idempotent repeats.

The recall lane: $0.50 (500_000_000 nanos), JEV at 100_000 / 400_000 nanos per
million input / output tokens, 3.5 bytes per token. A Reserve of 10_000 bytes
and 500 output tokens caps at ceil(2858 * 0.1) + 500 * 0.4 = 286 + 200 = 486.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2, timestamp_pb2

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb

CAP_10K_500 = 486
# Caps at 8_772 nanos with 500 output tokens: room for any estimate these tests give.
BIG_BYTES = 300_000
NOT_FOUND = grpc.StatusCode.NOT_FOUND
INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


@pytest.fixture
def harness(ledger_harness: Any) -> Any:
    ledger_harness.make_lane()
    return ledger_harness


def _already_reserved(first: pb.ReserveResponse) -> pb.ReserveResponse:
    """The first answer as a repeat of its Reserve gets it."""
    repeat = pb.ReserveResponse()
    repeat.CopyFrom(first)
    repeat.already_reserved = True
    return repeat


# Reserve ------------------------------------------------------------------------


def test_reserve_admits_with_the_cap_as_hold(harness: Any) -> None:
    response = harness.reserve("r1")
    now = harness.START_US
    assert response.decision == pb.ADMITTED
    assert (response.cap_nanos, response.hold_nanos) == (CAP_10K_500, CAP_10K_500)
    assert harness.micros_of(response.reserved_at) == now
    assert harness.micros_of(response.expires_at) == now + 120 * harness.MICROS_PER_SECOND
    assert not response.HasField("retry_after")
    balance = response.balance
    assert (balance.spent_nanos, balance.held_nanos, balance.charged_nanos) == (486, 486, 0)
    assert balance.available_nanos == harness.RECALL_LIMIT_NANOS - 486
    assert balance.open_bookings == 1
    assert harness.micros_of(balance.as_of) == now
    booking = harness.booking("r1")
    assert booking.state == pb.OPEN
    assert booking.amount_nanos == 486
    assert harness.micros_of(booking.ages_out_at) == now + 86_400 * harness.MICROS_PER_SECOND


def test_cap_is_exact_for_a_large_request(harness: Any) -> None:
    # 300_000 bytes / 3.5 = 85714.29 -> 85715 tokens -> ceil(8571.5) = 8572; 1000 out -> 400.
    assert harness.reserve("big", request_bytes=300_000, max_output_tokens=1000).cap_nanos == 8972


def test_cap_uses_bytes_per_token_and_overhead_tokens(harness: Any) -> None:
    harness.make_lane("strict", bytes_per_token=1.0, overhead_tokens=11)
    # 1.0 byte per token is the hard bound: 10 bytes + 11 overhead = 21 tokens -> ceil(2.1) = 3.
    response = harness.reserve("s1", lane="strict", request_bytes=10, max_output_tokens=1)
    assert response.cap_nanos == 3 + 1


def test_hold_is_min_of_estimate_and_cap(harness: Any) -> None:
    assert harness.reserve("low", estimate_nanos=100).hold_nanos == 100
    high = harness.reserve("high", estimate_nanos=10**9)
    assert (high.hold_nanos, high.cap_nanos) == (CAP_10K_500, CAP_10K_500)
    assert harness.balance().held_nanos == 100 + CAP_10K_500


def test_a_repeated_reserve_returns_the_first_answer_and_books_nothing(harness: Any) -> None:
    first = harness.reserve("r1", estimate_nanos=300)
    harness.reserve("r2", estimate_nanos=50)
    harness.advance_us(7)
    again = harness.reserve("r1", estimate_nanos=300)
    # The whole first answer, including the balance recorded with it, said to
    # be an earlier Reserve's answer.
    assert not first.already_reserved
    assert again == _already_reserved(first)
    assert harness.balance().held_nanos == 350
    assert [event.kind for event in harness.events("recall", reservation_id="r1")] == ["reserved"]


def test_a_denied_reserve_is_an_answer_and_its_repeat_is_the_same_denial(harness: Any) -> None:
    harness.make_lane(limit_nanos=1000)
    harness.reserve("a", estimate_nanos=900, request_bytes=BIG_BYTES)
    denied = harness.reserve("b", estimate_nanos=200)
    assert denied.decision == pb.DENIED
    assert denied.denial_reason == pb.BUDGET_EXHAUSTED
    assert denied.reason
    assert denied.balance.spent_nanos == 900
    harness.settle("a", pb.SUCCEEDED, input_tokens=10)  # frees 899 nanos
    again = harness.reserve("b", estimate_nanos=200)
    assert not denied.already_reserved
    assert again == _already_reserved(denied), "a denial is final for its id"
    assert harness.reserve("b2", estimate_nanos=200).decision == pb.ADMITTED
    assert [event.kind for event in harness.events("recall", reservation_id="b")] == ["denied"]
    rejected = harness.booking("b")
    assert rejected.state == pb.REJECTED
    assert rejected.amount_nanos == 0
    # It never held and never counts: no deadline, nothing to age out.
    assert not rejected.HasField("expires_at")
    assert not rejected.HasField("ages_out_at")
    assert harness.booking("a").HasField("expires_at")


def test_reused_id_with_other_arguments_is_already_exists(harness: Any) -> None:
    harness.reserve("r1", estimate_nanos=300, ttl_us=60 * harness.MICROS_PER_SECOND)
    for change in (
        {"estimate_nanos": 301},
        {"estimate_nanos": None},
        {"request_bytes": 10_001},
        {"max_output_tokens": 501},
        {"ttl_us": 61 * harness.MICROS_PER_SECOND},
    ):
        arguments = {"estimate_nanos": 300, "ttl_us": 60 * harness.MICROS_PER_SECOND, **change}
        failure = harness.fails(
            grpc.StatusCode.ALREADY_EXISTS,
            lambda arguments=arguments: harness.reserve("r1", **arguments),
        )
        assert failure.reason == "RESERVATION_ID_REUSED"


def test_the_same_id_on_another_lane_is_another_booking(harness: Any) -> None:
    harness.make_lane("filter")
    harness.reserve("r1", estimate_nanos=100)
    other = harness.reserve("r1", lane="filter", request_bytes=1, max_output_tokens=1)
    assert other.decision == pb.ADMITTED
    assert other.hold_nanos == 2


# Settle -------------------------------------------------------------------------


def test_succeeded_charges_the_real_cost(harness: Any) -> None:
    harness.reserve("r1")
    settled = harness.settle("r1", input_tokens=1_000, output_tokens=101)
    # ceil(100.0) + ceil(40.4)
    assert settled.charged_nanos == 141
    assert settled.state == pb.SETTLED
    assert (settled.balance.held_nanos, settled.balance.charged_nanos) == (0, 141)
    assert harness.booking("r1").amount_nanos == 141


def test_succeeded_with_a_billed_amount_charges_it(harness: Any) -> None:
    harness.reserve("r1")
    assert harness.settle("r1", input_tokens=1, billed_nanos=333).charged_nanos == 333


def test_succeeded_above_the_hold_is_an_overrun_reported_not_hidden(harness: Any) -> None:
    harness.make_lane(limit_nanos=1000)
    harness.reserve("r1", estimate_nanos=900, request_bytes=BIG_BYTES)
    settled = harness.settle("r1", billed_nanos=1_250)
    assert settled.charged_nanos == 1_250
    balance = harness.balance()
    assert balance.spent_nanos == 1_250
    assert balance.available_nanos == -250
    assert balance.overrun_nanos == 250
    # Nothing fits while the lane is over its limit, not even a zero hold.
    assert harness.reserve("r2", estimate_nanos=0).decision == pb.DENIED


@pytest.mark.parametrize(("billed", "charge"), [(None, 300), (120, 120), (10_000, 300)])
def test_unknown_charges_the_hold_or_a_lower_figure(
    harness: Any, billed: int | None, charge: int
) -> None:
    harness.reserve("r1", estimate_nanos=300)
    settled = harness.settle("r1", pb.UNKNOWN, billed_nanos=billed, http_status=504)
    assert settled.charged_nanos == charge
    assert settled.state == pb.SETTLED_UNKNOWN
    assert harness.booking("r1").state == pb.SETTLED_UNKNOWN


def test_a_repeated_settle_returns_the_first_answer(harness: Any) -> None:
    harness.reserve("r1")
    first = harness.settle("r1", input_tokens=1_000)
    harness.reserve("r2")
    harness.advance_us(3)
    again = harness.settle("r1", input_tokens=1_000)
    assert again == first
    assert [event.kind for event in harness.events("recall", reservation_id="r1")] == [
        "reserved",
        "settled",
    ]


def test_a_different_succeeded_usage_is_failed_precondition(harness: Any) -> None:
    harness.reserve("r1")
    harness.settle("r1", input_tokens=1_000)
    failure = harness.fails(PRECONDITION, lambda: harness.settle("r1", input_tokens=1_001))
    assert failure.reason == "BOOKING_ALREADY_ENDED"


def test_a_late_success_replaces_an_unknown_charge(harness: Any) -> None:
    harness.reserve("r1", estimate_nanos=300)
    harness.settle("r1", pb.UNKNOWN)
    corrected = harness.settle("r1", input_tokens=1_000)
    assert corrected.charged_nanos == 100
    assert corrected.state == pb.SETTLED
    assert harness.balance().charged_nanos == 100
    settled = harness.events("recall", reservation_id="r1", kinds=["settled"])
    assert [(event.previous_amount_nanos, event.amount_nanos) for event in settled] == [
        (300, 300),
        (100 * 3, 100),
    ]


def test_unknown_after_unknown_changes_nothing(harness: Any) -> None:
    harness.reserve("r1", estimate_nanos=300)
    harness.settle("r1", pb.UNKNOWN)
    again = harness.settle("r1", pb.UNKNOWN, billed_nanos=10)
    assert again.charged_nanos == 300
    assert again.state == pb.SETTLED_UNKNOWN
    assert len(harness.events("recall", reservation_id="r1", kinds=["settled"])) == 1


# Refund -------------------------------------------------------------------------


@pytest.mark.parametrize(("status", "reason"), [(403, ""), (429, "rate limited"), (0, "unsent")])
def test_refund_charges_zero(harness: Any, status: int, reason: str) -> None:
    harness.reserve("r1")
    refunded = harness.refund("r1", status, reason=reason)
    assert (refunded.balance.spent_nanos, refunded.balance.open_bookings) == (0, 0)
    booking = harness.booking("r1")
    assert (booking.state, booking.amount_nanos) == (pb.REFUNDED, 0)
    (event,) = harness.events("recall", reservation_id="r1", kinds=["refunded"])
    assert (event.amount_nanos, event.previous_amount_nanos) == (0, CAP_10K_500)
    assert (event.http_status, event.reason) == (status, reason)


def test_refund_after_unknown_is_refused(harness: Any) -> None:
    """Refund after settle contradicts the ending, whatever the settle's outcome."""
    harness.reserve("r1", estimate_nanos=300)
    harness.settle("r1", pb.UNKNOWN)
    failure = harness.fails(PRECONDITION, lambda: harness.refund("r1", 403))
    assert failure.reason == "BOOKING_ALREADY_ENDED"
    assert harness.balance().spent_nanos == 300


def test_a_repeated_refund_returns_the_first_answer_whatever_its_reason(harness: Any) -> None:
    harness.reserve("r1")
    first = harness.refund("r1", 403)
    harness.reserve("r2")
    assert harness.refund("r1", 0, reason="another story") == first
    assert len(harness.events("recall", reservation_id="r1", kinds=["refunded"])) == 1


def test_refund_after_settle_and_settle_after_refund_fail(harness: Any) -> None:
    harness.reserve("settled")
    harness.settle("settled", input_tokens=5)
    failure = harness.fails(PRECONDITION, lambda: harness.refund("settled", 403))
    assert failure.reason == "BOOKING_ALREADY_ENDED"
    harness.reserve("refunded")
    harness.refund("refunded", 403)
    for outcome in (pb.SUCCEEDED, pb.UNKNOWN):
        failure = harness.fails(
            PRECONDITION, lambda outcome=outcome: harness.settle("refunded", outcome)
        )
        assert failure.reason == "BOOKING_ALREADY_ENDED"


def test_settle_or_refund_of_a_denied_id_is_failed_precondition(harness: Any) -> None:
    harness.make_lane(limit_nanos=100)
    assert harness.reserve("d").decision == pb.DENIED
    for call in (lambda: harness.settle("d", input_tokens=1), lambda: harness.refund("d", 403)):
        assert harness.fails(PRECONDITION, call).reason == "BOOKING_WAS_DENIED"


# NOT_FOUND -------------------------------------------------------------------------


def test_unknown_lane_is_not_found(harness: Any) -> None:
    for call in (
        lambda: harness.reserve("r1", lane="nope"),
        lambda: harness.settle("r1", lane="nope"),
        lambda: harness.refund("r1", lane="nope"),
        lambda: harness.balance("nope"),
        lambda: harness.booking("r1", lane="nope"),
        lambda: harness.admin.GetLane(pb.GetLaneRequest(lane="nope")),
        lambda: harness.events("nope"),
    ):
        assert harness.fails(NOT_FOUND, call).reason == "LANE_NOT_FOUND"


def test_unknown_booking_is_not_found(harness: Any) -> None:
    for call in (
        lambda: harness.settle("ghost", input_tokens=1),
        lambda: harness.settle("ghost", pb.UNKNOWN),
        lambda: harness.refund("ghost", 403),
        lambda: harness.booking("ghost"),
    ):
        assert harness.fails(NOT_FOUND, call).reason == "BOOKING_NOT_FOUND"


def test_another_lanes_booking_is_not_found(harness: Any) -> None:
    harness.make_lane("filter")
    harness.reserve("theirs", lane="filter")
    for call in (
        lambda: harness.settle("theirs", input_tokens=1),
        lambda: harness.refund("theirs", 403),
        lambda: harness.booking("theirs"),
    ):
        assert harness.fails(NOT_FOUND, call).reason == "BOOKING_NOT_FOUND"
    assert harness.booking("theirs", lane="filter").state == pb.OPEN


# INVALID_ARGUMENT ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"request_bytes": -1}, "request_bytes"),
        ({"max_output_tokens": -1}, "max_output_tokens"),
        ({"estimate_nanos": -1}, "estimate_nanos"),
        ({"ttl_us": -1_000_000}, "ttl"),
        ({"model": "unpriced"}, "model"),
    ],
)
def test_reserve_refuses_bad_values_naming_the_field(
    harness: Any, arguments: dict[str, Any], field: str
) -> None:
    failure = harness.fails(INVALID, lambda: harness.reserve("r1", **arguments))
    assert failure.field == field
    assert not harness.events("recall", reservation_id="r1")


def test_reserve_ttl_above_the_lane_hold_ttl_is_invalid(harness: Any) -> None:
    harness.make_lane(hold_ttl_seconds=60)
    failure = harness.fails(
        INVALID, lambda: harness.reserve("r1", ttl_us=60 * harness.MICROS_PER_SECOND + 1)
    )
    assert (failure.field, failure.reason) == ("ttl", "TTL_EXCEEDS_HOLD_TTL")
    assert harness.reserve("r1", ttl_us=60 * harness.MICROS_PER_SECOND).decision == pb.ADMITTED


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"input_tokens": -1}, "input_tokens"),
        ({"output_tokens": -1}, "output_tokens"),
        ({"billed_nanos": -1}, "billed_nanos"),
        ({"outcome": 7}, "outcome"),
        ({"outcome": pb.OUTCOME_UNSPECIFIED}, "outcome"),
        ({"http_status": 403}, "http_status"),
        ({"http_status": -1}, "http_status"),
    ],
)
def test_settle_refuses_bad_values_naming_the_field(
    harness: Any, arguments: dict[str, Any], field: str
) -> None:
    harness.reserve("r1")
    failure = harness.fails(INVALID, lambda: harness.settle("r1", **arguments))
    assert failure.field == field
    assert harness.booking("r1").state == pb.OPEN


@pytest.mark.parametrize(
    ("status", "reason", "field"),
    [(-1, "x", "http_status"), (500, "", "http_status"), (0, "", "reason")],
)
def test_refund_refuses_bad_values_naming_the_field(
    harness: Any, status: int, reason: str, field: str
) -> None:
    harness.reserve("r1")
    failure = harness.fails(INVALID, lambda: harness.refund("r1", status, reason=reason))
    assert failure.field == field


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"limit_nanos": -1}, "lane.limit_nanos"),
        ({"overhead_tokens": -1}, "lane.overhead_tokens"),
        ({"prices": {"jev": (-1, 1)}}, "lane.prices[jev].input_nanos_per_million_tokens"),
        ({"prices": {"jev": (1, -1)}}, "lane.prices[jev].output_nanos_per_million_tokens"),
        ({"expire_charge": 7}, "lane.expire_charge"),
        ({"bytes_per_token": -3.5}, "lane.bytes_per_token"),
        ({"window_seconds": -1}, "lane.window"),
        ({"hold_ttl_seconds": -1}, "lane.hold_ttl"),
    ],
)
def test_put_lane_refuses_bad_values_naming_the_field(
    harness: Any, fields: dict[str, Any], field: str
) -> None:
    failure = harness.fails(INVALID, lambda: harness.make_lane("bad", **fields))
    assert failure.field == field


def test_the_test_clock_refuses_instants_finer_than_a_microsecond(harness: Any) -> None:
    before = harness.now_us()
    for call in (
        lambda: harness.clock.Advance(duration_pb2.Duration(nanos=1)),
        lambda: harness.clock.SetTime(timestamp_pb2.Timestamp(seconds=2_000_000_000, nanos=500)),
    ):
        assert harness.fails(INVALID, call).field == "nanos"
    assert harness.now_us() == before
    for call in (
        lambda: harness.clock.Advance(duration_pb2.Duration(seconds=1, nanos=-500)),
        lambda: harness.clock.SetTime(timestamp_pb2.Timestamp(seconds=2_000_000_000, nanos=-5)),
        lambda: harness.clock.SetTime(timestamp_pb2.Timestamp(seconds=2_000_000_000, nanos=-1000)),
        lambda: harness.clock.SetTime(timestamp_pb2.Timestamp(seconds=2_000_000_000, nanos=10**9)),
    ):
        failure = harness.fails(INVALID, call)
        assert "not a valid" in failure.details
        assert failure.field == "nanos"
    harness.clock.Advance(duration_pb2.Duration(nanos=1000))
    assert harness.now_us() == before + 1


def test_durations_finer_than_a_microsecond_are_refused_not_cut(harness: Any) -> None:
    """1 ns is no ttl the ledger can hold, and 1.5 us would be held as 1 us:
    both are refused naming the field, as the test clock refuses them."""
    for nanos in (1, 1_500):
        request = pb.ReserveRequest(
            lane="recall", reservation_id="fine", model="jev", request_bytes=10, max_output_tokens=5
        )
        request.ttl.CopyFrom(duration_pb2.Duration(nanos=nanos))
        failure = harness.fails(INVALID, lambda request=request: harness.ledger.Reserve(request))
        assert (failure.field, "whole microseconds" in failure.details) == ("ttl", True)
    assert not harness.events("recall", reservation_id="fine")
    lane = harness.lane_message("recall")
    lane.window.CopyFrom(duration_pb2.Duration(seconds=3600, nanos=1))
    put = pb.PutLaneRequest(lane=lane)
    assert harness.fails(INVALID, lambda: harness.admin.PutLane(put)).field == "lane.window"


def test_negative_durations_and_paging_values_are_invalid(harness: Any) -> None:
    failure = harness.fails(
        INVALID, lambda: harness.clock.Advance(duration_pb2.Duration(seconds=-1))
    )
    assert failure.field
    failure = harness.fails(
        INVALID, lambda: harness.ledger.ListEvents(pb.ListEventsRequest(page_size=-1))
    )
    assert failure.field == "page_size"
    failure = harness.fails(
        INVALID, lambda: harness.ledger.ListEvents(pb.ListEventsRequest(after_seq=-1))
    )
    assert failure.field == "after_seq"
    # A filter no booking can match is a mistake, not an empty page.
    failure = harness.fails(
        INVALID, lambda: harness.ledger.ListEvents(pb.ListEventsRequest(reservation_id="a b"))
    )
    assert failure.field == "reservation_id"
