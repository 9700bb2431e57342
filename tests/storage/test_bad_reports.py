"""One bad report cannot jam a lane, on both databases, through a real server.

The incident's lane: $0.50 a day, JEV at $0.10 / $0.40 per million tokens; a
booking of 7,000 request bytes and 200 output tokens caps at 280 nanos.
"""

from __future__ import annotations

from typing import Any

import grpc

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb

INVALID = grpc.StatusCode.INVALID_ARGUMENT
CAP_7K_200 = 280
LIMIT_NANOS = 500_000_000
LARGEST_NANOS = 2**62


def reserve(harness: Any, reservation_id: str, lane: str = "recall") -> pb.ReserveResponse:
    return harness.reserve(reservation_id, lane=lane, request_bytes=7_000, max_output_tokens=200)


def event_count(harness: Any) -> int:
    return len(harness.events())


def test_implausible_usage_is_refused_and_the_booking_stays_open(harness: Any) -> None:
    harness.make_lane()
    assert reserve(harness, "x-5").cap_nanos == CAP_7K_200
    before = event_count(harness)
    # A client that misread a response: 10^9 tokens each way.
    misread = harness.fails(
        INVALID,
        lambda: harness.settle("x-5", input_tokens=10**9, output_tokens=10**9, http_status=200),
    )
    assert (misread.reason, misread.field) == ("OUTPUT_EXCEEDS_MAX_TOKENS", "output_tokens")
    too_dear = harness.fails(
        INVALID, lambda: harness.settle("x-5", input_tokens=10**9, output_tokens=200)
    )
    assert (too_dear.reason, too_dear.field) == ("CHARGE_EXCEEDS_CAP_MULTIPLE", "input_tokens")
    billed = harness.fails(INVALID, lambda: harness.settle("x-5", billed_nanos=500 * 10**9))
    assert (billed.reason, billed.field) == ("CHARGE_EXCEEDS_CAP_MULTIPLE", "billed_nanos")
    empty = harness.fails(INVALID, lambda: harness.settle("x-5", output_tokens=150))
    assert (empty.reason, empty.field) == ("SETTLE_WITHOUT_USAGE", "input_tokens")
    assert event_count(harness) == before, "a refusal writes no event"
    assert harness.booking("x-5").state == pb.OPEN
    assert harness.balance().available_nanos == LIMIT_NANOS - CAP_7K_200
    # Nobody settles it correctly: it ends at its hold, and can still be settled for real.
    harness.advance_us(121 * harness.MICROS_PER_SECOND)
    assert harness.booking("x-5").state == pb.EXPIRED
    late = harness.settle("x-5", input_tokens=1_800, output_tokens=150)
    assert (late.charged_nanos, late.state) == (240, pb.SETTLED)


def test_one_correction_unjams_a_lane(harness: Any) -> None:
    # A lane that set no bound on charges takes a $500 report for a $0.00028 call.
    harness.make_lane(max_charge_multiple=0)
    reserve(harness, "r-1")
    jammed = harness.settle("r-1", billed_nanos=500 * 10**9)
    assert jammed.balance.available_nanos == LIMIT_NANOS - 500 * 10**9
    assert reserve(harness, "r-2").decision == pb.DENIED
    corrected = harness.correct("r-1", 240, reason="the bill says $0.00024", correction_id="c-1")
    assert (corrected.previous_charge_nanos, corrected.charged_nanos) == (500 * 10**9, 240)
    assert corrected.state == pb.CORRECTED
    assert corrected.balance.available_nanos == LIMIT_NANOS - 240
    assert reserve(harness, "r-3").decision == pb.ADMITTED
    [event] = harness.events("recall", kinds=["corrected"])
    assert (event.reservation_id, event.amount_nanos, event.previous_amount_nanos) == (
        "r-1",
        240,
        500 * 10**9,
    )
    assert (event.correction_id, event.reason) == ("c-1", "the bill says $0.00024")
    assert event.grant_id, "the grant that made it"
    assert harness.booking("r-1").state == pb.CORRECTED
    # Idempotent by its id: the same correction again books nothing new.
    again = harness.correct("r-1", 240, reason="the bill says $0.00024", correction_id="c-1")
    assert (again.seq, again.charged_nanos) == (corrected.seq, 240)
    assert len(harness.events("recall", kinds=["corrected"])) == 1
    reused = harness.fails(
        grpc.StatusCode.ALREADY_EXISTS,
        lambda: harness.correct("r-1", 241, reason="the bill says $0.00024", correction_id="c-1"),
    )
    assert reused.reason == "CORRECTION_ID_REUSED"
    # The lane's own late report no longer overrides the operator.
    late = harness.fails(
        grpc.StatusCode.FAILED_PRECONDITION,
        lambda: harness.settle("r-1", input_tokens=1_800, output_tokens=150),
    )
    assert late.reason == "BOOKING_ALREADY_ENDED"


