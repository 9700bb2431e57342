"""The servers' CPU and context switches per call (bench/usage.py), merged and reported."""

from __future__ import annotations

import array
import os
import subprocess
import sys
import time

import pytest

from bench import load, report, usage
from bench.load import CallKind, Schedule, WorkerReport, Workload

SECOND_NS = 1_000_000_000


def test_reading_a_process_counts_its_cpu_and_its_switches() -> None:
    before = usage.read([os.getpid()])
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    for _ in range(50):
        time.sleep(0.001)  # each sleep gives the CPU up: a voluntary switch
    after = usage.read([os.getpid()])
    assert before is not None and after is not None
    spent = after - before
    assert spent.cpu_seconds >= 0.15
    assert spent.voluntary_switches >= 50
    assert spent.involuntary_switches >= 0


def test_a_process_that_is_gone_reads_as_unknown() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert usage.read([child.pid]) is None


def _round(latencies: int, server: usage.Usage | None) -> load.Round:
    workload = Workload(CallKind.ECHO, ("a",), 1, 1, 0.0, 1.0)
    samples = array.array("q", [1_000_000] * latencies)
    worker = WorkerReport(samples, samples, {})
    return load.Round(workload, Schedule(0, 0, SECOND_NS), (worker,), server)


def test_rounds_sum_their_usage_and_divide_it_by_the_calls_counted() -> None:
    merged = load.merge_rounds(
        [_round(100, usage.Usage(0.2, 1000, 200)), _round(300, usage.Usage(0.6, 2000, 600))]
    )
    assert merged.server_usage == {
        "cpu_seconds": pytest.approx(0.8),
        "voluntary_switches": 3000,
        "involuntary_switches": 800,
        "calls": 400,
        "cpu_ms_per_call": pytest.approx(2.0),
        "switches_per_call": 9.5,
    }
    assert "server 2.00 ms CPU, 10 switches a call" in report._notes(merged.to_json())


def test_usage_is_left_out_when_a_round_could_not_read_it() -> None:
    merged = load.merge_rounds([_round(10, usage.Usage(0.1, 10, 1)), _round(10, None)])
    assert merged.server_usage is None
    assert "switches" not in report._notes(merged.to_json())
