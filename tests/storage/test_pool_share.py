"""Lanes do not wait on each other for PostgreSQL's connections (docs/semantics.md,
limits): one grant whose calls are all held at the database (here by locks on
its lanes' rows that the test holds, as slow or locked lanes hold them) keeps
at most its share of the server's pool, and another grant's Reserve on another
lane still finds a connection and is answered within its deadline."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import sqlalchemy as sa

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.server import LedgerServer
from ledger_service.settings import Settings
from tests.conftest import lane_message
from tests.test_e2e_grant_share import _connection, _grant, _reserve

pytestmark = pytest.mark.postgres

_DEFAULTS = {field.name: field.default for field in dataclasses.fields(Settings)}
# The pool's connections at the defaults (16 and 4 more), and one grant's share.
POOL: int = _DEFAULTS["pool_size"] + _DEFAULTS["pool_max_overflow"]  # type: ignore[operator]
SHARE: int = _DEFAULTS["max_connections_per_grant"]  # type: ignore[assignment]
# More of the flood's calls than the pool has connections, each on a lane of
# its own: one lane's moves in a server take one connection at a time
# (storage/lane_commit.py).
FLOOD_CALLS = 2 * POOL
# Each of two floods' calls: more than the pool has connections.
TWO_FLOODS_CALLS = 40
WAIT_SECONDS = 30.0
# Longer than the test: the flood's calls wait for the lock, not for a deadline.
HELD_SECONDS = 120.0
# The calm lane's deadline: longer than a Reserve takes on a loaded machine,
# shorter than the flood is held.
CALM_SECONDS = 10.0


def _waiting(observer: sa.Connection) -> int:
    """Sessions of the database waiting for a lock: the first of the flood's
    moves for the row the test locked, the others for that move's lock on the
    lane. `observer` commits each read: a transaction sees one snapshot of
    pg_stat_activity."""
    return int(
        observer.execute(
            sa.text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND cardinality(pg_blocking_pids(pid)) > 0"
            )
        ).scalar_one()
    )


@dataclasses.dataclass
class Floods:
    """Grants whose lanes' rows the test holds FOR UPDATE, each with calls at
    the server that wait for its lane, until `release`; a calm lane beside."""

    server: LedgerServer
    stack: contextlib.ExitStack
    holder: sa.Connection
    observer: sa.Connection
    calls: list[grpc.Future]

    def flood(self, name: str, calls: int) -> None:
        """`calls` Reserves of one grant, each on a lane of its own (`_lanes`)."""
        lanes = _lanes(name, calls)
        stub = pb_grpc.LedgerStub(
            self.stack.enter_context(_connection(self.server, _grant(self.server, *lanes)))
        )
        self.calls += [
            stub.Reserve.future(_reserve(lane, f"{lane}-r"), timeout=HELD_SECONDS) for lane in lanes
        ]

    def wait_at_the_lock(self, sessions: int) -> None:
        """Until `sessions` of the floods' calls wait at the database."""
        give_up = time.monotonic() + WAIT_SECONDS
        while _waiting(self.observer) < sessions:
            assert time.monotonic() < give_up, f"{_waiting(self.observer)} flood calls at the lock"
            time.sleep(0.05)

    def calm_reserve(self) -> pb.ReserveResponse:
        stub = pb_grpc.LedgerStub(
            self.stack.enter_context(_connection(self.server, _grant(self.server, "calm")))
        )
        return stub.Reserve(_reserve("calm", "c1"), timeout=CALM_SECONDS)

    def release(self) -> list[pb.ReserveResponse]:
        """Lets the lanes go; every flood call's answer."""
        self.holder.rollback()
        return [call.result() for call in self.calls]


def _lanes(name: str, calls: int) -> list[str]:
    return [f"{name}-{number}" for number in range(calls)]


@contextlib.contextmanager
def held_lanes(
    url: str, start_ledger_server: Callable[..., LedgerServer], flooded: list[str]
) -> Iterator[Floods]:
    """A server whose `flooded` lanes' rows the test holds, for calls that wait
    for the lock rather than their deadline."""
    server = start_ledger_server(
        database_url=url,
        request_deadline_seconds=HELD_SECONDS,
        statement_timeout_ms=int(HELD_SECONDS * 1000),
    )
    holder_engine = sa.create_engine(url)
    with contextlib.ExitStack() as stack:
        stack.callback(holder_engine.dispose)
        admin = pb_grpc.LaneAdminStub(stack.enter_context(_connection(server, server.admin_grant)))
        for lane in (*flooded, "calm"):
            admin.PutLane(pb.PutLaneRequest(lane=lane_message(lane)), timeout=WAIT_SECONDS)
        holder = stack.enter_context(holder_engine.connect())
        observer = stack.enter_context(
            holder_engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        )
        holder.execute(
            sa.text("SELECT lane FROM lanes WHERE lane = ANY(:lanes) FOR UPDATE"),
            {"lanes": list(flooded)},
        )
        floods = Floods(server, stack, holder, observer, [])
        try:
            yield floods
        finally:
            holder.rollback()
            for call in floods.calls:
                call.exception()


def test_a_grant_held_at_the_database_leaves_connections_to_another_lane(
    postgres_schema_url: str, start_ledger_server: Callable[..., LedgerServer]
) -> None:
    flooded = _lanes("flood", FLOOD_CALLS)
    with held_lanes(postgres_schema_url, start_ledger_server, flooded) as floods:
        floods.flood("flood", FLOOD_CALLS)
        # The flood's calls hold their share of the connections (before,
        # every one of them), each waiting for its lane's row.
        floods.wait_at_the_lock(SHARE)
        assert floods.calm_reserve().decision == pb.ADMITTED
        # Still held: the calm lane did not get in because the flood let go,
        # and the flood holds its share, not one connection more.
        assert not any(call.done() for call in floods.calls)
        assert _waiting(floods.observer) == SHARE
        # Calls past the grant's share waited their turn, and were served once
        # the lock was let go, not refused.
        answers = floods.release()
    assert {answer.decision for answer in answers} == {pb.ADMITTED}


def test_two_grants_held_at_the_database_leave_a_connection_to_a_third(
    postgres_schema_url: str, start_ledger_server: Callable[..., LedgerServer]
) -> None:
    """Two floods at once took 16 + 4, every connection, and a third lane's
    Reserve waited for one until its deadline: the pool's last connection is
    kept for a grant that holds none."""
    flooded = _lanes("flood-a", TWO_FLOODS_CALLS) + _lanes("flood-b", TWO_FLOODS_CALLS)
    with held_lanes(postgres_schema_url, start_ledger_server, flooded) as floods:
        for name in ("flood-a", "flood-b"):
            floods.flood(name, TWO_FLOODS_CALLS)
        floods.wait_at_the_lock(POOL - 1)
        assert floods.calm_reserve().decision == pb.ADMITTED
        assert not any(call.done() for call in floods.calls)
        assert _waiting(floods.observer) == POOL - 1
        answers = floods.release()
    assert {answer.decision for answer in answers} == {pb.ADMITTED}
