"""A server on SQLite files it may not write: NOT_SERVING, and a log line that
names the file and why, until an operator gives it write access; then it
serves again by itself.

SQLite opens a file it may not write read-only without a word, so such a
server used to come up SERVING and refuse every move as "retry later". When
the tests run as root, whom file modes do not stop, the file is made
immutable instead (chattr +i), which stops root too.
"""

from __future__ import annotations

import os
import pathlib
import resource
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ledger_service.application.ledger import Ledger
from ledger_service.domain import moves
from ledger_service.domain.clock import SystemClock
from ledger_service.domain.policies import LanePolicy
from ledger_service.domain.pricing import ModelPrice
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.storage import database, migrate
from ledger_service.storage.sql import SqlStore
from tests import serving

WAIT_SECONDS = 15.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _read_only(path: pathlib.Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(path)], check=True)
    else:
        path.chmod(0o444)


def _writable(path: pathlib.Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], check=True)
    path.chmod(0o644)


@pytest.fixture
def data_dir() -> Iterator[pathlib.Path]:
    directory = pathlib.Path(tempfile.mkdtemp(prefix="ledger-unwritable-"))
    engine = database.create(f"sqlite:///{directory}/ledger.db", database.EngineLimits())
    migrate.upgrade(engine)
    engine.dispose()
    try:
        yield directory
    finally:
        for path in directory.iterdir():
            _writable(path)
            path.unlink()
        directory.rmdir()


@pytest.fixture
def serve(data_dir: pathlib.Path) -> Iterator[Callable[[], tuple[str, pathlib.Path]]]:
    processes: list[subprocess.Popen[str]] = []
    log_path = data_dir / "server.log"

    def start() -> tuple[str, pathlib.Path]:
        env = serving.clean_env(LEDGER_HEALTH_CHECK_INTERVAL_SECONDS="0.2")
        with log_path.open("w") as log:
            process, address = serving.spawn(
                data_dir, "--insecure-no-auth", "--no-migrate", env=env, stderr=log
            )
        processes.append(process)
        return address, log_path

    yield start
    for process in processes:
        serving.stop(process)


def _health_becomes(channel: grpc.Channel, status: int) -> bool:
    stub = health_pb2_grpc.HealthStub(channel)
    give_up = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < give_up:
        if stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == status:
            return True
        time.sleep(0.1)
    return False


def _put_lane(channel: grpc.Channel, limit_nanos: int = 1_000_000) -> grpc.StatusCode:
    """PutLane; the same limit again writes nothing (the lane is as asked)."""
    lane = pb.Lane(lane="recall", limit_nanos=limit_nanos, prices={"jev": pb.ModelPrice()})
    try:
        pb_grpc.LaneAdminStub(channel).PutLane(pb.PutLaneRequest(lane=lane), timeout=10)
    except grpc.RpcError as error:
        assert isinstance(error, grpc.Call)
        return error.code()
    return grpc.StatusCode.OK


def test_files_it_cannot_write_are_not_serving_until_they_can_be(
    data_dir: pathlib.Path, serve: Callable[[], tuple[str, pathlib.Path]]
) -> None:
    database_file = data_dir / "ledger.db"
    _read_only(database_file)
    address, log_path = serve()
    with grpc.insecure_channel(address) as channel:
        assert _health_becomes(channel, NOT_SERVING)
        assert _put_lane(channel) is grpc.StatusCode.UNAVAILABLE
        logged = log_path.read_text()
        assert "THE DATABASE CANNOT BE WRITTEN" in logged
        assert f"{database_file} is not writable by this process" in logged
        # The operator fixes it; no restart.
        for path in data_dir.glob("ledger.db*"):
            _writable(path)
        assert _health_becomes(channel, SERVING)
        assert _put_lane(channel) is grpc.StatusCode.OK
        assert "the database can be written again" in log_path.read_text()


def test_files_it_can_write_serve_without_a_word(
    data_dir: pathlib.Path, serve: Callable[[], tuple[str, pathlib.Path]]
) -> None:
    address, log_path = serve()
    with grpc.insecure_channel(address) as channel:
        assert _health_becomes(channel, SERVING)
    assert "CANNOT BE WRITTEN" not in log_path.read_text()


def test_reads_are_served_while_the_files_cannot_be_written(
    data_dir: pathlib.Path, serve: Callable[[], tuple[str, pathlib.Path]]
) -> None:
    """docs/recovery.md: moves are refused, reads are still served (a balance too)."""
    store = SqlStore(database.create(f"sqlite:///{data_dir}/ledger.db", database.EngineLimits()))
    ledger = Ledger(store, SystemClock())
    ledger.put_lane(LanePolicy("recall", 1_000_000, {"jev": ModelPrice(100_000, 400_000)}))
    assert ledger.reserve(moves.ReserveCommand("recall", "r-1", "jev", 3_500, 10)).admitted
    # Held open, the store keeps the WAL files, which readers write: the
    # database file alone is what may not be written, as after a chmod.
    _read_only(data_dir / "ledger.db")
    address, log_path = serve()
    with grpc.insecure_channel(address) as channel:
        assert _health_becomes(channel, NOT_SERVING)
        assert _put_lane(channel) is grpc.StatusCode.UNAVAILABLE
        stub = pb_grpc.LedgerStub(channel)
        balance = stub.GetBalance(pb.GetBalanceRequest(lane="recall"), timeout=10)
        assert (balance.held_nanos, balance.open_bookings) == (104, 1), log_path.read_text()
    store.close()


