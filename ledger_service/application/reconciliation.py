"""Applies a provider's usage export to the ledger: all of it, or none of it."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

from ledger_service.application.ledger import Ledger, record_booking_event
from ledger_service.application.ports import StoreTransaction
from ledger_service.domain import moves, reconcile
from ledger_service.domain.reconcile import ExportFormat, RowResult, RowStatus
from ledger_service.domain.window import WindowTotals


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
) -> ReconcileReport:
    parsed = reconcile.parse(content, export_format, default_lane)
    if parsed.bad:
        # A file applies in full or not at all: one bad row and nothing changes.
        rows = [*parsed.bad, *(_not_applied(row) for row in parsed.rows)]
        return ReconcileReport(False, sorted(rows, key=lambda r: r.line))

    def work(tx: StoreTransaction) -> list[RowResult]:
        results = _apply(ledger, tx, parsed.rows, trace_id)
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
    ledger: Ledger, tx: StoreTransaction, rows: Sequence[reconcile.ExportRow], trace_id: str
) -> list[RowResult]:
    policies = {lane: tx.lock_lane(lane) for lane in sorted({row.lane for row in rows})}
    now_us = ledger.clock.now_us()
    totals: dict[str, WindowTotals] = {
        lane: tx.window_totals(lane, now_us, policy.window_us)
        for lane, policy in policies.items()
        if policy is not None
    }
    results: list[RowResult] = []
    for row in rows:
        policy = policies[row.lane]
        booking = tx.get_booking(row.lane, row.reservation_id) if policy is not None else None
        if policy is not None and booking is not None and booking.is_expired_at(now_us):
            expired = moves.expire(booking, now_us)
            _, booking, totals[row.lane] = record_booking_event(
                tx, policy, booking, expired, totals[row.lane], now_us, trace_id
            )
        result, event = reconcile.decide(booking, row, now_us)
        if event is not None and policy is not None:
            _, _, totals[row.lane] = record_booking_event(
                tx, policy, booking, event, totals[row.lane], now_us, trace_id
            )
        results.append(result)
    return results
