"""What the benchmark's tests share: a fresh PostgreSQL schema, and a channel
to a server of the bench (bench/servers.py) started for the test."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator, Sequence

import grpc
import pytest

from bench import load, scenarios, servers
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from tests import serving
from tests.conftest import RPC_TIMEOUT_SECONDS

LEDGER = pathlib.Path(sys.executable).with_name("ledger")


@contextlib.contextmanager
def fresh_postgres_schema() -> Iterator[str]:
    """A new schema at LEDGER_TEST_POSTGRES_URL, dropped afterwards; the test
    is skipped without PostgreSQL, and fails under CI=true."""
    url = os.environ.get("LEDGER_TEST_POSTGRES_URL", scenarios.DEFAULT_POSTGRES_URL)
    problem = scenarios.postgres_problem(url)
    if problem is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{problem}; under CI=true the PostgreSQL tests must run")
        pytest.skip(problem)
    with scenarios.fresh_schema(url) as schema_url:
        yield schema_url


@contextlib.contextmanager
def channel_to(name: str, argv: Sequence[str], directory: pathlib.Path) -> Iterator[grpc.Channel]:
    """A server without health (it is ready once it echoes) and a channel to it."""
    directory.mkdir(parents=True, exist_ok=True)
    with (
        servers.running(
            name,
            list(argv),
            directory,
            health=False,
            ready_timeout_seconds=60,
            stop_timeout_seconds=15,
        ) as server,
        grpc.insecure_channel(server.address) as opened,
    ):
        yield opened


def reserve_and_settle(
    stubs: Sequence[pb_grpc.LedgerStub], lanes: Sequence[str], pairs: int
) -> None:
    """`pairs` Reserve+Settle pairs from 8 threads, taking turns over `stubs`
    and `lanes` (reservation ids c-0, c-1, ...)."""

    def pair(index: int) -> None:
        stub, lane, reservation_id = (
            stubs[index % len(stubs)],
            lanes[index % len(lanes)],
            f"c-{index}",
        )
        stub.Reserve(load.reserve_request(lane, reservation_id), timeout=RPC_TIMEOUT_SECONDS)
        stub.Settle(load.settle_request(lane, reservation_id), timeout=RPC_TIMEOUT_SECONDS)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(pair, range(pairs)))


def verified(database_url: str, data_dir: pathlib.Path) -> str:
    """`ledger verify`'s report of the database, which must pass."""
    done = subprocess.run(
        [str(LEDGER), "verify", "--database-url", database_url, "--data-dir", str(data_dir)],
        cwd=data_dir, env=serving.clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    return done.stdout
