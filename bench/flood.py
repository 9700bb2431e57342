"""A flooding grant: what one grant's refused calls cost every other lane.

    python -m bench.flood [--port 41200] [--seconds 10] [--rounds 2]

Starts `ledger serve` on SQLite with grants (auth on) and a small share
(`max_calls_per_grant`, 4 unless told), and honest lanes, each with a grant
of its own and 2 Reserve+Settle pairs in flight (the load generator,
bench/load.py). Each round measures them alone, then beside one flooding
grant: `--callers` threads in a process of their own, each sending a Reserve
again the moment the last one is answered, so that nearly all are refused
with TOO_MANY_CALLS. The phases alternate, `--rounds` times, so that the
ratio of the honest lanes' pairs a second (flood / alone) compares phases of
one run on a machine shared with other work.

The server's CPU (bench/usage.py) is read over each measured window. Per
admitted move: the lone phase's CPU over its moves (Reserve and Settle each
count). Per refused call: the flood phase's CPU less its moves at the lone
phase's cost, over the refusals. Last, the same flood against the bare echo
server (bench/echo.py) gives gRPC's own cost of one call, the floor under a
refusal. Not in `make bench`: one run takes about a minute.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import multiprocessing
import pathlib
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

import grpc

from bench import echo, load, scenarios, servers, usage
from bench.load import CallKind, LoadGenerator, Workload
from ledger_service.domain.grants import Scope
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.storage import keyring

# The flood's calls are counted in buckets of this many ns by when they ended,
# so that only those inside the load generator's measured window count.
BUCKET_NS = 10_000_000
READY_TIMEOUT_SECONDS = 60.0
STOP_TIMEOUT_SECONDS = 15.0
CALL_TIMEOUT_SECONDS = 5.0
GRANT_LIFETIME_US = 3600 * 1_000_000
HONEST_LANES = 4
HONEST_IN_FLIGHT = 2
FLOOD_LANE = "flood"

# Counts by outcome ("ok", "refused", another code's name), by bucket.
Counts = dict[str, collections.Counter[int]]


# The flood's process ---------------------------------------------------------------


def _flood_call(channel: grpc.Channel, kind: str, grant: str) -> Callable[[str], object]:
    if kind == "echo":
        method = channel.unary_unary(  # type: ignore[call-arg]
            echo.FULL_METHOD, None, None, _registered_method=True
        )
        payload = load.reserve_request(FLOOD_LANE, "r-0").SerializeToString()
        return lambda _reservation_id: method(payload, timeout=CALL_TIMEOUT_SECONDS)
    stub = pb_grpc.LedgerStub(channel)
    metadata = load.grant_metadata(grant)
    return lambda reservation_id: stub.Reserve(
        load.reserve_request(FLOOD_LANE, reservation_id),
        timeout=CALL_TIMEOUT_SECONDS,
        metadata=metadata,
    )


def _flood_thread(call: Callable[[str], object], name: str, stop: threading.Event) -> Counts:
    counts: Counts = collections.defaultdict(collections.Counter)
    number = 0
    while not stop.is_set():
        number += 1
        try:
            call(f"{name}-{number}")
            outcome = "ok"
        except grpc.RpcError as error:
            code = error.code() if isinstance(error, grpc.Call) else None
            outcome = "refused" if code is grpc.StatusCode.RESOURCE_EXHAUSTED else str(code)
        counts[outcome][time.monotonic_ns() // BUCKET_NS] += 1
    return counts


def flood_main(connection: Connection, target: str, kind: str, grant: str, callers: int) -> None:
    """Floods `target` with `callers` threads until told to stop, then sends its counts."""
    stop = threading.Event()
    results: list[Counts] = []
    with grpc.insecure_channel(target) as channel:
        grpc.channel_ready_future(channel).result(timeout=READY_TIMEOUT_SECONDS)
        call = _flood_call(channel, kind, grant)
        prefix = f"flood-{time.monotonic_ns()}"
        threads = [
            threading.Thread(
                target=lambda index=index: results.append(
                    _flood_thread(call, f"{prefix}-{index}", stop)
                ),
                daemon=True,
            )
            for index in range(callers)
        ]
        for thread in threads:
            thread.start()
        connection.send("flooding")
        connection.recv()  # "stop"
        stop.set()
        for thread in threads:
            thread.join(CALL_TIMEOUT_SECONDS * 2)
    merged: Counts = collections.defaultdict(collections.Counter)
    for counts in results:
        for outcome, buckets in counts.items():
            merged[outcome].update(buckets)
    connection.send({outcome: dict(buckets) for outcome, buckets in merged.items()})


@contextlib.contextmanager
def flooding(
    target: str, kind: str, grant: str, callers: int
) -> Iterator[Callable[[int, int], dict[str, int]]]:
    """A flood running in its own process for the block; yields a function that
    gives, once the block ended, its calls by outcome between two instants."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(
        target=flood_main, args=(child, target, kind, grant, callers), daemon=True
    )
    process.start()
    child.close()
    counts: dict[str, dict[int, int]] = {}
    try:
        if not parent.poll(READY_TIMEOUT_SECONDS):
            raise servers.BenchError("the flood did not start")
        parent.recv()

        def between(start_ns: int, end_ns: int) -> dict[str, int]:
            first, last = start_ns // BUCKET_NS, end_ns // BUCKET_NS
            return {
                outcome: sum(n for bucket, n in buckets.items() if first <= bucket < last)
                for outcome, buckets in counts.items()
            }

        yield between
        parent.send("stop")
        if not parent.poll(CALL_TIMEOUT_SECONDS * 3):
            raise servers.BenchError("the flood did not stop")
        counts.update(parent.recv())
    finally:
        process.join(STOP_TIMEOUT_SECONDS)
        if process.is_alive():
            process.kill()
            process.join()
        parent.close()


