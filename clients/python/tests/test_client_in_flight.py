"""A client keeps at most `max_calls_in_flight` calls at the ledger: the server's
calls at once are shared by every lane first come first served, and a lane
looping on its calls crowded the others out (an overload audit: a well-behaved
lane lost 94 of 108 calls while another sent 500 at once)."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from ledger_client import ClientSettings, LaneClient
from ledger_client.errors import ClientClosed, LedgerOverloaded, is_retryable
from ledger_client.generated.ledger.v1 import ledger_pb2 as pb
from ledger_client.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc


class HeldReserves(pb_grpc.LedgerServicer):
    """Admits every Reserve once `release` is set; counts those that arrived."""

    def __init__(self) -> None:
        self.arrived = 0
        self.lock = threading.Lock()
        self.release = threading.Event()

    def Reserve(
        self, request: pb.ReserveRequest, context: grpc.ServicerContext
    ) -> pb.ReserveResponse:
        with self.lock:
            self.arrived += 1
        self.release.wait(10)
        return pb.ReserveResponse(decision=pb.ADMITTED, hold_nanos=1, cap_nanos=1)


@pytest.fixture
def held() -> Iterator[tuple[HeldReserves, int]]:
    servicer = HeldReserves()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_LedgerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    servicer.release.set()
    server.stop(0)


def test_a_call_past_the_limit_waits_its_deadline_then_is_overloaded_without_being_sent(
    held: tuple[HeldReserves, int],
) -> None:
    servicer, port = held
    settings = ClientSettings(max_calls_in_flight=2, deadline_seconds=5.0)
    with LaneClient(f"127.0.0.1:{port}", "recall", settings=settings) as client:
        pool = futures.ThreadPoolExecutor(max_workers=2)
        first = [pool.submit(client.reserve, "m", 10, 10) for _ in range(2)]
        for _ in range(500):
            if servicer.arrived == 2:
                break
            threading.Event().wait(0.01)
        assert servicer.arrived == 2
        with pytest.raises(LedgerOverloaded) as refused:
            client.reserve("m", 10, 10, deadline_seconds=0.2)
        assert is_retryable(refused.value)
        assert "max_calls_in_flight" in str(refused.value)
        assert servicer.arrived == 2, "the call past the limit never reached the ledger"
        servicer.release.set()
        assert all(call.result(10).admitted for call in first)
        assert client.reserve("m", 10, 10).admitted, "the slots are given back"
        pool.shutdown()


class _Slots:
    """Stands in for a client's slots (a semaphore) to tell when a call asks
    for one: the test closes the client once a call waits for a slot, not
    after a time its thread may not have had on a loaded machine."""

    def __init__(self, client: LaneClient) -> None:
        self._real = client._slots
        self.asked = threading.Event()
        client._slots = self  # type: ignore[assignment]

    def acquire(self, timeout: float | None = None) -> bool:
        self.asked.set()
        return self._real.acquire(timeout=timeout)

    def release(self) -> None:
        self._real.release()


def test_a_call_waiting_for_a_slot_when_the_client_closes_is_client_closed(
    held: tuple[HeldReserves, int],
) -> None:
    """It raised grpcio's ValueError (closed channel), past the outage mode. Now
    close() lets both go on for its grace, then cancels them: the lane's own
    doing, ClientClosed, never LedgerUnavailable (which would engage the
    outage mode)."""
    servicer, port = held
    settings = ClientSettings(max_calls_in_flight=1, deadline_seconds=5.0)
    client = LaneClient(f"127.0.0.1:{port}", "recall", settings=settings)
    pool = futures.ThreadPoolExecutor(max_workers=2)
    first = pool.submit(client.reserve, "m", 10, 10)
    for _ in range(500):
        if servicer.arrived == 1:
            break
        threading.Event().wait(0.01)
    slots = _Slots(client)
    waiting = pool.submit(client.reserve, "m", 10, 10)
    assert slots.asked.wait(10), "the second call never asked for a slot"
    client.close(grace_seconds=0.2)
    with pytest.raises(ClientClosed) as cut_off:
        first.result(10)
    assert cut_off.value.may_have_applied, "it reached the ledger"
    with pytest.raises(ClientClosed) as never_sent:
        waiting.result(10)
    assert not never_sent.value.may_have_applied
    assert servicer.arrived == 1
    pool.shutdown()


def test_the_limit_is_checked() -> None:
    with pytest.raises(ValueError, match="max_calls_in_flight"):
        ClientSettings(max_calls_in_flight=0)
    with pytest.raises(TypeError, match="max_calls_in_flight"):
        ClientSettings(max_calls_in_flight=1.5)  # type: ignore[arg-type]


def _call_after_close_in_a_child(port: int) -> None:
    client = LaneClient(f"127.0.0.1:{port}", "recall", settings=ClientSettings())
    client.close()
    try:
        client.settle("abc")  # a method this client had not called yet
    except ClientClosed:
        raise SystemExit(0) from None
    raise SystemExit(1)


def test_a_call_after_close_is_client_closed_and_never_touches_the_closed_channel(
    held: tuple[HeldReserves, int],
) -> None:
    """With the tracing extra the channel is intercepted, and grpcio's interceptor
    builds each call's handle on the channel anew: on a closed one that was a
    segmentation fault of the whole lane (a Settle retried, a background refund
    or the replayer after close()). Run in a child process, which a crash kills."""
    _, port = held
    child = multiprocessing.get_context("spawn").Process(
        target=_call_after_close_in_a_child, args=(port,)
    )
    child.start()
    child.join(60)
    assert child.exitcode == 0, f"the lane process ended with {child.exitcode}"


def test_the_channel_limits_are_checked_at_their_bounds() -> None:
    """max_message_bytes 0 made every call LedgerOverloaded ("Sent message
    larger than max (8 vs. 0)"), -1 lifted the limit, and a reconnect pause of
    0 or one above its maximum went to gRPC unchecked."""
    ClientSettings(max_message_bytes=64 * 1024)
    ClientSettings(max_message_bytes=2**31 - 1)
    ClientSettings(initial_reconnect_backoff_ms=1, max_reconnect_backoff_ms=120_000)
    for wrong in (
        {"max_message_bytes": 64 * 1024 - 1},
        {"max_message_bytes": 2**31},
        {"max_message_bytes": -1},
        {"initial_reconnect_backoff_ms": 0},
        {"initial_reconnect_backoff_ms": 2001},
        {"max_reconnect_backoff_ms": 120_001},
    ):
        name = next(iter(wrong))
        with pytest.raises(ValueError, match=name):
            ClientSettings(**wrong)  # type: ignore[arg-type]
