"""A Settle or Refund of a booking whose charge a bill or an operator replaced
compares itself with the booking as the lane's own moves left it, read from
the booking's events inside the move's transaction. On PostgreSQL that read
went through `list_events`, which stops at the commit horizon: behind a seq
still in flight or a hole not yet known final (a repeated Reserve leaves one),
the move saw none or only some of its booking's events, committed long before
under the lane's lock it holds. With none, the Settle failed with an
AssertionError (INTERNAL); with some, a repeat of the lane's own Settle was
refused as BOOKING_ALREADY_ENDED instead of getting its first answer. And the
read waited for the horizon (at most 1 s) behind the move's own seq, which
cannot commit while it waits, holding the lane's lock all that time."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from ledger_service.application.ledger import Ledger
from ledger_service.application.reconciliation import reconcile_export
from ledger_service.domain import moves
from ledger_service.domain.clock import ManualClock
from ledger_service.domain.errors import BookingAlreadyEnded
from ledger_service.domain.events import Outcome
from ledger_service.domain.reconcile import ExportFormat, RowStatus
from ledger_service.storage import horizon
from ledger_service.storage.sql import SqlStore
from tests.storage.conftest import RECALL, START_US

pytestmark = pytest.mark.postgres

EXPORT = b"lane,reservation_id,billed_nanos\nrecall,r-1,120\n"


def _reconciled_behind_a_hole(store: SqlStore, hole_before_settle: bool) -> Ledger:
    """recall's r-1 settled UNKNOWN, then reconciled, with a hole (a repeated
    Reserve's unused seq) that no read has passed before all its events, or
    between its Reserve and its Settle."""
    ledger = Ledger(store, ManualClock(START_US))
    ledger.put_lane(dataclasses.replace(RECALL, lane="recall"))
    reserve = moves.ReserveCommand("recall", "r-1", "jev", 1000, 10)
    if not hole_before_settle:
        first = moves.ReserveCommand("recall", "r-0", "jev", 1000, 10)
        assert ledger.reserve(first).admitted
        assert ledger.reserve(first).admitted  # a repeat: its seq is a hole
    assert ledger.reserve(reserve).admitted
    if hole_before_settle:
        assert ledger.reserve(reserve).admitted
    ledger.settle(moves.SettleCommand("recall", "r-1", Outcome.UNKNOWN))
    report = reconcile_export(ledger, EXPORT, ExportFormat.CSV, "recall")
    assert report.applied and report.count(RowStatus.CORRECTED) == 1
    return ledger


@pytest.fixture
def horizon_reads(monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """Every time a read asks the commit horizon, from now on: behind a hole or
    another lane's append in flight it waits up to a second, here holding the
    lane's lock, and still stops short of the booking's own events."""
    asked: list[int | None] = []
    advance = horizon.CommitHorizon.advance

    def noting(self: horizon.CommitHorizon, connection: Any, wanted: int | None = None) -> int:
        asked.append(wanted)
        return advance(self, connection, wanted)

    monkeypatch.setattr(horizon.CommitHorizon, "advance", noting)
    return asked


def test_a_late_settle_of_a_reconciled_booking_is_refused_not_an_internal_error(
    postgres_store: SqlStore, horizon_reads: list[int | None]
) -> None:
    ledger = _reconciled_behind_a_hole(postgres_store, hole_before_settle=False)
    late = moves.SettleCommand("recall", "r-1", Outcome.SUCCEEDED, input_tokens=100)
    horizon_reads.clear()
    with pytest.raises(BookingAlreadyEnded):
        ledger.settle(late)
    assert horizon_reads == [], "the Settle read its booking's history up to the horizon"


def test_a_repeated_settle_of_a_reconciled_booking_gets_its_first_answer(
    postgres_store: SqlStore,
) -> None:
    ledger = _reconciled_behind_a_hole(postgres_store, hole_before_settle=True)
    again = ledger.settle(moves.SettleCommand("recall", "r-1", Outcome.UNKNOWN))
    assert again.charged_nanos != 120  # the hold it was first charged, not the bill


def test_a_repeated_settle_of_a_reconciled_booking_does_not_wait_holding_the_lane(
    postgres_store: SqlStore, horizon_reads: list[int | None]
) -> None:
    """No hole at all: the history read still waited the horizon's whole 1 s
    for the move's own seq, holding the lane's lock, on every such repeat."""
    ledger = Ledger(postgres_store, ManualClock(START_US))
    ledger.put_lane(dataclasses.replace(RECALL, lane="recall"))
    assert ledger.reserve(moves.ReserveCommand("recall", "r-1", "jev", 1000, 10)).admitted
    first = ledger.settle(moves.SettleCommand("recall", "r-1", Outcome.UNKNOWN))
    assert reconcile_export(ledger, EXPORT, ExportFormat.CSV, "recall").applied
    horizon_reads.clear()
    again = ledger.settle(moves.SettleCommand("recall", "r-1", Outcome.UNKNOWN))
    assert again.charged_nanos == first.charged_nanos
    assert horizon_reads == [], "the Settle read its booking's history up to the horizon"
