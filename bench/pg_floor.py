"""The PostgreSQL floor: the bare Reserve-shaped transaction, from Python with psycopg.

What a move through PostgreSQL costs at the least, measured in the same run
as the ledger's PostgreSQL rows, with as many processes and connections as
their load (issue 24): one transaction that

1. locks the lane's row (`SELECT ... FOR UPDATE`),
2. checks the reservation id (a SELECT of the booking by lane and id),
3. inserts the event (`RETURNING seq`),
4. inserts the booking (its `answer_seq` is the event's seq),
5. updates the lane's row,
6. and commits.

It runs on the ledger's own `lanes`, `events` and `bookings` tables
(`ledger_service.storage.schema`, with their indexes) made in a scratch schema,
with rows the size of the ledger's: no hash chain, no window, no projections
marker, no gRPC. Each connection is a thread of its own (psycopg releases the
GIL while it waits on the socket), each issuing moves back to back; each
process is spawned, like the load generator's, and reports its own CPU time
(user and system, all its threads) between the end of the warm-up and the
end of the measurement: the client's CPU a move.

A move counts when it starts after the warm-up and ends before the
measurement does, as in bench/load.py; a failed move is rolled back and
counted by its exception's name.
"""

from __future__ import annotations

import array
import dataclasses
import multiprocessing
import threading
import time
import uuid
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from operator import itemgetter
from typing import Any

import psycopg
import sqlalchemy as sa

from bench import load
from ledger_service.storage import schema

TABLES = (schema.lanes, schema.events, schema.bookings)
MAX_PROCESSES = load.MAX_PROCESSES
MAX_CONNECTIONS_PER_PROCESS = load.MAX_IN_FLIGHT_PER_PROCESS
MAX_SAMPLES_PER_CONNECTION = 1_000_000
CONNECT_TIMEOUT_SECONDS = 30
START_DELAY_NANOS = 100_000_000
REPORT_SLACK_SECONDS = 30.0
ERROR_PAUSE_SECONDS = 0.01
# A booking's figures, about those of the load generator's Reserve.
HOLD_NANOS = 18_000_000
WINDOW_US = 86_400_000_000
HOLD_TTL_US = 120_000_000
LIMIT_NANOS = 10**18

LOCK_LANE = "SELECT limit_nanos, version FROM lanes WHERE lane = %s FOR UPDATE"
CHECK_ID = "SELECT state FROM bookings WHERE lane = %s AND reservation_id = %s"
UPDATE_LANE = "UPDATE lanes SET version = version + 1, updated_at_us = %s WHERE lane = %s"


def _insert(table: sa.Table, returning: str = "") -> tuple[str, tuple[str, ...]]:
    """INSERT of every column but an autoincremented key, and the column order."""
    names = tuple(column.name for column in table.columns if column.name != "seq")
    text = (
        f"INSERT INTO {table.name} ({', '.join(names)}) VALUES ({', '.join(['%s'] * len(names))})"
    )
    return (f"{text} RETURNING {returning}" if returning else text), names


def _row_values(table: sa.Table, given: dict[str, Any]) -> dict[str, Any]:
    """A row: the given values, and for every other column NULL if it may be,
    else 0 or an empty text."""
    values: dict[str, Any] = {}
    for column in table.columns:
        if column.name in given:
            values[column.name] = given[column.name]
        elif column.nullable:
            values[column.name] = None
        else:
            values[column.name] = 0 if column.type.python_type is int else ""
    return values


