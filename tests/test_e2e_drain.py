"""SIGTERM under load, as an operator sends it: `ledger serve` on SQLite with 16
clients reserving back to back. No call sent before the signal is cut off
(CANCELLED): each is answered, by its move or by UNAVAILABLE / SHUTTING_DOWN;
every move answered OK is in the log after a restart; and the process exits
once drained, well inside its grace period, with status 0. A stop that cuts
off a call (at the grace limit, or at a second signal) exits with
EXIT_CUT_OFF, so that a supervisor can tell it from a clean one."""

from __future__ import annotations

import collections
import contextlib
import pathlib
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.server import EXIT_CUT_OFF
from ledger_service.storage import database
from tests import serving

CLIENTS = 16
# Moves answered OK before the signal: the server was under load when it came.
LOADED_ANSWERS = 100
GRACE_SECONDS = 20.0


class Client(threading.Thread):
    def __init__(self, address: str, index: int, pause_seconds: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.address, self.index = address, index
        # How long the client waits after a refusal before its next call.
        self.pause_seconds = pause_seconds
        self.stop = threading.Event()
        self.signalled_at: float | None = None
        self.answered: list[str] = []  # reservation ids answered OK
        self.outcomes: collections.Counter[str] = collections.Counter()

    def run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = pb_grpc.LedgerStub(channel)
            number = 0
            while not self.stop.is_set():
                number += 1
                rid = f"c{self.index}-{number}"
                sent = time.monotonic()
                when = (
                    "before" if self.signalled_at is None or sent < self.signalled_at else "after"
                )
                request = pb.ReserveRequest(
                    lane="recall", reservation_id=rid, model="jev", request_bytes=1000,
                    max_output_tokens=10,
                )  # fmt: skip
                try:
                    stub.Reserve(request, timeout=10)
                except grpc.RpcError as error:
                    assert isinstance(error, grpc.Call)
                    reason = dict(error.trailing_metadata() or ()).get("ledger-reason", "")
                    self.outcomes[f"{error.code().name} {reason} {when}".strip()] += 1
                    time.sleep(self.pause_seconds)
                    continue
                self.answered.append(rid)
                self.outcomes[f"OK {when}"] += 1


def _until(condition: Callable[[], bool], seconds: float = 60.0) -> None:
    give_up = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < give_up, "the clients never got there"
        time.sleep(0.01)


def put_lane(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        pb_grpc.LaneAdminStub(channel).PutLane(
            pb.PutLaneRequest(
                lane=pb.Lane(
                    lane="recall",
                    limit_nanos=10**15,
                    prices={"jev": pb.ModelPrice(input_nanos_per_million_tokens=1)},
                )
            ),
            timeout=10,
        )


def _stopped_under_load(
    tmp_path: pathlib.Path, pause_seconds: float
) -> tuple[list[Client], collections.Counter[str], float]:
    """SIGTERM to a server under CLIENTS clients; their outcomes, and how long
    the process took to exit."""
    env = serving.clean_env(LEDGER_GRACE_PERIOD_SECONDS=str(GRACE_SECONDS))
    process, address = serving.spawn(tmp_path, "--insecure-no-auth", env=env)
    put_lane(address)
    clients = [Client(address, index, pause_seconds) for index in range(CLIENTS)]
    for client in clients:
        client.start()
    # Until the clients have had LOADED_ANSWERS (a fixed 2 s of load may give
    # fewer on a busy machine), then until each has had an answer to a call
    # sent after the signal: refused, or met by the process's exit.
    _until(lambda: sum(len(client.answered) for client in clients) > LOADED_ANSWERS)
    signalled = time.monotonic()
    for client in clients:
        client.signalled_at = signalled
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=GRACE_SECONDS + 10) == 0
    exited_after = time.monotonic() - signalled
    _until(lambda: all(any(key.endswith(" after") for key in list(c.outcomes)) for c in clients))
    for client in clients:
        client.stop.set()
    for client in clients:
        client.join(timeout=15)
    serving.stop(process)
    outcomes: collections.Counter[str] = collections.Counter()
    for client in clients:
        outcomes.update(client.outcomes)
    return clients, outcomes, exited_after


def test_a_sigterm_under_load_answers_every_call_it_had(tmp_path: pathlib.Path) -> None:
    clients, outcomes, exited_after = _stopped_under_load(tmp_path, pause_seconds=0.02)
    assert outcomes["OK before"] > LOADED_ANSWERS, outcomes
    before = {key: count for key, count in outcomes.items() if key.endswith(" before")}
    assert set(before) <= {"OK before", "UNAVAILABLE SHUTTING_DOWN before"}, outcomes
    # Drained, not waited out: the grace period is 20 s.
    assert exited_after < GRACE_SECONDS / 2, (exited_after, outcomes)
    engine = database.create(f"sqlite:///{tmp_path}/ledger.db", database.EngineLimits())
    with engine.connect() as connection:
        booked = {
            row[0]
            for row in connection.exec_driver_sql(
                "SELECT reservation_id FROM events WHERE kind = 'reserved'"
            )
        }
    engine.dispose()
    answered = {rid for client in clients for rid in client.answered}
    assert answered <= booked


def test_calls_sent_again_at_once_during_a_stop_are_refused_not_cancelled(
    tmp_path: pathlib.Path,
) -> None:
    """Clients that send again the instant they are refused keep calls arriving
    until grpcio stops; none of them may be cut off by the stop (CANCELLED):
    each is UNAVAILABLE, safe to send again."""
    _, outcomes, _ = _stopped_under_load(tmp_path, pause_seconds=0.0)
    assert outcomes["OK before"] > LOADED_ANSWERS, outcomes
    assert {key.split()[0] for key in outcomes} <= {"OK", "UNAVAILABLE"}, outcomes


def test_a_sigterm_sent_to_a_stopped_server_then_sigcont_still_drains(
    tmp_path: pathlib.Path,
) -> None:
    """systemd stops a frozen service with SIGTERM then SIGCONT; the kernel may
    hand that signal to any of the server's threads."""
    process, address = serving.spawn(tmp_path, "--insecure-no-auth", env=serving.clean_env())
    try:
        put_lane(address)  # the server's worker threads exist once it has served
        time.sleep(0.5)
        process.send_signal(signal.SIGSTOP)
        _until(lambda: _state(process.pid) == "T")  # the SIGTERM meets a stopped process
        process.send_signal(signal.SIGTERM)
        process.send_signal(signal.SIGCONT)
        assert process.wait(timeout=60) == 0
    finally:
        serving.stop(process)


def _state(pid: int) -> str:
    """The process's state letter from /proc (T: stopped by a signal)."""
    stat = pathlib.Path(f"/proc/{pid}/stat").read_text(encoding="ascii")
    return stat.rpartition(")")[2].split()[0]


def _stuck_reserve(address: str, timeout: float, outcome: list[str]) -> threading.Thread:
    """A Reserve sent on a thread of its own (it waits for the write lock the
    test holds); its status's name goes to `outcome` when it ends."""

    def reserve() -> None:
        with grpc.insecure_channel(address) as channel:
            request = pb.ReserveRequest(
                lane="recall", reservation_id="stuck", model="jev", request_bytes=1000,
                max_output_tokens=10,
            )  # fmt: skip
            try:
                pb_grpc.LedgerStub(channel).Reserve(request, timeout=timeout)
                outcome.append("OK")
            except grpc.RpcError as error:
                assert isinstance(error, grpc.Call)
                outcome.append(error.code().name)

    caller = threading.Thread(target=reserve, daemon=True)
    caller.start()
    return caller


def test_a_stop_exits_at_its_grace_limit_while_a_move_waits_for_the_database(
    tmp_path: pathlib.Path,
) -> None:
    """A move stuck behind another process's write lock is cut off at the grace
    limit, and the process exits then, not when the move gives up, with
    EXIT_CUT_OFF: the stop was not clean. The move's deadline is far past the
    wait for the exit, so only the grace limit can end the stop in time."""
    grace_seconds, deadline_seconds = 1.0, 600.0
    env = serving.clean_env(
        LEDGER_GRACE_PERIOD_SECONDS=str(grace_seconds),
        LEDGER_REQUEST_DEADLINE_SECONDS=str(deadline_seconds),
    )
    with watched(tmp_path, env) as (process, address, stderr):
        blocker = sqlite3.connect(tmp_path / "ledger.db", isolation_level=None)
        try:
            put_lane(address)
            blocker.execute("BEGIN IMMEDIATE")  # holds SQLite's write lock
            outcome: list[str] = []
            caller = _stuck_reserve(address, deadline_seconds + 5, outcome)
            wait_for_the_lock(stderr)
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=60) == EXIT_CUT_OFF
            assert time.monotonic() - signalled >= grace_seconds  # the drain waited for it
            caller.join(timeout=60)
            assert outcome and outcome[0] in {"UNAVAILABLE", "CANCELLED"}, outcome
        finally:
            blocker.close()


