"""PostgreSQL goes away under load and comes back: one short test.

While it is away a Reserve fails fast with UNAVAILABLE (never hangs on the pool
or a lock, never runs into its deadline) and health turns NOT_SERVING; when it
is back the server serves again by itself. Clients resend every move whose
answer they did not get; every acknowledged one is in the log exactly once.

This stops the shared PostgreSQL server for a few seconds: other suites'
PostgreSQL tests running at that moment fail, so it is kept short, and
PostgreSQL is started again in a `finally` whatever happens.
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest
import sqlalchemy as sa
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ledger_service.domain.clock import SystemClock
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.recovery.store import SqlRecoveryStore
from ledger_service.recovery.verify import Verifier
from ledger_service.server import LedgerServer
from ledger_service.settings import Settings
from ledger_service.storage import database
from tests.storage.conftest import POSTGRES_URL, require_postgres

pytestmark = pytest.mark.postgres

CLUSTER = ("pg_ctlcluster", "--skip-systemctl-redirect", "15", "main")
RPC_TIMEOUT_SECONDS = 4.0
# The server's own bound on a request's wait for the database.
REQUEST_DEADLINE_SECONDS = 2.0
CLIENTS = 3
PRICE = pb.ModelPrice(
    input_nanos_per_million_tokens=100_000, output_nanos_per_million_tokens=400_000
)


def _cluster(action: str) -> None:
    subprocess.run([*CLUSTER, action], check=True, capture_output=True, timeout=60)


def _wait_for_postgres(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while subprocess.run(["pg_isready", "-h", "127.0.0.1", "-q"], check=False).returncode:
        assert time.monotonic() < deadline, "PostgreSQL did not come back"
        time.sleep(0.1)


@pytest.fixture
def outage_schema_url() -> Iterator[str]:
    """Like the storage suite's `postgres_schema_url`, but its teardown opens a
    new connection: the pooled ones died with the outage."""
    require_postgres()
    schema = f"t_{uuid.uuid4().hex[:12]}"

    def run(statement: str) -> None:
        engine = sa.create_engine(POSTGRES_URL, poolclass=sa.pool.NullPool)
        try:
            with engine.begin() as connection:
                connection.execute(sa.text(statement))
        finally:
            engine.dispose()

    run(f'CREATE SCHEMA "{schema}"')
    try:
        yield f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"
    finally:
        _wait_for_postgres(30)
        run(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.fixture
def server(outage_schema_url: str, tmp_path: pathlib.Path) -> Iterator[LedgerServer]:
    ledger = LedgerServer(
        Settings(
            database_url=outage_schema_url,
            data_dir=tmp_path,
            listen="127.0.0.1:0",
            auth_enabled=False,
            sweep_interval_seconds=0.1,
            request_deadline_seconds=REQUEST_DEADLINE_SECONDS,
            statement_timeout_ms=2000,
            pool_timeout_seconds=1.0,
        )
    )
    ledger.start()
    yield ledger
    ledger.stop(0)


@dataclasses.dataclass
class Record:
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    acked: list[str] = dataclasses.field(default_factory=list)
    # (seconds the failed call took, its status code)
    failures: list[tuple[float, grpc.StatusCode | None]] = dataclasses.field(default_factory=list)
    retried: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)


def _client(index: int, stub: pb_grpc.LedgerStub, stop: threading.Event, record: Record) -> None:
    round_number = 0
    try:
        while not stop.is_set():
            round_number += 1
            rid = f"c{index}-{round_number}"
            request = pb.ReserveRequest(
                lane="recall", reservation_id=rid, model="jev", request_bytes=10_000,
                max_output_tokens=100,
            )  # fmt: skip
            for attempt in range(100_000):
                started = time.monotonic()
                try:
                    stub.Reserve(request, timeout=RPC_TIMEOUT_SECONDS)
                except grpc.RpcError as error:
                    code = error.code() if isinstance(error, grpc.Call) else None
                    with record.lock:
                        record.failures.append((time.monotonic() - started, code))
                        record.retried += attempt == 0
                    time.sleep(0.05)
                    continue
                with record.lock:
                    record.acked.append(rid)
                break
    except Exception as error:
        record.errors.append(repr(error))


def _health(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return int(stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status)


def _wait_health(channel: grpc.Channel, status: int, seconds: float) -> float:
    started = time.monotonic()
    while _health(channel) != status:
        assert time.monotonic() - started < seconds, f"health never became {status}"
        time.sleep(0.05)
    return time.monotonic() - started


def test_postgres_stops_and_returns_under_load(
    server: LedgerServer, outage_schema_url: str
) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.LedgerStub(channel)
    pb_grpc.LaneAdminStub(channel).PutLane(
        pb.PutLaneRequest(lane=pb.Lane(lane="recall", limit_nanos=10**12, prices={"jev": PRICE})),
        timeout=10,
    )
    stop, record = threading.Event(), Record()
    threads = [
        threading.Thread(target=_client, args=(i, stub, stop, record)) for i in range(CLIENTS)
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    try:
        _cluster("stop")
        not_serving_after = _wait_health(channel, health_pb2.HealthCheckResponse.NOT_SERVING, 5)
        time.sleep(1.0)  # the clients keep trying against a database that is not there
        with record.lock:
            during = list(record.failures)
    finally:
        _cluster("start")
        _wait_for_postgres(30)
    serving_after = _wait_health(channel, health_pb2.HealthCheckResponse.SERVING, 20)
    time.sleep(0.5)
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    channel.close()
    assert not record.errors, record.errors
    assert during, "no request met the outage"
    codes = collections.Counter(code for _, code in during)
    assert set(codes) == {grpc.StatusCode.UNAVAILABLE}, codes
    slowest = max(seconds for seconds, _ in during)
    assert slowest < REQUEST_DEADLINE_SECONDS + 1.0, f"a failing Reserve took {slowest:.2f}s"
    _check_log(outage_schema_url, record.acked)
    print(
        f"\noutage: health NOT_SERVING after {not_serving_after:.2f}s, SERVING again "
        f"{serving_after:.2f}s after PostgreSQL was back; {len(during)} failed calls "
        f"(slowest {slowest:.2f}s), {record.retried} moves retried, {len(record.acked)} acked"
    )


def _check_log(url: str, acked: list[str]) -> None:
    engine = database.create(url, database.EngineLimits(pool_size=2))
    try:
        store = SqlRecoveryStore(engine)
        answers: collections.Counter[str] = collections.Counter()
        after = 0
        while batch := store.events_after(after, 1000):
            answers.update(
                e.reservation_id for e in batch if e.kind.value in ("reserved", "denied")
            )
            after = batch[-1].seq
        assert Verifier(store).verify(SystemClock().now_us()).ok
    finally:
        engine.dispose()
    assert [rid for rid in acked if answers[rid] != 1] == []
    assert max(answers.values()) == 1
