"""The load generator: worker processes, each with a fixed number of calls in flight.

A `LoadGenerator` starts its worker processes once (multiprocessing, spawn) and
reuses them for every phase of a run. A phase is a `Workload`: which servers,
what one call is, how many processes and how many calls each keeps in flight
(one thread per call in flight, each issuing blocking calls back to back), how
long the warm-up and the measurement last and, optionally, how many calls at
most are measured.

A phase runs like this:

1. Each worker opens one channel per process to its server (worker i talks to
   `targets[i % len(targets)]`), waits until it is connected, and says ready.
2. The parent sets one schedule for all of them on CLOCK_MONOTONIC, which every
   process on the machine shares: start, end of warm-up, end of measurement.
3. Every thread times each call with `time.perf_counter_ns`. A call counts when
   it starts after the warm-up and ends before the measurement does (or before
   the thread's share of `max_calls` is used up); calls still in flight at the
   end are not counted.
4. Each worker sends back every counted latency; the parent merges them all
   and takes percentiles of the merged list (nearest rank), never an average
   of per-worker percentiles. Throughput is counted calls over the measured
   time.
5. When the phase names the servers' pids, the parent reads their CPU time
   and context switches at the end of the warm-up and at the end of the
   measurement (bench/usage.py): the server's cost per counted call.

A call is one echo RPC (`ECHO`), two echo RPCs back to back (`ECHO_PAIR`, the
shape of Reserve then Settle), one Reserve (`RESERVE`), or a Reserve then a
Settle of the same booking (`RESERVE_SETTLE`). For the ledger's calls the
Reserve's own latency is kept as well (`first_rpc`).
"""

from __future__ import annotations

import array
import collections
import contextlib
import dataclasses
import enum
import math
import multiprocessing
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import grpc

from bench import echo, usage
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc

# Bounds: one process never keeps more latencies than this (a 60 s phase at
# 30,000 calls/s stays far below), and every wait has a deadline.
MAX_SAMPLES_PER_PROCESS = 2_000_000
MAX_PROCESSES = 16
MAX_IN_FLIGHT_PER_PROCESS = 64
CONNECT_TIMEOUT_SECONDS = 30.0
START_DELAY_NANOS = 100_000_000
# Extra time a worker gets past the end of its phase before it is declared lost.
REPORT_SLACK_SECONDS = 30.0
# After a failed call a thread pauses, so a dead server is not hammered in a loop.
ERROR_PAUSE_SECONDS = 0.01

# The ledger's calls: one planned model call of about 4 KB of prompt.
MODEL = "bench-model"
REQUEST_BYTES = 4000
MAX_OUTPUT_TOKENS = 1000
INPUT_TOKENS = 1100
OUTPUT_TOKENS = 300
HTTP_STATUS = 200


class CallKind(enum.Enum):
    ECHO = "echo"
    ECHO_PAIR = "echo_pair"
    RESERVE = "reserve"
    RESERVE_SETTLE = "reserve_settle"


