"""Two server processes on one PostgreSQL, 32 concurrent clients, one hot lane.

Afterwards the event log, replayed in commit (seq) order, must show that no
admitted Reserve ever left a lane over its limit, that every acknowledged move
is in the log exactly once, and that the projected balances equal the replay.
This test is the proof behind "admission is serialized per lane across
replicas"; with the lane lock removed it fails (see docs/postgresql.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc

pytestmark = pytest.mark.postgres

CLIENTS = 32
ROUNDS_PER_CLIENT = 30
# Two hot lanes share a parent budget smaller than their own limits together.
PARENT = "judge"
HOT_LANES = ("hot-1", "hot-2")
COLD_LANES = ("cold-a", "cold-b", "cold-c")
# Prices: 35,000 bytes at 3.5 bytes/token = 10,000 tokens in at 100,000 nanos per
# million (1,000 nanos) + up to 1,000 tokens out at 400,000 (400 nanos).
PRICE = pb.ModelPrice(
    input_nanos_per_million_tokens=100_000, output_nanos_per_million_tokens=400_000
)
HOT_LIMIT_NANOS = 150_000
PARENT_LIMIT_NANOS = 200_000
COLD_LIMIT_NANOS = 10_000_000
LIMITS = {
    PARENT: PARENT_LIMIT_NANOS,
    **dict.fromkeys(HOT_LANES, HOT_LIMIT_NANOS),
    **dict.fromkeys(COLD_LANES, COLD_LIMIT_NANOS),
}
PARENTS = dict.fromkeys(HOT_LANES, PARENT)


@dataclasses.dataclass(frozen=True)
class Ack:
    lane: str
    reservation_id: str
    move: str  # reserve, settle, refund
    answer: object


class Replica:
    def __init__(self, url: str, data_dir: Path) -> None:
        ledger = Path(sys.executable).with_name("ledger")
        env = {**os.environ, "LEDGER_DATABASE_URL": url}
        self.process = subprocess.Popen(
            [str(ledger), "serve", "--listen", "127.0.0.1:0", "--data-dir", str(data_dir),
             *extra_serve_flags()],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
        )  # fmt: skip
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line.startswith("ledger listening on "), line
        self.address = line.rsplit(" ", 1)[1].strip()
        self.channel = grpc.insecure_channel(self.address)
        self.ledger = pb_grpc.LedgerStub(self.channel)
        self.admin = pb_grpc.LaneAdminStub(self.channel)

    def stop(self, how: int = signal.SIGTERM) -> None:
        self.channel.close()
        if self.process.poll() is None:
            self.process.send_signal(how)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        assert self.process.stdout is not None
        self.process.stdout.close()


def extra_serve_flags() -> list[str]:
    """Flags every test replica needs (kept in one place)."""
    return ["--insecure-no-auth"]


@contextlib.contextmanager
def two_replicas(url: str, directory: Path) -> Iterator[tuple[Replica, Replica]]:
    """Two replicas on one database, stopped (SIGTERM) when the block ends."""
    first = Replica(url, directory / "a")
    second = Replica(url, directory / "b")
    try:
        yield first, second
    finally:
        first.stop()
        second.stop()


@pytest.fixture
def replicas(postgres_schema_url: str, tmp_path: Path) -> Iterator[tuple[Replica, Replica]]:
    with two_replicas(postgres_schema_url, tmp_path) as pair:
        yield pair


def _client(index: int, replicas: tuple[Replica, Replica], acks: list[Ack]) -> None:
    rng = random.Random(index)
    for round_number in range(ROUNDS_PER_CLIENT):
        lane = rng.choice(HOT_LANES) if rng.random() < 0.7 else rng.choice(COLD_LANES)
        rid = f"c{index}-{round_number}"
        home, other = replicas if rng.random() < 0.5 else replicas[::-1]
        request = pb.ReserveRequest(
            lane=lane, reservation_id=rid, model="jev",
            request_bytes=rng.randrange(1_000, 35_000), max_output_tokens=1000,
        )  # fmt: skip
        if rng.random() < 0.25:
            # The same Reserve sent to both replicas at once: one booking, one answer.
            futures = [home.ledger.Reserve.future(request), other.ledger.Reserve.future(request)]
            answers = [future.result(timeout=30) for future in futures]
            # One made the booking; the other repeats its answer and says so.
            assert sorted(answer.already_reserved for answer in answers) == [False, True], answers
            for answer in answers:
                answer.already_reserved = False
            assert answers[0] == answers[1], (rid, answers)
            reserved = answers[0]
        else:
            reserved = home.ledger.Reserve(request, timeout=30)
        acks.append(Ack(lane, rid, "reserve", reserved.decision))
        if reserved.decision != pb.ADMITTED:
            continue
        _end(rng, lane, rid, reserved.hold_nanos, home, other, acks)


def _end(
    rng: random.Random, lane: str, rid: str, hold: int,
    home: Replica, other: Replica, acks: list[Ack],
) -> None:  # fmt: skip
    choice = rng.random()
    target = other if rng.random() < 0.5 else home
    if choice < 0.6:
        # Real usage never above the hold here, so no lane may ever go over.
        request = pb.SettleRequest(lane=lane, reservation_id=rid, outcome=pb.SUCCEEDED,
                                   billed_nanos=rng.randrange(0, hold + 1))  # fmt: skip
        answer = target.ledger.Settle(request, timeout=30)
        if rng.random() < 0.2:
            assert (home if target is other else other).ledger.Settle(request, timeout=30) == answer
        acks.append(Ack(lane, rid, "settle", answer.charged_nanos))
    elif choice < 0.8:
        request = pb.SettleRequest(lane=lane, reservation_id=rid, outcome=pb.UNKNOWN)
        acks.append(
            Ack(lane, rid, "settle", target.ledger.Settle(request, timeout=30).charged_nanos)
        )
    elif choice < 0.95:
        refund = pb.RefundRequest(lane=lane, reservation_id=rid, http_status=429)
        target.ledger.Refund(refund, timeout=30)
        acks.append(Ack(lane, rid, "refund", 0))
    # else: left open; it stays held (the ttl outlives the test).


def _all_events(replica: Replica) -> list[pb.Event]:
    events: list[pb.Event] = []
    token = ""
    for _ in range(10_000):
        page = replica.ledger.ListEvents(pb.ListEventsRequest(page_size=1000, page_token=token))
        events.extend(page.events)
        token = page.next_page_token
        if not token:
            return events
    raise AssertionError("event log did not end")


def _micros(stamp: object) -> int:
    return stamp.seconds * 1_000_000 + stamp.nanos // 1000  # type: ignore[attr-defined]


def _budgets_of(lane: str) -> list[str]:
    return [lane, PARENTS[lane]] if lane in PARENTS else [lane]


def _check_log(events: list[pb.Event]) -> dict[str, dict[str, int]]:
    """Replays the log in seq order; returns the amount of each booking per lane.

    At every admitted Reserve, every budget the lane belongs to (itself and its
    parent) must be within its limit.
    """
    assert [e.seq for e in events] == sorted(e.seq for e in events)
    amounts: dict[str, dict[str, int]] = defaultdict(dict)
    for event in events:
        lane_amounts = amounts[event.lane]
        if event.kind == "reserved":
            assert event.reservation_id not in lane_amounts, f"booked twice: {event.reservation_id}"
            lane_amounts[event.reservation_id] = event.amount_nanos
            for budget in _budgets_of(event.lane):
                members = [lane for lane in LIMITS if budget in _budgets_of(lane)]
                spent = sum(sum(amounts[member].values()) for member in members)
                assert spent <= LIMITS[budget], (
                    f"admitted {event.reservation_id} left {budget} at {spent} > {LIMITS[budget]}"
                )
            assert event.spent_after_nanos == sum(lane_amounts.values())
        elif event.kind in ("settled", "refunded", "expired"):
            assert event.reservation_id in lane_amounts
            lane_amounts[event.reservation_id] = event.amount_nanos
    return amounts


def test_two_replicas_never_overbook_and_lose_nothing(replicas: tuple[Replica, Replica]) -> None:
    first, _ = replicas
    for lane, limit in LIMITS.items():
        policy = pb.Lane(lane=lane, limit_nanos=limit, prices={"jev": PRICE})
        policy.parent = PARENTS.get(lane, "")
        first.admin.PutLane(pb.PutLaneRequest(lane=policy))
    acks: list[Ack] = []
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            _client(index, replicas, acks)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors[:3]

    events = _all_events(first)
    amounts = _check_log(events)
    by_booking: dict[tuple[str, str], list[str]] = defaultdict(list)
    for event in events:
        by_booking[(event.lane, event.reservation_id)].append(event.kind)
    moves = 0
    for ack in acks:
        kinds = by_booking[(ack.lane, ack.reservation_id)]
        expected = {
            "reserve": ("reserved", "denied"),
            "settle": ("settled",),
            "refund": ("refunded",),
        }
        assert sum(kind in expected[ack.move] for kind in kinds) == 1, (ack, kinds)
        moves += 1
    assert moves >= CLIENTS * ROUNDS_PER_CLIENT
    denied_by = {e.denied_by for e in events if e.kind == "denied"}
    assert PARENT in denied_by, "the parent never said no: the test proves nothing"
    for lane in LIMITS:
        balance = first.ledger.GetBalance(pb.GetBalanceRequest(lane=lane))
        members = [member for member in LIMITS if lane in _budgets_of(member)]
        assert balance.spent_nanos == sum(sum(amounts[m].values()) for m in members), lane
