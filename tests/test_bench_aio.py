"""The benchmark's grpc.aio server model (bench/aio.py) serves the same ledger:
the same answers, the same refusals with their trailers, grants checked, and
a stop that drains."""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Iterator

import grpc
import pytest

from bench import aio
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.server import LedgerServer
from tests.conftest import RPC_TIMEOUT_SECONDS, failure_of, lane_message, ledger_settings


@pytest.fixture
def aio_server(tmp_path: pathlib.Path) -> Iterator[LedgerServer]:
    server = LedgerServer(ledger_settings(tmp_path), transport=aio.transport)
    server.start()
    yield server
    server.stop(0)


def test_moves_and_refusals_are_the_sync_servers(
    aio_server: LedgerServer,
    open_ledger_channel: Callable[[LedgerServer], grpc.Channel],
) -> None:
    channel = open_ledger_channel(aio_server)
    admin, ledger = pb_grpc.LaneAdminStub(channel), pb_grpc.LedgerStub(channel)
    admin.PutLane(pb.PutLaneRequest(lane=lane_message()), timeout=RPC_TIMEOUT_SECONDS)
    request = pb.ReserveRequest(
        lane="recall", reservation_id="r-1", model="jev", request_bytes=4000, max_output_tokens=100
    )
    first = ledger.Reserve(request, timeout=RPC_TIMEOUT_SECONDS)
    assert first.decision == pb.ADMITTED and first.hold_nanos > 0
    again = ledger.Reserve(request, timeout=RPC_TIMEOUT_SECONDS)  # idempotent
    assert again.already_reserved and not first.already_reserved
    again.ClearField("already_reserved")
    assert again == first

    request.request_bytes = -1
    request.reservation_id = "r-2"
    with pytest.raises(grpc.RpcError) as caught:
        ledger.Reserve(request, timeout=RPC_TIMEOUT_SECONDS)
    failure = failure_of(caught.value, grpc.StatusCode.INVALID_ARGUMENT)
    assert (failure.reason, failure.field) == ("INVALID_ARGUMENT", "request_bytes")


def test_a_call_without_a_grant_is_refused(aio_server: LedgerServer) -> None:
    with (
        grpc.insecure_channel(f"127.0.0.1:{aio_server.port}") as channel,
        pytest.raises(grpc.RpcError) as caught,
    ):
        pb_grpc.LedgerStub(channel).GetBalance(
            pb.GetBalanceRequest(lane="recall"), timeout=RPC_TIMEOUT_SECONDS
        )
    failure_of(caught.value, grpc.StatusCode.UNAUTHENTICATED)
