"""The history phases' rounds: alternated ABBA, merged into one result each."""

from __future__ import annotations

import array
import dataclasses

import grpc
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


class _Clock:
    """load's clock, moved by the test alone: its window closes when a call says."""

    def __init__(self) -> None:
        self.now_ns = 0

    def monotonic_ns(self) -> int:
        return self.now_ns

    def perf_counter_ns(self) -> int:
        return self.now_ns

    def sleep(self, _seconds: float) -> None:
        pass


def _thread_calls(
    monkeypatch: pytest.MonkeyPatch, calls: list[str], start_ns: int = 5
) -> load.Round:
    """One load thread whose warm-up ends at 5 ns and window at 10 ns (on a
    clock the test moves), its calls answered as `calls` says: "now", "late"
    (11 ns on) or "refused"."""
    clock = _Clock()
    clock.now_ns = start_ns
    monkeypatch.setattr(load, "time", clock)
    workload = dataclasses.replace(_workload("a"), warmup_seconds=0.0)
    schedule = Schedule(0, 5, 10)
    thread = load._Thread(workload, schedule, 0, 0)
    answers = iter(calls)

    def call(_lane: str, _reservation_id: str) -> tuple[int, bool]:
        answer = next(answers)
        if answer == "refused":
            raise grpc.RpcError()
        clock.now_ns += 11 if answer == "late" else 0
        return 1, False

    thread.run(call)
    return load.Round(workload, schedule, (thread.report,))


def test_a_thread_whose_one_call_outlasts_the_window_still_counts_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a loaded machine one call may take longer than --quick's half
    second: the phase still has its figure, and its time runs to that call's end."""
    measured = _thread_calls(monkeypatch, ["late"])
    assert list(measured.reports[0].latencies_ns) == [11]
    assert measured.elapsed_seconds == (16 - 5) / 1e9


def test_a_thread_whose_warm_up_call_outlasts_the_window_makes_one_call_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    measured = _thread_calls(monkeypatch, ["late", "now"], start_ns=0)
    assert list(measured.reports[0].latencies_ns) == [0]
    assert measured.reports[0].warmup_calls == 1
    assert measured.elapsed_seconds == (11 - 5) / 1e9


def test_past_the_window_a_thread_makes_one_call_more_at_most(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    measured = _thread_calls(monkeypatch, ["late", "refused"], start_ns=0)
    assert list(measured.reports[0].latencies_ns) == []
    assert measured.reports[0].errors == {"UNKNOWN": 1}


def test_a_call_in_flight_at_the_end_is_not_counted_once_its_thread_has_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    measured = _thread_calls(monkeypatch, ["now", "now", "late"])
    assert list(measured.reports[0].latencies_ns) == [0, 0]
    assert measured.elapsed_seconds == (10 - 5) / 1e9
