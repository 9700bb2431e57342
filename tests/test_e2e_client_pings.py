"""The server admits a client's keepalive pings every client_ping_min_interval_seconds
and no faster: the lane clients ping every 5 s to find a frozen replica
(clients/python/tests/test_client_frozen_replica.py), and a peer pinging
faster is cut off (GOAWAY too_many_pings), so pings cannot be used to keep the
server busy."""

from __future__ import annotations

import pathlib
import threading

import grpc

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from tests import serving

# Far past the third early ping (a second apart, 3 s).
WAIT_SECONDS = 20.0


def _pinging_channel(address: str, interval_ms: int) -> grpc.Channel:
    return grpc.insecure_channel(
        address,
        options=[
            ("grpc.keepalive_time_ms", interval_ms),
            ("grpc.keepalive_timeout_ms", 5000),
            ("grpc.http2.ping_timeout_ms", 5000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ],
    )


def test_a_client_pinging_faster_than_the_floor_is_cut_off(tmp_path: pathlib.Path) -> None:
    env = serving.clean_env(LEDGER_CLIENT_PING_MIN_INTERVAL_SECONDS="3")
    process, address = serving.spawn(tmp_path, env=env)
    # A ping a second: grpcio's own floor (it delays faster ones).
    channel = _pinging_channel(address, 1000)
    left_ready = threading.Event()
    seen: list[grpc.ChannelConnectivity] = []

    def watch(state: grpc.ChannelConnectivity) -> None:
        seen.append(state)
        if grpc.ChannelConnectivity.READY in seen and state != grpc.ChannelConnectivity.READY:
            left_ready.set()

    try:
        channel.subscribe(watch, try_to_connect=True)
        grpc.channel_ready_future(channel).result(timeout=10)
        # One answered call, then silence but for the pings.
        stub = pb_grpc.LedgerStub(channel)
        try:
            stub.GetBalance(pb.GetBalanceRequest(lane="none"), timeout=5)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert left_ready.wait(WAIT_SECONDS), seen
    finally:
        channel.close()
        serving.stop(process)
