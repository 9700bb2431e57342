"""A lane pointed at several replicas (`ipv4:A,B` or a DNS name with one record
each) spreads its calls over them, and a call a draining replica refused with
SHUTTING_DOWN (no work done) is sent once more, within its deadline, where
another replica answers it. A rolling restart of three replicas measured
before: every lane's calls went to the first address (gRPC's default
pick_first), and each SIGTERM denied the lanes about 4 calls
(LEDGER_UNAVAILABLE) while two other replicas were up."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from ledger_client import LaneClient
from ledger_client.errors import LedgerUnavailable
from ledger_client.generated.ledger.v1 import ledger_pb2 as pb
from ledger_client.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc


class Replica(pb_grpc.LedgerServicer):
    """Admits every Reserve and Settle, or, draining, refuses them as `ledger
    serve` does: UNAVAILABLE / SHUTTING_DOWN, no work done."""

    def __init__(self) -> None:
        self.reserves = 0
        self.settles = 0
        self.draining = False
        self.lock = threading.Lock()

    def _refuse_if_draining(self, context: grpc.ServicerContext) -> None:
        if self.draining:
            context.set_trailing_metadata((("ledger-reason", "SHUTTING_DOWN"),))
            context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")

    def Reserve(
        self, request: pb.ReserveRequest, context: grpc.ServicerContext
    ) -> pb.ReserveResponse:
        with self.lock:
            self.reserves += 1
        self._refuse_if_draining(context)
        return pb.ReserveResponse(decision=pb.ADMITTED, hold_nanos=1, cap_nanos=1)

    def Settle(self, request: pb.SettleRequest, context: grpc.ServicerContext) -> pb.SettleResponse:
        with self.lock:
            self.settles += 1
        self._refuse_if_draining(context)
        return pb.SettleResponse(charged_nanos=1)


@pytest.fixture
def replicas() -> Iterator[tuple[list[Replica], str]]:
    servers, found, ports = [], [], []
    for _ in range(2):
        replica = Replica()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_LedgerServicer_to_server(replica, server)
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        server.start()
        servers.append(server)
        found.append(replica)
    yield found, "ipv4:" + ",".join(f"127.0.0.1:{port}" for port in ports)
    for server in servers:
        server.stop(0)


def test_calls_to_an_address_list_reach_every_replica(
    replicas: tuple[list[Replica], str],
) -> None:
    found, address = replicas
    with LaneClient(address, "recall") as client:
        client.reserve("m", 10, 10, deadline_seconds=5)  # connects
        for _ in range(20):
            assert client.reserve("m", 10, 10, deadline_seconds=5).admitted
    assert all(replica.reserves >= 5 for replica in found), [r.reserves for r in found]


def test_a_reserve_refused_by_a_draining_replica_is_answered_by_another(
    replicas: tuple[list[Replica], str],
) -> None:
    found, address = replicas
    with LaneClient(address, "recall") as client:
        for _ in range(4):  # both replicas connected
            client.reserve("m", 10, 10, deadline_seconds=5)
        found[0].draining = True
        # Round robin picks among the replicas ready so far: the first calls
        # need not have split evenly, so each one's calls count from here.
        before = [replica.reserves for replica in found]
        for _ in range(20):
            with client.model_call("m", 10, max_output_tokens=10) as call:
                call.succeeded(1, 1)
            assert call.end_error is None
    assert found[0].reserves > before[0]  # the draining one was asked, and refused
    assert found[1].reserves - before[1] >= 20  # and the other answered every one
    assert found[1].settles == 20


def test_a_second_shutting_down_is_the_lanes_outage(
    replicas: tuple[list[Replica], str],
) -> None:
    found, address = replicas
    for replica in found:
        replica.draining = True
    with LaneClient(address, "recall") as client, pytest.raises(LedgerUnavailable) as refused:
        client.reserve("m", 10, 10, deadline_seconds=5)
    assert refused.value.reason == "SHUTTING_DOWN"
    assert sum(replica.reserves for replica in found) == 2  # sent twice, not more
