"""The scenarios of `make bench`, each with its servers in processes of their own.

Every scenario returns plain JSON-ready data; a phase that fails is recorded as
{"failed": "..."} and the run goes on, so one broken scenario does not hide
the others' figures. Servers are stopped however a scenario ends, and every
PostgreSQL schema made here is dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import pathlib
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import grpc
import sqlalchemy as sa

from bench import latency_proxy, load, pg_floor, rebuild, seeding, servers
from bench.load import CallKind, LoadGenerator, Workload
from ledger_service.domain import moves
from ledger_service.domain.clock import SystemClock
from ledger_service.domain.policies import LanePolicy
from ledger_service.domain.pricing import ModelPrice
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.seeding import ScratchLedger, booking_count, recoveries

log = logging.getLogger("ledger.bench")

# The warm-up of every round of an interleaved phase but its first.
ROUND_WARMUP_SECONDS = 0.5
DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
# A lane the benchmark can never exhaust: every Reserve is admitted.
LIMIT_NANOS = 10**18
INPUT_NANOS_PER_MILLION = 3_000_000_000
OUTPUT_NANOS_PER_MILLION = 15_000_000_000
ADMIN_TIMEOUT_SECONDS = 30.0
DROP_SCHEMA_ATTEMPTS = 3
DROP_SCHEMA_PAUSE_SECONDS = 2.0
# Every seeded booking is one of the load generator's calls.
BOOKING_SHAPE = seeding.BookingShape(
    model=load.MODEL,
    request_bytes=load.REQUEST_BYTES,
    max_output_tokens=load.MAX_OUTPUT_TOKENS,
    input_tokens=load.INPUT_TOKENS,
    output_tokens=load.OUTPUT_TOKENS,
    http_status=load.HTTP_STATUS,
)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every duration, count and limit of one run."""

    name: str
    warmup_seconds: float
    measure_seconds: float
    # "Near saturation": this many load processes, each with this many calls in flight.
    processes: int
    in_flight_per_process: int
    spread_lanes: int
    history_small_bookings: int
    history_large_bookings: int
    history_measure_seconds: float
    # At most this many measured calls in each history phase: each adds a
    # booking to the window, and the small window should stay small.
    history_max_calls: int
    # The two sizes are served at once and measured in this many alternating
    # rounds (small, large, large, small, ...), so that the machine's drift
    # over the minutes of a run falls on both alike.
    history_rounds: int
    seed_batch_rows: int
    server_ready_timeout_seconds: float
    # The history server checks its whole log at start-up.
    history_ready_timeout_seconds: float
    stop_timeout_seconds: float
    call_timeout_seconds: float
    rebuild_timeout_seconds: float
    replay_max_events: int
    # Durable SQLite commits timed alone: the floor under one client's Reserve.
    commit_floor_commits: int
    # In-process Reserves, no server: this many back to back and as many each
    # after a pause (the machine idle, as a lone client leaves the server).
    lone_reserves: int
    # Round trips a move (the `roundtrips` scenario): the latency proxy's
    # delay each way, the pings that measure what it adds to a round trip,
    # the Reserve+Settle pairs (one client, back to back) timed with and
    # without the delay after as many unmeasured, and the floor's moves.
    roundtrip_delay_seconds: float
    roundtrip_pings: int
    roundtrip_pairs: int
    roundtrip_floor_moves: int

    @property
    def saturating_calls(self) -> int:
        return self.processes * self.in_flight_per_process


FULL = Plan(
    name="full",
    warmup_seconds=2.0,
    measure_seconds=10.0,
    processes=2,
    in_flight_per_process=8,
    spread_lanes=16,
    history_small_bookings=100,
    history_large_bookings=1_000_000,
    history_measure_seconds=10.0,
    history_max_calls=500,
    history_rounds=6,
    seed_batch_rows=5000,
    server_ready_timeout_seconds=60.0,
    history_ready_timeout_seconds=900.0,
    stop_timeout_seconds=30.0,
    call_timeout_seconds=10.0,
    rebuild_timeout_seconds=180.0,
    replay_max_events=200_000,
    commit_floor_commits=2_000,
    lone_reserves=400,
    roundtrip_delay_seconds=0.005,
    roundtrip_pings=100,
    roundtrip_pairs=40,
    roundtrip_floor_moves=60,
)

QUICK = dataclasses.replace(
    FULL,
    name="quick",
    warmup_seconds=0.1,
    measure_seconds=0.5,
    in_flight_per_process=4,
    spread_lanes=4,
    history_large_bookings=10_000,
    history_measure_seconds=0.5,
    history_max_calls=100,
    history_rounds=2,
    history_ready_timeout_seconds=60.0,
    stop_timeout_seconds=15.0,
    rebuild_timeout_seconds=30.0,
    replay_max_events=5_000,
    commit_floor_commits=50,
    lone_reserves=20,
    roundtrip_pings=10,
    roundtrip_pairs=3,
    roundtrip_floor_moves=5,
)


def lane_policy(lane: str) -> LanePolicy:
    return LanePolicy(
        lane=lane,
        limit_nanos=LIMIT_NANOS,
        prices={load.MODEL: ModelPrice(INPUT_NANOS_PER_MILLION, OUTPUT_NANOS_PER_MILLION)},
    )


def put_lanes(
    address: str,
    lanes: Sequence[str],
    parent_of: Mapping[str, str] | None = None,
    *,
    grant: str = "",
) -> None:
    """Puts each lane, in order, under its parent in `parent_of` if it has one
    (with `grant`, an admin grant, on a server with auth)."""
    metadata = load.grant_metadata(grant) if grant else None
    with grpc.insecure_channel(address) as channel:
        admin = pb_grpc.LaneAdminStub(channel)
        for lane in lanes:
            policy = lane_policy(lane)
            prices = {
                model: pb.ModelPrice(
                    input_nanos_per_million_tokens=price.input_nanos_per_million_tokens,
                    output_nanos_per_million_tokens=price.output_nanos_per_million_tokens,
                )
                for model, price in policy.prices.items()
            }
            message = pb.Lane(
                lane=lane,
                limit_nanos=policy.limit_nanos,
                prices=prices,
                parent=(parent_of or {}).get(lane, ""),
            )
            admin.PutLane(
                pb.PutLaneRequest(lane=message), timeout=ADMIN_TIMEOUT_SECONDS, metadata=metadata
            )


