"""A balance read on PostgreSQL sees one instant of the log.

A balance moves the budget's kept window (one statement) by the bookings that
crossed its edges (another). Reads take no lock, so a move may commit between
the two: the kept window from before it, the bookings from after it. Read in
one snapshot, they always agree.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest

from ledger_service.application.audit import Auditor
from ledger_service.application.ledger import Ledger
from ledger_service.domain import moves
from ledger_service.domain.clock import ManualClock
from ledger_service.storage.sql import SqlStore, SqlTransaction
from tests.storage.conftest import RECALL, START_US

pytestmark = pytest.mark.postgres

PARENT = dataclasses.replace(RECALL, lane="team", window_us=7_200_000_000)
CHILD = dataclasses.replace(RECALL, lane="recall", parent="team", hold_ttl_us=1_000)


def test_a_balance_never_mixes_a_kept_window_with_a_later_commit(
    postgres_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = ManualClock(START_US)
    ledger = Ledger(postgres_store, clock)
    ledger.put_lane(PARENT)
    ledger.put_lane(CHILD)
    reserve = moves.ReserveCommand("recall", "gone", "jev", 1_000, 10)
    hold = ledger.reserve(reserve).event.hold_nanos
    clock.advance_us(1_000_000)
    # A move on the child keeps the parent's window, with the first booking in it.
    ledger.reserve(dataclasses.replace(reserve, reservation_id="keeps"))
    clock.advance_us(PARENT.window_us)  # both bookings out of every window, neither swept

    # The sweeper commits its expiries just after the balance read its kept window.
    read_kept = SqlTransaction.window_state
    swept = threading.Event()

    def kept_then_sweep(tx: SqlTransaction, lane: str) -> object:
        state = read_kept(tx, lane)
        if lane == "team" and not swept.is_set():
            swept.set()
            sweeper = threading.Thread(target=ledger.sweep, args=(100,))
            sweeper.start()
            sweeper.join(timeout=30)
        return state

    monkeypatch.setattr(SqlTransaction, "window_state", kept_then_sweep)
    balance = ledger.balance("team")
    assert swept.is_set()
    totals = balance.totals
    assert (totals.held_nanos, totals.charged_nanos, totals.open_bookings) == (0, 0, 0), hold
    assert balance.spent_nanos == 0


def test_an_audit_never_mixes_its_tallies_with_a_later_commit(
    postgres_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The audit reads its tallies, biggest bookings and next release in three
    statements; a Reserve that commits after the first must be in none of them."""
    clock = ManualClock(START_US)
    ledger = Ledger(postgres_store, clock)
    ledger.put_lane(RECALL)
    reserve = moves.ReserveCommand("recall", "first", "jev", 1_000, 10)
    ledger.reserve(reserve)
    clock.advance_us(1_000_000)

    read_tally = SqlTransaction.window_tally
    reserved = threading.Event()

    def tally_then_reserve(tx: SqlTransaction, *args: object) -> object:
        tallies = read_tally(tx, *args)  # type: ignore[arg-type]
        if not reserved.is_set():
            reserved.set()
            other = threading.Thread(
                target=ledger.reserve, args=(dataclasses.replace(reserve, reservation_id="late"),)
            )
            other.start()
            other.join(timeout=30)
        return tallies

    monkeypatch.setattr(SqlTransaction, "window_tally", tally_then_reserve)
    audit = Auditor(postgres_store, clock).audit("recall")
    assert reserved.is_set()
    assert audit.open.count == 1
    assert [booking.reservation_id for booking in audit.biggest] == ["first"]
