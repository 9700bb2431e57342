"""Applies a provider's usage export to the ledger: all of it, or none of it."""

from __future__ import annotations

import dataclasses
import uuid
from collections import Counter
from collections.abc import Sequence

from ledger_service.application.budgets import BudgetWindow, lane_time, open_window
from ledger_service.application.ledger import (
    Ledger,
    locked_ancestors,
    locked_trees,
    record_booking_event,
)
from ledger_service.application.ports import StoreTransaction
from ledger_service.domain import moves, reconcile
from ledger_service.domain.clock import Clock
from ledger_service.domain.errors import SumOutOfRange
from ledger_service.domain.policies import LanePolicy
from ledger_service.domain.reconcile import ExportFormat, RowResult, RowStatus

# Rows that replaced an estimate (corrected) or a real charge (replaced, bill wins).
CHANGED = (RowStatus.CORRECTED, RowStatus.REPLACED)


@dataclasses.dataclass(frozen=True)
class ReconcileReport:
    applied: bool
    rows: Sequence[RowResult]

    def count(self, *statuses: RowStatus) -> int:
        counts = Counter(row.status for row in self.rows)
        return sum(counts[status] for status in statuses)

    @property
    def estimated_before_nanos(self) -> int:
        return sum(r.before_nanos for r in self.rows if r.status is RowStatus.CORRECTED)

    @property
    def real_after_nanos(self) -> int:
        return sum(r.after_nanos for r in self.rows if r.status is RowStatus.CORRECTED)

    def largest_total_nanos(self) -> int:
        """The largest sum of amounts the report could state."""
        changed = [row for row in self.rows if row.status in CHANGED]
        return max(sum(r.before_nanos for r in changed), sum(r.after_nanos for r in changed))


class _DryRun(Exception):
    """Rolls a dry run's transaction back while keeping its answer."""

    def __init__(self, rows: list[RowResult]) -> None:
        super().__init__("dry run")
        self.rows = rows


def reconcile_export(
    ledger: Ledger,
    content: bytes,
    export_format: ExportFormat,
    default_lane: str,
    *,
    dry_run: bool = False,
    trace_id: str = "",
    bill_wins: bool = False,
    grant_id: str = "",
) -> ReconcileReport:
    if default_lane:
        # Refused up front, as every other call refuses an unknown lane: its
        # rows were each "no such booking in this lane", and the call succeeded.
        ledger.check_lane(default_lane)
    parsed = reconcile.parse(content, export_format, default_lane)
    if parsed.bad:
        # A file applies in full or not at all: one bad row and nothing changes.
        rows = [*parsed.bad, *(_not_applied(row) for row in parsed.rows)]
        return ReconcileReport(False, sorted(rows, key=lambda r: r.line))

    def work(tx: StoreTransaction) -> list[RowResult]:
        results = _apply(ledger, tx, parsed.rows, trace_id, grant_id, bill_wins)
        # The report's totals must fit the wire's int64, as every sum does.
        moves.check_window_sums([ReconcileReport(True, results).largest_total_nanos()], "content")
        if dry_run:
            raise _DryRun(results)
        return results

    try:
        return ReconcileReport(True, ledger.write(work))
    except _DryRun as dry:
        return ReconcileReport(False, dry.rows)


def _not_applied(row: reconcile.ExportRow) -> RowResult:
    message = "not applied: the file has bad rows"
    return RowResult(row.line, row.lane, row.reservation_id, RowStatus.NOT_APPLIED, message=message)


def _apply(
    ledger: Ledger,
    tx: StoreTransaction,
    rows: Sequence[reconcile.ExportRow],
    trace_id: str,
    grant_id: str,
    bill_wins: bool,
) -> list[RowResult]:
    """`bill_wins`: the bill replaces disagreeing real charges."""
    now_us, chains = _budget_chains(tx, sorted({row.lane for row in rows}), ledger.clock)
    results: list[RowResult] = []
    for row in rows:
        windows = chains.get(row.lane)
        booking = tx.get_booking(row.lane, row.reservation_id) if windows else None
        if windows and booking is not None and booking.is_expired_at(now_us):
            expired = moves.expire(booking, now_us)
            _, booking = record_booking_event(tx, windows, booking, expired, now_us, trace_id)
        replacing = reconcile.BillWins(f"bill-{uuid.uuid4().hex}", grant_id) if bill_wins else None
        result, event = reconcile.decide(booking, row, now_us, replacing, grant_id)
        if event is not None and windows:
            try:
                record_booking_event(tx, windows, booking, event, now_us, trace_id, "content")
            except SumOutOfRange as error:
                raise SumOutOfRange("content", f"line {row.line}: {error.detail}") from error
        results.append(result)
    return results


def _budget_chains(
    tx: StoreTransaction, lanes: Sequence[str], clock: Clock
) -> tuple[int, dict[str, list[BudgetWindow]]]:
    """Each named lane's budgets, locked, and the instant the reconcile is
    dated at: read once the locks are held, and, as for every move, no
    earlier than any of those budgets' kept windows (lane_time). A budget
    shared by several lanes is one BudgetWindow, so every change to it lands
    in the same kept sums.

    Every lock is taken up front, in locked_trees' order: a lane's chain
    locked in turn, the lanes by name, would hold a parent while it waits for
    a sibling that a move holds while it waits for that parent."""
    locked = locked_trees(tx, lanes)
    budgets: dict[str, list[LanePolicy]] = {}
    for lane in lanes:
        policy = locked.get(lane)
        if policy is not None:
            budgets[lane] = [policy, *locked_ancestors(tx, policy)]
    now_us = lane_time(tx, list(locked.values()), clock.now_us())
    windows: dict[str, BudgetWindow] = {}
    chains: dict[str, list[BudgetWindow]] = {}
    for lane, chain_of in budgets.items():
        chain = []
        for budget in chain_of:
            if budget.lane not in windows:
                windows[budget.lane] = open_window(tx, budget, now_us)
            chain.append(windows[budget.lane])
        chains[lane] = chain
    return now_us, chains
