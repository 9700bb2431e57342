"""A reconcile locks the lanes of its export and every budget above them in
one transaction. A move locks its lane and then each ancestor (strictly
decreasing depth); a reconcile that locked each named lane's chain in turn,
the lanes in name order, could hold a parent and wait for a sibling's lane
that a move on the sibling holds while it waits for the parent: a deadlock
(40P01, detected after deadlock_timeout and retried). Each test pauses the
transactions at chosen points to force the interleaving."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import text

from ledger_service.application.ledger import Ledger
from ledger_service.application.reconciliation import reconcile_export
from ledger_service.domain import moves
from ledger_service.domain.clock import ManualClock
from ledger_service.domain.events import Outcome
from ledger_service.domain.reconcile import ExportFormat, RowStatus
from ledger_service.storage.sql import SqlStore, SqlTransaction
from tests.storage.conftest import RECALL, START_US

pytestmark = pytest.mark.postgres

CSV_HEADER = "lane,reservation_id,billed_nanos\n"
# Lock waits in this database other than the probe's own.
WAITING = text(
    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
    " AND datname = current_database() AND pid <> pg_backend_pid()"
)


def _tree(store: SqlStore, edges: tuple[tuple[str, str | None], ...]) -> Ledger:
    ledger = Ledger(store, ManualClock(START_US))
    for lane, parent in edges:
        ledger.put_lane(dataclasses.replace(RECALL, lane=lane, parent=parent))
    return ledger


def _unknown_booking(ledger: Ledger, lane: str, reservation_id: str) -> None:
    """A booking settled with an unknown outcome: a reconcile corrects it."""
    assert ledger.reserve(moves.ReserveCommand(lane, reservation_id, "jev", 1000, 10)).admitted
    ledger.settle(moves.SettleCommand(lane, reservation_id, Outcome.UNKNOWN))


class Roles:
    """Names the thread each piece of work runs on, and keeps its answer."""

    def __init__(self) -> None:
        self.of: dict[int, str] = {}
        self.done: dict[str, Any] = {}
        self.failed: dict[str, BaseException] = {}

    def current(self) -> str | None:
        return self.of.get(threading.get_ident())

    def start(self, role: str, work: Callable[[], Any]) -> threading.Thread:
        def run() -> None:
            self.of[threading.get_ident()] = role
            try:
                self.done[role] = work()
            except BaseException as error:  # reported by the test
                self.failed[role] = error

        thread = threading.Thread(target=run)
        thread.start()
        return thread


def _pause_after_lock(
    monkeypatch: pytest.MonkeyPatch, roles: Roles, role: str, lane: str
) -> tuple[threading.Event, threading.Event]:
    """Pauses `role`'s transaction once, just after its lock of `lane`."""
    paused, go_on = threading.Event(), threading.Event()
    lock_lane = SqlTransaction.lock_lane

    def pausing(tx: SqlTransaction, name: str, reservation_id: str = "", **options: Any) -> Any:
        policy = lock_lane(tx, name, reservation_id, **options)
        if roles.current() == role and name == lane and not paused.is_set():
            paused.set()
            assert go_on.wait(30)
        return policy

    monkeypatch.setattr(SqlTransaction, "lock_lane", pausing)
    return paused, go_on


def _wait_until(store: SqlStore, done: Callable[[], bool], what: str) -> None:
    """Until `done()`, or until another transaction waits for a lock."""
    autocommit = store.engine.execution_options(isolation_level="AUTOCOMMIT")
    with autocommit.connect() as probe:
        for _ in range(3000):
            if done() or probe.execute(WAITING).scalar_one():
                return
            time.sleep(0.01)
    pytest.fail(f"{what} neither completed nor waited for a lock")


