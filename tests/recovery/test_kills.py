"""SIGKILL the server at random moments under load, many times, and lose nothing.

Clients keep reserving, settling (SUCCEEDED and UNKNOWN) and refunding on two
lanes. At a random moment the server process gets SIGKILL; a move whose answer
was lost with it is in doubt, and its client sends the very same request again
to the next server until it is answered. At the end every acknowledged move
must be in the log exactly once (a retried move is never booked twice), and
`ledger verify` must pass: chains, projections and window totals. The figures
are printed (run with -s to see them) and kept in `FIGURES` for the report.

The server processes are forked by tests/recovery/zygote.py, which has already
imported everything: a cold `ledger serve` costs seconds on a busy machine.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from ledger_service import cli
from ledger_service.domain.clock import SystemClock
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.recovery.store import SqlRecoveryStore
from ledger_service.recovery.verify import Verifier
from ledger_service.storage import database, migrate

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLIENTS = 4
LANES = ("recall", "dreaming")
PRICE = pb.ModelPrice(
    input_nanos_per_million_tokens=100_000, output_nanos_per_million_tokens=400_000
)
RPC_TIMEOUT_SECONDS = 5.0
# The figures of the last runs, by backend, for the report.
FIGURES: dict[str, dict[str, int]] = {}


class Zygote:
    def __init__(self, log_path: pathlib.Path) -> None:
        self.log_path = log_path
        self._log = log_path.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.recovery.zygote"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        assert json.loads(self._readline(120.0)) == {"ready": True}

    def _readline(self, timeout_seconds: float) -> str:
        assert self.process.stdout is not None
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(self.process.stdout.readline()))  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout_seconds)
        assert lines and lines[0], "the zygote said nothing in time"
        return lines[0]

    def spawn(self, **settings: Any) -> tuple[int, int]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(settings) + "\n")
        self.process.stdin.flush()
        answer = json.loads(self._readline(60.0))
        assert "error" not in answer, answer.get("error")
        return int(answer["pid"]), int(answer["port"])

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.kill()
        self.process.wait(timeout=10)
        assert self.process.stdout is not None
        self.process.stdout.close()
        self._log.close()


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    forker = Zygote(tmp_path_factory.mktemp("zygote") / "servers.log")
    yield forker
    forker.close()


@dataclasses.dataclass
class Target:
    """The server the clients talk to now; `generation` moves on at each restart."""

    condition: threading.Condition = dataclasses.field(default_factory=threading.Condition)
    generation: int = 0
    port: int = 0
    up: bool = False
    stopping: bool = False

    def publish(self, port: int) -> None:
        with self.condition:
            self.generation += 1
            self.port, self.up = port, True
            self.condition.notify_all()

    def down(self) -> None:
        with self.condition:
            self.up = False

    def current(self) -> tuple[int, int]:
        """(generation, port) of the live server, waiting while there is none."""
        with self.condition:
            self.condition.wait_for(lambda: self.up, timeout=60)
            assert self.up, "no server came back"
            return self.generation, self.port


@dataclasses.dataclass(frozen=True)
class Ack:
    lane: str
    reservation_id: str
    move: str  # reserve, settle, refund
    answer: str


@dataclasses.dataclass
class Tally:
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    acks: list[Ack] = dataclasses.field(default_factory=list)
    retried: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)


class Client:
    """Sends one move at a time; a move in doubt is sent again, unchanged."""

    def __init__(self, index: int, target: Target, tally: Tally) -> None:
        self._rng = random.Random(index)
        self._index = index
        self._target = target
        self._tally = tally
        self._generation = 0
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.LedgerStub | None = None
        self._round = 0

    def _connect(self) -> pb_grpc.LedgerStub:
        generation, port = self._target.current()
        if self._stub is None or generation != self._generation:
            if self._channel is not None:
                self._channel.close()
            self._generation = generation
            self._channel = grpc.insecure_channel(f"127.0.0.1:{port}")
            self._stub = pb_grpc.LedgerStub(self._channel)
        return self._stub

    def _send(self, method: str, request: Any) -> Any:
        """The answer, however many servers it takes."""
        for attempt in range(10_000):
            try:
                return getattr(self._connect(), method)(request, timeout=RPC_TIMEOUT_SECONDS)
            except grpc.RpcError as error:
                code = error.code() if isinstance(error, grpc.Call) else None
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                if attempt == 0:
                    with self._tally.lock:
                        self._tally.retried += 1
                # The server is gone (the next one is on its way) or busy: the same
                # request again, to whichever server is up.
                time.sleep(0.02)
        raise AssertionError(f"{method} was never answered")

    def run(self) -> None:
        try:
            while not self._target.stopping:
                self._one_booking()
        except Exception as error:
            with self._tally.lock:
                self._tally.errors.append(f"client {self._index}: {error!r}")
        finally:
            if self._channel is not None:
                self._channel.close()

    def _ack(self, lane: str, rid: str, move: str, answer: str) -> None:
        with self._tally.lock:
            self._tally.acks.append(Ack(lane, rid, move, answer))

    def _one_booking(self) -> None:
        self._round += 1
        lane = self._rng.choice(LANES)
        rid = f"c{self._index}-{self._round}"
        reserve = pb.ReserveRequest(
            lane=lane, reservation_id=rid, model="jev",
            request_bytes=self._rng.randrange(1_000, 35_000), max_output_tokens=1000,
        )  # fmt: skip
        reserved = self._send("Reserve", reserve)
        self._ack(lane, rid, "reserve", pb.Decision.Name(reserved.decision))
        if reserved.decision != pb.ADMITTED:
            return
        choice = self._rng.random()
        if choice < 0.5:
            billed = self._rng.randrange(0, reserved.hold_nanos + 1)
            settle = pb.SettleRequest(
                lane=lane, reservation_id=rid, outcome=pb.SUCCEEDED, billed_nanos=billed
            )
            self._ack(lane, rid, "settle", str(self._send("Settle", settle).charged_nanos))
        elif choice < 0.7:
            settle = pb.SettleRequest(lane=lane, reservation_id=rid, outcome=pb.UNKNOWN)
            self._ack(lane, rid, "settle", str(self._send("Settle", settle).charged_nanos))
        elif choice < 0.95:
            refund = pb.RefundRequest(lane=lane, reservation_id=rid, http_status=429)
            self._send("Refund", refund)
            self._ack(lane, rid, "refund", "0")
        # else: left open.


def _put_lanes(port: int) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        admin = pb_grpc.LaneAdminStub(channel)
        for lane in LANES:
            admin.PutLane(
                pb.PutLaneRequest(
                    lane=pb.Lane(lane=lane, limit_nanos=10**12, prices={"jev": PRICE})
                ),
                timeout=30,
            )


def _server_settings(url: str, data_dir: pathlib.Path) -> dict[str, Any]:
    return {
        "database_url": url,
        "data_dir": str(data_dir),
        "listen": "127.0.0.1:0",
        "auth_enabled": False,
        "max_workers": 8,
        "sweep_interval_seconds": 0.05,
        # Snapshots and consistency checks often, so that kills land in them too.
        "snapshot_every_events": 25,
        "recovery_check_interval_seconds": 0.1,
        "consistency_check_interval_seconds": 0.5,
    }


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


EXPECTED_KINDS = {
    "reserve": ("reserved", "denied"),
    "settle": ("settled",),
    "refund": ("refunded",),
}


def _log_and_verify(url: str) -> dict[tuple[str, str], list[str]]:
    """Each booking's event kinds in seq order; asserts that `verify` passes."""
    engine = database.create(url, database.EngineLimits(pool_size=2))
    try:
        store = SqlRecoveryStore(engine)
        by_booking: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
        after = 0
        while batch := store.events_after(after, 1000):
            for event in batch:
                by_booking[(event.lane, event.reservation_id)].append(event.kind.value)
            after = batch[-1].seq
        report = Verifier(store).verify(SystemClock().now_us())
        assert report.ok, report.findings[:5]
    finally:
        engine.dispose()
    return by_booking


