"""`ledger migrate` run three times at once on a fresh SQLite file. Each one's
migration began a deferred transaction: it read the revision, then met
another's write at its first step, and SQLite answered "database is locked"
at once (a read transaction cannot become a writer past another's commit).
Measured: 9 of 18 processes in 6 rounds exited 2. Each now begins IMMEDIATE,
waiting its turn for the write lock, boundedly."""

from __future__ import annotations

import pathlib
import sqlite3
import subprocess
import sys
import time

import pytest

from ledger_service import server
from ledger_service.domain.errors import StoreUnavailable
from ledger_service.storage import database, migrate, translate
from ledger_service.storage.sql import SqlStore
from tests.test_cli_first_use import head_revision

# Each process imports the CLI, then waits for the start file, so that the
# three migrations start together rather than an import's time apart.
_STARTER = """
import os, pathlib, sys, time
from ledger_service.cli import main
pathlib.Path(sys.argv[3]).touch()
while not os.path.exists(sys.argv[1]):
    time.sleep(0.001)
sys.exit(main(["migrate", "--database-url", sys.argv[2]]))
"""


def test_three_migrations_at_once_on_a_fresh_file_take_turns(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "ledger.db"
    url = f"sqlite:///{path}"
    go = tmp_path / "go"
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _STARTER, str(go), url, str(tmp_path / f"ready-{number}")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for number in range(3)
    ]
    while len(list(tmp_path.glob("ready-*"))) < 3:
        assert all(process.poll() is None for process in processes), "a process ended early"
        time.sleep(0.01)
    go.touch()
    results = [(process.wait(120), process.communicate()[1]) for process in processes]
    assert [code for code, _ in results] == [0, 0, 0], results
    head = head_revision(url)
    said = sorted(err.split(" in ")[0] for _, err in results)
    assert (
        said
        == [f"created the schema at revision {head}"]
        + [f"the schema is already at revision {head} (up to date)"] * 2
    ), said
    with sqlite3.connect(path) as connection:
        found = connection.execute("SELECT version_num FROM alembic_version").fetchall()
    assert found == [(head,)]


def test_a_write_lock_held_past_the_bound_is_said_in_words(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sqlite3 shell holding the write lock: the migration gives up at the
    bound, naming what may hold it and what to do, not "database is locked"."""
    path = tmp_path / "ledger.db"
    engine = database.create(f"sqlite:///{path}", database.EngineLimits(sqlite_busy_timeout_ms=50))
    monkeypatch.setattr(migrate, "SQLITE_MIGRATION_WAIT_SECONDS", 0.2)
    shell = sqlite3.connect(path, isolation_level=None)
    try:
        shell.execute("BEGIN IMMEDIATE")
        with pytest.raises(migrate.MigrationWaitExceeded) as caught:
            migrate.upgrade(engine)
        assert "write lock for longer than 0.2 s" in str(caught.value)
        assert "run `ledger migrate` again" in str(caught.value)
        shell.execute("ROLLBACK")
        assert migrate.upgrade(engine).after == head_revision(f"sqlite:///{path}")
    finally:
        shell.close()
        engine.dispose()


def test_a_server_starting_behind_a_held_write_lock_is_told_an_outage(
    tmp_path: pathlib.Path,
) -> None:
    """A server does not wait the migration's bound at start: past one busy
    timeout it comes up NOT_SERVING and tries again (StoreUnavailable), as
    it did before migrations took turns."""
    path = tmp_path / "ledger.db"
    store = SqlStore(
        database.create(f"sqlite:///{path}", database.EngineLimits(sqlite_busy_timeout_ms=50))
    )
    shell = sqlite3.connect(path, isolation_level=None)
    try:
        shell.execute("BEGIN IMMEDIATE")
        with pytest.raises(StoreUnavailable) as caught:
            server._upgrade(store)
        assert translate.lock_wait_gave_up(caught.value)
    finally:
        shell.close()
        store.close()


def test_ctrl_c_while_migrate_waits_its_turn_is_one_line(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C during the wait for the write lock (up to 300 s, beside a
    server): one line and exit 130, as the recovery commands, not a traceback
    from inside SQLAlchemy's begin."""
    from ledger_service import cli

    def interrupted(*_: object, **__: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(migrate, "_begin_immediate", interrupted)
    code = cli.main(["migrate", "--database-url", f"sqlite:///{tmp_path / 'ledger.db'}"])
    said = capsys.readouterr().err
    assert code == 130, said
    assert "Traceback" not in said and "KeyboardInterrupt" not in said, said
    [line] = said.splitlines()
    assert line.startswith("ledger migrate: interrupted"), line
