"""A PostgreSQL that stops answering altogether, as under an operator's SIGSTOP.

A real `ledger serve` reaches its own fresh database through a proxy that can
freeze (tests/freezing_proxy.py): every socket stays open and the kernel keeps
ACKing, so neither statement_timeout nor TCP keepalives fire. Twelve clients
send Reserves with 5 s deadlines through a 10 s freeze. Every call must end by
its deadline with UNAVAILABLE and the constant message, health must turn
NOT_SERVING within a few seconds and stay so, and after the thaw calls must
succeed and health return to SERVING, without a restart.

With the watchdog's interruption removed (storage/watchdog.py `interrupt`
returning at once) the calls caught inside a statement wait out the freeze and
end with the client's DEADLINE_EXCEEDED, and this test fails.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import sqlalchemy as sa
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy.engine import make_url

from ledger_service.application import deadlines
from ledger_service.domain.errors import StoreUnavailable
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.storage import database, watchdog
from ledger_service.storage.sql import SqlStore
from tests import serving
from tests.freezing_proxy import FreezingProxy
from tests.storage.conftest import POSTGRES_URL, require_postgres

CLIENTS = 12
CALL_DEADLINE_SECONDS = 5.0
# A call may end this much after its deadline (scheduling on a busy machine).
LATE_SECONDS = 0.5
WARM_SECONDS = 2.0
FREEZE_SECONDS = 10.0
AFTER_THAW_SECONDS = 8.0
# Health must say NOT_SERVING this soon after the freeze, SERVING after the thaw.
HEALTH_TURNS_SECONDS = 4.0
HEALTH_POLL_SECONDS = 0.1
CONSTANT_MESSAGE = StoreUnavailable().message
PRICE = pb.ModelPrice(
    input_nanos_per_million_tokens=100_000, output_nanos_per_million_tokens=400_000
)


@dataclasses.dataclass(frozen=True)
class Call:
    started: float
    ended: float
    code: grpc.StatusCode
    details: str
    reason: str


@pytest.fixture
def frozen_database_url() -> Iterator[str]:
    """A fresh database of this test's own, dropped afterwards."""
    require_postgres()
    name = f"ledger_frozen_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def proxy(frozen_database_url: str) -> Iterator[FreezingProxy]:
    url = make_url(frozen_database_url)
    started = FreezingProxy(url.host or "127.0.0.1", url.port or 5432)
    yield started
    started.close()