class Stderr(threading.Thread):
    """Reads a process's stderr to its end; `seen(text)` waits for a line with it."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        super().__init__(daemon=True)
        assert process.stderr is not None
        self.stream = process.stderr
        self.lines: list[str] = []
        self.changed = threading.Condition()

    def run(self) -> None:
        for line in self.stream:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()

    def close(self) -> None:
        """Once the process has exited: the rest read, the pipe closed."""
        self.join(timeout=15)
        self.stream.close()

    def seen(self, text: str, timeout: float = 15.0) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: any(text in line for line in self.lines), timeout)


@contextlib.contextmanager
def watched(
    tmp_path: pathlib.Path, env: dict[str, str]
) -> Iterator[tuple[subprocess.Popen[str], str, Stderr]]:
    """`ledger serve` (no auth) with its stderr read as it comes; stopped at the end."""
    process, address = serving.spawn(
        tmp_path, "--insecure-no-auth", env=env, stderr=subprocess.PIPE
    )
    stderr = Stderr(process)
    stderr.start()
    try:
        yield process, address, stderr
    finally:
        serving.stop(process)
        stderr.close()


def wait_for_the_lock(stderr: Stderr) -> None:
    """Until the server says a move waits for the write lock the test holds:
    the Reserve is in a handler, which a stop then waits for (the drain)."""
    assert stderr.seen(f"{database.LOCK_HELD} on "), stderr.lines


def wait_until_held(stderr: Stderr, method: str) -> None:
    """Until the server says the drain holds a late call of `method`: it
    reached a handler while the server drained, and waits there for its refusal."""
    said = f"holding a call that arrived while draining: /ledger.v1.Ledger/{method};"
    assert stderr.seen(said, timeout=60), stderr.lines


def answer_of(call: Callable[[pb_grpc.LedgerStub], object], address: str) -> str:
    """ "OK", or the refusal's status and ledger-reason."""
    with grpc.insecure_channel(address) as channel:
        try:
            call(pb_grpc.LedgerStub(channel))
            return "OK"
        except grpc.RpcError as error:
            assert isinstance(error, grpc.Call)
            reason = dict(error.trailing_metadata() or ()).get("ledger-reason", "")
            return f"{error.code().name} {reason}"


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_ends_the_drain_at_once(
    tmp_path: pathlib.Path, second: signal.Signals
) -> None:
    """An operator who signals again does not wait out the grace period: the
    call still running is cut off at once (UNAVAILABLE or CANCELLED, as at the
    grace limit) and the process exits with EXIT_CUT_OFF. The grace period and
    the move's deadline are far longer than the waits here, so only the second
    signal can end the stop in time."""
    grace_seconds, deadline_seconds = 600.0, 600.0
    env = serving.clean_env(
        LEDGER_GRACE_PERIOD_SECONDS=str(grace_seconds),
        LEDGER_REQUEST_DEADLINE_SECONDS=str(deadline_seconds),
    )
    with watched(tmp_path, env) as (process, address, stderr):
        blocker = sqlite3.connect(tmp_path / "ledger.db", isolation_level=None)
        outcome: list[str] = []
        try:
            put_lane(address)
            blocker.execute("BEGIN IMMEDIATE")  # holds SQLite's write lock
            caller = _stuck_reserve(address, deadline_seconds, outcome)
            wait_for_the_lock(stderr)
            process.send_signal(signal.SIGTERM)
            # Handled before the second is sent: two pending signals may merge into one.
            assert stderr.seen("received SIGTERM: draining"), stderr.lines
            process.send_signal(second)
            assert process.wait(timeout=60) == EXIT_CUT_OFF, stderr.lines
            caller.join(timeout=15)
            assert outcome and outcome[0] in {"UNAVAILABLE", "CANCELLED"}, outcome
            stderr.join(timeout=15)
            assert any(f"received {second.name} again" in line for line in stderr.lines), (
                stderr.lines
            )
        finally:
            blocker.close()


