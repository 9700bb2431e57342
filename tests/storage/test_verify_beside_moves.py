"""`ledger verify` beside serving replicas: moves commit between its reads of the
log and of the projections, and it must not take them for damage (it read them
at one instant), on both databases."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from ledger_service.application.ledger import Ledger
from ledger_service.domain import moves
from ledger_service.domain.bookings import Booking
from ledger_service.domain.clock import ManualClock
from ledger_service.recovery.store import SqlRecoveryStore
from ledger_service.recovery.verify import Verifier
from ledger_service.storage.sql import SqlStore
from tests.storage.conftest import RECALL


def test_a_move_committed_while_verify_reads_is_no_finding(
    store: SqlStore, ledger: Ledger, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger.put_lane(RECALL)
    reserve = moves.ReserveCommand("recall", "before", "jev", 1_000, 10)
    ledger.reserve(reserve)
    ledger.settle(moves.SettleCommand("recall", "before", moves.Outcome.SUCCEEDED, 10, 1))
    ledger.reserve(moves.ReserveCommand("recall", "open", "jev", 1_000, 10))

    # After verify has read the log, a Reserve and a Settle commit elsewhere.
    read_bookings = SqlRecoveryStore.projected_bookings
    moved = threading.Event()

    def bookings_after_moves(recovery: SqlRecoveryStore, lane: str) -> Sequence[Booking]:
        if not moved.is_set():
            moved.set()

            def elsewhere() -> None:
                ledger.reserve(moves.ReserveCommand("recall", "during", "jev", 1_000, 10))
                ledger.settle(moves.SettleCommand("recall", "open", moves.Outcome.SUCCEEDED, 5))

            mover = threading.Thread(target=elsewhere)
            mover.start()
            mover.join(timeout=30)
        return read_bookings(recovery, lane)

    monkeypatch.setattr(SqlRecoveryStore, "projected_bookings", bookings_after_moves)
    report = Verifier(SqlRecoveryStore(store.engine)).verify(clock.now_us())
    assert moved.is_set()
    assert report.ok, report.findings
