"""Servers under test, each in a process of its own, always stopped.

A server writes its "listening on HOST:PORT" line to a file (never an undrained
pipe) and its log to another, both in the scenario's temporary directory. It is
ready once it answers: the echo its one method, the ledger its health check
with SERVING (which the ledger says only after its database answered and its
projections were found whole). Every wait is bounded; a server that does not
stop on SIGTERM within its grace is killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench import echo

_LISTENING = re.compile(r"listening on (\S+):(\d+)")
# How often a starting server is looked at.
POLL_SECONDS = 0.05
# One probe RPC's deadline while waiting for a server to become ready.
PROBE_TIMEOUT_SECONDS = 2.0
LOG_TAIL_BYTES = 4000
# The directory holding the `bench` package.
CHECKOUT = pathlib.Path(__file__).resolve().parents[1]


class BenchError(Exception):
    """The benchmark could not run a step (not: a figure missed its target)."""


def server_environment() -> dict[str, str]:
    """This process's environment without LEDGER_* and OTEL_* variables, so that
    an operator's settings (TLS, a collector) cannot change what is measured."""
    environment = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("LEDGER_", "OTEL_"))
    }
    environment.update(
        OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none", PYTHONUNBUFFERED="1"
    )
    # The bench is not installed: its servers run from a scratch directory and
    # find `bench` on the path of the checkout it lives in.
    path = environment.get("PYTHONPATH", "")
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, (str(CHECKOUT), path)))
    return environment


class ServerProcess:
    def __init__(self, name: str, process: subprocess.Popen[bytes], workdir: pathlib.Path):
        self.name = name
        self.process = process
        self.workdir = workdir
        self.address = ""
        # From spawning the process to its first good answer.
        self.ready_seconds = 0.0

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def log_path(self) -> pathlib.Path:
        return self.workdir / f"{self.name}.log"

    @property
    def out_path(self) -> pathlib.Path:
        return self.workdir / f"{self.name}.out"

    def memory_bytes(self) -> dict[str, int]:
        """VmRSS (resident now) and VmHWM (the most it was resident) from /proc."""
        return process_memory_bytes(self.pid)

    def log_tail(self) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-LOG_TAIL_BYTES:].decode("utf-8", "replace")

    def stop(self, timeout_seconds: float) -> int | None:
        """SIGTERM, then SIGKILL after `timeout_seconds`; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_seconds)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout_seconds)
        return self.process.returncode


def process_memory_bytes(pid: int) -> dict[str, int]:
    figures: dict[str, int] = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                # "123456 kB"
                figures[name] = int(value.split()[0]) * 1024
    return {"rss_bytes": figures.get("VmRSS", 0), "peak_rss_bytes": figures.get("VmHWM", 0)}


def _wait_listening(server: ServerProcess, deadline: float) -> str:
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            found = _LISTENING.search(server.out_path.read_text(encoding="utf-8", errors="replace"))
            if found:
                return f"{found.group(1)}:{found.group(2)}"
        if server.process.poll() is not None:
            raise BenchError(
                f"{server.name} exited with {server.process.returncode} before listening:\n"
                f"{server.log_tail()}"
            )
        time.sleep(POLL_SECONDS)
    raise BenchError(f"{server.name} did not listen in time:\n{server.log_tail()}")


def _answers(channel: grpc.Channel, health: bool) -> bool:
    try:
        if health:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_SECONDS)
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
        call = channel.unary_unary(echo.FULL_METHOD, None, None)
        return bool(call(b"probe", timeout=PROBE_TIMEOUT_SECONDS) == b"probe")
    except grpc.RpcError:
        return False


def _wait_ready(server: ServerProcess, health: bool, deadline: float) -> None:
    with grpc.insecure_channel(server.address) as channel:
        while time.monotonic() < deadline:
            if _answers(channel, health):
                return
            if server.process.poll() is not None:
                raise BenchError(
                    f"{server.name} exited with {server.process.returncode}:\n{server.log_tail()}"
                )
            time.sleep(POLL_SECONDS * 4)
    raise BenchError(f"{server.name} was not ready in time:\n{server.log_tail()}")


@contextlib.contextmanager
def running(
    name: str,
    argv: list[str],
    workdir: pathlib.Path,
    *,
    health: bool,
    ready_timeout_seconds: float,
    stop_timeout_seconds: float,
) -> Iterator[ServerProcess]:
    """Starts a server, waits until it answers, and stops it however the block ends."""
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    out: TextIO
    with (
        open(workdir / f"{name}.out", "w", encoding="utf-8") as out,
        open(workdir / f"{name}.log", "w", encoding="utf-8") as log,
    ):
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=log,
            cwd=workdir,
            env=server_environment(),
            start_new_session=True,
        )
    server = ServerProcess(name, process, workdir)
    try:
        deadline = started + ready_timeout_seconds
        server.address = _wait_listening(server, deadline)
        _wait_ready(server, health, deadline)
        server.ready_seconds = time.monotonic() - started
        yield server
    finally:
        server.stop(stop_timeout_seconds)


def echo_argv() -> list[str]:
    return [sys.executable, "-m", "bench.echo", "--listen", "127.0.0.1:0"]


def aio_echo_argv() -> list[str]:
    return [sys.executable, "-m", "bench.aio", "--listen", "127.0.0.1:0"]


def reference_argv(database: pathlib.Path, lanes: list[str]) -> list[str]:
    """bench/reference.py on a new SQLite file, with these lanes put before it listens."""
    return [
        *[sys.executable, "-m", "bench.reference", "--database", str(database)],
        *["--lanes", ",".join(lanes), "--listen", "127.0.0.1:0"],
    ]


def reference_pg_argv(database_url: str, lanes: Sequence[str]) -> list[str]:
    """bench/reference_pg.py on a PostgreSQL URL; with lanes, it migrates the
    database and puts them before it listens (the first replica only)."""
    return [
        *[sys.executable, "-m", "bench.reference_pg", "--database-url", database_url],
        *["--lanes", ",".join(lanes), "--listen", "127.0.0.1:0"],
    ]


def replica_argv(
    settings: Mapping[str, Any],
    *,
    migrate: bool = True,
    storeless: bool = False,
    aio: bool = False,
    aio_writer: bool = False,
    sync_writer: bool = False,
) -> list[str]:
    argv = [sys.executable, "-m", "bench.replica"]
    argv += ["--settings", json.dumps(dict(settings), sort_keys=True, default=str)]
    argv += [] if migrate else ["--no-migrate"]
    argv += ["--storeless"] if storeless else []
    argv += ["--aio-writer"] if aio_writer else []
    argv += ["--sync-writer"] if sync_writer else []
    return [*argv, "--aio"] if aio else argv