def test_a_write_ahead_log_deleted_under_the_server_books_nothing_more(
    data_dir: pathlib.Path, serve: Callable[[], tuple[str, pathlib.Path]]
) -> None:
    """Moves since the last checkpoint live in ledger.db-wal: deleted, they
    would be lost to a crash, so no move is booked into it."""
    address, log_path = serve()
    with grpc.insecure_channel(address) as channel:
        assert _health_becomes(channel, SERVING)
        assert _put_lane(channel) is grpc.StatusCode.OK
        (data_dir / "ledger.db-wal").unlink()
        assert _put_lane(channel, 2_000_000) is grpc.StatusCode.UNAVAILABLE
        assert _health_becomes(channel, NOT_SERVING)
        logged = log_path.read_text()
        assert f"THE DATABASE FILE IS GONE: {data_dir / 'ledger.db-wal'} was" in logged, logged


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_database_file_gone_under_the_server_books_nothing_more(
    data_dir: pathlib.Path, serve: Callable[[], tuple[str, pathlib.Path]], how: str
) -> None:
    """A move written to a deleted (or moved-over) file would be lost at the next
    start: the server refuses every move and is NOT_SERVING until restarted."""
    address, log_path = serve()
    database_file = data_dir / "ledger.db"
    with grpc.insecure_channel(address) as channel:
        assert _health_becomes(channel, SERVING)
        assert _put_lane(channel) is grpc.StatusCode.OK
        if how == "deleted":
            for path in data_dir.glob("ledger.db*"):
                path.unlink()
        else:
            copy = data_dir / "copy.db"
            copy.write_bytes(database_file.read_bytes())
            copy.replace(database_file)
        assert _put_lane(channel) is grpc.StatusCode.UNAVAILABLE
        assert _health_becomes(channel, NOT_SERVING)
        logged = log_path.read_text()
        assert f"THE DATABASE FILE IS GONE: {database_file} was" in logged, logged


@pytest.mark.skipif(os.geteuid() != 0, reason="an open file is stopped only by chattr +i (root)")
def test_files_made_unwritable_while_serving_are_not_serving_until_they_can_be(
    data_dir: pathlib.Path, serve: Callable[[], tuple[str, pathlib.Path]]
) -> None:
    """The write fails with an I/O error, in the group commit's own statements."""
    address, log_path = serve()
    files = [data_dir / "ledger.db", data_dir / "ledger.db-wal"]
    with grpc.insecure_channel(address) as channel:
        assert _health_becomes(channel, SERVING)
        assert _put_lane(channel) is grpc.StatusCode.OK
        for path in files:
            _read_only(path)
        try:
            assert _put_lane(channel, 2_000_000) is grpc.StatusCode.UNAVAILABLE
            assert _health_becomes(channel, NOT_SERVING)
            assert "THE DATABASE CANNOT BE WRITTEN" in log_path.read_text()
        finally:
            for path in files:
                _writable(path)
        assert _health_becomes(channel, SERVING)
        assert _put_lane(channel, 2_000_000) is grpc.StatusCode.OK


def test_a_file_that_cannot_grow_is_not_serving_until_it_can(data_dir: pathlib.Path) -> None:
    """A full disk or a file-size limit (EFBIG: SQLITE_IOERR; ENOSPC:
    SQLITE_FULL) fails only a write that grows a file: a write transaction
    begun and rolled back still passes. The server used to stay SERVING while
    every move failed, log 'the database can be written again' at every
    probe, and one line per failed group commit that said neither what was
    wrong nor what to do."""
    log_path = data_dir / "server.log"
    env = serving.clean_env(LEDGER_HEALTH_CHECK_INTERVAL_SECONDS="0.2")
    with log_path.open("w") as log:
        process, address = serving.spawn(
            data_dir, "--insecure-no-auth", "--no-migrate", env=env, stderr=log
        )
    try:
        with grpc.insecure_channel(address) as channel:
            assert _health_becomes(channel, SERVING)
            assert _put_lane(channel) is grpc.StatusCode.OK
            wal = data_dir / "ledger.db-wal"
            # The soft limit at the log's size: no write may make it longer.
            resource.prlimit(process.pid, resource.RLIMIT_FSIZE, (wal.stat().st_size, -1))
            refused = [_put_lane(channel, 2_000_000 + n) for n in range(30)]
            assert set(refused) == {grpc.StatusCode.UNAVAILABLE}
            assert _health_becomes(channel, NOT_SERVING)
            time.sleep(1.0)  # probes come and go: still not serving, nothing said again
            assert _health_becomes(channel, NOT_SERVING)
            logged = log_path.read_text()
            assert logged.count("THE DATABASE CANNOT BE WRITTEN") == 1, logged
            assert "the database can be written again" not in logged, logged
            # One line for the failed commits, not one each (2,534 in 35 s under load).
            assert logged.count("group commit of") <= 2, logged
            resource.prlimit(process.pid, resource.RLIMIT_FSIZE, (-1, -1))
            assert _health_becomes(channel, SERVING)
            assert _put_lane(channel, 3_000_000) is grpc.StatusCode.OK
            assert log_path.read_text().count("the database can be written again") == 1
    finally:
        serving.stop(process)
