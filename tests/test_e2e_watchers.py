"""WatchEvents at its documented limits, through real gRPC: 64 streams beside the
moves, 16 for one grant, and a stop that ends every stream with SHUTTING_DOWN."""

from __future__ import annotations

import dataclasses
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from ledger_service.domain.clock import SystemClock
from ledger_service.domain.grants import Scope
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.server import LedgerServer
from ledger_service.settings import Settings

# How long a test waits for what must happen (an event, a stream's end, a
# stop): generous, as a loaded machine may be slow; passing tests never wait it out.
WAIT_SECONDS = 30.0
HOUR_US = 3_600_000_000
_DEFAULTS = {field.name: field.default for field in dataclasses.fields(Settings)}
LIMIT: int = _DEFAULTS["max_watchers"]  # type: ignore[assignment]
PER_GRANT: int = _DEFAULTS["max_watchers_per_grant"]  # type: ignore[assignment]


class Watch:
    """One stream, read on a thread of its own."""

    def __init__(self, stub: pb_grpc.LedgerStub, grant: str, after_seq: int) -> None:
        self.call = stub.WatchEvents(
            pb.WatchEventsRequest(lane="recall", after_seq=after_seq),
            metadata=(("authorization", f"Bearer {grant}"),),
        )
        self.received: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for event in self.call:
                self.received.put(event)
        except grpc.RpcError as error:
            self.received.put(error)

    def next(self) -> Any:
        return self.received.get(timeout=WAIT_SECONDS)

    def close(self) -> None:
        self.call.cancel()
        self._thread.join(WAIT_SECONDS)


def _reason(error: grpc.RpcError) -> str:
    assert isinstance(error, grpc.Call)
    return dict(error.trailing_metadata() or ()).get("ledger-reason", "")


@pytest.fixture
def raw_stub(server: LedgerServer) -> Iterator[pb_grpc.LedgerStub]:
    """A stub without the admin grant: each call carries its own."""
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield pb_grpc.LedgerStub(channel)


@pytest.fixture
def watches() -> Iterator[list[Watch]]:
    opened: list[Watch] = []
    yield opened
    for watch in opened:
        watch.close()


def _grants(server: LedgerServer, count: int) -> list[str]:
    now_us = SystemClock().now_us()
    return [
        server.keyring.issue(
            ["recall"], [Scope.READ], issued_at_us=now_us, expires_at_us=now_us + HOUR_US
        )
        for _ in range(count)
    ]