# Issue 25: the documented limit of WatchEvents streams, open beside one client's Reserves.
WATCHERS = 64


@contextlib.contextmanager
def watching(address: str, lane: str, count: int) -> Iterator[Callable[[], list[str]]]:
    """`count` WatchEvents streams on `lane`, open (and read) while the block runs.
    Yields a function that says how each stream that already ended did (a
    refused or dropped stream ends its reader): the target is about `count`
    streams held open, so the caller checks that none ended."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.LedgerStub(channel)
        calls = [
            stub.WatchEvents(pb.WatchEventsRequest(lane=lane, from_now=True)) for _ in range(count)
        ]
        ended: list[str] = []

        def read(call: Any) -> None:
            try:
                for _event in call:
                    pass
                ended.append("ended by the server")
            except grpc.RpcError as error:
                code = error.code() if isinstance(error, grpc.Call) else None
                ended.append(code.name if code is not None else type(error).__name__)

        readers = [threading.Thread(target=read, args=(call,), daemon=True) for call in calls]
        for reader in readers:
            reader.start()
        try:
            yield lambda: list(ended)
        finally:
            for call in calls:
                call.cancel()  # type: ignore[no-untyped-call]
            for reader in readers:
                reader.join(timeout=ADMIN_TIMEOUT_SECONDS)


def lanes_named(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}-{index:02d}" for index in range(count))


def _phase(
    generator: LoadGenerator,
    name: str,
    workload: Workload,
    before: Callable[[], None] = lambda: None,
    *,
    watch: Sequence[int] = (),
) -> dict[str, Any]:
    """Runs one phase; a failure becomes {"failed": ...} instead of ending the run.
    `watch`: the pids of the servers whose CPU and context switches to read."""
    log.info(
        "phase %s: %s, %d x %d in flight",
        name,
        workload.kind.value,
        workload.processes,
        workload.in_flight,
    )
    try:
        before()
        result = generator.run(workload, watch).to_json()
    except Exception as error:
        log.exception("phase %s failed", name)
        return {"failed": f"{type(error).__name__}: {error}"}
    log.info(
        "phase %s: %.0f calls/s, p50 %.2f ms, p99 %.2f ms, %d errors",
        name,
        result["throughput_per_second"],
        result["latency"]["p50_ms"],
        result["latency"]["p99_ms"],
        sum(result["errors"].values()),
    )
    return result


def _workload(plan: Plan, kind: CallKind, targets: Sequence[str], **fields: Any) -> Workload:
    values: dict[str, Any] = {
        "kind": kind,
        "targets": tuple(targets),
        "processes": plan.processes,
        "in_flight": plan.in_flight_per_process,
        "warmup_seconds": plan.warmup_seconds,
        "measure_seconds": plan.measure_seconds,
        "call_timeout_seconds": plan.call_timeout_seconds,
        "id_prefix": f"b{uuid.uuid4().hex[:8]}",
    }
    values.update(fields)
    return Workload(**values)


def _single(plan: Plan, kind: CallKind, targets: Sequence[str], **fields: Any) -> Workload:
    """One client: one process, one call in flight."""
    return _workload(plan, kind, targets, processes=1, in_flight=1, **fields)


def _server_facts(server: servers.ServerProcess) -> dict[str, Any]:
    return {"pid": server.pid, "ready_seconds": server.ready_seconds, **server.memory_bytes()}


# The scenarios --------------------------------------------------------------------


def echo_scenario(plan: Plan, generator: LoadGenerator, workdir: pathlib.Path) -> dict[str, Any]:
    """(1) The baseline: one call and two back-to-back calls, at 1 and near saturation."""
    with _echo(plan, "echo", servers.echo_argv(), workdir / "echo") as server:
        targets, watch = [server.address], (server.pid,)
        phases = {
            "single_1": _phase(
                generator, "echo 1", _single(plan, CallKind.ECHO, targets), watch=watch
            ),
            "pair_1": _phase(
                generator, "echo pair 1", _single(plan, CallKind.ECHO_PAIR, targets), watch=watch
            ),
            "single_saturated": _phase(
                generator, "echo saturated", _workload(plan, CallKind.ECHO, targets), watch=watch
            ),
            "pair_saturated": _phase(
                generator,
                "echo pair saturated",
                _workload(plan, CallKind.ECHO_PAIR, targets),
                watch=watch,
            ),
        }
        return {"server": _server_facts(server), "phases": phases}


def _replica_settings(database_url: str, data_dir: pathlib.Path, **extra: Any) -> dict[str, Any]:
    return {
        "database_url": database_url,
        "data_dir": str(data_dir),
        "listen": "127.0.0.1:0",
        "auth_enabled": False,
        **extra,
    }


@contextlib.contextmanager
def _echo(
    plan: Plan, name: str, argv: list[str], workdir: pathlib.Path
) -> Iterator[servers.ServerProcess]:
    with servers.running(
        name,
        argv,
        workdir,
        health=False,
        ready_timeout_seconds=plan.server_ready_timeout_seconds,
        stop_timeout_seconds=plan.stop_timeout_seconds,
    ) as server:
        yield server


@contextlib.contextmanager
def _replica(
    plan: Plan,
    name: str,
    workdir: pathlib.Path,
    settings: dict[str, Any],
    *,
    migrate: bool = True,
    storeless: bool = False,
    aio: bool = False,
    aio_writer: bool = False,
    sync_writer: bool = False,
    ready_timeout_seconds: float | None = None,
) -> Iterator[servers.ServerProcess]:
    argv = servers.replica_argv(
        settings,
        migrate=migrate,
        storeless=storeless,
        aio=aio,
        aio_writer=aio_writer,
        sync_writer=sync_writer,
    )
    with servers.running(
        name,
        argv,
        workdir,
        health=True,
        ready_timeout_seconds=ready_timeout_seconds or plan.server_ready_timeout_seconds,
        stop_timeout_seconds=plan.stop_timeout_seconds,
    ) as server:
        yield server


# One event's row, about the size the ledger writes (bytes of payload).
COMMIT_FLOOR_ROW_BYTES = 600


def durable_commit_floor(path: pathlib.Path, commits: int) -> dict[str, Any]:
    """What one durable SQLite commit costs on this disk, with nothing else:
    WAL, synchronous=FULL, BEGIN IMMEDIATE, one row into a table with one
    index, COMMIT; each timed end to end. A lone client's Reserve cannot
    answer sooner than a round trip plus one such commit, since no move is
    answered before the commit that holds it is on disk."""
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA synchronous=FULL")
        connection.execute("CREATE TABLE log (seq INTEGER PRIMARY KEY, lane TEXT, body TEXT)")
        connection.execute("CREATE INDEX ix_log_lane_seq ON log (lane, seq)")
        body = "x" * COMMIT_FLOOR_ROW_BYTES
        samples: list[int] = []
        for _ in range(commits):
            started = time.perf_counter_ns()
            connection.execute("BEGIN IMMEDIATE")
            connection.execute("INSERT INTO log (lane, body) VALUES (?, ?)", ("floor", body))
            connection.execute("COMMIT")
            samples.append(time.perf_counter_ns() - started)
    finally:
        connection.close()
    latency = load.Percentiles.of(samples)
    return {"commits": commits, "latency": dataclasses.asdict(latency)}


# The pause before each of the lone Reserves timed "after idle", and how many
# Reserves each way make one round (the two ways alternate round by round).
IDLE_PAUSE_SECONDS = 0.002
LONE_ROUND_RESERVES = 50


def lone_reserves(directory: pathlib.Path, count: int) -> dict[str, Any]:
    """The same Reserve in this process, with no server and no gRPC: `count`
    back to back, and `count` each after IDLE_PAUSE_SECONDS asleep, in
    alternating rounds. A lone client leaves the server idle between its
    calls; a machine slow to come back from idle makes the same work slower
    (docs/benchmarks.md), which this measures apart from the server."""
    clock = SystemClock()
    directory.mkdir(parents=True, exist_ok=True)
    scratch = ScratchLedger(directory, clock.now_us())
    try:
        lane = "lone-reserve"
        scratch.ledger.put_lane(lane_policy(lane))
        samples: dict[str, list[int]] = {"back_to_back": [], "after_idle": []}
        done = 0
        for round_ in range(2 * math.ceil(count / LONE_ROUND_RESERVES)):
            way = "after_idle" if round_ % 2 else "back_to_back"
            for _ in range(min(LONE_ROUND_RESERVES, count - len(samples[way]))):
                command = moves.ReserveCommand(
                    lane,
                    f"lone-{done}",
                    load.MODEL,
                    request_bytes=load.REQUEST_BYTES,
                    max_output_tokens=load.MAX_OUTPUT_TOKENS,
                )
                if way == "after_idle":
                    time.sleep(IDLE_PAUSE_SECONDS)
                scratch.clock.set_us(clock.now_us())
                started = time.perf_counter_ns()
                admitted = scratch.ledger.reserve(command).admitted
                samples[way].append(time.perf_counter_ns() - started)
                if not admitted:
                    raise RuntimeError("a lone Reserve was denied: the lane's limit is too low")
                done += 1
    finally:
        scratch.close()
    return {
        "pause_ms": IDLE_PAUSE_SECONDS * 1000,
        **{
            way: {"latency": dataclasses.asdict(load.Percentiles.of(taken))}
            for way, taken in samples.items()
        },
    }


def sqlite_scenario(plan: Plan, generator: LoadGenerator, workdir: pathlib.Path) -> dict[str, Any]:
    """(2) The ledger on SQLite: Reserve alone at 1 client, Reserve+Settle at 1 and
    near saturation. Each phase has lanes of its own, so none inherits another's window.
    Beside them, one durable commit timed alone (the floor under a lone Reserve)."""
    directory = workdir / "sqlite"
    directory.mkdir(parents=True, exist_ok=True)
    floor = durable_commit_floor(directory / "commit-floor.db", plan.commit_floor_commits)
    log.info("durable commit alone: p50 %.3f ms", floor["latency"]["p50_ms"])
    lone = lone_reserves(directory / "lone", plan.lone_reserves)
    log.info(
        "lone Reserve in process: p50 %.3f ms back to back, %.3f ms after idle",
        lone["back_to_back"]["latency"]["p50_ms"],
        lone["after_idle"]["latency"]["p50_ms"],
    )
    settings = _replica_settings(f"sqlite:///{directory}/ledger.db", directory)
    with _replica(plan, "ledger-sqlite", directory, settings) as server:
        targets = [server.address]
        one = lanes_named("sqlite-reserve-1", 1)
        pair_one = lanes_named("sqlite-mix-1", 1)
        spread = lanes_named("sqlite-mix-saturated", plan.spread_lanes)
        watched, quiet = lanes_named("sqlite-watched-1", 1), lanes_named("sqlite-quiet", 1)
        put_lanes(server.address, [*one, *pair_one, *spread, *watched, *quiet])
        phases = _move_phases(
            plan, generator, "sqlite", targets, one, pair_one, spread, watch=(server.pid,)
        )
        phases.update(_watched_phases(plan, generator, server, watched, quiet[0]))
        facts = _server_facts(server)
    phases.update(storeless_phases(plan, generator, directory / "storeless"))
    return {"server": facts, "phases": phases, "commit_floor": floor, "lone_reserve": lone}


# grpc.server against grpc.aio (bench/aio.py), and grpc.aio with async moves on
# one writer thread (bench/aio_writer.py), each model's servers in turn.
SERVER_MODELS = ("sync", "aio", "aio-writer", "sync-writer")
SERVER_MODEL_ROUNDS = 2


def server_model_scenario(
    plan: Plan, generator: LoadGenerator, workdir: pathlib.Path
) -> dict[str, Any]:
    """(7) The server model: the echo and the SQLite ledger on grpc.server and on
    grpc.aio, in SERVER_MODEL_ROUNDS alternating rounds (sync, aio, aio, sync,
    ...) so that the machine's drift falls on both alike. One client's call and
    the pair at 16 in flight, for each."""
    rounds: list[dict[str, Any]] = []
    for index in range(SERVER_MODEL_ROUNDS):
        order = SERVER_MODELS if index % 2 == 0 else SERVER_MODELS[::-1]
        rounds.append(
            {
                model: _server_model_round(plan, generator, workdir / f"{model}-{index}", model)
                for model in order
            }
        )
    return {"rounds": rounds}


def _server_model_round(
    plan: Plan, generator: LoadGenerator, directory: pathlib.Path, model: str
) -> dict[str, Any]:
    aio, aio_writer = model == "aio", model == "aio-writer"
    phases: dict[str, Any] = {}
    argv = servers.aio_echo_argv() if aio or aio_writer else servers.echo_argv()
    with _echo(plan, f"echo-{model}", argv, directory / "echo") as echo:
        targets, watch = [echo.address], (echo.pid,)
        phases["echo_1"] = _phase(
            generator, f"{model} echo 1", _single(plan, CallKind.ECHO, targets), watch=watch
        )
        phases["echo_pair_saturated"] = _phase(
            generator,
            f"{model} echo pair saturated",
            _workload(plan, CallKind.ECHO_PAIR, targets),
            watch=watch,
        )
    settings = _replica_settings(f"sqlite:///{directory}/ledger.db", directory)
    replica = _replica(
        plan,
        f"ledger-{model}",
        directory,
        settings,
        aio=aio,
        aio_writer=aio_writer,
        sync_writer=model == "sync-writer",
    )
    with replica as server:
        one, spread = lanes_named(f"{model}-1", 1), lanes_named(f"{model}-mix", plan.spread_lanes)
        put_lanes(server.address, [*one, *spread])
        phases.update(
            _move_phases(
                plan, generator, model, [server.address], one, (), spread, watch=(server.pid,)
            )
        )
    return phases


# Issue 25's reference design (bench/reference.py) beside the real server and
# the echo, in rounds of alternating order; run only when named.
REFERENCE_SERVERS = ("echo", "ours", "reference")
REFERENCE_ROUNDS = 2


def reference_scenario(
    plan: Plan, generator: LoadGenerator, workdir: pathlib.Path
) -> dict[str, Any]:
    """(8) The reference server against ours: in each of REFERENCE_ROUNDS rounds
    (echo, ours, reference, then the reverse) one client's call and the pair at
    16 in flight on each, and one durable commit alone, so every ratio is to
    the echo and the floor line of its own round."""
    rounds: list[dict[str, Any]] = []
    for index in range(REFERENCE_ROUNDS):
        order = REFERENCE_SERVERS if index % 2 == 0 else REFERENCE_SERVERS[::-1]
        directory = workdir / f"reference-{index}"
        directory.mkdir(parents=True, exist_ok=True)
        found = {name: _reference_round(plan, generator, directory / name, name) for name in order}
        found["commit_floor"] = durable_commit_floor(
            directory / "commit-floor.db", plan.commit_floor_commits
        )
        rounds.append(found)
    return {"rounds": rounds}


def _reference_round(
    plan: Plan, generator: LoadGenerator, directory: pathlib.Path, name: str
) -> dict[str, Any]:
    one, spread = lanes_named(f"{name}-1", 1), lanes_named(f"{name}-mix", plan.spread_lanes)
    if name == "echo":
        with _echo(plan, "echo", servers.echo_argv(), directory) as echo:
            targets, watch = [echo.address], (echo.pid,)
            return {
                "echo_1": _phase(
                    generator, "echo 1", _single(plan, CallKind.ECHO, targets), watch=watch
                ),
                "echo_pair_saturated": _phase(
                    generator,
                    "echo pair saturated",
                    _workload(plan, CallKind.ECHO_PAIR, targets),
                    watch=watch,
                ),
            }
    if name == "ours":
        settings = _replica_settings(f"sqlite:///{directory}/ledger.db", directory)
        with _replica(plan, "ledger-sqlite", directory, settings) as server:
            put_lanes(server.address, [*one, *spread])
            return _move_phases(
                plan, generator, name, [server.address], one, (), spread, watch=(server.pid,)
            )
    directory.mkdir(parents=True, exist_ok=True)
    argv = servers.reference_argv(directory / "reference.db", [*one, *spread])
    with _echo(plan, "reference", argv, directory) as server:
        return _move_phases(
            plan, generator, name, [server.address], one, (), spread, watch=(server.pid,)
        )


def _watched_phases(
    plan: Plan,
    generator: LoadGenerator,
    server: servers.ServerProcess,
    lanes: Sequence[str],
    quiet_lane: str,
) -> dict[str, Any]:
    """One client's Reserves without streams, then beside WATCHERS streams (on
    another lane), then without again: the same lane, in one run."""
    phases: dict[str, Any] = {}
    for name in ("reserve_1_unwatched", "reserve_1_watched", "reserve_1_unwatched_after"):
        workload = _single(plan, CallKind.RESERVE, [server.address], lanes=tuple(lanes))
        label = f"sqlite {name.replace('_', ' ')}"
        if name == "reserve_1_watched":
            with watching(server.address, quiet_lane, WATCHERS) as ended:
                phases[name] = _phase(generator, label, workload, watch=(server.pid,))
                phases[name] = _with_streams_open(phases[name], ended())
        else:
            phases[name] = _phase(generator, label, workload, watch=(server.pid,))
    return phases


def _with_streams_open(figures: dict[str, Any], ended: Sequence[str]) -> dict[str, Any]:
    """The watched phase's figures, failed if any of the WATCHERS streams ended
    before the phase did: fewer streams open is not what the target measures."""
    if ended and "failed" not in figures:
        how = ", ".join(sorted(set(ended)))
        return {"failed": f"{len(ended)} of {WATCHERS} streams ended during the phase ({how})"}
    return {**figures, "streams_open": WATCHERS - len(ended)}


def storeless_phases(
    plan: Plan, generator: LoadGenerator, directory: pathlib.Path
) -> dict[str, Any]:
    """The same calls against a ledger that answers without its store
    (bench/storeless.py): what the transport and the API layer cost alone."""
    directory.mkdir(parents=True, exist_ok=True)
    settings = _replica_settings(f"sqlite:///{directory}/ledger.db", directory)
    with _replica(plan, "ledger-storeless", directory, settings, storeless=True) as server:
        targets = [server.address]
        lanes = lanes_named("storeless", 1)
        put_lanes(server.address, lanes)
        phases = _move_phases(
            plan, generator, "storeless", targets, lanes, (), lanes, watch=(server.pid,)
        )
        return {f"storeless_{name}": figures for name, figures in phases.items()}


def _move_phases(
    plan: Plan,
    generator: LoadGenerator,
    label: str,
    targets: Sequence[str],
    one: Sequence[str],
    pair_one: Sequence[str],
    spread: Sequence[str],
    *,
    watch: Sequence[int],
) -> dict[str, Any]:
    """Reserve at 1 client on `one`, Reserve+Settle at 1 client on `pair_one`
    (left out when empty), Reserve+Settle near saturation on `spread`."""
    phases = {
        "reserve_1": _phase(
            generator,
            f"{label} reserve 1",
            _single(plan, CallKind.RESERVE, targets, lanes=tuple(one)),
            watch=watch,
        )
    }
    if pair_one:
        phases["reserve_settle_1"] = _phase(
            generator,
            f"{label} reserve+settle 1",
            _single(plan, CallKind.RESERVE_SETTLE, targets, lanes=tuple(pair_one)),
            watch=watch,
        )
    phases["reserve_settle_saturated"] = _phase(
        generator,
        f"{label} reserve+settle saturated",
        _workload(plan, CallKind.RESERVE_SETTLE, targets, lanes=tuple(spread)),
        watch=watch,
    )
    return phases


def postgres_problem(url: str) -> str | None:
    engine = sa.create_engine(url, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as connection:
            connection.execute(sa.text("SELECT 1"))
    except sa.exc.SQLAlchemyError as error:
        shown = sa.engine.make_url(url).render_as_string(hide_password=True)
        return f"PostgreSQL at {shown} is unreachable: {type(error).__name__}"
    finally:
        engine.dispose()
    return None


def postgres_version(url: str) -> str:
    engine = sa.create_engine(url, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as connection:
            return str(connection.execute(sa.text("SHOW server_version")).scalar_one())
    finally:
        engine.dispose()


@contextlib.contextmanager
def fresh_schema(url: str) -> Iterator[str]:
    """A URL whose search_path is a new, empty schema, dropped afterwards."""
    schema = f"bench_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(url, pool_pre_ping=True)
    try:
        with admin.begin() as connection:
            connection.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        try:
            yield f"{url}?options=-csearch_path%3D{schema}"
        finally:
            _drop_schema(admin, schema)
    finally:
        admin.dispose()


def _drop_schema(admin: sa.Engine, schema: str) -> None:
    """Drops the schema, retrying a few times: a restarted database must not
    leave it behind, nor throw away the figures measured in it."""
    for attempt in range(DROP_SCHEMA_ATTEMPTS):
        try:
            with admin.begin() as connection:
                connection.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
            return
        except sa.exc.SQLAlchemyError as error:
            log.warning(
                "dropping schema %s failed (%s); attempt %d of %d",
                schema,
                type(error).__name__,
                attempt + 1,
                DROP_SCHEMA_ATTEMPTS,
            )
            admin.dispose()
            time.sleep(DROP_SCHEMA_PAUSE_SECONDS)
    log.error("schema %s is left behind: drop it by hand", schema)


def _postgres_phase(
    plan: Plan,
    generator: LoadGenerator,
    workdir: pathlib.Path,
    url: str,
    variant: str,
    server: str = "ours",
) -> dict[str, Any]:
    """Reserve+Settle near saturation on two replicas of `server` ("ours", or
    "reference": bench/reference_pg.py) sharing a fresh schema."""
    lanes = lanes_named(f"pg-{variant}", 1 if variant == "hot" else plan.spread_lanes)
    with fresh_schema(url) as schema_url, contextlib.ExitStack() as stack:
        replicas = []
        for index, name in enumerate(("a", "b")):
            directory = workdir / f"postgres-{server}-{variant}-{name}"
            # The first replica migrates the schema; the second finds it there.
            if server == "reference":
                directory.mkdir(parents=True, exist_ok=True)
                argv = servers.reference_pg_argv(schema_url, lanes if index == 0 else [])
                replica = _echo(plan, f"reference-pg-{name}", argv, directory)
            else:
                settings = _replica_settings(schema_url, directory)
                replica = _replica(
                    plan, f"ledger-pg-{name}", directory, settings, migrate=index == 0
                )
            replicas.append(stack.enter_context(replica))
        if server != "reference":
            put_lanes(replicas[0].address, lanes)
        targets = [replica.address for replica in replicas]
        result = _phase(
            generator,
            f"postgres {server} {variant}",
            _workload(plan, CallKind.RESERVE_SETTLE, targets, lanes=lanes),
            watch=[replica.pid for replica in replicas],
        )
        result["replicas"] = [_server_facts(replica) for replica in replicas]
        result["lanes"] = len(lanes)
        return result


def _postgres_floor(plan: Plan, url: str, variant: str) -> dict[str, Any]:
    """The bare Reserve-shaped transaction (bench/pg_floor.py) with the ledger
    phase's processes, connections (one per call in flight) and lanes, on
    tables of its own in a fresh schema."""
    lanes = lanes_named(f"floor-{variant}", 1 if variant == "hot" else plan.spread_lanes)
    with fresh_schema(url) as schema_url:
        pg_floor.create_tables(schema_url, lanes)
        workload = pg_floor.FloorWorkload(
            conninfo=pg_floor.conninfo(schema_url),
            lanes=lanes,
            processes=plan.processes,
            connections=plan.in_flight_per_process,
            warmup_seconds=plan.warmup_seconds,
            measure_seconds=plan.measure_seconds,
        )
        log.info(
            "phase postgres floor %s: %d x %d connections",
            variant,
            workload.processes,
            workload.connections,
        )
        result = pg_floor.measure(workload)
    log.info(
        "phase postgres floor %s: %.0f moves/s, client %.3f ms CPU a move, %d errors",
        variant,
        result["moves_per_second"],
        result["client_cpu_ms_per_move"] or 0.0,
        sum(result["errors"].values()),
    )
    return result


def postgres_scenario(
    plan: Plan, generator: LoadGenerator, workdir: pathlib.Path, url: str
) -> dict[str, Any]:
    """(3) Two replicas on one PostgreSQL, Reserve+Settle near saturation: every call
    on one hot lane, then spread over many lanes; each in a fresh schema. Right
    before each, the bare transaction's floor in the same shape."""
    problem = postgres_problem(url)
    if problem is not None:
        return {"skipped": problem}
    phases: dict[str, Any] = {}
    for variant in ("hot", "spread"):
        phases[f"floor_{variant}"] = _failed_as_figures(
            f"postgres floor {variant}", functools.partial(_postgres_floor, plan, url, variant)
        )
        phases[variant] = _failed_as_figures(
            f"postgres {variant}",
            functools.partial(_postgres_phase, plan, generator, workdir, url, variant),
        )
    return {"server_version": postgres_version(url), "phases": phases}


