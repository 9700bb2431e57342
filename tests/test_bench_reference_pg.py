"""The benchmark's PostgreSQL reference server (bench/reference_pg.py): its
figures mean something only if it does the work of two replicas sharing one
database: answers a Reserve and a Settle as ours would, refuses what ours
refuses, reads what admission needs from the database, and leaves a log
whose hash chain and projections `ledger verify` finds whole."""

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
def schema_url() -> Iterator[str]:
    with bench_servers.fresh_postgres_schema() as fresh:
        yield fresh


@pytest.mark.postgres
def test_two_replicas_answer_moves_and_leave_a_log_that_verifies(
    schema_url: str, tmp_path: pathlib.Path
) -> None:
    # The first replica migrates and puts the lanes; the second finds them there.
    first, second = (
        servers.reference_pg_argv(schema_url, LANES),
        servers.reference_pg_argv(schema_url, []),
    )
    with (
        bench_servers.channel_to("reference-pg", first, tmp_path / "a") as first_channel,
        bench_servers.channel_to("reference-pg", second, tmp_path / "b") as second_channel,
    ):
        stubs = [pb_grpc.LedgerStub(first_channel), pb_grpc.LedgerStub(second_channel)]
        first = stubs[0].Reserve(load.reserve_request("ref-a", "r-1"), timeout=RPC_TIMEOUT_SECONDS)
        assert first.decision == pb.ADMITTED and first.hold_nanos > 0
        assert first.balance.held_nanos == first.hold_nanos
        # A resend to the other replica gets the same answer, read from the database;
        # other arguments under the same id are refused.
        again = stubs[1].Reserve(load.reserve_request("ref-a", "r-1"), timeout=RPC_TIMEOUT_SECONDS)
        assert again.already_reserved and not first.already_reserved
        again.ClearField("already_reserved")
        assert again == first
        changed = pb.ReserveRequest(lane="ref-a", reservation_id="r-1", model=load.MODEL)
        with pytest.raises(grpc.RpcError) as caught:
            stubs[1].Reserve(changed, timeout=RPC_TIMEOUT_SECONDS)
        assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
        # The other replica sees the first one's hold in the window it reads.
        second = stubs[1].Reserve(load.reserve_request("ref-a", "r-2"), timeout=RPC_TIMEOUT_SECONDS)
        assert second.balance.held_nanos == first.hold_nanos + second.hold_nanos
        settled = stubs[1].Settle(load.settle_request("ref-a", "r-1"), timeout=RPC_TIMEOUT_SECONDS)
        assert settled.state == pb.SETTLED and 0 < settled.charged_nanos <= first.hold_nanos
        assert settled.balance.held_nanos == second.hold_nanos
        repeated = stubs[0].Settle(load.settle_request("ref-a", "r-1"), timeout=RPC_TIMEOUT_SECONDS)
        assert repeated.charged_nanos == settled.charged_nanos
        with pytest.raises(grpc.RpcError) as caught:
            stubs[0].Settle(load.settle_request("ref-a", "nobody"), timeout=RPC_TIMEOUT_SECONDS)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND

        bench_servers.reserve_and_settle(stubs, LANES, 40)

    report = bench_servers.verified(schema_url, tmp_path)
    assert "42 bookings" in report and ": OK" in report, report
