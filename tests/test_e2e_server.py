"""The server's wiring: health, and the test clock that exists only when asked for."""

from __future__ import annotations

import time
from typing import Any

import grpc
from google.protobuf import duration_pb2, empty_pb2, timestamp_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ledger_service.generated.ledger.v1 import ledger_pb2
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc


def test_health_is_serving_for_the_server_and_each_service(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "ledger.v1.Ledger", "ledger.v1.LaneAdmin"):
        answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING, service


def test_the_test_clock_is_unimplemented_without_the_flag(
    server_without_test_clock: Any, open_ledger_channel: Any
) -> None:
    clock = pb_grpc.TestClockStub(open_ledger_channel(server_without_test_clock))
    for call in (
        lambda: clock.GetTime(empty_pb2.Empty(), timeout=10),
        lambda: clock.SetTime(timestamp_pb2.Timestamp(seconds=1), timeout=10),
        lambda: clock.Advance(duration_pb2.Duration(seconds=86_400), timeout=10),
    ):
        try:
            call()
        except grpc.RpcError as error:
            assert isinstance(error, grpc.Call)
            assert error.code() is grpc.StatusCode.UNIMPLEMENTED
        else:
            raise AssertionError("a server without --test-clock let a client move time")
    health = health_pb2_grpc.HealthStub(open_ledger_channel(server_without_test_clock))
    answer = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_the_test_clock_is_served_with_the_flag(clock_stub: Any) -> None:
    instant = timestamp_pb2.Timestamp(seconds=1_800_000_000, nanos=5_000)
    assert clock_stub.SetTime(instant, timeout=10) == instant
    assert clock_stub.GetTime(empty_pb2.Empty(), timeout=10) == instant


def test_health_watches_hold_no_worker_thread(
    start_ledger_server: Any, open_ledger_channel: Any
) -> None:
    """Health.Watch needs no grant and is limited only by max_concurrent_rpcs:
    served as a blocking generator, each open watch held one of the pool's
    threads for its life, and the pool's size of them (276 by default; here
    6) stalled every other call of the server."""
    server = start_ledger_server(max_workers=2, max_watchers=1, max_calls_per_grant=1)
    channel = open_ledger_channel(server)
    health = health_pb2_grpc.HealthStub(channel)
    watches = []
    try:
        for index in range(10):
            watches.append(
                health.Watch(
                    health_pb2.HealthCheckRequest(service="" if index % 2 else "ledger.v1.Ledger"),
                    timeout=600,
                )
            )
        assert next(watches[0]).status == health_pb2.HealthCheckResponse.SERVING
        # Every watch is open; a call still finds a thread (it would wait out its deadline).
        answer = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=20)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        lanes = pb_grpc.LaneAdminStub(channel)
        assert list(lanes.ListLanes(ledger_pb2.ListLanesRequest(), timeout=20).lanes) == []
    finally:
        for watch in watches:
            watch.cancel()


def test_a_watch_of_a_name_not_served_is_unknown_and_leaves_nothing_behind(
    start_ledger_server: Any, open_ledger_channel: Any
) -> None:
    """Each watched name used to stay in the servicer for the process's life:
    made-up names, each up to a message long, grew the server's memory."""
    server = start_ledger_server(test_clock=False)
    health = health_pb2_grpc.HealthStub(open_ledger_channel(server))
    unknown = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
    for index in range(20):
        watch = health.Watch(health_pb2.HealthCheckRequest(service=f"made.up.{index}"), timeout=20)
        assert next(watch).status == unknown
        watch.cancel()
    served = health.Watch(health_pb2.HealthCheckRequest(service="ledger.v1.Ledger"), timeout=20)
    assert next(served).status == health_pb2.HealthCheckResponse.SERVING
    served.cancel()
    # The served watch is dropped once gRPC reports its end; the others were never kept.
    waited_until = time.monotonic() + 10
    while server.health.watcher_count() and time.monotonic() < waited_until:
        time.sleep(0.01)
    assert server.health.watcher_count() == 0
