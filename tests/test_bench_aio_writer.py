"""The benchmark's prototype server model (bench/aio_writer.py): grpc.aio, Reserve
and Settle as coroutines whose moves one writer thread commits in batches. It
must give the real server's answers and refusals, or its figures mean nothing."""

from __future__ import annotations

import concurrent.futures
import pathlib
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from bench import aio_writer
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.server import LedgerServer
from tests.conftest import RPC_TIMEOUT_SECONDS, failure_of, lane_message, ledger_settings


@pytest.fixture
def channel(tmp_path: pathlib.Path) -> Iterator[grpc.Channel]:
    # As the benchmark runs it: without grants (the prototype's moves skip them).
    settings = ledger_settings(tmp_path, auth_enabled=False, test_clock=False)
    server = LedgerServer(settings, transport=aio_writer.transport)
    aio_writer.install(server)
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as opened:
        yield opened
    server.stop(0)


def _reserve(reservation_id: str, request_bytes: int = 4000) -> pb.ReserveRequest:
    return pb.ReserveRequest(
        lane="recall",
        reservation_id=reservation_id,
        model="jev",
        request_bytes=request_bytes,
        max_output_tokens=100,
    )


def test_moves_and_refusals_are_the_real_servers(
    channel: grpc.Channel, monkeypatch: pytest.MonkeyPatch
) -> None:
    submitted: list[object] = []
    submit = aio_writer.WriterThread.submit

    def counted(self: aio_writer.WriterThread, work: Any) -> Any:
        submitted.append(work)
        return submit(self, work)

    monkeypatch.setattr(aio_writer.WriterThread, "submit", counted)
    admin, ledger = pb_grpc.LaneAdminStub(channel), pb_grpc.LedgerStub(channel)
    admin.PutLane(pb.PutLaneRequest(lane=lane_message()), timeout=RPC_TIMEOUT_SECONDS)
    first = ledger.Reserve(_reserve("r-1"), timeout=RPC_TIMEOUT_SECONDS)
    assert first.decision == pb.ADMITTED and first.hold_nanos > 0
    again = ledger.Reserve(_reserve("r-1"), timeout=RPC_TIMEOUT_SECONDS)
    assert again.already_reserved and not first.already_reserved
    again.ClearField("already_reserved")
    assert again == first
    with pytest.raises(grpc.RpcError) as caught:
        ledger.Reserve(_reserve("r-2", request_bytes=-1), timeout=RPC_TIMEOUT_SECONDS)
    failure = failure_of(caught.value, grpc.StatusCode.INVALID_ARGUMENT)
    assert (failure.reason, failure.field) == ("INVALID_ARGUMENT", "request_bytes")
    with pytest.raises(grpc.RpcError) as caught:
        ledger.Reserve(_reserve("r-1", request_bytes=5000), timeout=RPC_TIMEOUT_SECONDS)
    assert failure_of(caught.value, grpc.StatusCode.ALREADY_EXISTS).reason == (
        "RESERVATION_ID_REUSED"
    )
    settled = ledger.Settle(
        pb.SettleRequest(
            lane="recall", reservation_id="r-1", outcome=pb.SUCCEEDED, input_tokens=10
        ),
        timeout=RPC_TIMEOUT_SECONDS,
    )
    assert settled.state == pb.SETTLED
    # Three Reserves that reached the store and the Settle went to the writer.
    assert len(submitted) >= 4, "the moves did not go through the writer thread"


def test_concurrent_moves_share_batches_and_each_is_answered(channel: grpc.Channel) -> None:
    admin, ledger = pb_grpc.LaneAdminStub(channel), pb_grpc.LedgerStub(channel)
    admin.PutLane(pb.PutLaneRequest(lane=lane_message()), timeout=RPC_TIMEOUT_SECONDS)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(
            pool.map(lambda index: ledger.Reserve(_reserve(f"c-{index}"), timeout=30), range(200))
        )
    assert all(answer.decision == pb.ADMITTED for answer in answers)
    events = ledger.ListEvents(
        pb.ListEventsRequest(lane="recall", kinds=["reserved"], page_size=1000), timeout=30
    ).events
    assert sorted(event.reservation_id for event in events) == sorted(
        f"c-{index}" for index in range(200)
    )
