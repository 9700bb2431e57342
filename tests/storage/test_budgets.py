"""Parent budgets and reconciliation, on SQLite and PostgreSQL."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from ledger_service.application.ledger import Ledger
from ledger_service.application.ports import EventQuery
from ledger_service.application.reconciliation import ReconcileReport, reconcile_export
from ledger_service.domain.clock import ManualClock
from ledger_service.domain.errors import InvalidArgument, SumOutOfRange
from ledger_service.domain.events import DenialReason, EventKind, Outcome
from ledger_service.domain.moves import (
    CorrectCommand,
    RefundCommand,
    ReserveCommand,
    SettleCommand,
)
from ledger_service.domain.policies import LanePolicy
from ledger_service.domain.pricing import MAX_AMOUNT_NANOS
from ledger_service.domain.reconcile import ExportFormat, RowStatus
from tests.storage.conftest import RECALL

HOLD = 1400  # 35,000 request bytes and 1,000 output tokens at the RECALL prices


def _lane(name: str, limit: int, parent: str | None = None) -> LanePolicy:
    return dataclasses.replace(RECALL, lane=name, limit_nanos=limit, parent=parent)


def _reserve(lane: str, rid: str) -> ReserveCommand:
    return ReserveCommand(lane, rid, "jev", 35_000, 1000)


def test_a_reserve_must_fit_every_ancestor(ledger: Ledger, clock: ManualClock) -> None:
    ledger.put_lane(_lane("judge", 3 * HOLD))
    ledger.put_lane(_lane("recall", 10 * HOLD, parent="judge"))
    ledger.put_lane(_lane("filter", 10 * HOLD, parent="judge"))
    first_at = clock.now_us()
    assert ledger.reserve(_reserve("recall", "a")).admitted
    clock.advance_us(1_000)
    assert ledger.reserve(_reserve("filter", "b")).admitted
    assert ledger.reserve(_reserve("recall", "c")).admitted
    denied = ledger.reserve(_reserve("filter", "d"))
    assert not denied.admitted
    assert denied.event.denied_by == "judge"
    assert denied.event.denial_reason is DenialReason.BUDGET_EXHAUSTED
    # The parent frees room when its oldest booking ages out of its window.
    assert denied.event.retry_after_us == first_at + RECALL.window_us
    parent = ledger.balance("judge")
    assert parent.spent_nanos == 3 * HOLD and parent.available_nanos == 0
    assert ledger.balance("recall").spent_nanos == 2 * HOLD


def test_a_hold_above_an_ancestors_limit_can_never_fit(ledger: Ledger) -> None:
    ledger.put_lane(_lane("judge", HOLD - 1))
    ledger.put_lane(_lane("recall", 10 * HOLD, parent="judge"))
    denied = ledger.reserve(_reserve("recall", "a"))
    assert denied.event.denial_reason is DenialReason.HOLD_EXCEEDS_LIMIT
    assert denied.event.denied_by == "judge" and denied.event.retry_after_us is None


def test_parents_are_validated_for_existence_cycles_and_depth(ledger: Ledger) -> None:
    with pytest.raises(InvalidArgument, match="no lane named"):
        ledger.put_lane(_lane("recall", HOLD, parent="nobody"))
    ledger.put_lane(_lane("a", HOLD))
    ledger.put_lane(_lane("b", HOLD, parent="a"))
    ledger.put_lane(_lane("c", HOLD, parent="b"))
    with pytest.raises(InvalidArgument, match="cycle") as caught:
        ledger.put_lane(_lane("a", HOLD, parent="c"))
    assert caught.value.field == "lane.parent"
    ledger.put_lane(_lane("d", HOLD, parent="c"))  # four deep: the most
    with pytest.raises(InvalidArgument, match="at most 4"):
        ledger.put_lane(_lane("e", HOLD, parent="d"))
    with pytest.raises(InvalidArgument, match="at most 4"):
        ledger.put_lane(_lane("root", HOLD))  # fine alone...
        ledger.put_lane(_lane("a", HOLD, parent="root"))  # ...but a's tree is four deep


def test_a_reserve_must_fit_the_budget_four_levels_up(ledger: Ledger) -> None:
    """Budgets nest four deep, and the top one holds a Reserve at the bottom."""
    ledger.put_lane(_lane("org", HOLD))
    ledger.put_lane(_lane("dept", 10 * HOLD, parent="org"))
    ledger.put_lane(_lane("team", 10 * HOLD, parent="dept"))
    ledger.put_lane(_lane("recall", 10 * HOLD, parent="team"))
    assert ledger.reserve(_reserve("recall", "a")).admitted
    denied = ledger.reserve(_reserve("recall", "b"))
    assert not denied.admitted
    assert (denied.event.denied_by, denied.event.denial_reason) == (
        "org",
        DenialReason.BUDGET_EXHAUSTED,
    )
    assert ledger.balance("org").spent_nanos == HOLD


def test_a_new_parent_counts_the_lane_s_bookings_from_the_moment_it_is_set(
    ledger: Ledger,
) -> None:
    ledger.put_lane(_lane("team", 2 * HOLD))
    ledger.put_lane(_lane("recall", 10 * HOLD))
    # The parent has kept a window of its own before the lane joins it.
    ledger.reserve(_reserve("team", "t"))
    ledger.refund(RefundCommand("team", "t", http_status=429))
    assert ledger.reserve(_reserve("recall", "a")).admitted
    ledger.put_lane(_lane("recall", 10 * HOLD, parent="team"))
    assert ledger.balance("team").spent_nanos == HOLD
    assert ledger.reserve(_reserve("recall", "b")).admitted
    denied = ledger.reserve(_reserve("recall", "c"))
    assert (denied.admitted, denied.event.denied_by) == (False, "team")
    # Leaving the parent takes the lane's bookings out of it.
    ledger.put_lane(_lane("recall", 10 * HOLD))
    assert ledger.balance("team").spent_nanos == 0
    assert ledger.reserve(_reserve("team", "t2")).admitted


def test_hot_lanes_sharing_a_parent_never_overbook_it(ledger: Ledger) -> None:
    ledger.put_lane(_lane("judge", 12 * HOLD))
    for name in ("hot-1", "hot-2", "hot-3"):
        ledger.put_lane(_lane(name, 8 * HOLD, parent="judge"))
    admitted: list[str] = []
    lock = threading.Lock()

    def worker(index: int) -> None:
        for attempt in range(6):
            result = ledger.reserve(_reserve(f"hot-{index % 3 + 1}", f"w{index}-{attempt}"))
            if result.admitted:
                with lock:
                    admitted.append(result.event.reservation_id)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(admitted) == 12
    assert ledger.balance("judge").spent_nanos == 12 * HOLD


CSV_HEADER = "reservation_id,billed_nanos,input_tokens,output_tokens,model\n"


def _reconcile(ledger: Ledger, content: str, dry_run: bool = False) -> ReconcileReport:
    return reconcile_export(ledger, content.encode(), ExportFormat.CSV, "recall", dry_run=dry_run)


def test_reconcile_corrects_estimates_and_flags_real_disagreements(
    ledger: Ledger, clock: ManualClock
) -> None:
    ledger.put_lane(RECALL)
    for rid in ("unknown", "expired", "real", "refused", "open"):
        ledger.reserve(_reserve("recall", rid))
    ledger.settle(SettleCommand("recall", "unknown", Outcome.UNKNOWN))
    ledger.settle(SettleCommand("recall", "real", Outcome.SUCCEEDED, billed_nanos=500))
    ledger.refund(RefundCommand("recall", "refused", http_status=403))
    clock.advance_us(30_000_000)
    ledger.reserve(_reserve("recall", "late-open"))
    clock.advance_us(RECALL.hold_ttl_us - 30_000_000)  # "expired" and "open" are past due
    export = CSV_HEADER + (
        "unknown,120,,,jev\nexpired,,1000,100,\nreal,999,,,\nrefused,0,,,\nghost,5,,,\n"
        "late-open,7,,,\n"
    )
    report = _reconcile(ledger, export)
    statuses = {row.reservation_id: row.status for row in report.rows}
    assert statuses == {
        "unknown": RowStatus.CORRECTED,
        "expired": RowStatus.CORRECTED,
        "real": RowStatus.DISAGREES,
        "refused": RowStatus.MATCHED,
        "ghost": RowStatus.UNMATCHED,
        "late-open": RowStatus.OPEN,
    }
    assert report.applied
    # 1,000 input tokens at 0.1 $/M (100) + 100 output at 0.4 $/M (40).
    assert report.real_after_nanos == 120 + 140
    assert report.estimated_before_nanos == 2 * HOLD
    assert ledger.balance("recall").spent_nanos == 120 + 140 + 500 + HOLD + HOLD
    again = _reconcile(ledger, export)
    assert again.count(RowStatus.CORRECTED) == 0 and again.count(RowStatus.MATCHED) == 3
    events = ledger.list_events(EventQuery())
    assert sum(e.kind is EventKind.RECONCILED for e in events) == 2


def test_a_file_with_a_bad_row_changes_nothing(ledger: Ledger) -> None:
    ledger.put_lane(RECALL)
    ledger.reserve(_reserve("recall", "unknown"))
    ledger.settle(SettleCommand("recall", "unknown", Outcome.UNKNOWN))
    report = _reconcile(ledger, CSV_HEADER + "unknown,120,,,\nbad id,-5,,,\nx,,,,\n")
    assert not report.applied
    bad = [(row.line, row.field) for row in report.rows if row.status is RowStatus.BAD]
    assert bad == [(3, "reservation_id"), (4, "billed_nanos")]
    assert ledger.balance("recall").spent_nanos == HOLD
    dry = _reconcile(ledger, CSV_HEADER + "unknown,120,,,\n", dry_run=True)
    assert not dry.applied and dry.count(RowStatus.CORRECTED) == 1
    assert ledger.balance("recall").spent_nanos == HOLD


@pytest.mark.parametrize(("bookings", "charge"), [(2, MAX_AMOUNT_NANOS - 1), (3, MAX_AMOUNT_NANOS)])
def test_a_longer_window_that_would_pass_the_largest_sum_is_refused(
    ledger: Ledger, clock: ManualClock, bookings: int, charge: int
) -> None:
    """Each booking fits its one-second window alone; an hour's window would
    hold them all. Two sum past the largest the ledger keeps; three also past
    what a database integer holds. Either way the PutLane is refused naming the
    window, and nothing changes."""
    short = dataclasses.replace(RECALL, lane="whale", window_us=1_000_000, hold_ttl_us=1_000)
    ledger.put_lane(short)
    for index in range(bookings):
        rid = f"big-{index}"
        ledger.reserve(ReserveCommand("whale", rid, "jev", 1000, 10))
        ledger.refund(RefundCommand("whale", rid, http_status=429))
        ledger.correct(
            CorrectCommand("whale", rid, charge, "the bill said so", f"fix-{index}"),
            grant_id="operator",
        )
        clock.advance_us(2_000_000)
    before = ledger.get_lane("whale")
    with pytest.raises(SumOutOfRange) as refused:
        ledger.put_lane(dataclasses.replace(short, window_us=3_600_000_000))
    assert refused.value.field == "lane.window"
    assert ledger.get_lane("whale") == before
    # The lane still serves moves.
    assert ledger.reserve(ReserveCommand("whale", "after", "jev", 1000, 10)).admitted
