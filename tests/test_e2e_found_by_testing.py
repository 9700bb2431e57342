"""Small faults a new user found (issue 21): every event kind can be filtered,
a deeply nested usage export is bad input, the test clock never runs back past
the log, and a lane cannot bring a parent's window past the largest sum."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from ledger_service.domain.clock import TEST_CLOCK_LATEST_US
from ledger_service.domain.events import EventKind
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
def harness(ledger_harness: Any) -> Any:
    ledger_harness.make_lane(max_charge_multiple=0)
    return ledger_harness


def one_of_each_kind(harness: Any) -> None:
    harness.reserve("settled")
    harness.settle("settled", input_tokens=1_000)
    harness.reserve("refunded")
    harness.refund("refunded")
    harness.reserve("expired", ttl_us=1_000_000)
    harness.reserve("unknown")
    harness.settle("unknown", pb.UNKNOWN)
    harness.reserve("denied", request_bytes=10**11)
    harness.advance_us(2_000_000)
    harness.correct("settled", 50)
    export = b"reservation_id,billed_nanos\nunknown,7\n"
    reconciled = harness.ledger.Reconcile(
        pb.ReconcileRequest(format=pb.ReconcileRequest.CSV, content=export, default_lane="recall"),
        timeout=30,
    )
    assert reconciled.corrected_count == 1


def test_every_event_kind_can_be_filtered(harness: Any) -> None:
    one_of_each_kind(harness)
    harness.settle("expired", input_tokens=10)  # expires it first, then settles it late
    for kind in EventKind:
        found = harness.events("recall", kinds=[kind.value])
        assert found, f"no {kind.value} event to filter"
        assert {event.kind for event in found} == {kind.value}
    unknown = harness.fails(INVALID, lambda: harness.events("recall", kinds=["spent"]))
    assert unknown.field == "kinds"
    assert "corrected" in unknown.details, "the refusal lists the kinds there are"


def test_the_test_clock_keeps_every_answer_a_valid_timestamp(harness: Any) -> None:
    """Set to 9999-12-31, the clock would answer a hold's expires_at past the
    last instant a protobuf Timestamp holds, which other languages' clients refuse."""
    last_second_us = 253_402_300_799 * harness.MICROS_PER_SECOND
    refused = harness.fails(INVALID, lambda: harness.set_time_us(last_second_us))
    assert refused.field == "seconds" and "9998-12-23" in refused.details
    latest_us = harness.set_time_us(TEST_CLOCK_LATEST_US)
    assert harness.advance_us(0) == latest_us
    refused = harness.fails(INVALID, lambda: harness.advance_us(1))
    assert refused.field == "seconds" and "9998-12-23" in refused.details
    assert harness.now_us() == latest_us, "a refused Advance leaves the clock where it was"
    admitted = harness.reserve("r-late")
    assert admitted.decision == pb.ADMITTED
    assert admitted.expires_at.seconds <= 253_402_300_799


def test_the_test_clock_starts_no_earlier_than_the_epoch(harness: Any) -> None:
    refused = harness.fails(INVALID, lambda: harness.set_time_us(-1))
    assert refused.field == "seconds" and "1970-01-01" in refused.details


def test_a_deeply_nested_export_is_a_bad_row_not_internal(harness: Any) -> None:
    harness.reserve("r1")
    nested = b"[" * 100_000 + b"]" * 100_000
    export = b'{"reservation_id": "r1", "billed_nanos": 5}\n' + nested + b"\n"
    response = harness.ledger.Reconcile(
        pb.ReconcileRequest(
            format=pb.ReconcileRequest.JSONL, content=export, default_lane="recall"
        ),
        timeout=30,
    )
    assert (response.applied, response.bad_count) == (False, 1)
    [bad] = [row for row in response.rows if row.status == "bad"]
    assert (bad.line, bad.field) == (2, "content")
    assert "nested" in bad.message


def test_the_test_clock_never_runs_back_past_the_log(harness: Any) -> None:
    harness.reserve("r1")
    last_us = harness.START_US
    refused = harness.fails(INVALID, lambda: harness.set_time_us(last_us - 1))
    assert "before the last recorded event" in refused.details
    assert harness.now_us() == last_us, "a refused SetTime leaves the clock where it was"
    fifty_six_years_us = 56 * 366 * 86_400 * harness.MICROS_PER_SECOND
    harness.fails(INVALID, lambda: harness.set_time_us(last_us - fifty_six_years_us))
    # To the instant of the last event, and forward, it may go.
    assert harness.set_time_us(last_us) == last_us
    assert harness.set_time_us(last_us + 5) == last_us + 5


