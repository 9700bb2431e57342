"""A damaged SQLite file: the server never serves from it, says so with its
own reason (STORE_DAMAGED, not RECOVERY_REQUIRED), is NOT_SERVING, logs what is
damaged and what to do, and stops its recovery checks instead of retrying them
forever."""

from __future__ import annotations

import logging
import os
import pathlib
import sqlite3
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.server import LedgerServer
from ledger_service.settings import Settings
from tests.recovery.conftest import History
from tests.recovery.test_server import NOT_SERVING, Running

PAGE_BYTES = 4096


def _truncate(path: pathlib.Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _overwrite_header(path: pathlib.Path) -> None:
    with path.open("r+b") as file:
        file.write(b"\xa5" * 100)


def _overwrite_middle_pages(path: pathlib.Path) -> None:
    pages = path.stat().st_size // PAGE_BYTES
    with path.open("r+b") as file:
        for page in range(pages // 3, 2 * pages // 3 + 1):
            file.seek(page * PAGE_BYTES)
            file.write(bytes((page * 7 + offset) % 251 for offset in range(PAGE_BYTES)))


DAMAGE = {
    "truncated": _truncate,
    "header": _overwrite_header,
    "middle pages": _overwrite_middle_pages,
}


def _damaged_file(history: History, damage: Callable[[pathlib.Path], None]) -> str:
    path = pathlib.Path(history.url.removeprefix("sqlite:///"))
    history.store.close()
    with sqlite3.connect(path) as connection:
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        connection.execute("PRAGMA journal_mode=DELETE")
    for suffix in ("-wal", "-shm"):
        pathlib.Path(f"{path}{suffix}").unlink(missing_ok=True)
    damage(path)
    return history.url


@pytest.fixture
def started(tmp_path: pathlib.Path) -> Iterator[Callable[[str], Running]]:
    running: list[Running] = []

    def start(url: str) -> Running:
        settings = Settings(
            database_url=url,
            data_dir=tmp_path / "server",
            listen="127.0.0.1:0",
            auth_enabled=False,
            sweep_interval_seconds=0.05,
            recovery_check_interval_seconds=0.1,
        )
        server = LedgerServer(settings, run_migrations=False)
        server.start()
        running.append(Running(server))
        return running[-1]

    yield start
    for each in running:
        each.channel.close()
        each.server.stop(0)


def _reason(call: Callable[[], object]) -> str:
    with pytest.raises(grpc.RpcError) as caught:
        call()  # an answer here would be an answer from a damaged store
    error = caught.value
    assert isinstance(error, grpc.Call) and error.code() is grpc.StatusCode.UNAVAILABLE
    return str(dict(error.trailing_metadata() or ()).get("ledger-reason"))


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_damaged_store_is_refused_with_its_own_reason(
    kind: str,
    sqlite_history: History,
    started: Callable[[str], Running],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    running = started(_damaged_file(sqlite_history, DAMAGE[kind]))
    running.wait_for(NOT_SERVING)
    calls: list[Callable[[], object]] = [
        lambda: running.reserve("after-damage"),
        lambda: running.ledger.GetBalance(pb.GetBalanceRequest(lane="recall"), timeout=5),
    ]
    deadline = time.monotonic() + 10
    reasons = [_reason(call) for call in calls]
    while reasons != ["STORE_DAMAGED"] * len(calls):
        assert set(reasons) <= {"STORE_DAMAGED", "RECOVERY_REQUIRED"}, reasons
        assert time.monotonic() < deadline, f"never told STORE_DAMAGED: {reasons}"
        time.sleep(0.05)
        reasons = [_reason(call) for call in calls]
    assert running.status() == NOT_SERVING
    damaged = [r.getMessage() for r in caplog.records if "DATABASE IS DAMAGED" in r.getMessage()]
    assert len(damaged) == 1 and "backup" in damaged[0] and "docs/recovery.md" in damaged[0]
    assert "ledger.db" in damaged[0] or "sqlite:" in damaged[0], damaged[0]
    # Damage found, the recovery checks stop: no retrying forever.
    time.sleep(0.3)
    before = len(caplog.records)
    time.sleep(1.0)
    later = [r.getMessage() for r in caplog.records[before:] if r.levelno >= logging.WARNING]
    assert later == [], later
    assert running.status() == health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.parametrize("damage", ["header", "middle pages"])
def test_ledger_verify_says_the_database_is_damaged_and_what_to_do(
    sqlite_history: History, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from ledger_service import cli

    url = _damaged_file(sqlite_history, DAMAGE[damage])
    assert cli.main(["verify", "--database-url", url]) == 2
    said = capsys.readouterr().err
    assert "the ledger's database is damaged" in said, said
    assert "restore the database from a backup" in said, said
    assert url in said, "the message names the damaged database"
    assert "unavailable" not in said


def test_a_row_that_breaks_its_schema_is_damage_and_then_nothing_is_served(
    sqlite_history: History,
    started: Callable[[str], Running],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SQLite hands back a damaged page's cells as rows without an error: a
    lane whose prices no longer parse is damage (STORE_DAMAGED, NOT_SERVING),
    never an INTERNAL error with a traceback; and once the damage is known, the
    log is not served either."""
    caplog.set_level(logging.INFO)
    sqlite_history.sql("UPDATE lanes SET prices_json = '{broken' WHERE lane = 'recall'")
    sqlite_history.store.close()
    running = started(sqlite_history.url)
    assert _reason(lambda: running.reserve("after-damage")) == "STORE_DAMAGED"
    running.wait_for(NOT_SERVING)
    listing = running.ledger.ListEvents
    assert _reason(lambda: listing(pb.ListEventsRequest(), timeout=5)) == "STORE_DAMAGED"
    tracebacks = [r for r in caplog.records if r.exc_info is not None]
    assert tracebacks == [], [r.getMessage() for r in tracebacks]
    damaged = [r.getMessage() for r in caplog.records if "DATABASE IS DAMAGED" in r.getMessage()]
    assert len(damaged) == 1 and "schema" in damaged[0], damaged


def test_an_event_row_that_breaks_its_schema_is_damage_to_the_start_up_recovery(
    sqlite_history: History,
    started: Callable[[str], Running],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The start-up recovery reads the log outside any one call: a row it
    cannot decode is damage there too (STORE_DAMAGED, NOT_SERVING, no
    traceback), not a recovery failure retried for ever."""
    caplog.set_level(logging.INFO)
    trigger = sqlite_history.scalar(
        "SELECT sql FROM sqlite_master WHERE type = 'trigger' AND name = 'events_refuse_update'"
    )
    sqlite_history.sql(
        "DROP TRIGGER events_refuse_update",
        "UPDATE events SET kind = 'bogus' WHERE seq = (SELECT max(seq) FROM events)",
        str(trigger),  # the append-only guard, as it was
    )
    sqlite_history.store.close()
    running = started(sqlite_history.url)
    running.wait_for(NOT_SERVING)
    assert _reason(lambda: running.reserve("after-damage")) == "STORE_DAMAGED"
    tracebacks = [r for r in caplog.records if r.exc_info is not None]
    assert tracebacks == [], [r.getMessage() for r in tracebacks]


def _schema_text_not_utf8(history: History) -> str:
    """The `CREATE TABLE` text of `events` in sqlite_master with bytes that are
    not UTF-8, as a damaged page of the schema leaves it: SQLite's "malformed
    database schema (events) - near ..." quotes them, which Python's sqlite3
    cannot decode (a UnicodeDecodeError, not a sqlite3.Error)."""
    path = pathlib.Path(history.url.removeprefix("sqlite:///"))
    history.store.close()
    with sqlite3.connect(path) as connection:
        connection.execute("PRAGMA writable_schema=ON")
        connection.execute(
            "UPDATE sqlite_master SET sql = 'CREATE ' || CAST(X'DEADBEEF' AS TEXT) "
            "WHERE name = 'events'"
        )
    return history.url


def _lane_text_not_utf8(history: History) -> str:
    """A lane's text column whose bytes are not UTF-8 (the ledger never writes
    one): Python's sqlite3 says "Could not decode to UTF-8 column ..."."""
    history.sql("UPDATE lanes SET expire_charge = CAST(X'DEADBEEF' AS TEXT)")
    history.store.close()
    return history.url


@pytest.mark.parametrize("command", ["verify", "snapshot", "rebuild", "migrate"])
def test_a_schema_whose_text_is_not_utf8_is_damage_to_the_commands(
    sqlite_history: History,
    command: str,
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every command printed a UnicodeDecodeError's traceback, exit 1."""
    from ledger_service import cli

    url = _schema_text_not_utf8(sqlite_history)
    assert cli.main([command, "--database-url", url, "--data-dir", str(tmp_path)]) == 2
    said = capsys.readouterr().err
    assert "the ledger's database is damaged" in said, said
    assert "restore the database from a backup" in said, said
    assert "Traceback" not in said and "UnicodeDecodeError" not in said, said


@pytest.mark.parametrize("command", ["verify", "migrate"])
def test_a_command_on_a_damaged_file_says_so_in_one_line(
    sqlite_history: History,
    command: str,
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each also logged the server's line ("THE DATABASE IS DAMAGED ...
    Nothing is served from it: every move is refused with STORE_DAMAGED"),
    which is not what a command does."""
    from ledger_service import cli

    caplog.set_level(logging.INFO)
    url = _schema_text_not_utf8(sqlite_history)
    assert cli.main([command, "--database-url", url, "--data-dir", str(tmp_path)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"ledger {command}: the ledger's database is damaged"), line
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert logged == [], logged


def test_a_schema_whose_text_is_not_utf8_is_damage_to_the_server(
    sqlite_history: History,
    started: Callable[[str], Running],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`ledger serve` ended at start with Python's "'utf-8' codec can't decode
    byte ..." and no word of damage; it stays up, NOT_SERVING, STORE_DAMAGED."""
    caplog.set_level(logging.INFO)
    running = started(_schema_text_not_utf8(sqlite_history))
    running.wait_for(NOT_SERVING)
    assert _reason(lambda: running.reserve("after-damage")) == "STORE_DAMAGED"
    damaged = [r.getMessage() for r in caplog.records if "DATABASE IS DAMAGED" in r.getMessage()]
    assert damaged and "backup" in damaged[0], damaged


def test_a_text_column_that_is_not_utf8_is_damage_not_an_outage(
    sqlite_history: History,
    started: Callable[[str], Running],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """verify said "the database is unavailable" (as for a database that
    does not answer) and quoted the row's bytes; a move was STORE_UNAVAILABLE,
    which a lane retries, for ever."""
    from ledger_service import cli

    url = _lane_text_not_utf8(sqlite_history)
    assert cli.main(["verify", "--database-url", url]) == 2
    said = capsys.readouterr().err
    assert "the ledger's database is damaged" in said, said
    assert "unavailable" not in said and "\ufffd" not in said, said
    running = started(url)
    assert _reason(lambda: running.reserve("after-damage")) == "STORE_DAMAGED"


@pytest.mark.parametrize("table", ["bookings", "events"])
def test_a_dropped_table_is_damage_named_in_the_log(
    table: str,
    sqlite_history: History,
    started: Callable[[str], Running],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A table of a migrated schema gone (dropped by hand, a partial restore):
    SQLite answers, but nothing can be served. It is damage, not an outage
    to retry ("database unavailable; will retry" for ever, RECOVERY_REQUIRED
    to the callers): STORE_DAMAGED, NOT_SERVING, and one line naming the
    missing table and what to do."""
    caplog.set_level(logging.INFO)
    sqlite_history.sql(f"DROP TABLE {table}")
    sqlite_history.store.close()
    running = started(sqlite_history.url)
    running.wait_for(NOT_SERVING)
    assert _reason(lambda: running.reserve("after-damage")) == "STORE_DAMAGED"
    damaged = [r.getMessage() for r in caplog.records if "DATABASE IS DAMAGED" in r.getMessage()]
    assert len(damaged) == 1, [r.getMessage() for r in caplog.records]
    assert f"table '{table}'" in damaged[0] and "backup" in damaged[0], damaged[0]
    retries = [r.getMessage() for r in caplog.records if "will retry" in r.getMessage()]
    assert retries == [], retries


def test_ledger_verify_says_a_dropped_table_is_damage(
    history: History, capsys: pytest.CaptureFixture[str]
) -> None:
    """On both databases (PostgreSQL's undefined_table, 42P01)."""
    from ledger_service import cli

    cascade = "" if history.url.startswith("sqlite") else " CASCADE"
    history.sql(f"DROP TABLE bookings{cascade}")
    history.store.close()
    assert cli.main(["verify", "--database-url", history.url]) == 2
    said = capsys.readouterr().err
    assert "the ledger's database is damaged" in said, said
    assert "table 'bookings'" in said and "backup" in said, said
    assert "unavailable" not in said, said


def test_ledger_snapshot_says_a_dropped_table_is_damage(
    history: History, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A snapshot reads in a settled view of its own (on PostgreSQL, under the
    maintenance lock): a table gone there is damage too, not an outage."""
    from ledger_service import cli

    cascade = "" if history.url.startswith("sqlite") else " CASCADE"
    history.sql(f"DROP TABLE bookings{cascade}")
    history.store.close()
    argv = ["snapshot", "--database-url", history.url, "--data-dir", str(tmp_path)]
    assert cli.main(argv) == 2
    said = capsys.readouterr().err
    assert "the ledger's database is damaged" in said, said
    assert "table 'bookings'" in said, said


def test_a_database_not_migrated_yet_is_not_damage(tmp_path: pathlib.Path) -> None:
    """Before `ledger migrate` has made the schema every table is missing: a
    server started with --no-migrate waits for the migration (an outage),
    and is never marked damaged for it."""
    from ledger_service import server
    from ledger_service.domain.errors import StoreDamaged, StoreUnavailable

    settings = Settings(database_url=f"sqlite:///{tmp_path}/ledger.db", data_dir=tmp_path)
    store = server.build_store(settings)
    try:
        with pytest.raises(StoreUnavailable) as caught:
            store.run(lambda transaction: transaction.last_seq(), write=False)
        assert not isinstance(caught.value, StoreDamaged)
        assert store.damage is None
    finally:
        store.close()


def _flip_a_key_byte_of_an_index_verify_never_reads(path: pathlib.Path) -> None:
    """One byte of an index entry's key changed, its page's structure intact:
    SQLite's quick_check passes it, integrity_check does not."""
    with sqlite3.connect(path) as connection:
        (page,) = connection.execute(
            "SELECT pageno FROM dbstat WHERE name = 'ix_bookings_state_expires_at_us'"
        ).fetchone()
    with path.open("r+b") as file:
        file.seek(page * PAGE_BYTES - 3)
        (byte,) = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte ^ 0x01]))


def test_ledger_verify_finds_damage_its_reads_never_touch(
    sqlite_history: History, capsys: pytest.CaptureFixture[str]
) -> None:
    """A damaged index that no read of verify uses (the sweeper's): verify
    runs SQLite's integrity_check and says the file is damaged (exit 2)."""
    from ledger_service import cli

    url = _damaged_file(sqlite_history, _flip_a_key_byte_of_an_index_verify_never_reads)
    with sqlite3.connect(url.removeprefix("sqlite:///")) as connection:
        found = connection.execute("PRAGMA integrity_check").fetchall()
    assert found != [("ok",)], "the damage is there"
    assert cli.main(["verify", "--database-url", url]) == 2
    said = capsys.readouterr().err
    assert "the ledger's database is damaged" in said, said
    assert "integrity_check" in said and "ix_bookings_state_expires_at_us" in said, said
    assert "restore the database from a backup" in said, said


def test_a_database_that_does_not_answer_is_told_as_unavailable_not_as_recovering(
    started: Callable[[str], Running],
) -> None:
    """A database the server cannot open at all (PostgreSQL down at start; a
    SQLite file in a directory where its -shm file cannot be made): nothing
    is being recovered, so a caller is told STORE_UNAVAILABLE, as the log
    says, not RECOVERY_REQUIRED ("recovering its projections")."""
    running = started("postgresql+psycopg://postgres@127.0.0.1:1/ledger_nowhere")
    running.wait_for(NOT_SERVING)
    assert _reason(lambda: running.reserve("while-down")) == "STORE_UNAVAILABLE"
    balance = running.ledger.GetBalance
    assert _reason(lambda: balance(pb.GetBalanceRequest(lane="recall"), timeout=5)) == (
        "STORE_UNAVAILABLE"
    )


def _zero_a_page_of_the_log(path: pathlib.Path) -> None:
    """A leaf page of the event table zeroed, as a torn write or a bad sector
    leaves it; the projections and the newest snapshot are whole."""
    with sqlite3.connect(path) as connection:
        (page,) = connection.execute(
            "SELECT pageno FROM dbstat WHERE name = 'events' AND pagetype = 'leaf'"
            " ORDER BY pageno LIMIT 1"
        ).fetchone()
    with path.open("r+b") as file:
        file.seek((page - 1) * PAGE_BYTES)
        file.write(bytes(PAGE_BYTES))


@pytest.mark.parametrize(
    "damage", [_zero_a_page_of_the_log, _flip_a_key_byte_of_an_index_verify_never_reads]
)
def test_ledger_rebuild_from_a_snapshot_refuses_a_damaged_file(
    sqlite_history: History,
    damage: Callable[[pathlib.Path], None],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A rebuild from the newest snapshot reads only the log after it, and
    so never met damage before it: it said "rebuilt", exit 0, on a file that
    verify calls damaged. It checks the file's integrity first (exit 2)."""
    from ledger_service import cli

    url = sqlite_history.url
    assert cli.main(["snapshot", "--database-url", url]) == 0
    url = _damaged_file(sqlite_history, damage)
    capsys.readouterr()
    assert cli.main(["rebuild", "--database-url", url]) == 2
    said = capsys.readouterr()
    assert "rebuilt" not in said.out, said.out
    assert "the ledger's database is damaged" in said.err, said.err
    assert "restore the database from a backup" in said.err, said.err


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_corrupt_sqlite_file_is_not_sent_round_to_verify_and_rebuild(
    sqlite_history: History, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """verify runs integrity_check, so on a corrupt SQLite file it never
    "finds the log whole", and a rebuild refuses the file: advice to run
    them sent the operator round in a loop. Only a backup helps there."""
    from ledger_service import cli

    url = _damaged_file(sqlite_history, DAMAGE[damage])
    assert cli.main(["verify", "--database-url", url]) == 2
    said = capsys.readouterr().err
    assert "restore the database from a backup" in said, said
    assert "`ledger rebuild` remakes" not in said, said


def _crashed_copy_without_its_wal(history: History, tmp_path: pathlib.Path) -> pathlib.Path:
    """A copy of the ledger as a `kill -9` leaves it (a commit in ledger.db-wal
    not yet copied into ledger.db, the -shm saying so), then its -wal deleted
    and its -shm left behind."""
    path = pathlib.Path(history.url.removeprefix("sqlite:///"))
    history.store.close()
    copy = tmp_path / "crashed" / "ledger.db"
    copy.parent.mkdir()
    connection = sqlite3.connect(path)
    try:
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA wal_autocheckpoint=0")
        connection.execute("PRAGMA user_version = 7")  # a commit, in the WAL alone
        for suffix in ("", "-wal", "-shm"):
            copy.with_name(f"ledger.db{suffix}").write_bytes(
                pathlib.Path(f"{path}{suffix}").read_bytes()
            )
    finally:
        connection.close()
    copy.with_name("ledger.db-wal").unlink()
    return copy


def test_a_wal_deleted_with_commits_in_it_is_refused_not_served_older(
    sqlite_history: History, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SQLite opens a file whose -wal is gone without a word, and the moves
    only the -wal held are gone with it: a server started, said SERVING and
    answered from the older ledger. Its -shm still says the -wal held
    commits not copied into the file: serve and verify refuse it (exit 2)."""
    from ledger_service import cli

    copy = _crashed_copy_without_its_wal(sqlite_history, tmp_path)
    url = f"sqlite:///{copy}"
    with pytest.raises(SystemExit) as exited:  # as for an empty file: before any open
        cli.main(["verify", "--database-url", url])
    assert exited.value.code == 2
    said = capsys.readouterr().err
    assert "ledger.db-wal is missing" in said and "ledger.db-shm" in said, said
    assert "restore the database from a backup" in said, said
    settings = Settings(database_url=url, data_dir=tmp_path / "server", listen="127.0.0.1:0")
    with pytest.raises(ValueError, match=r"ledger\.db-wal is missing"):
        LedgerServer(settings)
    assert copy.with_name("ledger.db-shm").exists(), "nothing opened the file"
