"""Recovery's reads while another replica serves: moves and snapshots land
between them.

An assessment or a plan reads the log, the projections and the snapshots in
more than one transaction. Another replica keeps appending and snapshotting
meanwhile, so a later read may see a snapshot whose position is past the end
of the log an earlier read saw. That is the log growing, not events missing;
read as "events are missing", an assessment refused moves and a plan refused
to rebuild (HARD_ABORT). Found by reading recovery for reads that span
transactions; the hooks below put the other replica's move and snapshot
between two of them, where a busy replica may put it.

Likewise a recovery acts on what its assessment read: when two replicas see
the same damage, the second to claim the projections must notice that the
first has rebuilt them since, not rebuild them again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from ledger_service.domain.errors import StoreUnavailable
from ledger_service.domain.moves import ReserveCommand
from ledger_service.recovery.plan import RecoveryPolicy, Verdict
from ledger_service.recovery.rebuild import Recovery
from ledger_service.recovery.store import SqlRecoveryStore
from tests.recovery.conftest import History, open_history


def _reserve(history: History, rid: str) -> None:
    history.ledger.reserve(ReserveCommand("recall", rid, "jev", 1_000, 10))


def _after_first_facts(
    monkeypatch: pytest.MonkeyPatch, store: SqlRecoveryStore, then: Callable[[], None]
) -> None:
    """Runs `then` once, right after `store` has read its facts."""
    facts = SqlRecoveryStore.facts
    done: list[bool] = []

    def and_then(self: SqlRecoveryStore) -> Any:
        found = facts(self)
        if self is store and not done:
            done.append(True)
            then()
        return found

    monkeypatch.setattr(SqlRecoveryStore, "facts", and_then)


def test_an_assessment_beside_another_replicas_snapshot_finds_nothing(
    history: History, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours, theirs = history.recovery("replica-a"), history.recovery("replica-b")

    def a_move_and_a_snapshot() -> None:
        _reserve(history, "between-the-reads")
        assert theirs.take_snapshot() is not None

    _after_first_facts(monkeypatch, ours.store, a_move_and_a_snapshot)
    assessment = ours.assess()
    assert assessment.consistent, assessment.findings


def test_a_plan_beside_another_replicas_snapshot_finds_no_events_missing(
    history: History,
) -> None:
    # A break the snapshot check does not see (the event altered is not its
    # booking's latest), so the other replica keeps serving and snapshotting.
    seq = history.scalar("SELECT seq FROM events WHERE reservation_id = 'r2' AND kind = 'reserved'")
    history.tamper_event(int(seq), 1)  # type: ignore[call-overload]
    ours, theirs = history.recovery("replica-a"), history.recovery("replica-b")
    assessment = ours.assess()
    assert not assessment.consistent
    _reserve(history, "after-the-assessment")
    assert theirs.take_snapshot() is not None
    plan = ours.plan(assessment, RecoveryPolicy(max_budget_seconds=300, max_risk_score=1.0))
    assert plan.manifest.verdict is not Verdict.HARD_ABORT, plan.manifest.findings
    assert not any("no source holds" in found for found in plan.manifest.findings)


POLICY = RecoveryPolicy(max_budget_seconds=300, max_risk_score=0.3)


def test_a_recovery_after_another_replicas_rebuild_does_not_rebuild_again(
    history: History, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both replicas' checks see the damage; the other one rebuilds first,
    # while this one is still planning.
    history.sql("DELETE FROM bookings WHERE reservation_id = 'r3'")
    ours, theirs = history.recovery("replica-a"), history.recovery("replica-b")
    plan = Recovery.plan
    done: list[bool] = []

    def and_theirs_recovers(self: Recovery, *arguments: Any, **keywords: Any) -> Any:
        planned = plan(self, *arguments, **keywords)
        if self is ours and not done:
            done.append(True)
            assert theirs.recover(POLICY, "replica-b").ready
        return planned

    monkeypatch.setattr(Recovery, "plan", and_theirs_recovers)
    assert ours.recover(POLICY, "replica-a").ready
    outcomes = [manifest["outcome"] for manifest in ours.store.manifests()]
    # One rebuild, not a second one that refuses every move for nothing.
    assert outcomes.count("rebuilt") == 1, outcomes
    assert ours.assess().consistent


@pytest.mark.postgres
def test_a_planners_dry_run_gives_up_at_once_on_a_row_a_rebuild_holds(
    postgres_schema_url: str,
) -> None:
    # Three replicas see the same damage; one claims and rebuilds while the
    # others still plan, and each plan measures its rate by folding the log's
    # first events into the live bookings in a transaction it rolls back. A
    # dry run that met a row the rebuild had written waited for it (up to
    # lock_timeout, 5 s) while it held the rows it had folded already, which
    # the rebuild wanted next: the rebuild died of a deadlock or of its own
    # lock_timeout, again and again (5 rebuilds and 47 s of refused moves for
    # 4,910 events, three replicas under load). A dry run is only a
    # measurement: it gives up at once, and plans again at the next check,
    # when the rebuild's claim tells it to wait.
    for history in open_history(postgres_schema_url, bookings=20):
        history.sql("DELETE FROM bookings WHERE reservation_id = 'r3'")
        planner = history.recovery("replica-b", sample_events=10_000)
        with history.engine.connect() as rebuild, rebuild.begin():
            rebuild.execute(sa.text("SELECT 1 FROM bookings FOR UPDATE"))
            started = time.perf_counter()
            with pytest.raises(StoreUnavailable):
                planner.measure_rate()
            waited = time.perf_counter() - started
        assert waited < 1.0, f"the dry run waited {waited:.1f} s for the rebuild's rows"
