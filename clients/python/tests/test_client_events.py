"""The lane's events through the lane client (list_events, all_events,
watch_events) against a real `ledger serve`: pages, the tail, its resumption
after the server restarts or its connection is cut, and the streams it frees."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import pathlib
import queue
import re
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from client_ledger import TEST_SETTINGS, Admin, LedgerProcess, new_lane_name, running
from ledger_client import (
    LaneClient,
    LedgerEvent,
    LedgerUnavailable,
    ModelPrice,
    PermissionDenied,
    TooManyWatchers,
    Usage,
)

# Long enough for any wait of these tests on a busy machine; never a measure.
WAIT_SECONDS = 60.0
# The server's share of event streams for one grant (max_watchers_per_grant).
STREAMS_PER_GRANT = 16


def _read_grant(server: LedgerProcess, lane: str) -> str:
    """A lane's grant that reads its history: charge alone cannot (auth.py)."""
    return server.issue_grant("--lane", lane, "--scope", "charge", "--scope", "read")


def _reserve(client: LaneClient, count: int) -> None:
    for _ in range(count):
        client.reserve("model-a", 100, 10)


def _reserve_once_back(client: LaneClient, count: int) -> None:
    """Reserves sent again (the same ids: booked once) until the ledger that
    restarted answers: the channel reconnects at its own pace."""
    for number in range(count):
        give_up = time.monotonic() + WAIT_SECONDS
        while True:
            try:
                client.reserve("model-a", 100, 10, reservation_id=f"after-restart-{number}")
                break
            except LedgerUnavailable:
                if time.monotonic() > give_up:
                    raise
                time.sleep(0.1)


def _seqs(events: Iterator[LedgerEvent] | list[LedgerEvent]) -> list[int]:
    return [event.seq for event in events]


@pytest.fixture
def reader(ledger_server: LedgerProcess, lane: str) -> Iterator[LaneClient]:
    grant = _read_grant(ledger_server, lane)
    with LaneClient(ledger_server.address, lane, grant=grant, settings=TEST_SETTINGS) as made:
        yield made


class Tail:
    """A watch_events generator read in a thread of its own, as a lane would."""

    def __init__(self, events: Iterator[LedgerEvent]) -> None:
        self.events = events
        self.seen: queue.Queue[LedgerEvent | BaseException | None] = queue.Queue()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for event in self.events:
                self.seen.put(event)
        except BaseException as error:  # handed to the test
            self.seen.put(error)
        self.seen.put(None)  # the generator ended

    def take(self, count: int) -> list[LedgerEvent]:
        taken: list[LedgerEvent] = []
        while len(taken) < count:
            item = self.seen.get(timeout=WAIT_SECONDS)
            assert isinstance(item, LedgerEvent), f"the tail ended early: {item!r}"
            taken.append(item)
        return taken


def test_pages_follow_each_other_to_the_end_of_the_log(
    reader: LaneClient, admin: Admin, lane: str
) -> None:
    _reserve(reader, 5)
    expected = _seqs(admin.events(lane))  # lane_configured, then 5 reserved
    assert len(expected) == 6

    first = reader.list_events(page_size=4)
    assert _seqs(first.events) == expected[:4]
    assert first.next_after_seq == expected[3]
    second = reader.list_events(after_seq=first.next_after_seq, page_size=4)
    assert _seqs(second.events) == expected[4:]
    assert second.next_after_seq is None, "the end of the log as it stands"
    assert _seqs(reader.all_events(page_size=2)) == expected
    assert _seqs(reader.all_events(after_seq=expected[2])) == expected[3:]


def test_events_are_typed_as_the_ledger_recorded_them(
    reader: LaneClient, admin: Admin, lane: str
) -> None:
    reservation = reader.reserve("model-a", 100, 10, reservation_id="r-typed")
    reserved = [event for event in reader.all_events() if event.kind == "reserved"]
    assert len(reserved) == 1
    event = reserved[0]
    assert (event.lane, event.reservation_id, event.model) == (lane, "r-typed", "model-a")
    assert event.hold_nanos == event.amount_nanos == reservation.hold_nanos
    assert event.occurred_at.tzinfo is not None
    assert event.expires_at == reservation.expires_at
    assert event.billed_nanos is None and event.denial_reason is None
    assert event.hash and event.previous_hash
    reader.settle(
        "r-typed", Usage(input_tokens=10, output_tokens=5, billed_nanos=7), http_status=200
    )
    (ended,) = reader.list_events(after_seq=event.seq).events
    assert (ended.kind, ended.outcome, ended.http_status, ended.input_tokens) == (
        "settled",
        "SUCCEEDED",
        200,
        10,
    )
    assert (ended.billed_nanos, ended.amount_nanos, ended.previous_hash) == (7, 7, event.hash)