@dataclasses.dataclass(frozen=True)
class Workload:
    kind: CallKind
    targets: tuple[str, ...]
    processes: int
    in_flight: int
    warmup_seconds: float
    measure_seconds: float
    # At most this many measured calls in all (0: the duration alone bounds it).
    max_calls: int = 0
    # Lanes for the ledger's calls: thread t of worker i uses lanes[(i*in_flight+t) % n].
    lanes: tuple[str, ...] = ()
    # Makes reservation ids unique across phases that share a lane.
    id_prefix: str = "bench"
    # (lane, grant) pairs: the ledger's calls of a lane carry its grant (a
    # server with auth); a lane named in none sends no grant.
    grants: tuple[tuple[str, str], ...] = ()
    call_timeout_seconds: float = 10.0

    def validate(self) -> None:
        if not self.targets:
            raise ValueError("a workload needs at least one target")
        if not 1 <= self.processes <= MAX_PROCESSES:
            raise ValueError(f"processes must be between 1 and {MAX_PROCESSES}")
        if not 1 <= self.in_flight <= MAX_IN_FLIGHT_PER_PROCESS:
            raise ValueError(f"in_flight must be between 1 and {MAX_IN_FLIGHT_PER_PROCESS}")
        if self.kind in (CallKind.RESERVE, CallKind.RESERVE_SETTLE) and not self.lanes:
            raise ValueError("the ledger's calls need lanes")
        if self.measure_seconds <= 0 or self.warmup_seconds < 0:
            raise ValueError("measure_seconds must be positive, warmup_seconds not negative")

    @property
    def calls_in_flight(self) -> int:
        return self.processes * self.in_flight

    @property
    def calls_per_thread(self) -> int:
        """Each thread's share of max_calls (0: unbounded)."""
        return math.ceil(self.max_calls / self.calls_in_flight) if self.max_calls else 0


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Absolute CLOCK_MONOTONIC instants (time.monotonic_ns) shared by all workers."""

    start_ns: int
    warmup_end_ns: int
    measure_end_ns: int


@dataclasses.dataclass
class WorkerReport:
    latencies_ns: array.array[int]
    first_rpc_ns: array.array[int]
    errors: dict[str, int]
    denied: int = 0
    warmup_calls: int = 0
    dropped_samples: int = 0
    # True when every thread stopped because its share of max_calls was used up.
    exhausted: bool = False
    last_end_ns: int = 0


@dataclasses.dataclass(frozen=True)
class Percentiles:
    """Of one phase's merged samples; None when there were none."""

    count: int
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    mean_ms: float | None

    @classmethod
    def of(cls, samples_ns: Sequence[int]) -> Percentiles:
        ordered = sorted(samples_ns)
        if not ordered:
            return cls(0, None, None, None, None, None)
        return cls(
            len(ordered),
            nearest_rank(ordered, 50) / 1e6,
            nearest_rank(ordered, 90) / 1e6,
            nearest_rank(ordered, 99) / 1e6,
            ordered[-1] / 1e6,
            sum(ordered) / len(ordered) / 1e6,
        )


