"""The history phases' rounds: alternated ABBA, merged into one result each."""

from __future__ import annotations

import array

import pytest

from bench import load, scenarios
from bench.load import CallKind, Schedule, WorkerReport, Workload

SECOND_NS = 1_000_000_000


def _workload(target: str) -> Workload:
    return Workload(
        kind=CallKind.RESERVE,
        targets=(target,),
        processes=1,
        in_flight=1,
        warmup_seconds=2.0,
        measure_seconds=1.0,
        lanes=("lane",),
    )


def _round(workload: Workload, latencies_ms: list[int], measured_seconds: int) -> load.Round:
    report = WorkerReport(
        array.array("q", [ms * 1_000_000 for ms in latencies_ms]),
        array.array("q", [ms * 1_000_000 for ms in latencies_ms]),
        {"UNAVAILABLE": 1},
    )
    schedule = Schedule(0, SECOND_NS, SECOND_NS + measured_seconds * SECOND_NS)
    return load.Round(workload, schedule, (report,))


def test_rounds_merge_into_percentiles_of_every_sample_and_summed_time() -> None:
    workload = _workload("a")
    merged = load.merge_rounds(
        [_round(workload, [1, 2, 3], measured_seconds=1), _round(workload, [10, 20], 3)]
    )
    assert merged.calls == 5
    assert merged.elapsed_seconds == 4.0
    assert merged.throughput_per_second == 5 / 4
    # Nearest rank over all five samples, not an average of the rounds' medians.
    assert merged.latency.p50_ms == 3.0
    assert merged.latency.max_ms == 20.0
    assert merged.errors == {"UNAVAILABLE": 2}


class _Recorder:
    def __init__(self, failing: str = "") -> None:
        self.ran: list[tuple[str, float]] = []
        self.prefixes: list[tuple[str, str]] = []
        self.failing = failing

    def run_round(self, workload: Workload) -> load.Round:
        target = workload.targets[0]
        self.ran.append((target, workload.warmup_seconds))
        self.prefixes.append((target, workload.id_prefix))
        if target == self.failing:
            raise load.LoadGeneratorError("lost")
        return _round(workload, [len(self.ran)], measured_seconds=1)


def test_interleaved_rounds_alternate_abba_and_warm_up_fully_once() -> None:
    recorder = _Recorder()
    workloads = {100: _workload("small"), 1_000_000: _workload("large")}
    results = scenarios._interleaved(recorder, "history", workloads, 4)  # type: ignore[arg-type]
    order = [target for target, _ in recorder.ran]
    assert order == ["small", "large", "large", "small", "small", "large", "large", "small"]
    warmups = [warmup for _, warmup in recorder.ran]
    assert warmups[:2] == [2.0, 2.0]
    assert set(warmups[2:]) == {scenarios.ROUND_WARMUP_SECONDS}
    assert results[100]["rounds"] == 4
    # Every round books new reservations: none is an idempotent replay of another's.
    assert len(set(recorder.prefixes)) == len(recorder.prefixes)
    assert results[100]["calls"] == results[1_000_000]["calls"] == 4
    assert results[100]["elapsed_seconds"] == pytest.approx(4.0)


def test_a_failed_round_fails_its_own_workload_only() -> None:
    recorder = _Recorder(failing="large")
    workloads = {100: _workload("small"), 1_000_000: _workload("large")}
    results = scenarios._interleaved(recorder, "history", workloads, 4)  # type: ignore[arg-type]
    assert "failed" in results[1_000_000]
    assert results[100]["calls"] == 4
    # Not retried after its failure.
    assert [target for target, _ in recorder.ran].count("large") == 1
