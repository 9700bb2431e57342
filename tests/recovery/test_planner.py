"""The recovery planner (recovery/plan.py): the seed's decision boundary."""

from __future__ import annotations

import json

import pytest

from ledger_service.recovery.plan import RecoveryPolicy, Source, Verdict, plan

POLICY = RecoveryPolicy(max_budget_seconds=10.0, max_risk_score=0.3, min_viable_sources=1)
LOG = Source("log", cost_seconds=8.0, risk_score=0.0)
SNAPSHOT = Source("snapshot-3", cost_seconds=1.0, risk_score=0.0)
STALE = Source("snapshot-2", cost_seconds=0.5, risk_score=0.9)


def test_admissible_uses_the_cheapest_safe_source() -> None:
    manifest = plan([LOG, SNAPSHOT, STALE], POLICY, ["bookings missing"])
    assert manifest.verdict is Verdict.ADMISSIBLE
    # The stale snapshot is cheaper but too risky: excluded, cost re-evaluated.
    assert manifest.chosen == ("snapshot-3",) and manifest.total_cost_seconds == 1.0
    assert manifest.directive.startswith("PROCEED")


def test_over_budget_is_a_refusal_naming_what_it_would_have_used() -> None:
    manifest = plan([LOG], RecoveryPolicy(5.0, 0.3))
    assert manifest.verdict is Verdict.EXCEEDS_BUDGET
    assert manifest.chosen == ("log",) and manifest.total_cost_seconds == 8.0
    assert manifest.directive.startswith("HALT")


def test_exactly_the_budget_is_admissible() -> None:
    assert plan([LOG], RecoveryPolicy(8.0, 0.3)).verdict is Verdict.ADMISSIBLE


def test_too_few_safe_sources_is_risk_too_high() -> None:
    assert plan([STALE], POLICY).verdict is Verdict.RISK_TOO_HIGH
    two = RecoveryPolicy(100.0, 0.3, min_viable_sources=2)
    assert plan([SNAPSHOT, STALE], two).verdict is Verdict.RISK_TOO_HIGH
    both = plan([SNAPSHOT, LOG, STALE], two)
    assert both.verdict is Verdict.ADMISSIBLE and both.chosen == ("snapshot-3", "log")
    assert both.total_cost_seconds == 9.0


def test_no_possible_source_is_a_hard_abort() -> None:
    impossible = Source("log", 1.0, 0.0, possible=False)
    manifest = plan([impossible], POLICY)
    assert manifest.verdict is Verdict.HARD_ABORT and manifest.chosen == ()
    assert plan([], POLICY).verdict is Verdict.HARD_ABORT


def test_the_digest_is_deterministic_and_covers_the_decision() -> None:
    first = plan([LOG, SNAPSHOT], POLICY, ["x"])
    assert plan([SNAPSHOT, LOG], POLICY, ["x"]).digest == first.digest
    assert plan([LOG, SNAPSHOT], POLICY, ["y"]).digest != first.digest
    assert (
        plan([LOG], RecoveryPolicy(5.0, 0.3)).digest != plan([LOG], RecoveryPolicy(6.0, 0.3)).digest
    )
    body = json.loads(first.to_json())
    assert body["digest"] == first.digest and body["verdict"] == "ADMISSIBLE"
    assert [s["source_id"] for s in body["sources"]] == ["log", "snapshot-3"]


@pytest.mark.parametrize(
    "policy",
    [RecoveryPolicy(-1.0, 0.3), RecoveryPolicy(1.0, 1.5), RecoveryPolicy(1.0, 0.3, 0)],
)
def test_a_nonsensical_policy_is_refused(policy: RecoveryPolicy) -> None:
    with pytest.raises(ValueError):
        plan([LOG], policy)