def test_a_reconcile_does_not_deadlock_with_a_move_on_a_sibling_lane(
    postgres_store: SqlStore,
    monkeypatch: pytest.MonkeyPatch,
    retried_codes: list[str | None],
) -> None:
    """hub <- leaf-1, hub <- leaf-2. A reconcile of both leaves that holds hub
    and leaf-1 (leaf-1's chain first, or every lane in name order) waits for
    leaf-2, which a Reserve on leaf-2 holds while it waits for hub."""
    ledger = _tree(postgres_store, (("hub", None), ("leaf-1", "hub"), ("leaf-2", "hub")))
    _unknown_booking(ledger, "leaf-1", "r-1")
    _unknown_booking(ledger, "leaf-2", "r-2")
    roles = Roles()
    paused, go_on = _pause_after_lock(monkeypatch, roles, "reconcile", "leaf-1")
    export = (CSV_HEADER + "leaf-1,r-1,120\nleaf-2,r-2,130\n").encode()
    reconciler = roles.start(
        "reconcile", lambda: reconcile_export(ledger, export, ExportFormat.CSV, "leaf-1")
    )
    assert paused.wait(30)
    reserve = moves.ReserveCommand("leaf-2", "r-3", "jev", 1000, 10)
    mover = roles.start("move", lambda: ledger.reserve(reserve))
    # The Reserve completes, or waits for a lock the paused reconcile holds.
    _wait_until(postgres_store, lambda: "move" in roles.done, "the Reserve on leaf-2")
    go_on.set()
    reconciler.join(30)
    mover.join(30)
    assert not roles.failed, roles.failed
    assert roles.done["move"].admitted
    report = roles.done["reconcile"]
    assert report.applied and report.count(RowStatus.CORRECTED) == 2
    assert "40P01" not in retried_codes, f"a reconcile and a move deadlocked: {retried_codes}"


def test_a_reconcile_does_not_deadlock_with_a_put_lane_that_moves_a_lane_deeper(
    postgres_store: SqlStore,
    monkeypatch: pytest.MonkeyPatch,
    retried_codes: list[str | None],
) -> None:
    """root <- team-a <- leaf, root <- deep-1 <- deep-2 <- m; a PutLane moves
    leaf under deep-2. It locks leaf first, then team-a, then deep-2 and
    deep-1, then root. A reconcile of leaf and m ordering by depth as read
    before the PutLane committed would lock m, deep-2 and then wait for leaf
    (deep-2 and leaf both at depth 2), while the PutLane holds leaf and waits
    for deep-2."""
    ledger = _tree(
        postgres_store,
        (
            ("root", None),
            ("team-a", "root"),
            ("deep-1", "root"),
            ("deep-2", "deep-1"),
            ("leaf", "team-a"),
            ("m", "deep-2"),
        ),
    )
    _unknown_booking(ledger, "leaf", "r-leaf")
    _unknown_booking(ledger, "m", "r-m")
    roles = Roles()
    paused, go_on = _pause_after_lock(monkeypatch, roles, "put", "leaf")
    move_leaf = dataclasses.replace(RECALL, lane="leaf", parent="deep-2")
    putter = roles.start("put", lambda: ledger.put_lane(move_leaf))
    assert paused.wait(30)
    export = (CSV_HEADER + "leaf,r-leaf,120\nm,r-m,130\n").encode()
    reconciler = roles.start(
        "reconcile", lambda: reconcile_export(ledger, export, ExportFormat.CSV, "m")
    )
    # The reconcile waits for a lock the paused PutLane holds (leaf's row, or
    # the configuration lock).
    _wait_until(postgres_store, lambda: "reconcile" in roles.done, "the reconcile")
    go_on.set()
    putter.join(30)
    reconciler.join(30)
    assert not roles.failed, roles.failed
    assert roles.done["put"].parent == "deep-2"
    report = roles.done["reconcile"]
    assert report.applied and report.count(RowStatus.CORRECTED) == 2
    assert "40P01" not in retried_codes, f"a reconcile and a PutLane deadlocked: {retried_codes}"
