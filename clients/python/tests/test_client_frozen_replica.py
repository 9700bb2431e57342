"""A lane pointed at two replicas while one is frozen (SIGSTOP: its kernel still
accepts TCP, so its connection looks healthy and round robin keeps picking it).
The client's keepalive pings find it within the documented bound (a ping every
5 s, unanswered for 5 s: at most 10 s), and from then on every call goes to the
other replica. Measured before: with no client pings, 77 of 154 calls over 28 s
failed by their deadline, for as long as the replica stayed frozen."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import time
from collections.abc import Iterator

import pytest
from client_ledger import Admin, LedgerProcess
from ledger_client import ClientSettings, LaneClient, LedgerError

# Well past the detection bound (10 s), so a busy machine does not fail the test;
# the loop below ends as soon as the frozen replica is out of the rotation.
DETECTION_WAIT_SECONDS = 30.0
CALLS_AFTER_DETECTION = 20
SETTINGS = ClientSettings(deadline_seconds=2.0, replay_interval_seconds=None)


@pytest.fixture
def two_replicas(tmp_path: pathlib.Path) -> Iterator[tuple[list[LedgerProcess], str]]:
    """Two `ledger serve` processes sharing one keyring and lane (the second's
    data directory is a copy of the first's), and a lane grant both accept."""
    first = LedgerProcess(tmp_path / "a")
    first.data_dir.mkdir()
    first.start()
    admin = Admin(first)
    admin.put_lane("frozen", 10**15)
    admin.close()
    grant = first.issue_grant("--lane", "frozen", "--scope", "charge")
    first.stop()
    shutil.copytree(first.data_dir, tmp_path / "b")
    second = LedgerProcess(tmp_path / "b")
    replicas = [first, second]
    try:
        for replica in replicas:
            replica.start()
        yield replicas, grant
    finally:
        for replica in replicas:
            if replica._process is not None:
                os.kill(replica._process.pid, signal.SIGCONT)
            replica.stop()


def reserve_ok(client: LaneClient) -> bool:
    try:
        return client.reserve("model-a", 100, 10).admitted
    except LedgerError:
        return False


def test_calls_leave_a_frozen_replica_after_the_keepalive_finds_it(
    two_replicas: tuple[list[LedgerProcess], str],
) -> None:
    replicas, grant = two_replicas
    address = "ipv4:" + ",".join(replica.address for replica in replicas)
    with LaneClient(address, "frozen", grant=grant, settings=SETTINGS) as client:
        for _ in range(10):
            assert reserve_ok(client)
        # The replica about to freeze was in the rotation (its own database).
        assert _reserves_booked(replicas[1]) > 0
        process = replicas[1]._process
        assert process is not None
        os.kill(process.pid, signal.SIGSTOP)
        # Calls until five in a row succeed: round robin over a frozen replica
        # never gives two in a row.
        in_a_row = 0
        waited_until = time.monotonic() + DETECTION_WAIT_SECONDS
        while in_a_row < 5 and time.monotonic() < waited_until:
            in_a_row = in_a_row + 1 if reserve_ok(client) else 0
        outcomes = [reserve_ok(client) for _ in range(CALLS_AFTER_DETECTION)]
    assert outcomes.count(True) == CALLS_AFTER_DETECTION, outcomes


def _reserves_booked(replica: LedgerProcess) -> int:
    admin = Admin(replica)
    try:
        return len(admin.booking_events("frozen"))
    finally:
        admin.close()
