"""Reflection streams need no grant and each held a thread of the pool while
its client sent nothing: 400 idle ones held every thread, and a lane's
Reserve waited out its deadline. Only `reflection_streams` are open at once;
one more is refused at once, and the lanes' calls are served meanwhile."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.server import LedgerServer
from tests.conftest import GrantInterceptor, lane_message

# More idle streams than the pool has threads at these settings (8 + 2 x 4 + 2 + 1).
SETTINGS = {
    "max_workers": 2,
    "max_calls_per_grant": 4,
    "max_watchers": 8,
    "max_watchers_per_grant": 2,
    "max_calls_per_connection": 64,
}
IDLE_STREAMS = 40
WAIT_SECONDS = 30.0


def test_idle_reflection_streams_are_bounded_and_leave_the_lanes_their_threads(
    start_ledger_server: Callable[..., LedgerServer],
) -> None:
    server = start_ledger_server(**SETTINGS)
    address = f"127.0.0.1:{server.port}"
    idle = threading.Event()

    def one_request_then_nothing() -> Iterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        idle.wait(WAIT_SECONDS)

    with (
        grpc.insecure_channel(address) as raw,
        grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as lane,
    ):
        reflecting = reflection_pb2_grpc.ServerReflectionStub(raw)
        streams = [
            reflecting.ServerReflectionInfo(one_request_then_nothing(), timeout=WAIT_SECONDS)
            for _ in range(IDLE_STREAMS)
        ]
        try:
            answered, refused = 0, 0
            for stream in streams:
                try:
                    next(stream)
                    answered += 1
                except grpc.RpcError as error:
                    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, error
                    assert ("ledger-reason", "TOO_MANY_WATCHERS") in error.trailing_metadata()
                    refused += 1
            assert (answered, refused) == (1, IDLE_STREAMS - 1)  # reflection_streams: 1
            channel = grpc.intercept_channel(lane, GrantInterceptor(server.admin_grant))
            pb_grpc.LaneAdminStub(channel).PutLane(
                pb.PutLaneRequest(lane=lane_message("recall")), timeout=5
            )
            reserved = pb_grpc.LedgerStub(channel).Reserve(
                pb.ReserveRequest(
                    lane="recall",
                    reservation_id="calm",
                    model="jev",
                    request_bytes=100,
                    max_output_tokens=10,
                ),
                timeout=5,
            )
            assert reserved.decision == pb.ADMITTED
        finally:
            idle.set()
            for stream in streams:
                stream.cancel()