@pytest.fixture
def served(
    frozen_database_url: str, proxy: FreezingProxy, tmp_path: Path
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`ledger serve` on the database, through the proxy."""
    through_proxy = make_url(frozen_database_url).set(host="127.0.0.1", port=proxy.port)
    env = {
        **{key: value for key, value in os.environ.items() if not key.startswith("LEDGER_")},
        "LEDGER_DATABASE_URL": through_proxy.render_as_string(hide_password=False),
    }
    ledger = Path(sys.executable).with_name("ledger")
    process = subprocess.Popen(
        [str(ledger), "serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path),
         "--insecure-no-auth"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.startswith("ledger listening on "), line
    try:
        yield process, line.rsplit(" ", 1)[1].strip()
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()


def _reserve_until(stub: pb_grpc.LedgerStub, index: int, stop: threading.Event,
                   calls: list[Call]) -> None:  # fmt: skip
    number = 0
    while not stop.is_set():
        number += 1
        request = pb.ReserveRequest(
            lane="recall", reservation_id=f"c{index}-{number}", model="jev",
            request_bytes=7000, max_output_tokens=200,
        )  # fmt: skip
        started = time.monotonic()
        try:
            stub.Reserve(request, timeout=CALL_DEADLINE_SECONDS)
            calls.append(Call(started, time.monotonic(), grpc.StatusCode.OK, "", ""))
        except grpc.RpcError as error:
            assert isinstance(error, grpc.Call)
            reason = dict(error.trailing_metadata() or ()).get("ledger-reason", "")
            code, details = error.code(), error.details() or ""
            calls.append(Call(started, time.monotonic(), code, details, str(reason)))
            time.sleep(0.05)


def _poll_health(channel: grpc.Channel, stop: threading.Event,
                 samples: list[tuple[float, str]]) -> None:  # fmt: skip
    stub = health_pb2_grpc.HealthStub(channel)
    while not stop.is_set():
        at = time.monotonic()
        try:
            answer = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
        except grpc.RpcError as error:
            status = f"error {error.code() if isinstance(error, grpc.Call) else error}"
        samples.append((at, status))
        time.sleep(HEALTH_POLL_SECONDS)


def test_every_call_ends_by_its_deadline_while_the_database_is_frozen(
    served: tuple[subprocess.Popen[str], str], proxy: FreezingProxy
) -> None:
    process, address = served
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.LedgerStub(channel)
    policy = pb.Lane(lane="recall", limit_nanos=10**15, prices={"jev": PRICE})
    pb_grpc.LaneAdminStub(channel).PutLane(pb.PutLaneRequest(lane=policy), timeout=30)
    calls: list[Call] = []
    samples: list[tuple[float, str]] = []
    stop = threading.Event()
    threads = [
        threading.Thread(target=_reserve_until, args=(stub, index, stop, calls))
        for index in range(CLIENTS)
    ]
    threads.append(threading.Thread(target=_poll_health, args=(channel, stop, samples)))
    for thread in threads:
        thread.start()
    try:
        time.sleep(WARM_SECONDS)
        frozen_at = time.monotonic()
        proxy.freeze()
        time.sleep(FREEZE_SECONDS)
        thawed_at = time.monotonic()
        proxy.thaw()
        time.sleep(AFTER_THAW_SECONDS)
    finally:
        proxy.thaw()
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    channel.close()
    assert process.poll() is None, "the server must not have restarted or died"
    _report(calls, samples, frozen_at, thawed_at)

    late = [
        call for call in calls if call.ended - call.started > CALL_DEADLINE_SECONDS + LATE_SECONDS
    ]
    assert not late, f"{len(late)} calls outlived their deadline: {late[:3]}"
    failed = [call for call in calls if call.code is not grpc.StatusCode.OK]
    assert len(failed) >= CLIENTS, "the freeze must have failed calls"
    for call in failed:
        assert (call.code, call.details, call.reason) == (
            grpc.StatusCode.UNAVAILABLE, CONSTANT_MESSAGE, "STORE_UNAVAILABLE",
        ), call  # fmt: skip
    assert all(frozen_at <= call.started + CALL_DEADLINE_SECONDS for call in failed)
    recovered = [call for call in calls if call.started > thawed_at + HEALTH_TURNS_SECONDS]
    assert recovered, "no call was made after the thaw"
    assert all(call.code is grpc.StatusCode.OK for call in recovered), recovered[:3]

    during = [status for at, status in samples
              if frozen_at + HEALTH_TURNS_SECONDS <= at < thawed_at]  # fmt: skip
    assert during and set(during) == {"NOT_SERVING"}, set(during)
    after = [status for at, status in samples if at >= thawed_at + HEALTH_TURNS_SECONDS]
    assert after and set(after) == {"SERVING"}, set(after)


def _report(calls: list[Call], samples: list[tuple[float, str]],
            frozen_at: float, thawed_at: float) -> None:  # fmt: skip
    """The figures docs/postgresql.md quotes (shown with -s)."""
    hit = [call for call in calls if call.started < thawed_at and call.ended > frozen_at]
    failed = [call.ended - call.started for call in hit if call.code is not grpc.StatusCode.OK]
    down = next((at for at, status in samples if at >= frozen_at and status == "NOT_SERVING"), None)
    up = next((at for at, status in samples if at >= thawed_at and status == "SERVING"), None)
    first_ok = min((call.ended for call in calls
                    if call.started >= thawed_at and call.code is grpc.StatusCode.OK),
                   default=None)  # fmt: skip

    def after(instant: float | None, origin: float) -> str:
        return "never" if instant is None else f"{instant - origin:.2f} s"

    print(
        f"\nfrozen {thawed_at - frozen_at:.1f} s: {len(failed)} calls failed, "
        f"taking {min(failed, default=0):.2f}-{max(failed, default=0):.2f} s; "
        f"NOT_SERVING after {after(down, frozen_at)}, SERVING {after(up, thawed_at)} "
        f"after the thaw; first success {after(first_ok, thawed_at)} after the thaw; "
        f"{len(calls)} calls in all"
    )


@pytest.mark.parametrize("budget_seconds", [0.4, 0.9])
def test_a_statement_under_a_short_watch_returns_by_its_deadline(
    proxy: FreezingProxy, frozen_database_url: str, budget_seconds: float
) -> None:
    """The cancel request a frozen server never answers is bounded by the
    watch's own time left, so the socket is shut at the deadline, not after
    the watchdog's full cancel grace (0.5 s) on a shorter deadline."""
    import psycopg

    url = make_url(frozen_database_url).set(host="127.0.0.1", port=proxy.port)
    dsn = url.render_as_string(hide_password=False).replace("postgresql+psycopg", "postgresql")
    connection = psycopg.connect(dsn, autocommit=True)
    dog = watchdog.Watchdog(cancel_grace_seconds=0.5)
    try:
        proxy.freeze()
        started = time.monotonic()
        with dog.watch(started + budget_seconds) as watch:
            watch.attach(connection)
            with pytest.raises(psycopg.Error):
                connection.execute("SELECT 1")
            took = time.monotonic() - started
        # By the deadline, give or take a scheduler's tick.
        assert took < budget_seconds + 0.1, took
    finally:
        proxy.thaw()
        dog.close()
        connection.close()


def test_a_new_connections_handshake_ends_by_a_short_calls_deadline(
    proxy: FreezingProxy, frozen_database_url: str
) -> None:
    """libpq's connect_timeout is whole seconds, at least 2: a handshake with
    a frozen server under a lane's 0.25 s call ended 1.75 s past its deadline.
    watchdog.DeadlineConnection ends it at the deadline (psycopg wakes every
    0.1 s to look)."""
    url = make_url(frozen_database_url).set(host="127.0.0.1", port=proxy.port)
    engine = database.create(url.render_as_string(hide_password=False), database.EngineLimits())
    store = SqlStore(engine)
    try:
        proxy.freeze()
        deadline = time.monotonic() + 0.25
        with deadlines.answering_by(deadline), pytest.raises(StoreUnavailable):
            store.run(lambda tx: tx.execute_text("SELECT 1"), write=False)
        late = time.monotonic() - deadline
        assert late < LATE_SECONDS, late
    finally:
        proxy.thaw()
        store.close()


def test_the_wait_for_a_free_connection_ends_at_the_watch_deadline() -> None:
    engine = sa.create_engine(
        "sqlite://", poolclass=watchdog.DeadlinePool, pool_size=1, max_overflow=0,
        pool_timeout=30,
    )  # fmt: skip
    dog = watchdog.Watchdog()
    try:
        with engine.connect():
            started = time.monotonic()
            with dog.watch(started + 0.3), pytest.raises(sa.exc.TimeoutError):
                engine.connect()
            assert time.monotonic() - started < 2.0
    finally:
        dog.close()
        engine.dispose()


def test_a_server_started_on_a_database_that_does_not_answer_comes_up_and_migrates_later(
    frozen_database_url: str, proxy: FreezingProxy, tmp_path: Path
) -> None:
    """docs/recovery.md: a database unreachable at start is tried again. The
    schema's migration too: the server listens, NOT_SERVING, with one log line,
    and brings a fresh database's schema up when it answers."""
    proxy.freeze()
    through_proxy = make_url(frozen_database_url).set(host="127.0.0.1", port=proxy.port)
    env = {
        **{key: value for key, value in os.environ.items() if not key.startswith("LEDGER_")},
        "LEDGER_DATABASE_URL": through_proxy.render_as_string(hide_password=False),
        "LEDGER_STATEMENT_TIMEOUT_MS": "1000",
        "LEDGER_RECOVERY_CHECK_INTERVAL_SECONDS": "0.5",
    }
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        process, address = serving.spawn(tmp_path, "--insecure-no-auth", env=env, stderr=log)
    try:
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest()
            assert (
                health.Check(request, timeout=5).status
                == health_pb2.HealthCheckResponse.NOT_SERVING
            )
            proxy.thaw()
            give_up = time.monotonic() + 30
            while health.Check(request, timeout=5).status != health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < give_up, log_path.read_text()
                time.sleep(0.2)
            lane = pb.Lane(lane="recall", limit_nanos=10**9, prices={"jev": PRICE})
            pb_grpc.LaneAdminStub(channel).PutLane(pb.PutLaneRequest(lane=lane), timeout=10)
        logged = log_path.read_text()
        assert "schema could not be brought up to date: it does not answer" in logged
        assert "Traceback" not in logged
    finally:
        serving.stop(process)