# The run ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Options:
    port: int
    seconds: float
    rounds: int
    share: int
    callers: int


def _grants(data_dir: pathlib.Path, lanes: Sequence[str]) -> dict[str, str]:
    """A charge grant for each lane, signed with the server's keyring."""
    keys = keyring.load(data_dir)
    now_us = time.time_ns() // 1000
    return {
        lane: keys.issue(
            [lane], [Scope.CHARGE], issued_at_us=now_us, expires_at_us=now_us + GRANT_LIFETIME_US
        )
        for lane in lanes
    }


def _phase(
    generator: LoadGenerator, workload: Workload, pid: int
) -> tuple[load.Round, dict[str, Any]]:
    measured = generator.run_round(workload, watch=(pid,))
    calls = sum(len(report.latencies_ns) for report in measured.reports)
    denied = sum(report.denied for report in measured.reports)
    errors: collections.Counter[str] = collections.Counter()
    for report in measured.reports:
        errors.update(report.errors)
    cpu = measured.server_usage.cpu_seconds if measured.server_usage else float("nan")
    return measured, {
        "pairs_per_second": calls / measured.elapsed_seconds,
        # Reserve and Settle are a move each; a denied Reserve is not settled.
        "moves": 2 * calls - denied,
        "honest_errors": dict(errors),
        "server_cpu_seconds": cpu,
        "seconds": measured.elapsed_seconds,
    }


def _rounds(
    options: Options, server: servers.ServerProcess, grants: dict[str, str]
) -> list[dict[str, Any]]:
    honest = tuple(lane for lane in grants if lane != FLOOD_LANE)
    rounds = []
    with LoadGenerator(2) as generator:
        for index in range(options.rounds):
            workload = Workload(
                kind=CallKind.RESERVE_SETTLE,
                targets=(server.address,),
                processes=2,
                in_flight=len(honest) * HONEST_IN_FLIGHT // 2,
                warmup_seconds=1.0,
                measure_seconds=options.seconds,
                lanes=honest,
                id_prefix=f"alone-{index}",
                grants=tuple(grants.items()),
            )
            _, alone = _phase(generator, workload, server.pid)
            flood_workload = dataclasses.replace(workload, id_prefix=f"flooded-{index}")
            with flooding(server.address, "reserve", grants[FLOOD_LANE], options.callers) as got:
                measured, flooded = _phase(generator, flood_workload, server.pid)
            window = got(measured.schedule.warmup_end_ns, measured.schedule.measure_end_ns)
            flooded["flood"] = window
            rounds.append(_costs(alone, flooded))
            print(json.dumps(rounds[-1]), file=sys.stderr, flush=True)
    return rounds


