"""The benchmark table's derived figures (bench/report.py): the floors it sets
beside the targets, computed from the phases' raw figures."""

from __future__ import annotations

from typing import Any

import pytest

from bench import report


def _phase(per_second: float, p50_ms: float) -> dict[str, Any]:
    return {
        "throughput_per_second": per_second,
        "calls": int(per_second * 10),
        "latency": {"p50_ms": p50_ms, "p99_ms": p50_ms * 3},
        "errors": {},
        "denied": 0,
        "server_usage": None,
    }


def _results() -> dict[str, Any]:
    """An SQLite run with the figures of an `--only sqlite` run of 2026-12-01."""
    return {
        "plan": {"saturating_calls": 16},
        "scenarios": {
            "echo": {
                "phases": {
                    "single_1": _phase(2979, 0.30),
                    "pair_1": _phase(1616, 0.57),
                    "single_saturated": _phase(4218, 3.48),
                    "pair_saturated": _phase(2063, 7.17),
                }
            },
            "sqlite": {
                "commit_floor": {"commits": 2000, "latency": {"p50_ms": 0.07, "p99_ms": 0.14}},
                "phases": {
                    "reserve_1": _phase(686, 1.35),
                    "reserve_settle_1": _phase(346, 2.63),
                    "reserve_settle_saturated": _phase(600, 23.63),
                    "storeless_reserve_1": _phase(1940, 0.45),
                    "storeless_reserve_settle_saturated": _phase(1695, 9.18),
                },
            },
        },
    }


def _row(rows: list[report.Row], scenario: str) -> report.Row:
    (found,) = [row for row in rows if row.scenario == scenario]
    return found


def test_the_moves_budget_is_what_the_target_leaves_past_the_api_layer() -> None:
    # A pair: 1/600 s through the ledger, 1/1695 through the API alone, so the
    # moves add 1.077 ms; 60% of 2063 pairs/s leaves 1/1237.8 s a pair in all,
    # 0.218 ms past the API.
    assert report.move_budget(600, 1695, 2063) == (
        "moves 1.08 ms a pair past the API; the target leaves them 0.22 ms (4.9x less)"
    )


def test_an_api_layer_slower_than_the_target_leaves_the_moves_nothing() -> None:
    assert report.move_budget(600, 1000, 2063) == (
        "moves 0.67 ms a pair past the API; the API alone misses the target"
    )


@pytest.mark.parametrize("missing", ["ledger", "storeless", "echo_pair"])
def test_no_budget_without_every_rate(missing: str) -> None:
    rates: dict[str, float | None] = {"ledger": 600, "storeless": 1695, "echo_pair": 2063}
    rates[missing] = None
    assert report.move_budget(**rates) == ""


def test_the_table_sets_both_floors_beside_their_targets() -> None:
    rows, _ = report.evaluate(_results())
    saturated = _row(rows, "sqlite Reserve+Settle, 16 in flight")
    assert saturated.notes.endswith("the target leaves them 0.22 ms (4.9x less)")
    assert saturated.met is False
    storeless = _row(rows, "storeless Reserve, 1 client")
    # (0.45 + 0.07) / 0.30: above 1.5x before the move does anything.
    assert storeless.notes == "+ commit: 1.73x echo, a free move's floor"