def test_a_second_signal_after_a_clean_drain_still_exits_0(tmp_path: pathlib.Path) -> None:
    """The exit status says whether work was cut off, not how many signals came."""
    with watched(tmp_path, serving.clean_env()) as (process, address, stderr):
        put_lane(address)
        process.send_signal(signal.SIGTERM)
        assert stderr.seen("received SIGTERM: draining"), stderr.lines
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, stderr.lines


def test_a_second_signal_after_the_stop_is_done_still_exits_0(tmp_path: pathlib.Path) -> None:
    """After "stopped" the interpreter still spends a moment exiting, and once
    it began, Python had put SIGTERM back to its default action: a second
    signal then (Ctrl-C twice, a supervisor that signals again) killed the
    process, status -15, though the stop had ended cleanly."""
    with watched(tmp_path, serving.clean_env()) as (process, address, stderr):
        put_lane(address)
        process.send_signal(signal.SIGTERM)
        assert stderr.seen("ledger.server: stopped"), stderr.lines
        # Signals until it exits, so that one lands while the interpreter exits.
        while process.poll() is None:
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=0.01)
        assert process.returncode == 0, stderr.lines


def test_calls_without_a_deadline_that_reach_a_drain_are_refused_as_shutting_down(
    tmp_path: pathlib.Path,
) -> None:
    """A call sent with no deadline (grpcio's default, and a WatchEvents
    stream's usual form) that reaches the server while it drains is held, then
    refused UNAVAILABLE / SHUTTING_DOWN like any other: safe to send again, not
    INTERNAL. grpcio gives such a call a time_remaining() of about 2^63 s,
    which no wait takes."""
    env = serving.clean_env(LEDGER_GRACE_PERIOD_SECONDS="60", LEDGER_REQUEST_DEADLINE_SECONDS="60")
    with watched(tmp_path, env) as (process, address, stderr):
        blocker = sqlite3.connect(tmp_path / "ledger.db", isolation_level=None)
        outcome: list[str] = []
        refusals: list[str] = []

        def refused(call: Callable[[pb_grpc.LedgerStub], object]) -> None:
            refusals.append(answer_of(call, address))

        try:
            put_lane(address)
            blocker.execute("BEGIN IMMEDIATE")  # holds SQLite's write lock: the drain waits
            caller = _stuck_reserve(address, 60, outcome)
            wait_for_the_lock(stderr)
            process.send_signal(signal.SIGTERM)
            assert stderr.seen("received SIGTERM: draining"), stderr.lines
            late = [
                threading.Thread(target=refused, args=(call,), daemon=True)
                for call in (
                    lambda stub: stub.GetBalance(pb.GetBalanceRequest(lane="recall")),
                    lambda stub: list(stub.WatchEvents(pb.WatchEventsRequest(after_seq=0))),
                )
            ]
            for thread in late:
                thread.start()
            for method in ("GetBalance", "WatchEvents"):
                wait_until_held(stderr, method)
            blocker.rollback()
            assert process.wait(timeout=30) == 0, stderr.lines
            caller.join(timeout=15)
            for thread in late:
                thread.join(timeout=15)
            assert outcome == ["OK"]
            assert refusals == ["UNAVAILABLE SHUTTING_DOWN"] * 2, refusals
        finally:
            blocker.close()