# Issue 24's reference (bench/reference_pg.py) beside ours and the floor, in
# rounds of alternating order on both layouts; run only when named.
REFERENCE_PG_SERVERS = ("floor", "ours", "reference")
REFERENCE_PG_ROUNDS = 3


def reference_postgres_scenario(
    plan: Plan, generator: LoadGenerator, workdir: pathlib.Path, url: str
) -> dict[str, Any]:
    """(9) The floor, ours and the reference, two replicas each, with the
    postgres scenario's load: in each of REFERENCE_PG_ROUNDS rounds (floor,
    ours, reference, then the reverse) on 16 lanes and on one hot lane, so
    every ratio is to the floor of its own round."""
    problem = postgres_problem(url)
    if problem is not None:
        return {"skipped": problem}
    rounds: list[dict[str, Any]] = []
    for index in range(REFERENCE_PG_ROUNDS):
        order = REFERENCE_PG_SERVERS if index % 2 == 0 else REFERENCE_PG_SERVERS[::-1]
        directory = workdir / f"reference-postgres-{index}"
        turn: dict[str, Any] = {}
        for variant in ("spread", "hot"):
            runs: dict[str, Callable[[], dict[str, Any]]] = {
                "floor": functools.partial(_postgres_floor, plan, url, variant),
                "ours": functools.partial(
                    _postgres_phase, plan, generator, directory, url, variant
                ),
                "reference": functools.partial(
                    _postgres_phase, plan, generator, directory, url, variant, "reference"
                ),
            }
            turn[variant] = {
                name: _failed_as_figures(f"postgres {name} {variant}", runs[name]) for name in order
            }
        rounds.append(turn)
    return {"server_version": postgres_version(url), "rounds": rounds}


