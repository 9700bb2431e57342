"""A lane's policy changed while it has bookings open and ended in its window,
through real gRPC stubs: what the docs leave to a choice (docs/semantics.md,
"A lane's policy" and "Dating and the rolling window")."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb

SECOND_US = 1_000_000
# 300_000 bytes and 500 output tokens cap at 8_772 nanos: room for any estimate here.
BIG_BYTES = 300_000


@pytest.fixture
def unswept(start_ledger_server: Any, harness_for: Any) -> Any:
    """A harness on a server whose sweeper never runs within a test."""
    harness = harness_for(start_ledger_server(sweep_interval_seconds=3600))
    harness.make_lane()
    return harness


def test_a_model_taken_off_the_price_list_still_ends_its_bookings(unswept: Any) -> None:
    for rid in ("settled", "unknown", "refunded", "expired"):
        unswept.reserve(rid, request_bytes=BIG_BYTES)
    unswept.make_lane(prices={"other": (1_000_000, 4_000_000)})
    # New bookings of it are refused; a repeat of an old Reserve gets its first answer.
    refused = unswept.fails(grpc.StatusCode.INVALID_ARGUMENT, lambda: unswept.reserve("new"))
    assert (refused.reason, refused.field) == ("UNKNOWN_MODEL", "model")
    assert unswept.reserve("settled", request_bytes=BIG_BYTES).hold_nanos == 8_772
    # The old bookings end at the prices they were reserved under.
    assert unswept.settle("settled", input_tokens=4_000, output_tokens=10).charged_nanos == 404
    assert unswept.settle("unknown", pb.UNKNOWN).charged_nanos == 8_772
    unswept.refund("refunded")
    assert unswept.booking("refunded").state == pb.REFUNDED
    assert unswept.correct("settled", 500).charged_nanos == 500
    unswept.set_time_us(unswept.START_US + 120 * SECOND_US)
    assert unswept.booking("expired").state == pb.EXPIRED
    late = unswept.settle("expired", input_tokens=4_000, output_tokens=10)
    assert (late.state, late.charged_nanos) == (pb.SETTLED, 404)
    assert unswept.balance().charged_nanos == 500 + 8_772 + 404


def test_a_lane_put_under_a_parent_brings_its_bookings_and_may_push_it_over(
    ledger_harness: Any,
) -> None:
    harness = ledger_harness
    harness.make_lane("old", limit_nanos=10_000)
    harness.make_lane("new", limit_nanos=1_000)
    harness.make_lane("kid", limit_nanos=10_000, parent="old")
    harness.reserve("open", lane="kid", estimate_nanos=1_500, request_bytes=BIG_BYTES)
    harness.reserve("ended", lane="kid", estimate_nanos=500, request_bytes=BIG_BYTES)
    harness.settle("ended", pb.UNKNOWN, lane="kid")
    assert harness.balance("old").spent_nanos == 2_000
    # Not refused: the new parent counts them at once and reports the overrun.
    harness.make_lane("kid", limit_nanos=10_000, parent="new")
    assert harness.balance("old").spent_nanos == 0
    moved = harness.balance("new")
    assert (moved.held_nanos, moved.charged_nanos) == (1_500, 500)
    assert (moved.available_nanos, moved.overrun_nanos) == (-1_000, 1_000)
    denied = harness.reserve("more", lane="kid", estimate_nanos=1, request_bytes=BIG_BYTES)
    assert (denied.decision, denied.denied_by) == (pb.DENIED, "new")
    assert harness.micros_of(denied.retry_after) == harness.START_US + 86_400 * SECOND_US
    # The open booking settles into the parent it has now, not the one it was made under.
    harness.settle("open", lane="kid", input_tokens=4_000, output_tokens=10)
    assert harness.balance("new").spent_nanos == 404 + 500
    assert harness.balance("old").spent_nanos == 0


def test_a_window_made_shorter_than_an_open_hold_s_ttl_takes_it_out_while_open(
    unswept: Any,
) -> None:
    start = unswept.START_US
    unswept.reserve("open", estimate_nanos=300, request_bytes=BIG_BYTES)
    unswept.make_lane(window_seconds=60, hold_ttl_seconds=60)
    unswept.set_time_us(start + 60 * SECOND_US)
    booking = unswept.booking("open")
    assert booking.state == pb.OPEN  # it keeps its own 120 s deadline
    assert unswept.micros_of(booking.ages_out_at) == start + 60 * SECOND_US
    assert unswept.balance().spent_nanos == 0
    # Its real charge, above the hold, is dated at reserved_at: outside the window too.
    assert unswept.settle("open", input_tokens=4_000, output_tokens=10).charged_nanos == 404
    assert unswept.balance().spent_nanos == 0
    # A window made long again brings it back.
    unswept.make_lane()
    assert unswept.balance().charged_nanos == 404


def test_a_put_of_the_policy_in_force_records_nothing(unswept: Any) -> None:
    first = unswept.admin.GetLane(pb.GetLaneRequest(lane="recall"))
    unswept.advance_us(5)
    # The same policy, its defaults spelled out: no new version, no new event.
    again = unswept.make_lane(
        window_seconds=86_400,
        hold_ttl_seconds=120,
        bytes_per_token=3.5,
        overhead_tokens=0,
        max_charge_multiple=100,
        expire_charge=pb.HOLD,
    )
    assert (again.version, again.updated_at) == (first.version, first.updated_at)
    assert len(unswept.events("recall", kinds=["lane_configured"])) == 1