def nearest_rank(ordered: Sequence[int], percent: float) -> int:
    """The smallest sample with at least `percent`% of all samples at or below it."""
    assert ordered, "no samples"
    rank = max(1, math.ceil(percent / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclasses.dataclass(frozen=True)
class LoadResult:
    kind: str
    processes: int
    in_flight: int
    calls: int
    elapsed_seconds: float
    throughput_per_second: float
    latency: Percentiles
    # The Reserve alone (ledger calls) or the first echo (ECHO_PAIR).
    first_rpc: Percentiles
    errors: dict[str, int]
    denied: int
    warmup_calls: int
    dropped_samples: int
    stopped_by_max_calls: bool
    # The watched servers' CPU and context switches while measured (usage.Usage.per_call).
    server_usage: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Round:
    """One run of a workload: its schedule and every worker's report."""

    workload: Workload
    schedule: Schedule
    reports: tuple[WorkerReport, ...]
    # The watched servers, from the end of the warm-up to the end of the measurement.
    server_usage: usage.Usage | None = None

    @property
    def elapsed_seconds(self) -> float:
        end_ns = self.schedule.measure_end_ns
        if self.reports and all(report.exhausted for report in self.reports):
            end_ns = min(end_ns, max(report.last_end_ns for report in self.reports))
        # A thread's one call counted past the end (_Thread.run) lengthens it.
        end_ns = max([end_ns, *(report.last_end_ns for report in self.reports)])
        return max(end_ns - self.schedule.warmup_end_ns, 1) / 1e9


def merge_rounds(rounds: Sequence[Round]) -> LoadResult:
    """One result of several rounds of one workload: percentiles of all their
    samples, throughput over the sum of their measured times."""
    assert rounds, "no rounds"
    reports = [report for round_ in rounds for report in round_.reports]
    latencies = [sample for report in reports for sample in report.latencies_ns]
    first = [sample for report in reports for sample in report.first_rpc_ns]
    errors: collections.Counter[str] = collections.Counter()
    for report in reports:
        errors.update(report.errors)
    elapsed_seconds = sum(round_.elapsed_seconds for round_ in rounds)
    workload = rounds[0].workload
    server_usage = None
    readings = [round_.server_usage for round_ in rounds if round_.server_usage is not None]
    if len(readings) == len(rounds):
        server_usage = sum(readings, usage.ZERO).per_call(len(latencies))
    return LoadResult(
        kind=workload.kind.value,
        processes=workload.processes,
        in_flight=workload.in_flight,
        calls=len(latencies),
        elapsed_seconds=elapsed_seconds,
        throughput_per_second=len(latencies) / elapsed_seconds,
        latency=Percentiles.of(latencies),
        first_rpc=Percentiles.of(first),
        errors=dict(errors),
        denied=sum(report.denied for report in reports),
        warmup_calls=sum(report.warmup_calls for report in reports),
        dropped_samples=sum(report.dropped_samples for report in reports),
        stopped_by_max_calls=all(report.exhausted for report in reports),
        server_usage=server_usage,
    )


# The worker process ---------------------------------------------------------------


# (first RPC's latency in ns, denied?) of one call; raises grpc.RpcError.
CallFn = Callable[[str, str], tuple[int, bool]]


def _call_function(workload: Workload, channel: grpc.Channel) -> CallFn:
    timeout = workload.call_timeout_seconds
    if workload.kind in (CallKind.ECHO, CallKind.ECHO_PAIR):
        # Registered like the generated ledger stubs' methods (grpc >= 1.63).
        method = channel.unary_unary(  # type: ignore[call-arg]
            echo.FULL_METHOD, None, None, _registered_method=True
        )
        payload = reserve_request("lane", "r-000000-000-000000000").SerializeToString()
        repeat = 2 if workload.kind is CallKind.ECHO_PAIR else 1

        def call_echo(_lane: str, _reservation_id: str) -> tuple[int, bool]:
            started = time.perf_counter_ns()
            method(payload, timeout=timeout)
            first = time.perf_counter_ns() - started
            for _ in range(repeat - 1):
                method(payload, timeout=timeout)
            return first, False

        return call_echo
    stub = pb_grpc.LedgerStub(channel)
    settle = workload.kind is CallKind.RESERVE_SETTLE
    metadata = {lane: grant_metadata(grant) for lane, grant in workload.grants}

    def call_ledger(lane: str, reservation_id: str) -> tuple[int, bool]:
        granted = metadata.get(lane)
        started = time.perf_counter_ns()
        reply = stub.Reserve(
            reserve_request(lane, reservation_id), timeout=timeout, metadata=granted
        )
        first = time.perf_counter_ns() - started
        admitted = reply.decision == pb.ADMITTED
        if settle and admitted:
            stub.Settle(settle_request(lane, reservation_id), timeout=timeout, metadata=granted)
        return first, not admitted

    return call_ledger


def grant_metadata(grant: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries `grant` (api/auth.py)."""
    return (("authorization", f"Bearer {grant}"),)


def reserve_request(lane: str, reservation_id: str) -> pb.ReserveRequest:
    return pb.ReserveRequest(
        lane=lane,
        reservation_id=reservation_id,
        model=MODEL,
        request_bytes=REQUEST_BYTES,
        max_output_tokens=MAX_OUTPUT_TOKENS,
    )


def settle_request(lane: str, reservation_id: str) -> pb.SettleRequest:
    return pb.SettleRequest(
        lane=lane,
        reservation_id=reservation_id,
        outcome=pb.SUCCEEDED,
        input_tokens=INPUT_TOKENS,
        output_tokens=OUTPUT_TOKENS,
        http_status=HTTP_STATUS,
    )


class _Thread:
    """One call in flight: issues calls back to back until the phase ends."""

    def __init__(self, workload: Workload, schedule: Schedule, index: int, worker: int) -> None:
        self.workload = workload
        self.schedule = schedule
        self.lane = workload.lanes[index % len(workload.lanes)] if workload.lanes else ""
        self.id_base = f"{workload.id_prefix}-{worker}-{index}"
        self.report = WorkerReport(array.array("q"), array.array("q"), {})
        self.sample_budget = MAX_SAMPLES_PER_PROCESS // workload.in_flight

    def run(self, call: CallFn) -> None:
        schedule, report = self.schedule, self.report
        quota = self.workload.calls_per_thread
        measured = number = 0
        past_end = False
        _sleep_until(schedule.start_ns)
        # A thread that has counted no call by the end makes one more and
        # counts it, even past the end: on a loaded machine one call may
        # outlast a short window (--quick's half second), and a phase needs a figure.
        while not past_end:
            began = time.monotonic_ns()
            past_end = began >= schedule.measure_end_ns
            if (past_end and measured) or (quota and measured >= quota):
                break
            number += 1
            started = time.perf_counter_ns()
            try:
                first_ns, denied = call(self.lane, f"{self.id_base}-{number}")
            except grpc.RpcError as error:
                # Counted like calls: only those begun after the warm-up.
                if began >= schedule.warmup_end_ns:
                    code = error.code() if isinstance(error, grpc.Call) else None
                    name = code.name if code is not None else "UNKNOWN"
                    report.errors[name] = report.errors.get(name, 0) + 1
                time.sleep(ERROR_PAUSE_SECONDS)
                continue
            latency = time.perf_counter_ns() - started
            ended = time.monotonic_ns()
            if began < schedule.warmup_end_ns:
                report.warmup_calls += 1
                continue
            if ended > schedule.measure_end_ns and measured:
                break
            measured += 1
            report.denied += int(denied)
            report.last_end_ns = ended
            if len(report.latencies_ns) >= self.sample_budget:
                report.dropped_samples += 1
                continue
            report.latencies_ns.append(latency)
            report.first_rpc_ns.append(first_ns)
        report.exhausted = bool(quota) and measured >= quota


def _run_workload(workload: Workload, worker: int, connection: Connection) -> WorkerReport:
    target = workload.targets[worker % len(workload.targets)]
    with grpc.insecure_channel(target) as channel:
        grpc.channel_ready_future(channel).result(timeout=CONNECT_TIMEOUT_SECONDS)
        call = _call_function(workload, channel)
        connection.send(("ready",))
        if not connection.poll(CONNECT_TIMEOUT_SECONDS):
            raise TimeoutError("no schedule from the parent")
        schedule: Schedule = connection.recv()
        threads = [
            _Thread(workload, schedule, worker * workload.in_flight + t, worker)
            for t in range(workload.in_flight)
        ]
        runners = [
            threading.Thread(target=thread.run, args=(call,), daemon=True) for thread in threads
        ]
        for runner in runners:
            runner.start()
        deadline = schedule.measure_end_ns / 1e9 + workload.call_timeout_seconds + 5
        for runner in runners:
            runner.join(timeout=max(0.0, deadline - time.monotonic()))
        if any(runner.is_alive() for runner in runners):
            raise TimeoutError("a call outlived its deadline")
    return _combined([thread.report for thread in threads])


def _combined(reports: Sequence[WorkerReport]) -> WorkerReport:
    combined = WorkerReport(array.array("q"), array.array("q"), {})
    for report in reports:
        combined.latencies_ns.extend(report.latencies_ns)
        combined.first_rpc_ns.extend(report.first_rpc_ns)
        for name, count in report.errors.items():
            combined.errors[name] = combined.errors.get(name, 0) + count
        combined.denied += report.denied
        combined.warmup_calls += report.warmup_calls
        combined.dropped_samples += report.dropped_samples
        combined.last_end_ns = max(combined.last_end_ns, report.last_end_ns)
    combined.exhausted = all(report.exhausted for report in reports)
    return combined


def worker_main(connection: Connection) -> None:
    """A worker process: runs one workload per ("run", workload, index) message."""
    while True:
        message = connection.recv()
        if message[0] == "stop":
            return
        _, workload, worker = message
        try:
            connection.send(("done", _run_workload(workload, worker, connection)))
        except Exception as error:
            connection.send(("failed", f"{type(error).__name__}: {error}"))


# The parent's side -------------------------------------------------------------------


class LoadGeneratorError(Exception):
    pass


def _watch(pids: Sequence[int], schedule: Schedule) -> usage.Usage | None:
    """The processes' usage from the end of the warm-up to the end of the
    measurement (None when one could not be read)."""
    _sleep_until(schedule.warmup_end_ns)
    before = usage.read(pids)
    _sleep_until(schedule.measure_end_ns)
    after = usage.read(pids)
    return None if before is None or after is None else after - before


def _sleep_until(instant_ns: int) -> None:
    time.sleep(max(0, instant_ns - time.monotonic_ns()) / 1e9)


class LoadGenerator:
    """A fixed pool of worker processes; use it as a context manager."""

    def __init__(self, processes: int) -> None:
        if not 1 <= processes <= MAX_PROCESSES:
            raise ValueError(f"processes must be between 1 and {MAX_PROCESSES}")
        self._processes = processes
        self._workers: list[tuple[BaseProcess, Connection]] = []
        self._spawn()

    def _spawn(self) -> None:
        context = multiprocessing.get_context("spawn")
        for index in range(self._processes):
            parent, child = context.Pipe()
            process = context.Process(
                target=worker_main, args=(child,), name=f"load-{index}", daemon=True
            )
            process.start()
            child.close()
            self._workers.append((process, parent))

    def __enter__(self) -> LoadGenerator:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        return [process.pid or 0 for process, _ in self._workers]

    def run(self, workload: Workload, watch: Sequence[int] = ()) -> LoadResult:
        """Runs one phase; `watch`: the pids of the servers whose usage to read."""
        return merge_rounds([self.run_round(workload, watch)])

    def run_round(self, workload: Workload, watch: Sequence[int] = ()) -> Round:
        """Runs one phase, or one round of one (see merge_rounds). After a failure
        the workers are replaced, so that no message of the failed phase is
        read by the next one."""
        workload.validate()
        if workload.processes > len(self._workers):
            raise ValueError(f"only {len(self._workers)} load processes were started")
        try:
            return self._run(workload, watch)
        except BaseException:
            self.close()
            self._spawn()
            raise

    def _run(self, workload: Workload, watch: Sequence[int]) -> Round:
        workers = self._workers[: workload.processes]
        for index, (_, connection) in enumerate(workers):
            connection.send(("run", workload, index))
        for _, connection in workers:
            self._expect(connection, "ready", CONNECT_TIMEOUT_SECONDS * 2)
        start_ns = time.monotonic_ns() + START_DELAY_NANOS
        warmup_end_ns = start_ns + int(workload.warmup_seconds * 1e9)
        schedule = Schedule(
            start_ns, warmup_end_ns, warmup_end_ns + int(workload.measure_seconds * 1e9)
        )
        for _, connection in workers:
            connection.send(schedule)
        server_usage = _watch(watch, schedule) if watch else None
        wait_seconds = (schedule.measure_end_ns - time.monotonic_ns()) / 1e9
        wait_seconds += workload.call_timeout_seconds + REPORT_SLACK_SECONDS
        reports = [self._expect(connection, "done", wait_seconds) for _, connection in workers]
        return Round(workload, schedule, tuple(reports), server_usage)

    def _expect(self, connection: Connection, kind: str, timeout_seconds: float) -> Any:
        if not connection.poll(max(0.0, timeout_seconds)):
            raise LoadGeneratorError(f"a load worker sent no {kind!r} within {timeout_seconds} s")
        message = connection.recv()
        if message[0] == "failed":
            raise LoadGeneratorError(f"a load worker failed: {message[1]}")
        if message[0] != kind:
            raise LoadGeneratorError(f"a load worker sent {message[0]!r}, not {kind!r}")
        return message[1] if len(message) > 1 else None

    def close(self, timeout_seconds: float = 5.0) -> None:
        for process, connection in self._workers:
            if process.is_alive():
                with contextlib.suppress(OSError):
                    connection.send(("stop",))
        for process, connection in self._workers:
            process.join(timeout_seconds)
            if process.is_alive():
                process.kill()
                process.join(timeout_seconds)
            connection.close()
        self._workers = []
