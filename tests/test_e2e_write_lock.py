"""SQLite's write lock held by another process (a `sqlite3` shell, a script
with BEGIN IMMEDIATE open on the ledger's file): every blocked move is
answered by the server before its caller's deadline, UNAVAILABLE with the
reason STORE_UNAVAILABLE (safe to retry), and health is NOT_SERVING while the
lock is held past the busy timeout, SERVING again by itself once it is let go.
A retry with the same id is then answered as a first call would be."""

from __future__ import annotations

import dataclasses
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ledger_service.api.deadlines import ANSWER_MARGIN_SECONDS
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.server import LedgerServer
from ledger_service.storage import database
from tests.conftest import lane_message

CALLS = 48
# The shortest deadline whose answer margin is the whole ANSWER_MARGIN_SECONDS
# (a tenth of a shorter one): at 1 s, 0.1 s less the answer's way back left
# some answers 4 ms to spare with the load average at 5, and none at 15.
SHORTEST_DEADLINE_SECONDS = 10 * ANSWER_MARGIN_SECONDS
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclasses.dataclass(frozen=True)
class _Answer:
    deadline_seconds: float
    taken_seconds: float
    code: grpc.StatusCode
    reason: str


def _reserve(rid: str) -> pb.ReserveRequest:
    return pb.ReserveRequest(
        lane="recall", reservation_id=rid, model="jev", request_bytes=35_000,
        max_output_tokens=1000,
    )  # fmt: skip


def _status(channel: grpc.Channel) -> int:
    health = health_pb2_grpc.HealthStub(channel)
    return int(health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status)


def _wait_for(channel: grpc.Channel, status: int, seconds: float) -> None:
    give_up = time.monotonic() + seconds
    while _status(channel) != status:
        assert time.monotonic() < give_up, f"health never became {status}"
        time.sleep(0.1)


def test_moves_behind_another_process_write_lock_are_answered_before_their_deadline(
    server: LedgerServer,
    ledger_harness: Any,
    open_ledger_channel: Callable[[LedgerServer], grpc.Channel],
) -> None:
    ledger_harness.make_lane()
    channel = open_ledger_channel(server)
    assert _status(channel) == SERVING
    blocker = sqlite3.connect(server.settings.data_dir / "ledger.db", isolation_level=None)
    answers: dict[int, _Answer] = {}
    try:
        blocker.execute("BEGIN IMMEDIATE")  # another process's write lock

        def call(index: int) -> None:
            deadline_seconds = SHORTEST_DEADLINE_SECONDS + (index % 8) / 8
            started = time.monotonic()
            try:
                ledger_harness.ledger.Reserve(
                    _reserve(f"blocked-{index}"), timeout=deadline_seconds
                )
                code, reason = grpc.StatusCode.OK, ""
            except grpc.RpcError as error:
                assert isinstance(error, grpc.Call)
                code = error.code()
                reason = str(dict(error.trailing_metadata() or ()).get("ledger-reason", ""))
            answers[index] = _Answer(deadline_seconds, time.monotonic() - started, code, reason)

        threads = [threading.Thread(target=call, args=(index,)) for index in range(CALLS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert len(answers) == CALLS, f"only {len(answers)} of {CALLS} calls were answered"
        expected = (grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE")
        # Each call that broke the rule: which, its deadline, how long it took, its status.
        broken = [
            f"blocked-{index}: deadline {answer.deadline_seconds:.3f} s, answered after "
            f"{answer.taken_seconds:.3f} s, {answer.code.name} {answer.reason}"
            for index, answer in sorted(answers.items())
            if (answer.code, answer.reason) != expected
        ]
        assert not broken, "\n".join(broken)
        _wait_for(channel, NOT_SERVING, seconds=15)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    _wait_for(channel, SERVING, seconds=15)
    # Safe to retry: the same ids are booked once each, as first calls.
    for index in range(CALLS):
        answer = ledger_harness.ledger.Reserve(_reserve(f"blocked-{index}"), timeout=10)
        assert answer.decision == pb.ADMITTED
    reserved = ledger_harness.events("recall", kinds=["reserved"])
    assert len(reserved) == CALLS


def test_a_stop_while_the_health_probe_waits_for_the_lock_is_clean(
    start_ledger_server: Callable[..., LedgerServer],
    open_ledger_channel: Callable[[LedgerServer], grpc.Channel],
) -> None:
    """The probe waits the busy timeout (5 s) for another process's lock; a stop
    whose grace is shorter than that waited on it and ended unclean (exit 3)."""
    server = start_ledger_server(grace_period_seconds=1.0, health_check_interval_seconds=0.1)
    channel = open_ledger_channel(server)
    pb_grpc.LaneAdminStub(channel).PutLane(
        pb.PutLaneRequest(lane=lane_message("recall")), timeout=10
    )
    blocker = sqlite3.connect(server.settings.data_dir / "ledger.db", isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.LedgerStub(channel).Reserve(_reserve("blocked"), timeout=0.5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # The probe waits for the lock holding this process's write gate.
        gate = database.write_gate(server.store.engine)
        assert gate is not None
        give_up = time.monotonic() + 10
        while not gate.locked():
            assert time.monotonic() < give_up, "the probe never waited for the lock"
            time.sleep(0.01)
        assert server.stop() is True
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
