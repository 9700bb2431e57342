"""Ctrl-C during the recovery commands: one line and exit 130, never a
traceback, from the command or from the processes it started; the claim is
given up, so the same command can run again at once (docs/recovery.md)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from ledger_service import cli
from ledger_service.cli import recovery as recovery_cli
from ledger_service.recovery.store import SqlRecoveryStore
from ledger_service.recovery.walk import Helpers
from tests.recovery.conftest import History


def _interrupt_at_first_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(recovery_cli.ProgressPrinter, "__call__", interrupted)


def test_a_rebuild_interrupted_half_way_says_so_and_can_run_again(
    sqlite_history: History, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = ("--database-url", sqlite_history.url)
    with monkeypatch.context() as patch:
        _interrupt_at_first_progress(patch)
        code = cli.main(["rebuild", "--from-scratch", *url])
    said = capsys.readouterr().err
    assert code == 130, said
    assert "Traceback" not in said and "KeyboardInterrupt" not in said, said
    [line] = [text for text in said.splitlines() if text.startswith("ledger rebuild:")]
    assert "interrupted" in line and "ledger rebuild" in line.split(":", 1)[1], line
    # Left rebuilding, its claim given up: the same command runs again at once.
    assert sqlite_history.scalar("SELECT state FROM projection_position") == "rebuilding"
    assert cli.main(["rebuild", *url]) == 0
    assert cli.main(["verify", *url]) == 0


@pytest.mark.parametrize("command", [["verify"], ["recover", "--budget-seconds", "60"]])
def test_the_other_commands_interrupted_say_so_in_one_line(
    sqlite_history: History,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: list[str],
) -> None:
    # A recover with something to rebuild, so that it reports progress.
    sqlite_history.sql("DELETE FROM bookings")
    _interrupt_at_first_progress(monkeypatch)
    code = cli.main([*command, "--database-url", sqlite_history.url])
    said = capsys.readouterr().err
    assert code == 130, said
    assert "Traceback" not in said, said
    assert f"ledger {command[0]}: interrupted" in said, said


def test_a_recover_interrupted_half_way_can_run_again_at_once(
    sqlite_history: History, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its line says to run `ledger recover` again; that used to be refused
    ('a rebuild by ledger recover ... is in progress', exit 2) until the
    interrupted one's claim lapsed (rebuild_lease_seconds)."""
    sqlite_history.sql("DELETE FROM bookings")
    recover = ["recover", "--budget-seconds", "60", "--database-url", sqlite_history.url]
    with monkeypatch.context() as patch:
        _interrupt_at_first_progress(patch)
        assert cli.main(recover) == 130
    assert sqlite_history.scalar("SELECT state FROM projection_position") == "rebuilding"
    capsys.readouterr()
    # Another process: another owner (one's own claim it may take again).
    monkeypatch.setattr(recovery_cli.socket, "gethostname", lambda: "elsewhere")
    assert cli.main(recover) == 0, capsys.readouterr().err
    assert cli.main(["verify", "--database-url", sqlite_history.url]) == 0


