"""What an operator ran into starting `ledger serve` by hand: a data directory
that is a file, a stdout nobody reads (`ledger serve | true`), a misspelled
LEDGER_* variable, and LEDGER_DATA_DIR set empty or to a path with `~`.

Each starts a real `ledger serve` process (tests/serving.py's environment),
since only a real process has a real stdout and a real exit code.
"""

from __future__ import annotations

import pathlib
import signal
import socket
import subprocess
import sys

import pytest

from ledger_service import settings as settings_module
from ledger_service.cli import connection
from ledger_service.settings import Settings
from tests.serving import STOP_SECONDS, clean_env, spawn, stop

LEDGER = pathlib.Path(sys.executable).with_name("ledger")
COMMAND_SECONDS = 60


def _serve_refused(*arguments: str) -> subprocess.CompletedProcess[str]:
    """`ledger serve` on a free port with `arguments`, for a start it refuses."""
    return _serve_on("127.0.0.1:0", *arguments)


def _serve_on(address: str, *arguments: str) -> subprocess.CompletedProcess[str]:
    """`ledger serve` on `address` with `arguments`, for a start it refuses."""
    return subprocess.run(
        [str(LEDGER), "serve", "--listen", address, *arguments],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=COMMAND_SECONDS,
        check=False,
    )


def test_a_data_dir_that_is_a_file_is_one_line_and_exit_2(tmp_path: pathlib.Path) -> None:
    # It ended in a traceback from the keyring's temporary file (NotADirectoryError), exit 1,
    # which the README keeps for "cannot listen".
    not_a_directory = tmp_path / "data"
    not_a_directory.write_text("")
    done = _serve_refused("--data-dir", str(not_a_directory))
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith("ledger serve: ") and str(not_a_directory) in last, done.stderr
    # One line, as the README says, and nothing before it: the store was opened
    # first, failed on the same path, and logged that the server would "try again
    # every 5 s" before the keyring refused the start (and the exit then waited up
    # to seconds for the threads that retry was to run on).
    assert done.stderr.strip().splitlines() == [last], done.stderr


