"""The benchmark's storeless ledger (bench/storeless.py) really leaves the store
out of Reserve and Settle, and still validates every request."""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Iterator

import grpc
import pytest

from bench.storeless import storeless
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.server import LedgerServer
from tests.conftest import RPC_TIMEOUT_SECONDS, lane_message, ledger_settings


@pytest.fixture
def storeless_server(tmp_path: pathlib.Path) -> Iterator[LedgerServer]:
    server = LedgerServer(ledger_settings(tmp_path))
    storeless(server)
    server.start()
    yield server
    server.stop(0)


def _reserve(reservation_id: str, request_bytes: int = 4000) -> pb.ReserveRequest:
    return pb.ReserveRequest(
        lane="recall",
        reservation_id=reservation_id,
        model="jev",
        request_bytes=request_bytes,
        max_output_tokens=100,
    )


def test_only_the_first_reserve_and_settle_reach_the_store(
    storeless_server: LedgerServer,
    open_ledger_channel: Callable[[LedgerServer], grpc.Channel],
) -> None:
    channel = open_ledger_channel(storeless_server)
    admin, ledger = pb_grpc.LaneAdminStub(channel), pb_grpc.LedgerStub(channel)
    admin.PutLane(pb.PutLaneRequest(lane=lane_message()), timeout=RPC_TIMEOUT_SECONDS)
    answers = [ledger.Reserve(_reserve(f"r-{n}"), timeout=RPC_TIMEOUT_SECONDS) for n in range(3)]
    assert all(answer == answers[0] for answer in answers)
    settle = pb.SettleRequest(
        lane="recall", reservation_id="r-0", outcome=pb.SUCCEEDED, input_tokens=10
    )
    for reservation_id in ("r-0", "r-1"):
        settle.reservation_id = reservation_id
        ledger.Settle(settle, timeout=RPC_TIMEOUT_SECONDS)

    written = ledger.ListEvents(pb.ListEventsRequest(lane="recall"), timeout=RPC_TIMEOUT_SECONDS)
    kinds = [(event.kind, event.reservation_id) for event in written.events]
    assert kinds == [("lane_configured", ""), ("reserved", "r-0"), ("settled", "r-0")]


def test_requests_are_still_validated(
    storeless_server: LedgerServer,
    open_ledger_channel: Callable[[LedgerServer], grpc.Channel],
) -> None:
    channel = open_ledger_channel(storeless_server)
    ledger = pb_grpc.LedgerStub(channel)
    with pytest.raises(grpc.RpcError) as caught:
        ledger.Reserve(_reserve("r-0", request_bytes=-1), timeout=RPC_TIMEOUT_SECONDS)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "request_bytes" in (caught.value.details() or "")