INSERT_EVENT, EVENT_COLUMNS = _insert(schema.events, returning="seq")
INSERT_BOOKING, BOOKING_COLUMNS = _insert(schema.bookings)
_PRICES = {
    "input_nanos_per_million_tokens": 3_000_000_000,
    "output_nanos_per_million_tokens": 15_000_000_000,
}
EVENT_TEMPLATE = _row_values(
    schema.events,
    {
        "kind": "reserved",
        "model": load.MODEL,
        "request_bytes": load.REQUEST_BYTES,
        "max_output_tokens": load.MAX_OUTPUT_TOKENS,
        "hold_nanos": HOLD_NANOS,
        "cap_nanos": HOLD_NANOS,
        "expire_charge": "hold",
        "limit_nanos": LIMIT_NANOS,
        "window_us": WINDOW_US,
        "open_bookings_after": 1,
        "trace_id": "0" * 32,
        "hash": "a" * 64,
        "previous_hash": "b" * 64,
        **_PRICES,
    },
)
BOOKING_TEMPLATE = _row_values(
    schema.bookings,
    {
        "model": load.MODEL,
        "request_bytes": load.REQUEST_BYTES,
        "max_output_tokens": load.MAX_OUTPUT_TOKENS,
        "cap_nanos": HOLD_NANOS,
        "hold_nanos": HOLD_NANOS,
        "amount_nanos": HOLD_NANOS,
        "expire_charge": "hold",
        "state": "held",
        **_PRICES,
    },
)
_event_parameters = itemgetter(*EVENT_COLUMNS)
_booking_parameters = itemgetter(*BOOKING_COLUMNS)


def create_tables(url: str, lanes: Sequence[str]) -> None:
    """The three tables and one row per lane, where `url` (SQLAlchemy's form,
    its search_path a scratch schema) puts them."""
    engine = sa.create_engine(url)
    now_us = time.time_ns() // 1000
    try:
        schema.Base.metadata.create_all(engine, tables=list(TABLES))
        with engine.begin() as connection:
            connection.execute(
                schema.lanes.insert(),
                [
                    {
                        "lane": lane,
                        "limit_nanos": LIMIT_NANOS,
                        "window_us": WINDOW_US,
                        "hold_ttl_us": HOLD_TTL_US,
                        "bytes_per_token_milli": 3500,
                        "overhead_tokens": 0,
                        "expire_charge": "hold",
                        "prices_json": '{"bench-model": [3000000000, 15000000000]}',
                        "version": 1,
                        "updated_at_us": now_us,
                        "parent": None,
                        "max_charge_multiple": 100,
                    }
                    for lane in lanes
                ],
            )
    finally:
        engine.dispose()


def conninfo(url: str) -> str:
    """psycopg's form of a SQLAlchemy PostgreSQL URL (query options kept)."""
    parsed = sa.engine.make_url(url).set(drivername="postgresql")
    return parsed.render_as_string(hide_password=False)


class Mover:
    """One connection making the bare move, one transaction each."""

    def __init__(self, info: str, lane: str) -> None:
        self.lane = lane
        self.connection = psycopg.connect(info, connect_timeout=CONNECT_TIMEOUT_SECONDS)
        self.cursor = self.connection.cursor()

    def close(self) -> None:
        self.connection.close()

    def move(self, reservation_id: str) -> None:
        cursor, lane = self.cursor, self.lane
        now_us = time.time_ns() // 1000
        try:
            cursor.execute(LOCK_LANE, (lane,))
            cursor.fetchone()
            cursor.execute(CHECK_ID, (lane, reservation_id))
            if cursor.fetchone() is not None:
                raise RuntimeError(f"reservation {reservation_id} is already booked")
            event = {
                **EVENT_TEMPLATE,
                "lane": lane,
                "reservation_id": reservation_id,
                "occurred_at_us": now_us,
                "reserved_at_us": now_us,
                "expires_at_us": now_us + HOLD_TTL_US,
            }
            cursor.execute(INSERT_EVENT, _event_parameters(event))
            found = cursor.fetchone()
            assert found is not None, "INSERT ... RETURNING gave no row"
            booking = {
                **BOOKING_TEMPLATE,
                "lane": lane,
                "reservation_id": reservation_id,
                "reserved_at_us": now_us,
                "expires_at_us": now_us + HOLD_TTL_US,
                "answer_seq": found[0],
            }
            cursor.execute(INSERT_BOOKING, _booking_parameters(booking))
            cursor.execute(UPDATE_LANE, (now_us, lane))
            self.connection.commit()
        except BaseException:
            self.connection.rollback()
            raise


