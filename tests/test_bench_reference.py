"""The benchmark's reference server (bench/reference.py): issue 25's design on
our proto, schema and domain. Its figures mean something only if it does the
work: answers a Reserve and a Settle as ours would, refuses what ours refuses,
and leaves a log whose hash chain `ledger verify` finds whole."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import grpc
import pytest

from bench import load, servers
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from tests import bench_servers
from tests.conftest import RPC_TIMEOUT_SECONDS

LANES = ["ref-a", "ref-b"]


@pytest.fixture
def channel(tmp_path: pathlib.Path) -> Iterator[grpc.Channel]:
    argv = servers.reference_argv(tmp_path / "reference.db", LANES)
    with bench_servers.channel_to("reference", argv, tmp_path) as opened:
        yield opened


def test_it_answers_moves_and_leaves_a_chain_that_verifies(
    channel: grpc.Channel, tmp_path: pathlib.Path
) -> None:
    stub = pb_grpc.LedgerStub(channel)
    first = stub.Reserve(load.reserve_request("ref-a", "r-1"), timeout=RPC_TIMEOUT_SECONDS)
    assert first.decision == pb.ADMITTED and first.hold_nanos > 0
    assert first.balance.held_nanos == first.hold_nanos
    # A retry gets the same answer; other arguments under the same id are refused.
    again = stub.Reserve(load.reserve_request("ref-a", "r-1"), timeout=RPC_TIMEOUT_SECONDS)
    assert again.already_reserved and not first.already_reserved
    again.ClearField("already_reserved")
    assert again == first
    changed = pb.ReserveRequest(lane="ref-a", reservation_id="r-1", model=load.MODEL)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Reserve(changed, timeout=RPC_TIMEOUT_SECONDS)
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    settled = stub.Settle(load.settle_request("ref-a", "r-1"), timeout=RPC_TIMEOUT_SECONDS)
    assert settled.state == pb.SETTLED and 0 < settled.charged_nanos <= first.hold_nanos
    assert settled.balance.held_nanos == 0

    bench_servers.reserve_and_settle([stub], LANES, 40)
    report = bench_servers.verified(f"sqlite:///{tmp_path}/reference.db", tmp_path)
    assert "41 bookings" in report and ": OK" in report, report
