"""The ledger's metrics, recorded through OpenTelemetry as named in
docs/observability.md: decisions, charges by outcome, each lane's spent, held,
limit and open holds, and the time a Reserve takes."""

from __future__ import annotations

import itertools
import math
import time
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.metrics.export import (
    Gauge,
    Histogram,
    InMemoryMetricReader,
    Metric,
    NumberDataPoint,
    Sum,
)
from opentelemetry.trace import SpanKind

from ledger_service.api.auth import MAX_REFUSALS_LOGGED_PER_SECOND
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb

BIG_BYTES = 300_000  # caps at 8_772 nanos with 500 output tokens


def metrics_by_name(reader: InMemoryMetricReader) -> dict[str, Metric]:
    data = reader.get_metrics_data()
    assert data is not None
    return {
        metric.name: metric
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
    }


def points(metric: Metric) -> dict[tuple[tuple[str, Any], ...], Any]:
    """Each data point by its sorted attributes: its value, or for a histogram the point."""
    assert isinstance(metric.data, Sum | Gauge | Histogram), metric.data
    found: dict[tuple[tuple[str, Any], ...], Any] = {}
    for point in metric.data.data_points:
        key = tuple(sorted((point.attributes or {}).items()))
        found[key] = point.value if isinstance(point, NumberDataPoint) else point
    return found


def test_moves_are_counted_by_lane_decision_and_outcome(
    ledger: Any, metric_reader: InMemoryMetricReader
) -> None:
    ledger.put_lane(limit_nanos=2_000)
    ledger.reserve("ok-1")
    ledger.reserve("ok-2")
    ledger.reserve("ok-3")
    ledger.reserve("ok-4")  # 4 x 486 = 1_944 of 2_000: the next 486 does not fit
    ledger.reserve("no-room")
    ledger.reserve("too-big", request_bytes=BIG_BYTES)
    ledger.settle("ok-1", pb.SUCCEEDED, input_tokens=1_000)  # 100 nanos
    ledger.settle("ok-2", pb.UNKNOWN)  # the hold, 486
    ledger.refund("ok-3")
    ledger.ledger.GetBalance(pb.GetBalanceRequest(lane="recall"), timeout=10)

    found = metrics_by_name(metric_reader)
    lane = ("ledger.lane", "recall")
    assert points(found["ledger.reserve.decisions"]) == {
        (("ledger.decision", "admitted"), lane): 4,
        (("ledger.decision", "denied"), ("ledger.denial_reason", "budget_exhausted"), lane): 1,
        (("ledger.decision", "denied"), ("ledger.denial_reason", "hold_exceeds_limit"), lane): 1,
    }
    assert points(found["ledger.charges"]) == {
        (lane, ("ledger.outcome", "succeeded")): 100,
        (lane, ("ledger.outcome", "unknown")): 486,
        (lane, ("ledger.outcome", "refunded")): 0,
    }
    assert points(found["ledger.endings"]) == {
        (lane, ("ledger.outcome", outcome)): 1 for outcome in ("succeeded", "unknown", "refunded")
    }
    # The balance after the last move: ok-1 100, ok-2 486, ok-4 held 486.
    assert points(found["ledger.lane.spent"]) == {(lane,): 1_072}
    assert points(found["ledger.lane.held"]) == {(lane,): 486}
    assert points(found["ledger.lane.limit"]) == {(lane,): 2_000}
    assert points(found["ledger.lane.open_holds"]) == {(lane,): 1}
    assert found["ledger.lane.spent"].unit == "{nano}"

    reserve = points(found["ledger.reserve.duration"])
    assert found["ledger.reserve.duration"].unit == "ms"
    assert reserve[(("ledger.decision", "admitted"), lane)].count == 4
    assert reserve[(("ledger.decision", "denied"), lane)].count == 2
    assert all(point.sum > 0 for point in reserve.values())
    rpc = points(found["rpc.server.duration"])
    reserve_ok = (
        ("rpc.grpc.status_code", 0),
        ("rpc.method", "Reserve"),
        ("rpc.service", "ledger.v1.Ledger"),
        ("rpc.system", "grpc"),
    )
    assert any(key[: len(reserve_ok)] == reserve_ok for key in rpc), sorted(rpc)


def test_a_failed_move_is_timed_but_not_counted(
    ledger: Any, metric_reader: InMemoryMetricReader
) -> None:
    ledger.put_lane()
    with pytest.raises(grpc.RpcError):
        ledger.reserve("r1", lane="nobody")
    found = metrics_by_name(metric_reader)
    assert "ledger.reserve.decisions" not in found
    codes = {dict(key)["rpc.grpc.status_code"] for key in points(found["rpc.server.duration"])}
    assert 5 in codes  # NOT_FOUND


