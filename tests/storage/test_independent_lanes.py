"""Lanes commit independently on PostgreSQL, and tailing stays gap-free.

A move on lane A is held open in this process just before its COMMIT (its
event has its seq; its locks are held) while two server replicas serve moves
on lane B. Lane B must not wait for lane A, and no reader may see past lane
A's uncommitted seq: a ListEvents page or a WatchEvents stream that moved past
it would never show it once it commits.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from ledger_service.application.ledger import Ledger
from ledger_service.domain import moves
from ledger_service.domain.clock import SystemClock
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.storage import database
from ledger_service.storage.sql import SqlStore, SqlTransaction
from tests.storage.test_replicas import PRICE, Replica, _all_events

pytestmark = pytest.mark.postgres

HELD_LANE = "lane-a"
FREE_LANE = "lane-b"
TIMEOUT_SECONDS = 10.0


class HeldCommits:
    """Holds this process's commits (those of threads whose name starts with
    `thread`) until released (or fails them instead)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, thread: str = "") -> None:
        self.reached = threading.Event()
        self.release = threading.Event()
        self.fail = False
        commit = SqlTransaction.commit

        def holding(tx: SqlTransaction) -> None:
            if not threading.current_thread().name.startswith(thread):
                commit(tx)
                return
            self.reached.set()
            assert self.release.wait(60), "the held commit was never released"
            if self.fail:
                raise RuntimeError("this move fails just before its commit")
            commit(tx)

        monkeypatch.setattr(SqlTransaction, "commit", holding)


@pytest.fixture
def cluster(postgres_schema_url: str, tmp_path: Path) -> Iterator[tuple[Replica, Replica, Ledger]]:
    first = Replica(postgres_schema_url, tmp_path / "a")
    second = Replica(postgres_schema_url, tmp_path / "b")
    for lane in (HELD_LANE, FREE_LANE):
        policy = pb.Lane(lane=lane, limit_nanos=10**12, prices={"jev": PRICE})
        first.admin.PutLane(pb.PutLaneRequest(lane=policy), timeout=TIMEOUT_SECONDS)
    engine = database.create(postgres_schema_url, database.EngineLimits(pool_size=4))
    store = SqlStore(engine, request_deadline_seconds=60.0)
    try:
        yield first, second, Ledger(store, SystemClock())
    finally:
        store.close()
        first.stop()
        second.stop()


def _reserve(replica: Replica, lane: str, rid: str) -> pb.ReserveResponse:
    request = pb.ReserveRequest(
        lane=lane, reservation_id=rid, model="jev", request_bytes=1000, max_output_tokens=10
    )
    answer: pb.ReserveResponse = replica.ledger.Reserve(request, timeout=TIMEOUT_SECONDS)
    return answer


def _held_reserve(ledger: Ledger, rid: str) -> moves.ReserveCommand:
    return moves.ReserveCommand(
        lane=HELD_LANE, reservation_id=rid, model="jev", request_bytes=1000, max_output_tokens=10
    )


def test_a_lane_commits_while_another_lanes_commit_is_held(
    cluster: tuple[Replica, Replica, Ledger], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second, ledger = cluster
    held = HeldCommits(monkeypatch)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        holding = pool.submit(ledger.reserve, _held_reserve(ledger, "held"))
        assert held.reached.wait(TIMEOUT_SECONDS)
        # Lane B, on both replicas, while lane A's transaction is open.
        for index, replica in enumerate((first, second, first, second)):
            assert _reserve(replica, FREE_LANE, f"b-{index}").decision == pb.ADMITTED
        # Lane A's own lock still serializes lane A.
        queued = pool.submit(_reserve, first, HELD_LANE, "queued")
        with pytest.raises(concurrent.futures.TimeoutError):
            queued.result(timeout=0.5)
        held.release.set()
        assert holding.result(timeout=TIMEOUT_SECONDS).admitted
        assert queued.result(timeout=TIMEOUT_SECONDS).decision == pb.ADMITTED


def _watch(replica: Replica, into: list[pb.Event], until_seq: list[int]) -> None:
    """Streams every event into `into` until it holds one at `until_seq[0]`."""
    stream = replica.ledger.WatchEvents(pb.WatchEventsRequest(after_seq=0), timeout=60)
    try:
        for event in stream:
            into.append(event)
            if until_seq and event.seq >= until_seq[0]:
                break
    except grpc.RpcError:
        pass  # the servers stopped first: what was streamed is checked
    finally:
        stream.cancel()


def test_tailing_waits_for_a_late_commit_and_never_skips_it(
    cluster: tuple[Replica, Replica, Ledger], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second, ledger = cluster
    watched: list[pb.Event] = []
    until_seq: list[int] = []
    watcher = threading.Thread(target=_watch, args=(second, watched, until_seq), daemon=True)
    watcher.start()
    held = HeldCommits(monkeypatch)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        holding = pool.submit(ledger.reserve, _held_reserve(ledger, "late"))
        assert held.reached.wait(TIMEOUT_SECONDS)
        for index in range(6):
            _reserve((first, second)[index % 2], FREE_LANE, f"after-{index}")
        # Pages read while the late event is in flight stop before it.
        during = [event.seq for event in _all_events(first)]
        held.release.set()
        late = holding.result(timeout=TIMEOUT_SECONDS).event
    events = _all_events(second)
    everything = [event.seq for event in events]
    assert everything == sorted(set(everything))
    later = [event.seq for event in events if event.reservation_id.startswith("after-")]
    assert len(later) == 6 and late.seq < min(later)
    assert late.seq in everything
    assert during and max(during) < late.seq
    # The stream, once it has caught up, holds every event once, in order.
    until_seq.append(everything[-1])
    _reserve(first, FREE_LANE, "wake-the-watcher")
    watcher.join(timeout=TIMEOUT_SECONDS)
    assert not watcher.is_alive()
    assert [event.seq for event in watched][: len(everything)] == everything


def test_a_rolled_back_append_leaves_a_hole_that_readers_pass(
    cluster: tuple[Replica, Replica, Ledger], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second, ledger = cluster
    held = HeldCommits(monkeypatch)
    held.fail = True
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        failing = pool.submit(ledger.reserve, _held_reserve(ledger, "doomed"))
        assert held.reached.wait(TIMEOUT_SECONDS)
        _reserve(second, FREE_LANE, "after-the-hole")
        held.release.set()
        with pytest.raises(RuntimeError):
            failing.result(timeout=TIMEOUT_SECONDS)
    events = _all_events(first)
    seqs = [event.seq for event in events]
    assert "after-the-hole" in {event.reservation_id for event in events}
    assert "doomed" not in {event.reservation_id for event in events}
    # The hole is where the failed append's seq was: never filled, never waited on.
    assert set(range(1, max(seqs) + 1)) - set(seqs)