def _kill_under_load(
    zygote: Zygote, url: str, data_dir: pathlib.Path, kills: int, seed: int
) -> dict[str, int]:
    engine = database.create(url, database.EngineLimits(pool_size=2))
    migrate.upgrade(engine)
    engine.dispose()
    settings = _server_settings(url, data_dir)
    rng = random.Random(seed)
    target, tally = Target(), Tally()
    pid, port = zygote.spawn(**settings)
    _put_lanes(port)
    target.publish(port)
    threads = [
        threading.Thread(target=Client(index, target, tally).run, daemon=True)
        for index in range(CLIENTS)
    ]
    for thread in threads:
        thread.start()
    for _ in range(kills):
        time.sleep(rng.uniform(0.05, 0.6))
        target.down()
        _kill(pid)
        pid, port = zygote.spawn(**settings)
        target.publish(port)
    # A last server: every move in doubt is answered, then the clients stop.
    time.sleep(0.3)
    target.stopping = True
    for thread in threads:
        thread.join(timeout=60)
    _kill(pid)
    assert not tally.errors, tally.errors[:3]
    # Nothing was altered: a kill may leave a rebuild to do, never a break to see.
    said = zygote.log_path.read_text()
    assert "chain is broken" not in said and "did NOT check out" not in said
    by_booking = _log_and_verify(url)
    lost = duplicated = 0
    for ack in tally.acks:
        kinds = by_booking.get((ack.lane, ack.reservation_id), [])
        found = sum(kind in EXPECTED_KINDS[ack.move] for kind in kinds)
        lost += found == 0
        duplicated += found > 1
        if ack.move == "reserve" and kinds:
            assert (kinds[0] == "reserved") == (ack.answer == "ADMITTED"), (ack, kinds)
    return {
        "kills": kills,
        "moves_acknowledged_and_checked": len(tally.acks),
        "moves_in_doubt_retried": tally.retried,
        "lost": lost,
        "duplicated": duplicated,
        "bookings_in_log": len(by_booking),
    }


def _report(name: str, figures: dict[str, int]) -> None:
    FIGURES[name] = figures
    print(f"\n{name}: {json.dumps(figures, sort_keys=True)}")


def test_twenty_kills_on_sqlite_lose_and_double_nothing(
    zygote: Zygote, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path}/ledger.db"
    figures = _kill_under_load(zygote, url, tmp_path / "server", kills=20, seed=1)
    with capsys.disabled():
        _report("sqlite", figures)
    assert figures["lost"] == 0 and figures["duplicated"] == 0
    assert figures["moves_in_doubt_retried"] > 0, "no kill landed on a move: proves nothing"
    assert cli.main(["verify", "--database-url", url]) == 0


@pytest.mark.postgres
def test_ten_kills_on_postgres_lose_and_double_nothing(
    zygote: Zygote,
    postgres_schema_url: str,
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    figures = _kill_under_load(zygote, postgres_schema_url, tmp_path / "server", kills=10, seed=2)
    with capsys.disabled():
        _report("postgres", figures)
    assert figures["lost"] == 0 and figures["duplicated"] == 0
    assert figures["moves_in_doubt_retried"] > 0, "no kill landed on a move: proves nothing"
