"""What the benchmark's tests share: a fresh PostgreSQL schema, and a channel
to a server of the bench (bench/servers.py) started for the test."""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Iterator, Sequence

import grpc
import pytest

from bench import scenarios, servers


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