def test_the_documented_limit_of_streams_is_served_beside_the_moves(
    ledger_harness: Any,
    server: LedgerServer,
    raw_stub: pb_grpc.LedgerStub,
    watches: list[Watch],
) -> None:
    ledger_harness.make_lane()
    stub = raw_stub
    grants = _grants(server, LIMIT // PER_GRANT + 1)
    head = ledger_harness.events("recall")[-1].seq
    for index in range(LIMIT):
        watches.append(Watch(stub, grants[index // PER_GRANT], head))
    ledger_harness.reserve("seen-by-all")
    for watch in watches:
        got = watch.next()
        assert not isinstance(got, grpc.RpcError), (got.code(), got.details())
        assert got.reservation_id == "seen-by-all"
    # Every stream is open: a move is still served, and one more stream is refused.
    ledger_harness.reserve("beside-them")
    extra = Watch(stub, grants[-1], head)
    watches.append(extra)
    refused = extra.next()
    assert isinstance(refused, grpc.RpcError)
    assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _reason(refused) == "TOO_MANY_WATCHERS"
    for watch in watches[:LIMIT]:
        assert watch.next().reservation_id == "beside-them"


def test_one_grant_cannot_take_every_slot(
    ledger_harness: Any,
    server: LedgerServer,
    raw_stub: pb_grpc.LedgerStub,
    watches: list[Watch],
) -> None:
    ledger_harness.make_lane()
    stub = raw_stub
    mine, other = _grants(server, 2)
    head = ledger_harness.events("recall")[-1].seq
    for _ in range(PER_GRANT):
        watches.append(Watch(stub, mine, head))
    ledger_harness.reserve("opened")
    for watch in watches:
        assert watch.next().reservation_id == "opened"
    watches.append(Watch(stub, mine, head))
    refused = watches[-1].next()
    assert isinstance(refused, grpc.RpcError)
    assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "this grant" in (refused.details() or "")
    watches.append(Watch(stub, other, head))
    assert watches[-1].next().reservation_id == "opened"


def test_a_stop_ends_every_stream_as_unavailable(
    start_ledger_server: Callable[..., LedgerServer],
    open_ledger_channel: Callable[[LedgerServer], grpc.Channel],
    watches: list[Watch],
) -> None:
    server = start_ledger_server()
    admin = pb_grpc.LaneAdminStub(open_ledger_channel(server))
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.LedgerStub(channel)
    admin.PutLane(
        pb.PutLaneRequest(
            lane=pb.Lane(
                lane="recall",
                limit_nanos=1_000_000,
                prices={"jev": pb.ModelPrice(input_nanos_per_million_tokens=1)},
            )
        )
    )
    for _ in range(3):
        watches.append(Watch(stub, server.admin_grant, 0))
    for watch in watches:
        assert watch.next().kind == "lane_configured"
    # A grace far past WAIT_SECONDS: only streams that end by themselves let it end in time.
    clean: list[bool] = []
    stopping = threading.Thread(target=lambda: clean.append(server.stop(600.0)), daemon=True)
    stopping.start()
    for watch in watches:
        ended = watch.next()
        assert isinstance(ended, grpc.RpcError)
        assert ended.code() is grpc.StatusCode.UNAVAILABLE
        assert _reason(ended) == "SHUTTING_DOWN"
    # The streams ended at once: the stop drained, it did not cut them off at its grace.
    stopping.join(WAIT_SECONDS)
    assert clean == [True]
    channel.close()


_FROZEN_READER = """
import sys, time, grpc
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
channel = grpc.insecure_channel(sys.argv[1])
stream = pb_grpc.LedgerStub(channel).WatchEvents(
    pb.WatchEventsRequest(from_now=True), metadata=(("authorization", "Bearer " + sys.argv[2]),)
)
print("open", flush=True)
time.sleep(600)
"""


def test_a_stream_whose_client_froze_on_a_quiet_log_gives_its_slot_back(
    start_ledger_server: Callable[..., LedgerServer],
) -> None:
    """A reader that stopped answering (a paused VM, a silent network
    partition, a SIGSTOP) on a quiet log has no event waiting, so the stall
    limit never sees it: without keepalive pings its stream held a slot, and
    one of its grant's 16, for as long as the TCP connection looked open."""
    server = start_ledger_server(keepalive_seconds=0.5)
    child = subprocess.Popen(
        [sys.executable, "-c", _FROZEN_READER, f"127.0.0.1:{server.port}", server.admin_grant],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "open\n"
        give_up = time.monotonic() + WAIT_SECONDS
        while server.feed.open_streams() != 1:
            assert time.monotonic() < give_up, "the stream never opened"
            time.sleep(0.05)
        child.send_signal(signal.SIGSTOP)
        give_up = time.monotonic() + WAIT_SECONDS
        while server.feed.open_streams():
            assert time.monotonic() < give_up, "the frozen reader's stream still holds its slot"
            time.sleep(0.05)
    finally:
        child.kill()
        child.communicate()


def test_a_stream_on_a_quiet_lane_answers_its_headers_before_any_event(
    ledger_harness: Any, server: LedgerServer, raw_stub: pb_grpc.LedgerStub
) -> None:
    """A watcher of a quiet lane got no headers until the lane's first event:
    it could not tell an accepted stream from a hung connection."""
    ledger_harness.make_lane()
    [grant] = _grants(server, 1)
    call = raw_stub.WatchEvents(
        pb.WatchEventsRequest(lane="recall", from_now=True),
        metadata=(("authorization", f"Bearer {grant}"),),
    )
    headers: queue.Queue[object] = queue.Queue()
    threading.Thread(target=lambda: headers.put(call.initial_metadata()), daemon=True).start()
    try:
        assert headers.get(timeout=WAIT_SECONDS) is not None
        assert call.is_active() and server.feed.open_streams() == 1  # accepted, no event sent
    finally:
        call.cancel()
