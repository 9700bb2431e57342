"""One connection cannot take every call slot of the server: a client's
calls past `max_calls_per_connection` at once wait in its own connection
(HTTP/2's concurrent-stream limit), so another lane's connection still gets
in (docs/semantics.md, limits)."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable

import grpc
import pytest

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.server import LedgerServer
from ledger_service.storage import database
from tests.conftest import GrantInterceptor, lane_message

# Long enough for any machine: the calls are let go by the test, not ended by
# their deadline.
HELD_SECONDS = 60.0


def _stub(server: LedgerServer) -> tuple[grpc.Channel, pb_grpc.LedgerStub]:
    # A connection of its own: channels with the same arguments share one.
    raw = grpc.insecure_channel(
        f"127.0.0.1:{server.port}", options=[("grpc.use_local_subchannel_pool", 1)]
    )
    channel = grpc.intercept_channel(raw, GrantInterceptor(server.admin_grant))
    return raw, pb_grpc.LedgerStub(channel)


def _reserve(rid: str) -> pb.ReserveRequest:
    return pb.ReserveRequest(
        lane="recall", reservation_id=rid, model="jev", request_bytes=4_000, max_output_tokens=100
    )


def test_one_connection_cannot_take_every_call_slot(
    start_ledger_server: Callable[..., LedgerServer], caplog: pytest.LogCaptureFixture
) -> None:
    server = start_ledger_server(
        max_concurrent_rpcs=4, max_calls_per_connection=2, max_watchers=1, max_watchers_per_grant=1
    )
    flood_channel, flood = _stub(server)
    calm_channel, calm = _stub(server)
    pb_grpc.LaneAdminStub(
        grpc.intercept_channel(calm_channel, GrantInterceptor(server.admin_grant))
    ).PutLane(pb.PutLaneRequest(lane=lane_message("recall")), timeout=10)
    # Another process's write lock holds every Reserve in the server until it
    # is let go: the flood's calls keep their slots for as long as the test
    # needs, whatever the machine's speed (no deadline ends them first).
    holder = sqlite3.connect(str(server.settings.data_dir / "ledger.db"), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        flooding = [flood.Reserve.future(_reserve(f"f{n}"), timeout=HELD_SECONDS) for n in range(4)]
        # The flood's calls are at the server, or waiting in its connection:
        # the server says a move waits for the lock, and two calls run.
        _until(
            lambda: (
                any(r.getMessage().startswith(database.LOCK_HELD) for r in caplog.records)
                and server.call_shares.running() >= 2
            ),
            "no flood call reached the server",
        )
        calm_call = calm.Reserve.future(_reserve("c"), timeout=HELD_SECONDS)
        # Let in: counted at the server beside the flood's two, not refused
        # for want of a slot (which would end the calm call at once).
        _until(
            lambda: server.call_shares.running() == 3 or calm_call.done(),
            "the calm call was neither let in nor refused",
        )
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    try:
        # The lock let go, every call is served: the calm one too.
        assert calm_call.code() is grpc.StatusCode.OK, calm_call.code()
        assert [call.code() for call in flooding] == [grpc.StatusCode.OK] * 4
    finally:
        flood_channel.close()
        calm_channel.close()


def _until(condition: Callable[[], bool], failure: str) -> None:
    give_up = time.monotonic() + HELD_SECONDS
    while not condition():
        assert time.monotonic() < give_up, failure
        time.sleep(0.01)


def test_refusals_free_their_streams_at_once(
    start_ledger_server: Callable[..., LedgerServer],
) -> None:
    """A refused call's stream is free when its answer is sent: refusals held
    their calls until the garbage collector ran (a reference cycle through
    the refusal's traceback), so one connection's refusals under the stream
    limit came back RST_STREAM (REFUSED_STREAM), which clients take for an
    outage (docs/benchmarks.md has the figures)."""
    server = start_ledger_server(
        max_calls_per_connection=16, max_watchers=8, max_watchers_per_grant=8
    )
    channel, ledger = _stub(server)
    codes: list[grpc.StatusCode] = []

    def read() -> None:
        for _ in range(40):
            try:
                ledger.GetBalance(pb.GetBalanceRequest(lane="no-such-lane"), timeout=10)
            except grpc.RpcError as error:
                codes.append(error.code())

    with channel:
        threads = [threading.Thread(target=read) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert codes == [grpc.StatusCode.NOT_FOUND] * 160