def test_a_lane_configured_event_carries_the_policy_the_ledger_resolved(
    reader: LaneClient, lane: str
) -> None:
    # The lane fixture sets the limit, the hold_ttl and one price; the ledger
    # fills in the rest with its defaults (docs/semantics.md).
    (configured,) = reader.list_events(page_size=1).events
    assert configured.kind == "lane_configured"
    policy = configured.policy
    assert policy is not None
    assert (policy.lane, policy.limit_nanos, policy.version) == (lane, 1_000_000, configured.seq)
    assert (policy.window, policy.hold_ttl) == (
        datetime.timedelta(days=1),
        datetime.timedelta(seconds=120),
    )
    assert (policy.bytes_per_token_milli, policy.overhead_tokens) == (3500, 0)
    assert dict(policy.prices) == {"model-a": ModelPrice(1_000_000, 2_000_000)}
    assert (policy.expire_charge, policy.parent, policy.max_charge_multiple) == ("HOLD", "", 100)
    assert policy.updated_at == configured.occurred_at
    _reserve(reader, 1)
    assert [event.policy for event in reader.list_events(after_seq=configured.seq).events] == [None]


def test_a_grant_without_read_is_refused_the_history(
    ledger_server: LedgerProcess, lane: str, lane_grant: str
) -> None:
    # A lane's usual grant (charge) reads its balance and bookings, not its
    # events: ListEvents and WatchEvents need read (ledger_service/api/auth.py).
    with LaneClient(ledger_server.address, lane, grant=lane_grant, settings=TEST_SETTINGS) as made:
        with pytest.raises(PermissionDenied):
            made.list_events()
        with pytest.raises(PermissionDenied):
            next(made.watch_events())


def test_the_tail_sees_events_committed_after_it_started(reader: LaneClient) -> None:
    tail = Tail(reader.watch_events())
    (configured,) = tail.take(1)  # the stream is open: the lane's first event came
    assert configured.kind == "lane_configured"
    _reserve(reader, 3)
    later = tail.take(3)
    assert [event.kind for event in later] == ["reserved"] * 3
    assert _seqs(later) == _seqs(reader.all_events(after_seq=configured.seq))
    reader.close()


def test_closing_the_client_ends_the_tail(reader: LaneClient) -> None:
    tail = Tail(reader.watch_events())
    tail.take(1)
    reader.close()
    assert tail.seen.get(timeout=WAIT_SECONDS) is None, "ended without an error"
    tail.thread.join(WAIT_SECONDS)
    assert not tail.thread.is_alive()


@pytest.mark.slow  # starts a server or spawns a process
def test_a_tail_resumes_after_a_restart_without_skipping_or_repeating(
    tmp_path: pathlib.Path,
) -> None:
    with running(tmp_path / "ledger") as server:
        admin = Admin(server)
        lane = new_lane_name()
        admin.put_lane(lane, 1_000_000)
        grant = _read_grant(server, lane)
        with LaneClient(server.address, lane, grant=grant, settings=TEST_SETTINGS) as client:
            _reserve(client, 2)
            tail = Tail(client.watch_events())
            before = tail.take(3)
            admin.close()
            server.stop()  # the stream ends: SHUTTING_DOWN, then no ledger at all
            server.start()  # the same port and data directory
            admin = Admin(server)
            _reserve_once_back(client, 3)
            after = tail.take(3)
            assert _seqs(before + after) == _seqs(admin.events(lane))
        admin.close()