@dataclasses.dataclass(frozen=True)
class FloorWorkload:
    """`processes` x `connections` movers; mover g uses lanes[g % len(lanes)]."""

    conninfo: str
    lanes: tuple[str, ...]
    processes: int
    connections: int
    warmup_seconds: float
    measure_seconds: float
    id_prefix: str = dataclasses.field(default_factory=lambda: f"f{uuid.uuid4().hex[:8]}")

    def validate(self) -> None:
        if not self.lanes:
            raise ValueError("the floor needs lanes")
        if not 1 <= self.processes <= MAX_PROCESSES:
            raise ValueError(f"processes must be between 1 and {MAX_PROCESSES}")
        if not 1 <= self.connections <= MAX_CONNECTIONS_PER_PROCESS:
            raise ValueError(f"connections must be between 1 and {MAX_CONNECTIONS_PER_PROCESS}")
        if self.measure_seconds <= 0 or self.warmup_seconds < 0:
            raise ValueError("measure_seconds must be positive, warmup_seconds not negative")


@dataclasses.dataclass
class _ConnectionReport:
    latencies_ns: array.array[int] = dataclasses.field(default_factory=lambda: array.array("q"))
    errors: dict[str, int] = dataclasses.field(default_factory=dict)
    dropped_samples: int = 0


def _moves_until(
    mover: Mover, schedule: load.Schedule, id_base: str, report: _ConnectionReport
) -> None:
    """One connection's moves, back to back, from the schedule's start to its end."""
    latencies, errors = report.latencies_ns, report.errors
    number = 0
    _sleep_until(schedule.start_ns)
    while (began := time.monotonic_ns()) < schedule.measure_end_ns:
        number += 1
        started = time.perf_counter_ns()
        try:
            mover.move(f"{id_base}-{number}")
        except (psycopg.Error, RuntimeError) as error:
            if began >= schedule.warmup_end_ns:
                errors[type(error).__name__] = errors.get(type(error).__name__, 0) + 1
            time.sleep(ERROR_PAUSE_SECONDS)
            continue
        taken = time.perf_counter_ns() - started
        if began < schedule.warmup_end_ns:
            continue
        if time.monotonic_ns() > schedule.measure_end_ns:
            break
        if len(latencies) < MAX_SAMPLES_PER_CONNECTION:
            latencies.append(taken)
        else:
            report.dropped_samples += 1


def _sleep_until(instant_ns: int) -> None:
    time.sleep(max(0, instant_ns - time.monotonic_ns()) / 1e9)


def _worker(pipe: Connection, workload: FloorWorkload, index: int) -> None:
    """One process: its movers, then the schedule, then its report."""
    try:
        movers = []
        for t in range(workload.connections):
            mover_index = index * workload.connections + t
            lane = workload.lanes[mover_index % len(workload.lanes)]
            movers.append(Mover(workload.conninfo, lane))
        pipe.send(("ready", None))
        schedule: load.Schedule = pipe.recv()
        reports = [_ConnectionReport() for _ in movers]
        threads = [
            threading.Thread(
                target=_moves_until,
                args=(mover, schedule, f"{workload.id_prefix}-{index}-{t}", reports[t]),
                daemon=True,
            )
            for t, mover in enumerate(movers)
        ]
        for thread in threads:
            thread.start()
        _sleep_until(schedule.warmup_end_ns)
        cpu_before = time.process_time()
        _sleep_until(schedule.measure_end_ns)
        cpu_after = time.process_time()
        for thread in threads:
            thread.join(REPORT_SLACK_SECONDS)
        for mover in movers:
            mover.close()
        errors: dict[str, int] = {}
        for report in reports:
            for name, count in report.errors.items():
                errors[name] = errors.get(name, 0) + count
        pipe.send(
            (
                "done",
                {
                    "latencies_ns": [sample for r in reports for sample in r.latencies_ns],
                    "errors": errors,
                    "dropped_samples": sum(r.dropped_samples for r in reports),
                    "cpu_seconds": cpu_after - cpu_before,
                    "stuck_threads": sum(thread.is_alive() for thread in threads),
                },
            )
        )
    except Exception as error:
        pipe.send(("failed", f"{type(error).__name__}: {error}"))