def _costs(alone: dict[str, Any], flooded: dict[str, Any]) -> dict[str, Any]:
    move_ms = alone["server_cpu_seconds"] * 1000 / max(alone["moves"], 1)
    window = flooded["flood"]
    moves = flooded["moves"] + window.get("ok", 0)
    refused = window.get("refused", 0)
    refused_cpu_ms = flooded["server_cpu_seconds"] * 1000 - moves * move_ms
    return {
        "alone": alone,
        "flooded": flooded,
        "honest_ratio": flooded["pairs_per_second"] / max(alone["pairs_per_second"], 1e-9),
        "cpu_ms_per_move": move_ms,
        "cpu_ms_per_refusal": refused_cpu_ms / refused if refused else None,
        "refusals_per_second": refused / flooded["seconds"],
    }


def _echo_floor(options: Options, workdir: pathlib.Path) -> dict[str, Any]:
    """The flood against the bare echo server: gRPC's own CPU per call."""
    argv = [sys.executable, "-m", "bench.echo", "--listen", f"127.0.0.1:{options.port + 1}"]
    with (
        servers.running(
            "echo",
            argv,
            workdir / "echo",
            health=False,
            ready_timeout_seconds=READY_TIMEOUT_SECONDS,
            stop_timeout_seconds=STOP_TIMEOUT_SECONDS,
        ) as server,
        flooding(server.address, "echo", "", options.callers) as got,
    ):
        time.sleep(1.0)
        start_ns, before = time.monotonic_ns(), usage.read([server.pid])
        time.sleep(options.seconds)
        end_ns, after = time.monotonic_ns(), usage.read([server.pid])
    calls = got(start_ns, end_ns).get("ok", 0)
    cpu = (after - before).cpu_seconds if after and before else float("nan")
    return {
        "calls_per_second": calls / ((end_ns - start_ns) / 1e9),
        "cpu_ms_per_call": cpu * 1000 / max(calls, 1),
    }


def run(options: Options, workdir: pathlib.Path) -> dict[str, Any]:
    data_dir = workdir / "ledger"
    settings = {
        "database_url": f"sqlite:///{data_dir}/ledger.db",
        "data_dir": str(data_dir),
        "listen": f"127.0.0.1:{options.port}",
        "auth_enabled": True,
        "max_calls_per_grant": options.share,
    }
    with servers.running(
        "ledger",
        servers.replica_argv(settings),
        data_dir,
        health=True,
        ready_timeout_seconds=READY_TIMEOUT_SECONDS,
        stop_timeout_seconds=STOP_TIMEOUT_SECONDS,
    ) as server:
        lanes = [*scenarios.lanes_named("honest", HONEST_LANES), FLOOD_LANE]
        admin = keyring.admin_grant_path(data_dir).read_text(encoding="utf-8").strip()
        scenarios.put_lanes(server.address, lanes, grant=admin)
        rounds = _rounds(options, server, _grants(data_dir, lanes))
    return {
        "options": dataclasses.asdict(options),
        "rounds": rounds,
        "echo": _echo_floor(options, workdir),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.flood",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--port", type=int, default=41200, help="the ledger's; the echo's is +1")
    parser.add_argument("--seconds", type=float, default=10.0, help="each phase's measured time")
    parser.add_argument("--rounds", type=int, default=2, help="alone/flooded pairs")
    parser.add_argument("--share", type=int, default=4, help="max_calls_per_grant")
    parser.add_argument("--callers", type=int, default=64, help="the flood's calls in flight")
    arguments = parser.parse_args(argv)
    options = Options(
        arguments.port, arguments.seconds, arguments.rounds, arguments.share, arguments.callers
    )
    with tempfile.TemporaryDirectory(prefix="ledger-flood-") as directory:
        result = run(options, pathlib.Path(directory))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