def test_a_stream_whose_reader_takes_nothing_at_a_stop_is_cut_off_at_the_grace_limit(
    tmp_path: pathlib.Path,
) -> None:
    """A stream blocked in its send (its client reads one event, then nothing)
    cannot take its SHUTTING_DOWN: the drain waits for it as for any call, and at the grace
    limit it is cut off (UNAVAILABLE, which its client resumes from), logged as
    such, and the process exits EXIT_CUT_OFF, not 0 after "drained"."""
    env = serving.clean_env(LEDGER_GRACE_PERIOD_SECONDS="1")
    with watched(tmp_path, env) as (process, address, stderr):
        # Without BDP probing the client's window stays at 64 KiB: a few large
        # events fill it, and the server's send of the next one blocks.
        stuck = grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)])
        try:
            prices = {
                f"m{index}".ljust(200, "x"): pb.ModelPrice(input_nanos_per_million_tokens=1)
                for index in range(256)
            }
            lanes = 20
            with grpc.insecure_channel(address) as channel:
                admin = pb_grpc.LaneAdminStub(channel)
                for index in range(lanes):  # about 58 KB an event
                    lane = pb.Lane(lane=f"big-{index}", limit_nanos=10**15, prices=prices)
                    admin.PutLane(pb.PutLaneRequest(lane=lane), timeout=10)
            stream = pb_grpc.LedgerStub(stuck).WatchEvents(pb.WatchEventsRequest(after_seq=0))
            # Its first event came: the stream is sending its batch, every event
            # (1.1 MB), which a stop does not interrupt. Its reader takes no
            # other until the process has exited, so the batch cannot finish
            # before the stop begins, nor before the grace limit: no timing
            # decides the order, the full window does.
            next(stream)
            process.send_signal(signal.SIGTERM)
            assert stderr.seen("received SIGTERM: draining"), stderr.lines
            assert process.wait(timeout=30) == EXIT_CUT_OFF, stderr.lines
            stderr.join(timeout=15)
            assert any("1 call cut off" in line for line in stderr.lines), stderr.lines
            received = 1
            with pytest.raises(grpc.RpcError) as ended:
                for _ in stream:
                    received += 1
            assert ended.value.code() is grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
            # Cut off in its batch: the stream never sent the rest, so its send
            # was still blocked when the stop began and at the grace limit.
            assert received < lanes, received
        finally:
            stuck.close()


