"""Replicas whose clocks disagree share one database. A lane's time is the
latest any of them has moved its window to: a replica whose clock lags never
dates a move before what another recorded, so the bookings that one dated
ahead stay in the window and the budget holds (both databases)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import pytest

from ledger_service.application import budgets
from ledger_service.application.audit import Auditor
from ledger_service.application.ledger import Ledger
from ledger_service.application.ports import EventQuery
from ledger_service.application.reconciliation import reconcile_export
from ledger_service.domain.clock import ManualClock
from ledger_service.domain.events import EventKind, Outcome
from ledger_service.domain.moves import ReserveCommand, SettleCommand
from ledger_service.domain.reconcile import ExportFormat
from ledger_service.storage import database, migrate
from ledger_service.storage.sql import SqlStore
from tests.storage.conftest import RECALL, START_US

HOLD = 1400  # 35,000 request bytes and 1,000 output tokens at the RECALL prices
LEAD_US = 10 * 60 * 1_000_000  # the faster replica's clock runs ten minutes ahead


def _reserve(rid: str, lane: str = "recall") -> ReserveCommand:
    return ReserveCommand(lane, rid, "jev", 35_000, 1000)


def _replicas(store: SqlStore) -> tuple[Ledger, Ledger]:
    ahead = Ledger(store, ManualClock(START_US + LEAD_US), verify_windows=True)
    behind = Ledger(store, ManualClock(START_US), verify_windows=True)
    return ahead, behind


def test_a_lagging_replica_counts_what_a_faster_one_booked(store: SqlStore) -> None:
    ahead, behind = _replicas(store)
    behind.put_lane(dataclasses.replace(RECALL, limit_nanos=HOLD + HOLD // 2))
    first = ahead.reserve(_reserve("r1"))
    assert first.admitted
    second = behind.reserve(_reserve("r2"))
    assert not second.admitted, "the lagging replica overbooked the lane"
    assert second.event.occurred_at_us >= first.event.occurred_at_us
    assert behind.balance("recall").totals.held_nanos == HOLD


def test_a_lagging_replica_ends_a_booking_no_earlier_than_it_was_booked(
    store: SqlStore,
) -> None:
    ahead, behind = _replicas(store)
    behind.put_lane(RECALL)
    booked = ahead.reserve(_reserve("r1")).event
    assert behind.settle(SettleCommand("recall", "r1", Outcome.UNKNOWN)).charged_nanos == HOLD
    [ending] = behind.list_events(EventQuery(lane="recall", kinds=(EventKind.SETTLED.value,)))
    assert ending.occurred_at_us >= booked.occurred_at_us


def test_a_lagging_replicas_reconcile_is_dated_no_earlier_than_the_window(
    store: SqlStore,
) -> None:
    """A reconcile is a move too: dated at the lagging replica's bare clock, it
    moved the lane's kept window back to that instant, and on PostgreSQL the
    next move there read its time from it and left out what the faster replica
    had booked ahead."""
    ahead, behind = _replicas(store)
    behind.put_lane(RECALL)
    ahead.reserve(_reserve("r0"))
    ahead.settle(SettleCommand("recall", "r0", Outcome.UNKNOWN))
    export = b"lane,reservation_id,billed_nanos\nrecall,r0,0\n"
    assert reconcile_export(behind, export, ExportFormat.CSV, "recall").applied
    [reconciled] = behind.list_events(
        EventQuery(lane="recall", kinds=(EventKind.RECONCILED.value,))
    )
    assert reconciled.occurred_at_us >= START_US + LEAD_US


@pytest.fixture
def replicas_store(postgres_schema_url: str) -> Iterator[SqlStore]:
    """PostgreSQL alone: replicas share it. (One SQLite file has one server,
    and one server's clock never runs backwards.)"""
    engine = database.create(postgres_schema_url, database.EngineLimits(pool_size=8))
    migrate.upgrade(engine)
    sql_store = SqlStore(engine, request_deadline_seconds=10.0)
    yield sql_store
    sql_store.close()


@pytest.mark.postgres
def test_a_lagging_replica_counts_what_a_faster_one_booked_after_a_put(
    replicas_store: SqlStore,
) -> None:
    """A PutLane drops the budget's kept window, and with it the latest instant
    the window had been moved to: the lagging replica then dated its next
    Reserve at its own clock, before the faster one's booking, and admitted a
    hold the budget did not have (and the lane's time ran backwards)."""
    ahead, behind = _replicas(replicas_store)
    behind.put_lane(dataclasses.replace(RECALL, limit_nanos=HOLD + HOLD // 2))
    first = ahead.reserve(_reserve("r1"))
    assert first.admitted
    behind.put_lane(dataclasses.replace(RECALL, limit_nanos=HOLD + HOLD // 2 + 1))
    second = behind.reserve(_reserve("r2"))
    assert not second.admitted, "the lagging replica overbooked the lane after a put"
    assert second.event.occurred_at_us >= first.event.occurred_at_us


@pytest.mark.postgres
@pytest.mark.parametrize("how", ["a parent's limit changed", "a lane moved under a parent"])
def test_a_lagging_replica_counts_a_parents_bookings_after_a_put(
    replicas_store: SqlStore, how: str
) -> None:
    """The same through parents: a put of the parent, or a lane put under a
    new parent with the bookings the faster replica dated ahead, must leave
    the parent's time where the faster replica moved it."""
    ahead, behind = _replicas(replicas_store)
    team = dataclasses.replace(RECALL, lane="team", limit_nanos=HOLD + HOLD // 2)
    behind.put_lane(team)
    behind.put_lane(dataclasses.replace(RECALL, lane="other"))
    booked_on = "other" if how == "a lane moved under a parent" else "sibling"
    if booked_on == "sibling":
        behind.put_lane(dataclasses.replace(RECALL, lane="sibling", parent="team"))
    behind.put_lane(dataclasses.replace(RECALL, lane="recall", parent="team"))
    first = ahead.reserve(_reserve("r1", booked_on))
    assert first.admitted
    if how == "a parent's limit changed":
        behind.put_lane(dataclasses.replace(team, limit_nanos=team.limit_nanos + 1))
    else:
        behind.put_lane(dataclasses.replace(RECALL, lane="other", parent="team"))
    second = behind.reserve(_reserve("r2"))
    assert not second.admitted, f"the lagging replica overbooked the parent ({how})"
    assert second.event.denied_by == "team"
    assert second.event.occurred_at_us >= first.event.occurred_at_us


@pytest.mark.postgres
def test_a_lagging_replicas_audit_counts_what_a_faster_one_booked(
    replicas_store: SqlStore,
) -> None:
    """An audit reads at the lane's time, as a balance does: at the lagging
    replica's bare clock it left out the booking the faster one dated ahead,
    and said the lane had a hold's room its balance did not have."""
    ahead, behind = _replicas(replicas_store)
    behind.put_lane(RECALL)
    ahead.reserve(_reserve("r1"))
    audit = Auditor(replicas_store, behind.clock).audit("recall")
    assert audit.open.count == 1, "the lagging replica's audit missed a hold"
    assert audit.balance == behind.balance("recall")


@pytest.mark.postgres
def test_a_lagging_replica_reads_a_booking_at_the_lanes_time(replicas_store: SqlStore) -> None:
    """A booking read answers at the lane's time, as a balance does: at the
    lagging replica's bare clock a hold the lane had expired (its window moved
    past the deadline by a faster replica) read back open, while the balance
    on the same replica no longer counted it held."""
    ahead, behind = _replicas(replicas_store)
    behind.put_lane(RECALL)
    behind.reserve(_reserve("r0"))  # at START_US, due 120 s later
    ahead.reserve(_reserve("r1"))  # ten minutes later: r0 is past its deadline
    booking, now_us, _ = behind.booking("recall", "r0")
    balance = behind.balance("recall")
    assert now_us == balance.as_of_us
    assert booking.is_expired_at(now_us), "read back open after the lane expired it"


def test_a_replica_whose_clock_lags_the_lanes_time_says_so_once(
    store: SqlStore, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing else measures a skew: the replica that lags sees it, as the
    lane's time ahead of its own clock, and tells it, once a minute at most."""
    monkeypatch.setattr(budgets, "_behind", budgets._BehindLog())
    ahead, behind = _replicas(store)
    behind.put_lane(RECALL)
    with caplog.at_level(logging.WARNING, logger=budgets.__name__):
        ahead.reserve(_reserve("r1"))
        assert not caplog.records, "the replica ahead has nothing to say"
        behind.reserve(_reserve("r2"))
        behind.reserve(_reserve("r3"))
    [line] = [record.getMessage() for record in caplog.records]
    assert "clock is 600.000 s behind the time of lane 'recall'" in line
