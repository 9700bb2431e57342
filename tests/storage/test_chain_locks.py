"""A move locks its lane's row and then each ancestor's, each parent read
from the row just locked (migration 0007's ledger_lock_chain), in one round
trip. Read before the locks were granted, the chain could be one a PutLane
has since changed: after a PutLane moves a leaf from team-a to team-b (one
root), a move on the leaf that waited for it would hold team-a and the root
before team-b, while a move under team-b locks team-b and then the root, and
two plain moves would deadlock (40P01, retried after deadlock_timeout)."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import pytest
from sqlalchemy import text

from ledger_service.application.ledger import Ledger
from ledger_service.domain import moves
from ledger_service.domain.clock import ManualClock
from ledger_service.storage.sql import SqlStore, SqlTransaction
from tests.storage.conftest import RECALL, START_US

pytestmark = pytest.mark.postgres


def _one_root_two_teams(store: SqlStore) -> Ledger:
    """root <- team-a <- leaf, and root <- team-b <- sib."""
    ledger = Ledger(store, ManualClock(START_US))
    for lane, parent in (
        ("root", None),
        ("team-a", "root"),
        ("team-b", "root"),
        ("leaf", "team-a"),
        ("sib", "team-b"),
    ):
        ledger.put_lane(dataclasses.replace(RECALL, lane=lane, parent=parent))
    return ledger


def test_two_moves_do_not_deadlock_after_a_leaf_moved_between_teams(
    postgres_store: SqlStore,
    monkeypatch: pytest.MonkeyPatch,
    retried_codes: list[str | None],
) -> None:
    ledger = _one_root_two_teams(postgres_store)
    roles: dict[int, str] = {}
    hold_commit, put_paused = threading.Event(), threading.Event()
    leaf_paused, leaf_go = threading.Event(), threading.Event()
    commit, lock_lane = SqlTransaction.commit, SqlTransaction.lock_lane

    def pausing_commit(tx: SqlTransaction) -> None:
        if roles.get(threading.get_ident()) == "put":
            put_paused.set()
            assert hold_commit.wait(30)
        commit(tx)

    def pausing_lock(
        tx: SqlTransaction, lane: str, reservation_id: str = "", **options: Any
    ) -> Any:
        policy = lock_lane(tx, lane, reservation_id, **options)
        if (
            roles.get(threading.get_ident()) == "leaf"
            and lane == "leaf"
            and not leaf_paused.is_set()
        ):
            leaf_paused.set()  # its first lock statement done
            assert leaf_go.wait(30)
        return policy

    monkeypatch.setattr(SqlTransaction, "commit", pausing_commit)
    monkeypatch.setattr(SqlTransaction, "lock_lane", pausing_lock)
    done: dict[str, Any] = {}

    def run(role: str, work: Any) -> None:
        roles[threading.get_ident()] = role
        done[role] = work()

    move_leaf = dataclasses.replace(RECALL, lane="leaf", parent="team-b")
    put = threading.Thread(target=run, args=("put", lambda: ledger.put_lane(move_leaf)))
    put.start()
    assert put_paused.wait(30)
    leaf_reserve = moves.ReserveCommand("leaf", "r-leaf", "jev", 1000, 10)
    leaf = threading.Thread(target=run, args=("leaf", lambda: ledger.reserve(leaf_reserve)))
    leaf.start()
    autocommit = postgres_store.engine.execution_options(isolation_level="AUTOCOMMIT")
    waiting = text(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE wait_event_type = 'Lock' AND query LIKE '%ledger_lock_chain%'"
    )
    with autocommit.connect() as probe:
        for _ in range(3000):
            if probe.execute(waiting).scalar_one():
                break
            time.sleep(0.01)
        else:
            pytest.fail("the leaf's move never waited for the PutLane")
        hold_commit.set()
        put.join(30)
        assert leaf_paused.wait(30)
        sib_reserve = moves.ReserveCommand("sib", "r-sib", "jev", 1000, 10)
        sib = threading.Thread(target=run, args=("sib", lambda: ledger.reserve(sib_reserve)))
        sib.start()
        for _ in range(500):  # sib's move completes, or waits for a lock the leaf's holds
            if "sib" in done or probe.execute(waiting).scalar_one():
                break
            time.sleep(0.01)
    leaf_go.set()
    leaf.join(30)
    sib.join(30)
    assert done["leaf"].admitted and done["sib"].admitted
    assert "40P01" not in retried_codes, f"two moves deadlocked: {retried_codes}"


def test_a_put_lane_that_moves_a_lane_within_a_root_does_not_deadlock_with_moves(
    postgres_store: SqlStore,
    monkeypatch: pytest.MonkeyPatch,
    retried_codes: list[str | None],
) -> None:
    """A PutLane moving a leaf from team-a to team-b (one root) locks both
    teams before the root. Were it to lock team-a's chain, root included,
    before team-b, a Reserve under team-b holding team-b and waiting for the
    root would deadlock with it."""
    ledger = _one_root_two_teams(postgres_store)
    putting: list[int] = []
    paused, go_on = threading.Event(), threading.Event()
    lock_lane = SqlTransaction.lock_lane

    def pausing(tx: SqlTransaction, lane: str, reservation_id: str = "", **options: Any) -> Any:
        policy = lock_lane(tx, lane, reservation_id, **options)
        if threading.get_ident() in putting and lane == "team-a" and not paused.is_set():
            paused.set()
            assert go_on.wait(30)
        return policy

    monkeypatch.setattr(SqlTransaction, "lock_lane", pausing)
    done: dict[str, Any] = {}

    def put() -> None:
        putting.append(threading.get_ident())
        done["put"] = ledger.put_lane(dataclasses.replace(RECALL, lane="leaf", parent="team-b"))

    mover = threading.Thread(target=put)
    mover.start()
    assert paused.wait(30)
    sib = threading.Thread(
        target=lambda: done.update(
            sib=ledger.reserve(moves.ReserveCommand("sib", "r-sib", "jev", 1000, 10))
        )
    )
    sib.start()
    sib.join(2)  # it completes, unless the PutLane holds the root
    go_on.set()
    mover.join(30)
    sib.join(30)
    assert done["sib"].admitted and done["put"].parent == "team-b"
    assert "40P01" not in retried_codes, f"a PutLane and a move deadlocked: {retried_codes}"