def _expect(pipe: Connection, kind: str, timeout_seconds: float) -> Any:
    if not pipe.poll(max(0.0, timeout_seconds)):
        raise TimeoutError(f"a floor process sent no {kind!r} within {timeout_seconds:.0f} s")
    try:
        message, value = pipe.recv()
    except EOFError:
        raise RuntimeError(f"a floor process ended before it sent {kind!r}") from None
    if message != kind:
        raise RuntimeError(f"a floor process {message}: {value}")
    return value


def measure(workload: FloorWorkload) -> dict[str, Any]:
    """Runs the floor in `workload.processes` spawned processes; its figures."""
    workload.validate()
    context = multiprocessing.get_context("spawn")
    processes: list[tuple[BaseProcess, Connection]] = []
    try:
        for index in range(workload.processes):
            parent, child = context.Pipe()
            process = context.Process(
                target=_worker, args=(child, workload, index), name=f"floor-{index}", daemon=True
            )
            process.start()
            child.close()
            processes.append((process, parent))
        for _, pipe in processes:
            _expect(pipe, "ready", CONNECT_TIMEOUT_SECONDS * 2)
        start_ns = time.monotonic_ns() + START_DELAY_NANOS
        warmup_end_ns = start_ns + int(workload.warmup_seconds * 1e9)
        measure_end_ns = warmup_end_ns + int(workload.measure_seconds * 1e9)
        schedule = load.Schedule(start_ns, warmup_end_ns, measure_end_ns)
        for _, pipe in processes:
            pipe.send(schedule)
        wait = workload.warmup_seconds + workload.measure_seconds + REPORT_SLACK_SECONDS * 2
        reports = [_expect(pipe, "done", wait) for _, pipe in processes]
    finally:
        for started, pipe in processes:
            started.join(REPORT_SLACK_SECONDS)
            if started.is_alive():
                started.kill()
                started.join()
            pipe.close()
    return summary(workload, reports)


def summary(workload: FloorWorkload, reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The processes' reports merged: moves/s, latency, client CPU a move."""
    latencies = [sample for report in reports for sample in report["latencies_ns"]]
    errors: dict[str, int] = {}
    for report in reports:
        for name, count in report["errors"].items():
            errors[name] = errors.get(name, 0) + count
    moves = len(latencies)
    cpu_seconds = sum(report["cpu_seconds"] for report in reports)
    return {
        "processes": workload.processes,
        "connections_per_process": workload.connections,
        "lanes": len(workload.lanes),
        "moves": moves,
        "elapsed_seconds": workload.measure_seconds,
        "moves_per_second": moves / workload.measure_seconds,
        "latency": dataclasses.asdict(load.Percentiles.of(latencies)),
        "errors": errors,
        "dropped_samples": sum(report["dropped_samples"] for report in reports),
        "client_cpu_seconds": cpu_seconds,
        "client_cpu_ms_per_move": cpu_seconds * 1000 / moves if moves else None,
        "stuck_threads": sum(report["stuck_threads"] for report in reports),
    }


def timed_moves_on(mover: Mover, count: int, id_prefix: str) -> list[float]:
    """`count` moves back to back on one mover in this process, each timed
    (seconds): for the round trips through the latency proxy."""
    taken = []
    for number in range(count):
        started = time.perf_counter()
        mover.move(f"{id_prefix}-{number}")
        taken.append(time.perf_counter() - started)
    return taken