def test_a_stdout_nobody_reads_does_not_stop_the_server(tmp_path: pathlib.Path) -> None:
    # `ledger serve | true`, or a supervisor that read the first line and left: the
    # listening line met a closed pipe, and the server exited 1 at once, saying nothing,
    # without its clean stop.
    process = subprocess.Popen(
        [str(LEDGER), "serve", "--data-dir", str(tmp_path), "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=clean_env(),
        text=True,
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # before the server can print its line
    try:
        lines = []
        for line in process.stderr:
            lines.append(line)
            if "cannot write" in line and "stdout" in line:
                break
        assert lines and "cannot write" in lines[-1], "".join(lines)
        address = next(
            line.split("listening on ", 1)[1].split(" ", 1)[0]
            for line in lines
            if "listening on " in line
        )
        listed = subprocess.run(
            [str(LEDGER), "lane", "list", "--server", address],
            capture_output=True,
            text=True,
            env=clean_env(LEDGER_DATA_DIR=str(tmp_path)),
            timeout=COMMAND_SECONDS,
            check=False,
        )
        assert listed.returncode == 0, listed
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=STOP_SECONDS) == 0, process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()


def test_a_misspelled_ledger_variable_is_named_with_what_was_meant() -> None:
    said = settings_module.unread_variables(
        {
            "LEDGER_MAX_WORKER": "4",
            "LEDGER_DATADIR": "/srv/ledger",
            "LEDGER_AUTH_ENABLED": "0",
            "LEDGER_MAX_WORKERS": "4",
            "LEDGER_SERVER": "127.0.0.1:1",
            "LEDGER_GRANT": "x",
            "LEDGER_TLS_CA": "ca.pem",
            "PATH": "/bin",
        }
    )
    assert said == [
        "LEDGER_AUTH_ENABLED is not a setting the ledger reads: ignored",
        "LEDGER_DATADIR is not a setting the ledger reads (did you mean LEDGER_DATA_DIR?): ignored",
        "LEDGER_MAX_WORKER is not a setting the ledger reads (did you mean "
        "LEDGER_MAX_WORKERS?): ignored",
    ]


def test_serve_warns_of_a_misspelled_variable(tmp_path: pathlib.Path) -> None:
    process = subprocess.Popen(
        [str(LEDGER), "serve", "--data-dir", str(tmp_path), "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=clean_env(LEDGER_MAX_WORKER="4"),
        text=True,
    )
    assert process.stdout is not None and process.stderr is not None
    try:
        assert process.stdout.readline().startswith("ledger listening on ")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=STOP_SECONDS) == 0
        said = process.stderr.read()
        assert "WARNING" in said and "did you mean LEDGER_MAX_WORKERS?" in said, said
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
        process.stderr.close()


def test_an_empty_data_dir_variable_is_the_default_for_server_and_commands(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The server took LEDGER_DATA_DIR= as the current directory, while the commands
    # looked for admin.grant in ./data.
    monkeypatch.setenv("LEDGER_DATA_DIR", "")
    monkeypatch.delenv("LEDGER_DATABASE_URL", raising=False)
    settings = Settings.from_environment()
    assert settings.data_dir == pathlib.Path("data")
    assert settings.database_url == "sqlite:///data/ledger.db"
    assert connection.admin_grant_path() == pathlib.Path("data") / "admin.grant"


def test_a_data_dir_with_a_tilde_is_the_home_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    # LEDGER_DATA_DIR=~/ledger (a systemd unit, a quoted value) made a directory
    # named '~' in the current one; `rm -rf ~` is what an operator types next.
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("LEDGER_DATA_DIR", "~/ledger")
    monkeypatch.delenv("LEDGER_DATABASE_URL", raising=False)
    settings = Settings.from_environment()
    assert settings.data_dir == tmp_path / "ledger"
    assert settings.database_url == f"sqlite:///{tmp_path / 'ledger' / 'ledger.db'}"
    assert connection.admin_grant_path() == tmp_path / "ledger" / "admin.grant"
    flagged = Settings.from_environment(data_dir=pathlib.Path("~/other"))
    assert flagged.data_dir == tmp_path / "other"


def test_serve_refuses_fewer_than_one_viable_source_as_recover_does(
    tmp_path: pathlib.Path,
) -> None:
    # `ledger recover --min-viable-sources 0` was refused while `ledger serve
    # --recovery-min-viable-sources 0` started: one rule (RecoveryPolicy.validate) for both.
    done = _serve_refused(
        "--data-dir", str(tmp_path / "data"), "--recovery-min-viable-sources", "0"
    )
    assert done.returncode == 2, done
    assert done.stderr.strip().splitlines() == [
        "ledger serve: the recovery policy (--recovery-* or LEDGER_RECOVERY_*): "
        "at least one viable source is needed"
    ], done.stderr
    assert not (tmp_path / "data").exists()


def test_a_start_that_cannot_listen_leaves_the_admin_grant_as_it_was(
    tmp_path: pathlib.Path,
) -> None:
    # `make run` a second time, the port taken by the first: the start failed, yet it
    # had already written a grant of its own to data/admin.grant, so the file no longer
    # held the grant of the server that answers on that port.
    process, address = spawn(tmp_path)
    try:
        grant_file = tmp_path / "admin.grant"
        before = grant_file.read_bytes()
        done = _serve_on(address, "--data-dir", str(tmp_path))
        assert done.returncode == 1, done
        assert "Traceback" not in done.stderr, done.stderr
        assert f"cannot listen on {address}" in done.stderr, done.stderr
        assert grant_file.read_bytes() == before
    finally:
        stop(process)


def test_a_start_that_cannot_listen_makes_no_ledger_and_says_so_once(
    tmp_path: pathlib.Path,
) -> None:
    # A newcomer's `make run` on a port another program holds: the start failed, but
    # it had first made a keyring and a migrated database in a fresh data directory
    # (and would migrate an existing one), then said why twice, after grpcio's own line.
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        address = f"127.0.0.1:{holder.getsockname()[1]}"
        data_dir = tmp_path / "data"
        done = _serve_on(address, "--data-dir", str(data_dir))
    assert done.returncode == 1, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"ledger: cannot listen on {address}: the port is taken"), lines
    assert not data_dir.exists()


def test_ctrl_c_while_serve_starts_is_one_line_and_exit_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    # Ctrl-C before the server's own signal handlers are in place (a slow start on a
    # busy machine: importing grpcio and psycopg alone took over 6 s) ended in a
    # KeyboardInterrupt traceback, where every other command says one line, exit 130.
    from ledger_service import cli, server

    def interrupted(*_arguments: object, **_options: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(server, "serve", interrupted)
    try:
        code = cli.main(["serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path)])
    except KeyboardInterrupt:  # not pytest's own Ctrl-C: the run goes on
        pytest.fail("the KeyboardInterrupt left `ledger serve` (a traceback)")
    assert code == 130
    assert (
        capsys.readouterr().err == "ledger serve: interrupted while starting; it served nothing\n"
    )