def test_a_refused_settle_is_counted_by_its_reason(
    ledger: Any, metric_reader: InMemoryMetricReader
) -> None:
    ledger.put_lane()
    ledger.reserve("r1")  # 10_000 bytes and 500 output tokens: a cap of 486 nanos
    for usage in (
        {"input_tokens": 10, "output_tokens": 501},
        {"input_tokens": 10**7},
        {"output_tokens": 10},
    ):
        with pytest.raises(grpc.RpcError) as refused:
            ledger.settle("r1", pb.SUCCEEDED, **usage)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    ledger.settle("r1", pb.SUCCEEDED, input_tokens=1_000)  # still open: settles for real
    found = metrics_by_name(metric_reader)
    lane = ("ledger.lane", "recall")
    assert points(found["ledger.settle.refused"]) == {
        (lane, ("ledger.reason", reason)): 1
        for reason in (
            "OUTPUT_EXCEEDS_MAX_TOKENS",
            "CHARGE_EXCEEDS_CAP_MULTIPLE",
            "SETTLE_WITHOUT_USAGE",
        )
    }
    assert points(found["ledger.endings"]) == {(lane, ("ledger.outcome", "succeeded")): 1}


def test_a_correction_moves_the_lane_gauges_and_its_span_carries_the_balance(
    ledger: Any, metric_reader: InMemoryMetricReader, span_exporter: Any
) -> None:
    """Correct answers with the lane's balance, as Settle does: an operator's
    correction (the one move that can put a lane past its limit) must show."""
    ledger.put_lane(limit_nanos=2_000)
    ledger.reserve("fixed")
    ledger.settle("fixed", pb.SUCCEEDED, input_tokens=1_000)  # 100 nanos
    ledger.ledger.Correct(
        pb.CorrectRequest(
            lane="recall",
            reservation_id="fixed",
            charge_nanos=1_500,
            reason="the provider's bill",
            correction_id="c-1",
        ),
        timeout=10,
    )
    found = metrics_by_name(metric_reader)
    assert points(found["ledger.lane.spent"]) == {(("ledger.lane", "recall"),): 1_500}
    [span] = [
        s
        for s in span_exporter.get_finished_spans()
        if s.name == "ledger.v1.Ledger/Correct" and s.kind is SpanKind.SERVER
    ]
    assert span.attributes is not None
    assert (span.attributes["ledger.spent_nanos"], span.attributes["ledger.limit_nanos"]) == (
        1_500,
        2_000,
    )


def test_refused_settles_in_a_loop_do_not_flood_the_log(
    ledger: Any, metric_reader: InMemoryMetricReader, caplog: pytest.LogCaptureFixture
) -> None:
    """A lane whose usage parser is broken retries a refused Settle in a tight
    loop: each is counted, but the log takes at most so many lines a second
    (as refused grants), the rest counted in one line, not one line a call."""
    ledger.put_lane()
    ledger.reserve("r1")
    calls = 200
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="ledger_service.api.servicers"):
        for _ in range(calls):
            with pytest.raises(grpc.RpcError):
                ledger.settle("r1", pb.SUCCEEDED, output_tokens=10)
        seconds = time.monotonic() - started
        # A loop quicker than a second leaves its count to the flush a second
        # after the first line held back: wait for it, not for a slower machine.
        waited_until = time.monotonic() + 10
        while time.monotonic() < waited_until and not any(
            "were not logged" in record.getMessage() for record in caplog.records
        ):
            time.sleep(0.05)
    found = metrics_by_name(metric_reader)
    assert points(found["ledger.settle.refused"]) == {
        (("ledger.lane", "recall"), ("ledger.reason", "SETTLE_WITHOUT_USAGE")): calls
    }
    lines = [record.getMessage() for record in caplog.records]
    assert lines[0].startswith("refused a Settle of booking 'r1' of lane 'recall'")
    # The loop touches at most ceil(seconds) + 1 whole seconds of the clock:
    # so many refusal lines each. A count of those held back is written before
    # the next refusal logged (or by the flush a second later, the last line),
    # as docs/security.md says: never two counts in a row, never one a call.
    seconds_touched = math.ceil(seconds) + 1
    refusals = [line for line in lines if line.startswith("refused a Settle")]
    counts = [line for line in lines if "were not logged" in line]
    assert len(refusals) <= MAX_REFUSALS_LOGGED_PER_SECOND * seconds_touched, (lines, seconds)
    assert len(lines) == len(refusals) + len(counts) and len(lines) < calls, lines
    assert counts, lines
    for line, after in itertools.pairwise(lines):
        assert not ("were not logged" in line and "were not logged" in after), lines