def test_a_correction_needs_an_ended_booking(harness: Any) -> None:
    harness.make_lane()
    reserve(harness, "open")
    still_open = harness.fails(
        grpc.StatusCode.FAILED_PRECONDITION, lambda: harness.correct("open", 0)
    )
    assert still_open.reason == "BOOKING_STILL_OPEN"
    missing = harness.fails(grpc.StatusCode.NOT_FOUND, lambda: harness.correct("nope", 0))
    assert missing.reason == "BOOKING_NOT_FOUND"
    no_reason = harness.fails(INVALID, lambda: harness.correct("open", 0, reason=""))
    assert no_reason.field == "reason"
    # Past its deadline it has ended (expired), sweeper or not.
    harness.advance_us(120 * harness.MICROS_PER_SECOND)
    assert harness.correct("open", 5, correction_id="c-late").charged_nanos == 5


def test_a_correction_shows_in_the_parent_budget_and_the_audit(harness: Any) -> None:
    harness.make_lane("team", limit_nanos=LIMIT_NANOS)
    harness.make_lane(parent="team", max_charge_multiple=0)
    reserve(harness, "r-1")
    harness.settle("r-1", billed_nanos=400_000_000)
    assert harness.balance("team").spent_nanos == 400_000_000
    harness.correct("r-1", 240)
    assert harness.balance("team").spent_nanos == 240
    audit = harness.ledger.GetAudit(pb.GetAuditRequest(lane="team"), timeout=30)
    assert (audit.corrected_count, audit.corrected_charged_nanos) == (1, 240)
    assert audit.real_charged_nanos == 240
    assert audit.succeeded_count == 0


def test_no_sum_overflows_for_a_lane(harness: Any) -> None:
    harness.make_lane(limit_nanos=LARGEST_NANOS, max_charge_multiple=0)
    reserve(harness, "a")
    reserve(harness, "b")
    first = harness.settle("a", billed_nanos=LARGEST_NANOS - CAP_7K_200)
    assert first.balance.spent_nanos == LARGEST_NANOS
    refused = harness.fails(INVALID, lambda: harness.settle("b", billed_nanos=LARGEST_NANOS))
    assert (refused.reason, refused.field) == ("SUM_OUT_OF_RANGE", "billed_nanos")
    # Nothing changed, and the lane still answers.
    assert harness.booking("b").state == pb.OPEN
    assert harness.balance().spent_nanos == LARGEST_NANOS
    assert harness.settle("b", input_tokens=1).charged_nanos == 1