def _failed_as_figures(name: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """run(), or {"failed": ...} when it raised: the run goes on."""
    try:
        return run()
    except Exception as error:
        log.exception("%s failed", name)
        return {"failed": f"{type(error).__name__}: {error}"}


@contextlib.contextmanager
def _proxied(url: str) -> Iterator[tuple[latency_proxy.LatencyProxy, str]]:
    """A latency proxy (no delay yet) in front of `url`'s database, and the
    URL that reaches the database through it."""
    parsed = sa.engine.make_url(url)
    with latency_proxy.LatencyProxy(parsed.host or "127.0.0.1", parsed.port or 5432) as proxy:
        through = parsed.set(host=proxy.listen_host, port=proxy.port)
        yield proxy, through.render_as_string(hide_password=False)


# Each way (no delay, the delay) is timed in this many rounds, alternating
# ABBA, so that the machine's drift falls on both alike.
ROUND_TRIP_ROUNDS = 4


def _alternating_ways(
    proxy: latency_proxy.LatencyProxy,
    delay_seconds: float,
    count: int,
    measure: Callable[[str, int], dict[str, float]],
) -> dict[str, Any]:
    """measure(prefix, n) of n back-to-back moves or pairs, summed per way over
    the rounds; the proxy's turns and new connections counted per way too."""
    ways: dict[str, dict[str, Any]] = {
        way: {"count": 0, "turns": 0, "connections_opened": 0} for way in ("no_delay", "delayed")
    }
    rounds = max(1, min(ROUND_TRIP_ROUNDS, count))
    for index in range(rounds):
        order = ("no_delay", "delayed") if index % 2 == 0 else ("delayed", "no_delay")
        for way in order:
            proxy.delay_seconds = delay_seconds if way == "delayed" else 0.0
            turns, connections = proxy.turns, proxy.connections
            share = count // rounds + (1 if index < count % rounds else 0)
            for name, value in measure(f"{way}-{index}", share).items():
                ways[way][name] = ways[way].get(name, 0.0) + value
            ways[way]["count"] += share
            ways[way]["turns"] += proxy.turns - turns
            ways[way]["connections_opened"] += proxy.connections - connections
    proxy.delay_seconds = 0.0
    return ways


def _timed_pairs(
    stub: pb_grpc.LedgerStub, lane: str, timeout_seconds: float, prefix: str, pairs: int
) -> dict[str, float]:
    """`pairs` Reserve then Settle, back to back; the seconds of each RPC, summed."""
    reserve_seconds = settle_seconds = 0.0
    for number in range(pairs):
        reservation_id = f"{prefix}-{number}"
        started = time.perf_counter()
        reply = stub.Reserve(load.reserve_request(lane, reservation_id), timeout=timeout_seconds)
        reserved = time.perf_counter()
        if reply.decision != pb.ADMITTED:
            raise servers.BenchError(f"Reserve {reservation_id} was not admitted")
        stub.Settle(load.settle_request(lane, reservation_id), timeout=timeout_seconds)
        reserve_seconds += reserved - started
        settle_seconds += time.perf_counter() - reserved
    return {"reserve_seconds": reserve_seconds, "settle_seconds": settle_seconds}


# A lane under three parents (the deepest nesting allowed), root first.
NESTED_CHAIN = ("roundtrips-top", "roundtrips-mid", "roundtrips-low", "roundtrips-nested")


def _ledger_round_trips(plan: Plan, workdir: pathlib.Path, url: str) -> dict[str, Any]:
    """One client, Reserve then Settle back to back, through one ledger server
    whose database is behind the proxy: timed with no delay and with the
    delay, and the proxy's turns counted while each ran. On a lane of its own,
    and on a lane under three parents ("nested")."""
    directory = workdir / "roundtrips"
    lane = "roundtrips-00"
    parent_of = dict(zip(NESTED_CHAIN[1:], NESTED_CHAIN, strict=False))
    with fresh_schema(url) as schema_url, _proxied(schema_url) as (proxy, proxy_url):
        # No background queries (the sweeper's, health's) between the moves:
        # the proxy's count is then the moves' own round trips.
        quiet = {"sweep_interval_seconds": 600.0, "health_check_interval_seconds": 600.0}
        settings = _replica_settings(proxy_url, directory, **quiet)
        # Migrated and made ready with no delay: only the moves are measured.
        with _replica(plan, "ledger-roundtrips", directory, settings) as server:
            put_lanes(server.address, [lane, *NESTED_CHAIN], parent_of)
            with grpc.insecure_channel(server.address) as channel:
                stub = pb_grpc.LedgerStub(channel)
                timeout = plan.call_timeout_seconds
                measured = {}
                for name, on_lane in (("own", lane), ("nested", NESTED_CHAIN[-1])):
                    _timed_pairs(stub, on_lane, timeout, f"warm-{name}", plan.roundtrip_pairs)
                    measured[name] = _alternating_ways(
                        proxy,
                        plan.roundtrip_delay_seconds,
                        plan.roundtrip_pairs,
                        functools.partial(_timed_pairs, stub, on_lane, timeout),
                    )
            facts = _server_facts(server)
    for ways in measured.values():
        for figures in ways.values():
            figures["pairs"] = figures["count"]
            figures["reserve_mean_seconds"] = figures.pop("reserve_seconds") / figures["count"]
            figures["settle_mean_seconds"] = figures.pop("settle_seconds") / figures["count"]
    return {"server": facts, **measured["own"], "nested": measured["nested"]}


def _floor_round_trips(plan: Plan, url: str) -> dict[str, Any]:
    """The bare transaction on one connection, moves back to back, through the
    same proxy: with no delay and with the delay. Should come out 6 or 7."""
    lane = "roundtrips-floor-00"
    with fresh_schema(url) as schema_url, _proxied(schema_url) as (proxy, proxy_url):
        pg_floor.create_tables(schema_url, [lane])
        mover = pg_floor.Mover(pg_floor.conninfo(proxy_url), lane)
        try:
            # Past psycopg's prepare threshold (5 runs of a statement) first.
            pg_floor.timed_moves_on(mover, plan.roundtrip_floor_moves, "warm")
            ways = _alternating_ways(
                proxy,
                plan.roundtrip_delay_seconds,
                plan.roundtrip_floor_moves,
                lambda prefix, moves: {
                    "seconds": sum(pg_floor.timed_moves_on(mover, moves, prefix))
                },
            )
        finally:
            mover.close()
    for figures in ways.values():
        figures["moves"] = figures["count"]
        figures["move_mean_seconds"] = figures.pop("seconds") / figures["count"]
    return ways


def roundtrips_scenario(plan: Plan, workdir: pathlib.Path, url: str) -> dict[str, Any]:
    """(6) Round trips to the database a move: the ledger's and the bare
    transaction's, each through a latency proxy (bench/latency_proxy.py),
    beside what the proxy adds to one round trip, measured with a TCP echo."""
    problem = postgres_problem(url)
    if problem is not None:
        return {"skipped": problem}
    delay = plan.roundtrip_delay_seconds
    result: dict[str, Any] = {
        "delay_seconds": delay,
        "proxy": latency_proxy.added_round_trip_seconds(delay, plan.roundtrip_pings),
    }
    log.info(
        "latency proxy at %.1f ms each way adds %.2f ms a round trip",
        delay * 1000,
        result["proxy"]["added_round_trip_seconds"] * 1000,
    )
    result["ledger"] = _failed_as_figures(
        "round trips of the ledger", functools.partial(_ledger_round_trips, plan, workdir, url)
    )
    result["floor"] = _failed_as_figures(
        "round trips of the floor", functools.partial(_floor_round_trips, plan, url)
    )
    return result


@dataclasses.dataclass(frozen=True)
class _History:
    """One seeded history size."""

    count: int
    url: str
    directory: pathlib.Path
    lane: str
    seed: seeding.SeedReport


def _seed_history(plan: Plan, workdir: pathlib.Path, count: int) -> _History:
    directory = workdir / f"history-{count}"
    url = f"sqlite:///{directory}/ledger.db"
    policy = lane_policy(f"history-{count}")
    log.info("seeding %d bookings", count)
    report = seeding.seed(
        url, policy, count, SystemClock().now_us(), BOOKING_SHAPE, batch_rows=plan.seed_batch_rows
    )
    log.info("seeded %d bookings in %.1f s", count, report.seconds)
    return _History(count, url, directory, policy.lane, report)


def _interleaved(
    generator: LoadGenerator, name: str, workloads: dict[int, Workload], rounds: int
) -> dict[int, dict[str, Any]]:
    """Each workload run in `rounds` rounds, alternating ABBA, merged per workload.
    A failed round fails its workload's result, not the others'."""
    taken: dict[int, list[load.Round]] = {key: [] for key in workloads}
    failed: dict[int, str] = {}
    keys = list(workloads)
    for index in range(rounds):
        for key in keys if index % 2 == 0 else reversed(keys):
            if key in failed:
                continue
            workload = workloads[key]
            # Reservation ids of its own: a round that repeated another's ids
            # would measure idempotent replays, which write nothing.
            workload = dataclasses.replace(workload, id_prefix=f"{workload.id_prefix}r{index}")
            if index:
                # Connected and warmed once already: a short warm-up per round.
                warmup = min(workload.warmup_seconds, ROUND_WARMUP_SECONDS)
                workload = dataclasses.replace(workload, warmup_seconds=warmup)
            try:
                taken[key].append(generator.run_round(workload))
            except Exception as error:
                log.exception("phase %s %d, round %d failed", name, key, index)
                failed[key] = f"{type(error).__name__}: {error}"
    results: dict[int, dict[str, Any]] = {}
    for key in keys:
        if key in failed:
            results[key] = {"failed": failed[key]}
            continue
        result = load.merge_rounds(taken[key]).to_json()
        result["rounds"] = rounds
        results[key] = result
        log.info(
            "phase %s %d: %.0f calls/s, p50 %.2f ms, p99 %.2f ms, %d errors, %d rounds",
            name,
            key,
            result["throughput_per_second"],
            result["latency"]["p50_ms"],
            result["latency"]["p99_ms"],
            sum(result["errors"].values()),
            rounds,
        )
    return results


def _history_sizes(
    plan: Plan, generator: LoadGenerator, workdir: pathlib.Path, counts: Sequence[int]
) -> dict[str, Any]:
    """Every size seeded, then served by a server each, all at once, and each
    phase measured on them in alternating rounds."""
    histories = [_seed_history(plan, workdir, count) for count in counts]
    rounds = max(1, plan.history_rounds)
    first_start: dict[int, float] = {}
    with contextlib.ExitStack() as stack:
        running: dict[int, servers.ServerProcess] = {}
        for history in histories:
            settings = _replica_settings(
                history.url,
                history.directory,
                consistency_check_interval_seconds=0.0,
                snapshot_every_events=0,
            )
            # The first start walks the whole seeded chain and sets the verified
            # point; the restart, measured, walks on from there.
            with _replica(
                plan,
                f"ledger-history-{history.count}-first",
                history.directory,
                settings,
                ready_timeout_seconds=plan.history_ready_timeout_seconds,
            ) as first:
                first_start[history.count] = first.ready_seconds
            server = stack.enter_context(
                _replica(
                    plan,
                    f"ledger-history-{history.count}",
                    history.directory,
                    settings,
                    ready_timeout_seconds=plan.history_ready_timeout_seconds,
                )
            )
            if recoveries(history.url):
                # The start-up check found the seeded projections inconsistent with the log.
                raise servers.BenchError(
                    f"the server had to recover the seeded history:\n{server.log_tail()}"
                )
            running[history.count] = server
        at_start = {count: _server_facts(server) for count, server in running.items()}
        phases: dict[int, dict[str, Any]] = {history.count: {} for history in histories}
        for phase_name, make in (("reserve_1", _single), ("reserve_saturated", _workload)):
            workloads = {
                history.count: make(
                    plan,
                    CallKind.RESERVE,
                    [running[history.count].address],
                    lanes=(history.lane,),
                    measure_seconds=plan.history_measure_seconds / rounds,
                    max_calls=math.ceil(plan.history_max_calls / rounds),
                )
                for history in histories
            }
            label = f"history {phase_name.replace('_', ' ')}"
            for count, result in _interleaved(generator, label, workloads, rounds).items():
                phases[count][phase_name] = result
        after_run = {count: _server_facts(server) for count, server in running.items()}
    return {
        str(history.count): {
            "database_url": history.url,
            "seed": history.seed.to_json(),
            # Every measured Reserve adds a booking: the window the last call saw.
            "bookings_after_run": booking_count(history.url, history.lane),
            "server_at_start": at_start[history.count],
            "first_start_ready_seconds": first_start[history.count],
            "server_after_run": after_run[history.count],
            "phases": phases[history.count],
        }
        for history in histories
    }


def history_scenario(plan: Plan, generator: LoadGenerator, workdir: pathlib.Path) -> dict[str, Any]:
    """(4) The same Reserve against a lane with few and with very many bookings
    inside its window; (5) the rebuild of the large log, and the server's memory."""
    counts = (plan.history_small_bookings, plan.history_large_bookings)
    try:
        sizes = _history_sizes(plan, generator, workdir, counts)
    except Exception as error:
        log.exception("history failed")
        sizes = {str(count): {"failed": f"{type(error).__name__}: {error}"} for count in counts}
    result: dict[str, Any] = {
        "small_bookings": plan.history_small_bookings,
        "large_bookings": plan.history_large_bookings,
        "sizes": sizes,
    }
    large = sizes[str(plan.history_large_bookings)]
    if "failed" in large:
        result["rebuild"] = {"failed": "no large history to rebuild"}
        return result
    log.info("rebuilding the projections of %d events", large["seed"]["events"])
    try:
        result["rebuild"] = rebuild.measure(
            large["database_url"],
            large["seed"]["events"],
            replay_max_events=plan.replay_max_events,
            timeout_seconds=plan.rebuild_timeout_seconds,
        )
    except Exception as error:
        log.exception("rebuild failed")
        result["rebuild"] = {"failed": f"{type(error).__name__}: {error}"}
    return result