@pytest.mark.parametrize("ending", ["grace limit", "second signal"])
def test_a_call_held_by_a_drain_that_cuts_work_off_is_still_refused_as_shutting_down(
    tmp_path: pathlib.Path, ending: str
) -> None:
    """A call that reached the server during the drain did no work: when the
    drain ends by cutting off a move still running (at the grace limit or at
    a second signal), the held call is answered UNAVAILABLE / SHUTTING_DOWN,
    safe to send again, not cut off with it (UNAVAILABLE "Cancelling all
    calls", no reason: the client cannot tell it did nothing)."""
    # The late call must reach the server before the grace limit ends the
    # drain: 10 s leaves a loaded machine room (the test goes on once the
    # server says it holds the call, and then waits out the limit).
    grace_seconds = 10.0 if ending == "grace limit" else 600.0
    env = serving.clean_env(
        LEDGER_GRACE_PERIOD_SECONDS=str(grace_seconds), LEDGER_REQUEST_DEADLINE_SECONDS="60"
    )
    with watched(tmp_path, env) as (process, address, stderr):
        blocker = sqlite3.connect(tmp_path / "ledger.db", isolation_level=None)
        outcome: list[str] = []
        late: list[str] = []

        def send_late() -> None:
            balance = pb.GetBalanceRequest(lane="recall")
            late.append(answer_of(lambda stub: stub.GetBalance(balance, timeout=60), address))

        try:
            put_lane(address)
            blocker.execute("BEGIN IMMEDIATE")  # holds SQLite's write lock
            caller = _stuck_reserve(address, 60, outcome)
            wait_for_the_lock(stderr)
            process.send_signal(signal.SIGTERM)
            assert stderr.seen("received SIGTERM: draining"), stderr.lines
            sender = threading.Thread(target=send_late, daemon=True)
            sender.start()
            wait_until_held(stderr, "GetBalance")
            if ending == "second signal":
                process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == EXIT_CUT_OFF, stderr.lines
            sender.join(timeout=15)
            caller.join(timeout=15)
            assert late == ["UNAVAILABLE SHUTTING_DOWN"], late
            assert outcome and outcome[0] in {"UNAVAILABLE", "CANCELLED"}, outcome
        finally:
            blocker.close()


def test_a_hangup_drains_as_a_stop_does(tmp_path: pathlib.Path) -> None:
    """Closing the terminal that runs `make run` sends SIGHUP: it killed the
    server at once (exit 129), no drain and no clean close of the database.
    The server starts with SIGHUP at its default, as from a terminal, even when
    the tests run under nohup (an ignored SIGHUP is inherited, and the server
    then rightly runs on): a handler of the test's own is not."""
    saved = signal.signal(signal.SIGHUP, lambda _signum, _frame: None)
    try:
        with watched(tmp_path, serving.clean_env()) as (process, address, stderr):
            put_lane(address)
            process.send_signal(signal.SIGHUP)
            assert stderr.seen("received SIGHUP: draining"), stderr.lines
            assert process.wait(timeout=60) == 0, stderr.lines
    finally:
        signal.signal(signal.SIGHUP, saved)