def test_no_sum_overflows_for_a_parent(harness: Any) -> None:
    harness.make_lane("team", limit_nanos=LARGEST_NANOS)
    for lane in ("recall", "filter"):
        harness.make_lane(lane, limit_nanos=LARGEST_NANOS, parent="team", max_charge_multiple=0)
    reserve(harness, "a", lane="recall")
    reserve(harness, "b", lane="filter")
    harness.settle("a", lane="recall", billed_nanos=LARGEST_NANOS - CAP_7K_200)
    # The sibling's own window is small; the parent's would overflow.
    refused = harness.fails(
        INVALID, lambda: harness.settle("b", lane="filter", billed_nanos=LARGEST_NANOS)
    )
    assert (refused.reason, refused.field) == ("SUM_OUT_OF_RANGE", "billed_nanos")
    assert harness.balance("team").spent_nanos == LARGEST_NANOS
    audit = harness.ledger.GetAudit(pb.GetAuditRequest(lane="team"), timeout=30)
    assert audit.balance.spent_nanos == LARGEST_NANOS


def test_a_correction_cannot_overflow_a_window(harness: Any) -> None:
    harness.make_lane(limit_nanos=LARGEST_NANOS, max_charge_multiple=0)
    reserve(harness, "a")
    reserve(harness, "b")
    harness.settle("a", billed_nanos=LARGEST_NANOS - CAP_7K_200)
    harness.settle("b", input_tokens=10)
    refused = harness.fails(INVALID, lambda: harness.correct("b", LARGEST_NANOS))
    assert (refused.reason, refused.field) == ("SUM_OUT_OF_RANGE", "charge_nanos")


def test_cache_prices_follow_the_bill(harness: Any) -> None:
    # $3 / $15 per million, cached reads $0.30, cache writes $3.75.
    harness.make_lane(prices={"claude": (3_000_000, 15_000_000, 300_000, 3_750_000)})
    reserved = harness.reserve("c-1", model="claude", request_bytes=35_000, max_output_tokens=500)
    # 10,000 request tokens at the dearest input rate (writes) and 500 out.
    assert reserved.cap_nanos == 37_500 + 7_500
    settled = harness.settle(
        "c-1",
        input_tokens=10_000,
        cached_input_tokens=6_000,
        cache_write_tokens=2_000,
        output_tokens=500,
    )
    assert settled.charged_nanos == 6_000 + 1_800 + 7_500 + 7_500
    [event] = harness.events("recall", kinds=["settled"])
    assert (event.cached_input_tokens, event.cache_write_tokens) == (6_000, 2_000)
    lane = harness.admin.GetLane(pb.GetLaneRequest(lane="recall"), timeout=30)
    price = lane.prices["claude"]
    assert price.cached_input_nanos_per_million_tokens == 300_000
    assert price.cache_write_nanos_per_million_tokens == 3_750_000
    assert lane.max_charge_multiple == 100


def test_reconcile_lets_the_bill_win_only_when_asked(harness: Any) -> None:
    harness.make_lane()
    reserve(harness, "r-1")
    harness.settle("r-1", input_tokens=2_000, output_tokens=200)  # 280 nanos
    export = b"reservation_id,billed_nanos\nr-1,250\n"

    def reconcile(**fields: Any) -> pb.ReconcileResponse:
        request = pb.ReconcileRequest(
            format=pb.ReconcileRequest.CSV, content=export, default_lane="recall", **fields
        )
        response: pb.ReconcileResponse = harness.ledger.Reconcile(request, timeout=30)
        return response

    flagged = reconcile()
    assert (flagged.disagreement_count, flagged.replaced_count) == (1, 0)
    assert harness.booking("r-1").amount_nanos == 280
    replaced = reconcile(bill_wins=True)
    assert (replaced.replaced_count, replaced.applied) == (1, True)
    assert [row.status for row in replaced.rows] == ["replaced"]
    assert (harness.booking("r-1").amount_nanos, harness.booking("r-1").state) == (
        250,
        pb.CORRECTED,
    )
    [event] = harness.events("recall", kinds=["corrected"])
    assert (event.previous_amount_nanos, event.amount_nanos) == (280, 250)
    assert event.grant_id and event.correction_id
    assert reconcile(bill_wins=True).matched_count == 1, "a second run changes nothing"