def test_a_lane_cannot_take_a_parent_past_the_largest_sum(harness: Any) -> None:
    largest = 2**62
    for lane in ("a", "b"):
        harness.make_lane(lane, limit_nanos=largest, max_charge_multiple=0)
        harness.reserve(f"{lane}-1", lane=lane)
        harness.settle(f"{lane}-1", lane=lane, billed_nanos=largest // 2 + 1)
    harness.make_lane("team", limit_nanos=largest)
    harness.make_lane("a", limit_nanos=largest, max_charge_multiple=0, parent="team")
    refused = harness.fails(
        INVALID,
        lambda: harness.make_lane("b", limit_nanos=largest, max_charge_multiple=0, parent="team"),
    )
    assert (refused.reason, refused.field) == ("SUM_OUT_OF_RANGE", "lane.parent")
    assert harness.balance("team").spent_nanos == largest // 2 + 1
    assert not harness.admin.GetLane(pb.GetLaneRequest(lane="b"), timeout=30).parent


def test_a_reconcile_past_the_largest_sum_names_its_line_once(harness: Any) -> None:
    largest = 2**62
    harness.make_lane("big", limit_nanos=largest, max_charge_multiple=0)
    for rid in ("a", "b"):
        harness.reserve(rid, lane="big")
        harness.settle(rid, lane="big", outcome=pb.UNKNOWN)
    export = f"reservation_id,billed_nanos\na,{largest // 2}\nb,{largest // 2 + 1}\n".encode()
    request = pb.ReconcileRequest(
        format=pb.ReconcileRequest.CSV, content=export, default_lane="big"
    )
    refused = harness.fails(INVALID, lambda: harness.ledger.Reconcile(request, timeout=30))
    assert (refused.reason, refused.field) == ("SUM_OUT_OF_RANGE", "content")
    assert refused.details.startswith("content: line 3: would take a sum past")


@pytest.mark.parametrize("aged_out", [False, True])
def test_a_reconcile_row_priced_past_the_largest_amount_names_its_line(
    harness: Any, aged_out: bool
) -> None:
    """A row's tokens priced past 2^62 are one amount too large, not a sum: the
    refusal names the row's line and its tokens, in a window or out of every
    window (where no window's sum is moved and only the report's total was)."""
    dearest = 10**15
    harness.make_lane(
        "dear",
        limit_nanos=2**62,
        prices={"jev": (dearest, dearest)},
        window_seconds=1,
        hold_ttl_seconds=1,
    )
    harness.reserve("u", lane="dear", request_bytes=10, max_output_tokens=0)
    harness.settle("u", lane="dear", outcome=pb.UNKNOWN)
    if aged_out:
        harness.advance_us(2_000_000)
    export = b"reservation_id,input_tokens\nu,1000000000000\n"
    request = pb.ReconcileRequest(
        format=pb.ReconcileRequest.CSV, content=export, default_lane="dear"
    )
    refused = harness.fails(INVALID, lambda: harness.ledger.Reconcile(request, timeout=30))
    assert refused.field == "content"
    assert refused.details.startswith("content: line 2: input_tokens"), refused.details
    assert harness.booking("u", lane="dear").state == pb.SETTLED_UNKNOWN


def test_a_reconcile_row_priced_past_the_largest_amount_on_an_open_booking_is_reported_open(
    harness: Any,
) -> None:
    """The price is refused only where it is used: a row that an open booking
    answers is reported open, whatever its tokens would cost (the whole file
    was refused when rows were priced before the booking's state was read)."""
    dearest = 10**15
    harness.make_lane(
        "dear",
        limit_nanos=2**62,
        prices={"jev": (dearest, dearest)},
        window_seconds=3600,
        hold_ttl_seconds=600,
    )
    harness.reserve("o", lane="dear", request_bytes=10, max_output_tokens=0)
    export = b"reservation_id,input_tokens\no,1000000000000\n"
    request = pb.ReconcileRequest(
        format=pb.ReconcileRequest.CSV, content=export, default_lane="dear", dry_run=True
    )
    response = harness.ledger.Reconcile(request, timeout=30)
    assert [row.status for row in response.rows] == ["open"]
    assert response.bad_count == 0


def test_a_repeat_after_a_correction_returns_the_first_answer(harness: Any) -> None:
    """The contract: a repeated Settle or Refund returns the first answer. A lane
    retrying a Settle whose answer it lost must not be told the booking ended
    because an operator corrected it meanwhile; the correction still stands."""
    harness.reserve("s")
    first_settle = harness.settle("s", input_tokens=2_000, output_tokens=200)
    harness.correct("s", 100, correction_id="c-s")
    harness.reserve("r")
    first_refund = harness.refund("r", 429)
    harness.correct("r", 100, correction_id="c-r")
    assert harness.settle("s", input_tokens=2_000, output_tokens=200) == first_settle
    assert harness.refund("r", 429) == first_refund
    assert harness.booking("s").amount_nanos == harness.booking("r").amount_nanos == 100


def test_another_settle_or_refund_after_a_correction_says_the_correction_stands(
    harness: Any,
) -> None:
    harness.reserve("s")
    harness.settle("s", input_tokens=2_000, output_tokens=200)
    harness.correct("s", 100, correction_id="c-s")
    harness.reserve("r")
    harness.refund("r", 429)
    harness.correct("r", 100, correction_id="c-r")
    for call in (
        lambda: harness.settle("s", input_tokens=2_000, output_tokens=201),  # other usage
        lambda: harness.settle("s", outcome=pb.UNKNOWN),
        lambda: harness.refund("s", 429),
        lambda: harness.settle("r", input_tokens=2_000, output_tokens=200),
    ):
        refused = harness.fails(grpc.StatusCode.FAILED_PRECONDITION, call)
        assert refused.reason == "BOOKING_ALREADY_ENDED"
    assert harness.booking("s").amount_nanos == harness.booking("r").amount_nanos == 100


def test_a_repeat_after_the_bill_replaced_the_charge_returns_the_first_answer(
    harness: Any,
) -> None:
    harness.reserve("s")
    first = harness.settle("s", input_tokens=2_000, output_tokens=200)
    export = b"reservation_id,billed_nanos\ns,123\n"
    harness.ledger.Reconcile(
        pb.ReconcileRequest(
            format=pb.ReconcileRequest.CSV, content=export, default_lane="recall", bill_wins=True
        ),
        timeout=30,
    )
    assert harness.booking("s").amount_nanos == 123
    assert harness.settle("s", input_tokens=2_000, output_tokens=200) == first
    assert harness.booking("s").amount_nanos == 123


@pytest.mark.parametrize("reservation_id", ["a b", "a\x00b", "é", "tab\there", "\x7f", "x" * 201])
def test_get_booking_refuses_an_id_no_move_could_have_booked(
    harness: Any, reservation_id: str
) -> None:
    """The same rule as every move's: 1 to 200 printable ASCII characters, no spaces."""
    refused = harness.fails(INVALID, lambda: harness.booking(reservation_id))
    assert refused.field == "reservation_id"


def test_unknown_csv_columns_are_named_within_a_status_message(harness: Any) -> None:
    # Found by fuzzing: the refusal echoed every unknown column in full, so a
    # 20 kB header name made the status message pass gRPC's metadata limit and
    # the caller got RESOURCE_EXHAUSTED with no reason, on every retry.
    export = b"reservation_id," + b"x" * 20_000 + b",y\nr1,1,2\n"
    refused = harness.fails(
        INVALID,
        lambda: harness.ledger.Reconcile(
            pb.ReconcileRequest(
                format=pb.ReconcileRequest.CSV, content=export, default_lane="recall"
            ),
            timeout=30,
        ),
    )
    assert (refused.reason, refused.field) == ("INVALID_ARGUMENT", "content")
    assert "unknown CSV columns" in refused.details
    assert len(refused.details) < 1_000


def test_unknown_jsonl_keys_as_long_as_the_request_still_get_an_answer(harness: Any) -> None:
    # Found by fuzzing: a bad row's message echoed its unknown key in full, so
    # a key that filled the request made the answer pass the 1 MiB message
    # limit: RESOURCE_EXHAUSTED ("Sent message larger than max"), no reason.
    key = "k" * (1_048_550 - 8)
    export = b'{"' + key.encode() + b'": 1}\n'
    response = harness.ledger.Reconcile(
        pb.ReconcileRequest(
            format=pb.ReconcileRequest.JSONL, content=export, default_lane="recall"
        ),
        timeout=30,
    )
    assert (response.applied, response.bad_count) == (False, 1)
    [bad] = response.rows
    assert (bad.line, bad.field) == (1, "content")
    assert bad.message.startswith("unknown keys: kkk")
    assert len(bad.message) < 1_000


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_reconcile_for_an_unknown_lane_is_not_found(harness: Any, dry_run: bool) -> None:
    """Its rows were each reported "no such booking in this lane" and the call
    succeeded: the lane is refused up front, as every other RPC refuses it."""
    export = b"reservation_id,billed_nanos\nunknown,7\n"
    with pytest.raises(grpc.RpcError) as refused:
        harness.ledger.Reconcile(
            pb.ReconcileRequest(
                format=pb.ReconcileRequest.CSV,
                content=export,
                default_lane="nosuch",
                dry_run=dry_run,
            ),
            timeout=30,
        )
    error = refused.value
    assert isinstance(error, grpc.Call)
    assert error.code() is grpc.StatusCode.NOT_FOUND
    assert dict(error.trailing_metadata() or ())["ledger-reason"] == "LANE_NOT_FOUND"
    assert "'nosuch'" in (error.details() or "")