def test_the_helper_processes_leave_ctrl_c_to_the_command(
    sqlite_history: History, capfd: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C reaches every process of the terminal's group: the helpers must
    not die of it with a traceback each; the command stops them."""
    store = SqlRecoveryStore(sqlite_history.engine)
    with Helpers(store, 2) as helpers:
        pool = helpers._pool
        assert pool is not None
        # Two sleeps at once: both workers are up (imported, initialised).
        for started in [pool.submit(time.sleep, 0.5) for _ in range(2)]:
            started.result(timeout=60)
        workers = list(pool._processes.values())
        assert len(workers) == 2
        for worker in workers:
            assert worker.pid is not None
            os.kill(worker.pid, signal.SIGINT)
        time.sleep(0.5)
        assert all(worker.is_alive() for worker in workers)
        [walked] = helpers.walk({}, 0, [store.last_seq()])
        assert walked.events == store.count_events_after(0) and not walked.breaks
    assert "KeyboardInterrupt" not in capfd.readouterr().err


def test_recover_on_a_log_that_cannot_be_folded_says_so_without_a_traceback(
    sqlite_history: History, capsys: pytest.CaptureFixture[str]
) -> None:
    """A reserve deleted from the log by hand, its settle left: measuring the
    rebuild's rate on the log's first events fails on it. That was a
    RebuildFailed traceback from `ledger recover` (exit 1), and one in the
    server's log at every retry; then a failure without a manifest (exit 2);
    now the plan refuses the log, naming the event (exit 1)."""
    reserve = sqlite_history.scalar(
        "SELECT MIN(r.seq) FROM events r JOIN events s ON s.lane = r.lane "
        "AND s.reservation_id = r.reservation_id AND s.kind = 'settled' WHERE r.kind = 'reserved'"
    )
    sqlite_history.sql(
        "DROP TRIGGER events_refuse_delete",
        f"DELETE FROM events WHERE seq = {reserve}",
        "DELETE FROM bookings",
    )
    code = cli.main(["recover", "--budget-seconds", "60", "--database-url", sqlite_history.url])
    manifest, said = capsys.readouterr()
    assert code == 1, said
    assert "Traceback" not in said, said
    [line] = [text for text in said.splitlines() if text.startswith("ledger recover:")]
    assert "restore the database" in line and "backup" in line, line
    assert "cannot be applied" in manifest, manifest


# Runs `ledger rebuild` in a process of its own that sends itself SIGTERM at
# its first progress line.
_TERMINATED_REBUILD = """
import os, signal, sys
from ledger_service import cli
from ledger_service.cli import recovery
recovery.ProgressPrinter.__call__ = lambda *_: os.kill(os.getpid(), signal.SIGTERM)
sys.exit(cli.main(["rebuild", "--from-scratch", "--database-url", sys.argv[1]]))
"""


def test_a_rebuild_terminated_half_way_says_so_and_gives_up_its_claim(
    sqlite_history: History,
) -> None:
    """SIGTERM (`timeout`, a service manager) stops a rebuild as Ctrl-C does:
    one line, exit 143, the claim given up. It used to end the process on
    the spot, and the next rebuild was refused until the claim's lease ran out."""
    ended = subprocess.run(
        [sys.executable, "-c", _TERMINATED_REBUILD, sqlite_history.url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ended.returncode == 143, ended
    assert "Traceback" not in ended.stderr, ended.stderr
    [line] = [text for text in ended.stderr.splitlines() if text.startswith("ledger rebuild:")]
    assert "terminated" in line, line
    assert sqlite_history.scalar("SELECT state FROM projection_position") == "rebuilding"
    url = ("--database-url", sqlite_history.url)
    assert cli.main(["rebuild", *url]) == 0
    assert cli.main(["verify", *url]) == 0


@pytest.mark.parametrize(
    "command", [["rebuild"], ["recover", "--budget-seconds", "60"]], ids=lambda argv: argv[0]
)
def test_a_rebuild_refused_for_a_claim_names_its_holder_and_when_it_lapses(
    sqlite_history: History, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    """After a kill -9 of a rebuild, the next one is refused until the dead
    one's claim lapses: the line used to say only 'another process is
    rebuilding the projections' (`ledger recover`: 'is in progress'), leaving
    the operator to guess whether, and for how long."""
    store = SqlRecoveryStore(sqlite_history.engine)
    now_us = int(time.time() * 1_000_000)
    assert store.claim_rebuild("ledger rebuild gone:4242", now_us, 30_000_000, "any")
    assert cli.main([*command, "--database-url", sqlite_history.url]) == 2
    said = capsys.readouterr().err
    assert "a rebuild by ledger rebuild gone:4242 holds the projections" in said, said
    assert re.search(r"its claim lapses in \d+ s \(rebuild_lease_seconds 30\)", said), said


def test_verify_beside_a_rebuild_says_it_may_be_running_and_not_to_recover_yet(
    sqlite_history: History, capsys: pytest.CaptureFixture[str]
) -> None:
    """verify, run on a schedule beside a rebuild, said the rebuild "stopped
    at event N" and that `ledger recover` was next, which is refused (exit 2)
    while the claim holds."""
    store = SqlRecoveryStore(sqlite_history.engine)
    now_us = int(time.time() * 1_000_000)
    assert store.claim_rebuild("ledger rebuild busy:4242", now_us, 30_000_000, "any")
    assert cli.main(["verify", "--database-url", sqlite_history.url]) == 1
    said = capsys.readouterr().out
    first = next(line for line in said.splitlines() if line.startswith("first: "))
    assert "ledger rebuild busy:4242" in first and "it is running, or it stopped" in first, said
    [advice] = [line for line in said.splitlines() if line.startswith("next: ")]
    assert "is running, wait for it" in advice and "claim lapses" in advice, advice


def test_a_broken_pipe_not_of_stdout_is_told_not_taken_for_a_reader_that_left(
    sqlite_history: History, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pipe to a helper process that breaks (the resource tracker's, when
    spawned processes die at birth) used to end `ledger rebuild` with status 1
    and not a word, as a reader leaving `| head -1` does."""

    def broken(*_: object) -> str:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(recovery_cli.ProgressPrinter, "__call__", broken)
    code = cli.main(["rebuild", "--from-scratch", "--database-url", sqlite_history.url])
    said = capsys.readouterr().err
    assert code == 1
    assert "ledger: failed: a pipe to another process broke" in said, said
    assert "Traceback" not in said