class CuttingProxy:
    """A TCP proxy to the ledger whose cut() drops every connection through it
    at once, as a load balancer or a network failure does, while the ledger
    runs on; new connections are taken as before."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(self._upstream)
            with self._lock:
                self._sockets += [client, upstream]
            for source, target in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, target), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                target.sendall(data)
        except OSError:
            pass
        for end in (source, target):
            end.close()

    def cut(self) -> None:
        with self._lock:
            cut, self._sockets = self._sockets, []
        for end in cut:
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()

    def close(self) -> None:
        self._listener.close()
        self.cut()


def test_a_tail_resumes_after_its_connection_is_cut(
    ledger_server: LedgerProcess, admin: Admin, reader: LaneClient, lane: str
) -> None:
    proxy = CuttingProxy(ledger_server.address)
    grant = _read_grant(ledger_server, lane)
    try:
        with LaneClient(proxy.address, lane, grant=grant, settings=TEST_SETTINGS) as cut_off:
            tail = Tail(cut_off.watch_events())
            before = tail.take(1)
            proxy.cut()  # the ledger runs on; the tail's stream is gone
            _reserve(reader, 3)  # booked directly, while the tail may be between streams
            after = tail.take(3)
            assert _seqs(before + after) == _seqs(admin.events(lane))
    finally:
        proxy.close()


def test_stopping_a_tail_frees_its_stream(ledger_server: LedgerProcess, lane: str) -> None:
    # One grant has 16 streams at the server. A tail left open would hold its
    # own: the 17th would be refused (TooManyWatchers, once its resumption gave
    # up), whether the tail was closed or its loop left.
    settings = dataclasses.replace(TEST_SETTINGS, watch_resume_seconds=WAIT_SECONDS)
    grant = _read_grant(ledger_server, lane)
    with LaneClient(ledger_server.address, lane, grant=grant, settings=settings) as client:
        for turn in range(STREAMS_PER_GRANT + 4):
            if turn % 2:
                watch = client.watch_events()
                assert next(watch).kind == "lane_configured"
                watch.close()
                continue
            for event in client.watch_events():
                assert event.kind == "lane_configured"
                break


def test_a_refused_tail_raises_once_its_resumption_gives_up(
    ledger_server: LedgerProcess, lane: str
) -> None:
    # TOO_MANY_WATCHERS is "slow down, send it again" (the error table): a tail
    # tries again, and raises it once watch_resume_seconds passed without room.
    settings = dataclasses.replace(TEST_SETTINGS, watch_resume_seconds=0.0)
    grant = _read_grant(ledger_server, lane)
    with LaneClient(ledger_server.address, lane, grant=grant, settings=settings) as client:
        held = [client.watch_events() for _ in range(STREAMS_PER_GRANT)]
        for watch in held:
            next(watch)
        with pytest.raises(TooManyWatchers):
            next(client.watch_events())
        for watch in held:
            watch.close()


# An HTTP/2 server's preface (an empty SETTINGS frame) and its ACK of the client's.
_SETTINGS_AND_ACK = (
    b"\x00\x00\x00\x04\x00\x00\x00\x00\x00" + b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"
)


@contextlib.contextmanager
def _mute_http2_server() -> Iterator[str]:
    """A server that opens HTTP/2 connections and then answers nothing, as a
    ledger frozen after its connections were made: a stream on it is never
    accepted, so only the client's own deadline ends it."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                connection, _ = listener.accept()
                connection.sendall(_SETTINGS_AND_ACK)
                held.append(connection)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
        for connection in held:
            connection.close()


def test_a_tail_the_ledger_never_accepts_raises_a_deadline_naming_it() -> None:
    # The stream was given up at its deadline and raised CANCELLED, "Locally
    # cancelled by application!", as if the lane had cancelled it.
    settings = dataclasses.replace(TEST_SETTINGS, watch_resume_seconds=0.0)
    with (
        _mute_http2_server() as address,
        LaneClient(address, "recall", grant="grant-1", settings=settings) as client,
        pytest.raises(LedgerUnavailable) as caught,
    ):
        next(client.watch_events(deadline_seconds=0.5))
    assert caught.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert "did not accept the event stream within its deadline (0.5 s)" in caught.value.message


def test_the_readme_example_runs(ledger_server: LedgerProcess, admin: Admin) -> None:
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## The lane's history: its events", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None
    # A lane of its own: the README's lane example books on "recall".
    lane = new_lane_name()
    admin.put_lane(lane, 1_000_000)
    namespace = {"GRANT": _read_grant(ledger_server, lane)}
    code = match.group(1).replace("ledger.internal:50051", ledger_server.address)
    code = code.replace('"recall"', repr(lane))
    exec(compile(code, "README", "exec"), namespace)
    ledger: LaneClient = namespace["ledger"]  # type: ignore[assignment]
    recorded: queue.Queue[LedgerEvent] = queue.Queue()
    audit = threading.Thread(target=namespace["audit"], args=(recorded.put,), daemon=True)  # type: ignore[arg-type]
    audit.start()
    so_far = _seqs(admin.events(lane))
    seen = [recorded.get(timeout=WAIT_SECONDS).seq for _ in so_far]
    _reserve(ledger, 2)
    seen += [recorded.get(timeout=WAIT_SECONDS).seq for _ in range(2)]
    ledger.close()  # ends the tail, and so the example's function
    audit.join(WAIT_SECONDS)
    assert not audit.is_alive()
    assert seen == _seqs(admin.events(lane))
