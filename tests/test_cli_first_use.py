"""What a new user ran into with the CLI (issue 26): `ledger --version`, a pipe
closed early (`ledger history --json | head -1`), bare amounts taken as dollars,
cut trace ids, raw microseconds from `ledger verify`, raw nanos in a denial, and
`ledger migrate` saying "up to date" about a database it had just created.

The server-backed tests use the fixtures of tests/test_cli.py (a `ledger serve
--test-clock` subprocess for the module, the CLI in process); the closed-pipe
tests run the CLI as a subprocess, since only a real process has a real stdout.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import pathlib
import re
import subprocess

import pytest
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, text

from ledger_service.cli import exits, moves, reading, render, values
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.storage import migrate
from tests import test_cli
from tests.test_cli import (
    JEV_PRICE,
    LEDGER,
    LedgerProcess,
    RunLedger,
    one_line_error,
    put_recall,
    reserve,
    server_environment,
)

ledger_process = test_cli.ledger_process
target = test_cli.target
ledger = test_cli.ledger

# A trace id as the server stores it: 32 lowercase hex digits.
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
# The day of the recall jam, in microseconds since the epoch.
JAM_DAY = datetime.datetime(2026, 9, 24, 12, 0, tzinfo=datetime.UTC)
JAM_DAY_US = int(JAM_DAY.timestamp()) * 1_000_000
COMMAND_SECONDS = 60
# Events of more than 64 KiB of `history --json` (a reserved event is over 500 bytes).
HEADED_EVENTS = 150
BARE_NANOS = re.compile(r"\b\d+ nanos\b")


@pytest.fixture
def no_database_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The commands run next to the database get it from --data-dir alone."""
    for key in ("LEDGER_DATABASE_URL", "LEDGER_DATA_DIR"):
        monkeypatch.delenv(key, raising=False)


# 1. --version --------------------------------------------------------------


def test_version_prints_the_installed_distribution_version(ledger: RunLedger) -> None:
    run = ledger("--version")
    assert run.code == 0
    assert run.out == f"ledger {importlib.metadata.version('ledger-service')}\n"
    assert run.err == ""


# 2. A reader that leaves early ---------------------------------------------


def run_into_closed_pipe(*arguments: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Runs `ledger ARGUMENTS` with stdout a pipe nobody reads any more, as after `| head -1`
    has read its line and left: every write of the command fails (EPIPE)."""
    reader, writer = os.pipe()
    os.close(reader)
    try:
        return subprocess.run(
            [str(LEDGER), *arguments],
            stdout=writer,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=COMMAND_SECONDS,
            check=False,
        )
    finally:
        os.close(writer)


@pytest.mark.parametrize(
    "arguments",
    [["history", "--json"], ["history"], ["history", "piped", "--limit", "1"], ["lane", "list"]],
)
def test_a_closed_pipe_ends_a_command_quietly_with_status_1(
    target: LedgerProcess, ledger: RunLedger, arguments: list[str]
) -> None:
    put_recall(ledger, "piped")
    reserve(ledger, "piped", "p-1")
    environment = server_environment()
    environment["LEDGER_SERVER"] = target.address
    environment["LEDGER_DATA_DIR"] = str(target.data_dir)
    done = run_into_closed_pipe(*arguments, env=environment)
    assert (done.returncode, done.stderr) == (exits.EXIT_FAILED, "")


def test_a_closed_pipe_ends_a_database_command_quietly(tmp_path: pathlib.Path) -> None:
    environment = server_environment()
    assert (
        subprocess.run(
            [str(LEDGER), "migrate", "--data-dir", str(tmp_path)],
            capture_output=True,
            env=environment,
            timeout=COMMAND_SECONDS,
            check=False,
        ).returncode
        == 0
    )
    done = run_into_closed_pipe("verify", "--data-dir", str(tmp_path), env=environment)
    assert (done.returncode, done.stderr) == (exits.EXIT_FAILED, "")


def test_a_real_head_gets_its_line_and_the_command_ends_quietly(
    target: LedgerProcess, ledger: RunLedger
) -> None:
    """`ledger history --json | head -1` as typed: more than a pipe's buffer (64 KiB)
    of events, so the command is still writing when head leaves."""
    put_recall(ledger, "headed")
    for number in range(HEADED_EVENTS):
        reserve(ledger, "headed", f"h-{number}")
    environment = server_environment()
    environment["LEDGER_SERVER"] = target.address
    environment["LEDGER_DATA_DIR"] = str(target.data_dir)
    done = subprocess.run(
        ["bash", "-c", f"'{LEDGER}' history headed --json --limit 1000 | head -1; "
         'echo "status ${PIPESTATUS[0]}"'],
        capture_output=True,
        text=True,
        env=environment,
        timeout=COMMAND_SECONDS,
        check=False,
    )  # fmt: skip
    first, status = done.stdout.splitlines()
    assert first.startswith('{"') and status == f"status {exits.EXIT_FAILED}", done.stdout
    assert done.stderr == ""


# 3. Amounts need a unit ----------------------------------------------------


@pytest.mark.parametrize(
    ("text", "forms"),
    [
        ("100", "$100, 100 USD or 100n"),
        # Not '0.50n': nanos are whole, so that form would be refused in turn.
        ("0.50", "$0.50 or 0.50 USD"),
        ("0", "$0, 0 USD or 0n"),
        # '-1' is negative first of all (test_cli.py: no amount is negative).
    ],
)
def test_a_bare_amount_is_refused_naming_the_option_and_the_forms(text: str, forms: str) -> None:
    with pytest.raises(exits.CliError) as refused:
        values.parse_amount_nanos("--estimate", text)
    assert refused.value.message == f"--estimate: {text!r} has no unit (write {forms})"
    assert refused.value.exit_code == exits.EXIT_BAD_VALUE


@pytest.mark.parametrize("text", ["$0.50", "0.50 USD", "500000000n", "500000000 nanos"])
def test_amounts_with_a_unit_are_still_accepted(text: str) -> None:
    assert values.parse_amount_nanos("--estimate", text) == 500_000_000


def test_prices_keep_their_documented_bare_form_of_usd_per_million_tokens() -> None:
    _, price = values.parse_price(JEV_PRICE)
    assert price.input_nanos_per_million_tokens == 100_000_000
    assert price.output_nanos_per_million_tokens == 400_000_000


@pytest.mark.parametrize(
    ("option", "command_line"),
    [
        ("--estimate", ["reserve", "units", "u-1", "--model", "jev", "--request-bytes", "7000",
                        "--max-output-tokens", "200", "--estimate", "100"]),
        ("--billed", ["settle", "units", "u-1", "--outcome", "succeeded", "--input-tokens", "1",
                      "--billed", "100"]),
        ("--charge", ["correct", "units", "u-1", "--charge", "100", "--reason", "x"]),
        ("--limit", ["lane", "put", "units-2", "--limit", "100", "--price", JEV_PRICE]),
    ],
)  # fmt: skip
def test_every_amount_option_refuses_a_bare_number_before_any_call(
    target: LedgerProcess, ledger: RunLedger, option: str, command_line: list[str]
) -> None:
    run = ledger(*command_line)
    expected = f"ledger: {option}: '100' has no unit (write $100, 100 USD or 100n)\n"
    assert one_line_error(run) == expected
    assert run.code == exits.EXIT_BAD_VALUE


# 4. Whole trace ids ---------------------------------------------------------


def test_history_shows_the_whole_trace_id() -> None:
    event = pb.Event(seq=1, lane="recall", kind="reserved", trace_id=TRACE_ID)
    assert reading.event_row(event)[-1] == TRACE_ID
    assert reading.event_row(pb.Event(seq=2, kind="reserved"))[-1] == "-"


# 5. verify in human units ---------------------------------------------------


def test_verify_states_the_instant_of_its_window_totals_in_utc(
    ledger: RunLedger, tmp_path: pathlib.Path, no_database_settings: None
) -> None:
    assert ledger("migrate", "--data-dir", str(tmp_path)).code == 0
    run = ledger("verify", "--data-dir", str(tmp_path), "--at-us", str(JAM_DAY_US))
    assert run.code == 0, run
    assert run.out == (
        "verified 0 events, 0 lanes, 0 bookings, window totals at 2026-09-24T12:00:00.000Z: OK\n"
    )


def test_an_instant_in_micros_reads_like_every_other_time() -> None:
    assert render.micros_time_text(JAM_DAY_US + 1_234_567) == "2026-09-24T12:00:01.234Z"


# 6. A denial in dollars -----------------------------------------------------


def test_a_server_sentence_shows_its_nanos_as_dollars() -> None:
    sentence = "the hold of 280000 nanos does not fit the -5 nanos available in budget 'a'"
    assert render.money_in_text(sentence) == (
        "the hold of $0.000280000 does not fit the -$0.000000005 available in budget 'a'"
    )
    assert render.money_in_text("lane 'x1 nanos'") == "lane 'x1 nanos'"


def test_a_denial_shows_every_amount_in_dollars(target: LedgerProcess, ledger: RunLedger) -> None:
    ledger("lane", "put", "dollars", "--limit", "300000n", "--price", JEV_PRICE)
    assert reserve(ledger, "dollars", "d-1").code == 0
    denied = reserve(ledger, "dollars", "d-2")
    assert denied.code == exits.EXIT_DENIED
    first = denied.out.splitlines()[0]
    assert first.startswith(
        "denied d-2: budget exhausted: the hold of $0.000280000 does not fit the "
        "$0.000020000 available in budget 'dollars'; retry after "
    ), first
    never = ledger(
        "reserve", "dollars", "d-3", "--model", "jev", "--request-bytes", "7000000",
        "--max-output-tokens", "0",
    )  # fmt: skip
    assert never.code == exits.EXIT_DENIED
    assert never.out.startswith(
        "denied d-3: hold exceeds limit: the hold of $0.200000000 is larger than the limit of "
        "budget 'dollars' ($0.000300000) and can never fit\n"
    ), never.out
    for run in (denied, never):
        assert not BARE_NANOS.search(run.out), run.out
    # --json keeps the server's own sentence and every amount in nanos.
    as_json = reserve(ledger, "dollars", "d-2", "--json").json()
    assert as_json["hold_nanos"] == 280_000 and "280000 nanos" in as_json["reason"]


def test_a_denial_never_says_to_retry_before_the_servers_instant() -> None:
    """The ledger counts microseconds and the CLI shows milliseconds: cut to
    .234, a retry_after of .234567 told the lane to retry at an instant when
    the booking still counted and the same Reserve was denied again."""
    retry = render.micros_time_text(JAM_DAY_US + 1_234_567)
    response = pb.ReserveResponse(
        decision=pb.DENIED,
        denial_reason=pb.BUDGET_EXHAUSTED,
        reason="the hold of 5 nanos does not fit the 1 nanos available in budget 'a'",
        balance=pb.Balance(lane="a"),
    )
    response.retry_after.FromMicroseconds(JAM_DAY_US + 1_234_567)
    first = moves.reserve_lines("d-1", response)[0]
    assert retry == "2026-09-24T12:00:01.234Z"
    assert first.endswith("; retry after 2026-09-24T12:00:01.235Z with a new reservation id")
    whole = pb.ReserveResponse()
    whole.CopyFrom(response)
    whole.retry_after.FromMicroseconds(JAM_DAY_US + 1_234_000)  # a whole millisecond: as it is
    assert "retry after 2026-09-24T12:00:01.234Z " in moves.reserve_lines("d-1", whole)[0]


# 7. migrate says what it did -----------------------------------------------


def head_revision(url: str) -> str:
    engine = create_engine(url)
    try:
        head = ScriptDirectory.from_config(migrate.alembic_config(engine)).get_current_head()
    finally:
        engine.dispose()
    assert head is not None
    return head


def test_migrate_names_the_file_it_created_for_a_relative_sqlite_path(
    ledger: RunLedger, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # sqlite:///tmp/x/ledger.db is tmp/x/ledger.db under the current
    # directory: a new, empty ledger that an operator meaning /tmp/x was not told of.
    monkeypatch.chdir(tmp_path)
    url = "sqlite:///tmp/x/ledger.db"
    created = ledger("migrate", "--database-url", url, "--data-dir", str(tmp_path / "data"))
    assert created.code == 0
    made = tmp_path / "tmp" / "x" / "ledger.db"
    assert created.err.endswith(f" in {url} (the file {made})\n")
    assert made.exists()
    again = ledger("migrate", "--database-url", url, "--data-dir", str(tmp_path / "data"))
    assert again.err.endswith(f"(up to date) in {url}\n")


def migrate_to(url: str, revision: str) -> None:
    """The schema of an older release: upgraded to `revision` only."""
    engine = create_engine(url)
    try:
        config = migrate.alembic_config(engine)
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, revision)
    finally:
        engine.dispose()


def test_migrate_says_whether_it_created_upgraded_or_found_the_schema_current(
    ledger: RunLedger, tmp_path: pathlib.Path, no_database_settings: None
) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    head = head_revision(url)
    created = ledger("migrate", "--data-dir", str(tmp_path))
    assert (created.code, created.err) == (0, f"created the schema at revision {head} in {url}\n")
    again = ledger("migrate", "--data-dir", str(tmp_path))
    assert again.err == f"the schema is already at revision {head} (up to date) in {url}\n"

    older = f"sqlite:///{tmp_path / 'older.db'}"
    migrate_to(older, "0003")
    upgraded = ledger("migrate", "--database-url", older)
    assert upgraded.code == 0
    assert upgraded.err == f"upgraded the schema from revision 0003 to {head} in {older}\n"


def _migrated_by_a_newer_release(ledger: RunLedger, url: str) -> None:
    """A database migrated here, then stamped with a revision this build has never heard of."""
    assert ledger("migrate", "--database-url", url).code == 0
    engine = create_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    finally:
        engine.dispose()


def test_a_schema_of_a_newer_release_is_refused_in_one_line_by_migrate_and_serve(
    ledger: RunLedger, tmp_path: pathlib.Path, no_database_settings: None
) -> None:
    # An older build pointed at a database a newer release has migrated (a
    # rollback, a replica left behind): Alembic cannot find the revision, and
    # both commands ended in its traceback, `serve` with exit 1 ("cannot listen").
    url = f"sqlite:///{tmp_path / 'newer.db'}"
    _migrated_by_a_newer_release(ledger, url)
    head = head_revision(url)
    for command_line in (
        ("migrate", "--database-url", url),
        ("serve", "--database-url", url, "--data-dir", str(tmp_path), "--listen", "127.0.0.1:0"),
        # It served such a schema, health SERVING, when told not to migrate.
        (
            "serve", "--no-migrate", "--database-url", url,
            "--data-dir", str(tmp_path), "--listen", "127.0.0.1:0",
        ),
    ):  # fmt: skip
        refused = ledger(*command_line)
        assert refused.code == 2, refused
        said = one_line_error(refused)
        assert "revision 9999" in said and f"newest is {head}" in said, said


@pytest.mark.parametrize("revision", ["0004", "0006"])
def test_a_server_told_not_to_migrate_refuses_a_schema_behind_its_own(
    ledger: RunLedger, tmp_path: pathlib.Path, no_database_settings: None, revision: str
) -> None:
    # A deploy that starts the new release with --no-migrate before its
    # migration ran: the server came up, health SERVING, and answered every
    # call UNAVAILABLE for ever ("recovering its projections" at 0004; at 0006
    # on PostgreSQL every move failed on the missing ledger_lock_chain).
    url = f"sqlite:///{tmp_path / 'older.db'}"
    migrate_to(url, revision)
    head = head_revision(url)
    # A process of its own, bounded: the server that serves it never returns.
    refused = subprocess.run(
        [
            str(LEDGER), "serve", "--no-migrate", "--database-url", url,
            "--data-dir", str(tmp_path), "--listen", "127.0.0.1:0",
        ],
        capture_output=True, text=True, timeout=COMMAND_SECONDS, check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("LEDGER_")},
    )  # fmt: skip
    assert refused.returncode == 2, refused
    assert "Traceback" not in refused.stderr, refused.stderr
    said = refused.stderr.strip().splitlines()[-1]
    assert f"revision {revision}" in said and f"this build's {head}" in said, said
    assert "ledger migrate" in said, said
    # The revision was read, not changed; `ledger migrate` then lets it serve.
    assert ledger("migrate", "--database-url", url).code == 0


@pytest.mark.parametrize("command", [
    ("verify",), ("snapshot",), ("rebuild",), ("recover", "--budget-seconds", "60"),
])  # fmt: skip
def test_the_recovery_commands_refuse_a_schema_of_another_release_in_one_line(
    ledger: RunLedger, tmp_path: pathlib.Path, no_database_settings: None, command: tuple[str, ...]
) -> None:
    # serve and migrate refused a newer release's schema; these four read it
    # and wrote into it (a snapshot, a rebuild of the projections in this
    # build's columns) and exited 0. An older release's schema ended in
    # "the database is unavailable (...): no such column: events.cached_...".
    head = head_revision(f"sqlite:///{tmp_path / 'probe.db'}")
    newer = f"sqlite:///{tmp_path / 'newer.db'}"
    _migrated_by_a_newer_release(ledger, newer)
    refused = ledger(*command, "--database-url", newer)
    assert refused.code == 2, refused
    said = one_line_error(refused)
    assert "revision 9999" in said and f"newest is {head}" in said, said
    engine = create_engine(newer)
    try:
        with engine.connect() as connection:
            assert connection.execute(text("SELECT count(*) FROM snapshots")).scalar() == 0
    finally:
        engine.dispose()
    older = f"sqlite:///{tmp_path / 'older.db'}"
    migrate_to(older, "0004")
    refused = ledger(*command, "--database-url", older)
    assert refused.code == 2, refused
    said = one_line_error(refused)
    assert f"revision 0004, older than this build's {head}" in said, said
    assert "ledger migrate" in said and "column" not in said, said


def test_a_refusal_shows_its_amounts_in_dollars(target: LedgerProcess, ledger: RunLedger) -> None:
    ledger("lane", "put", "refusing", "--limit", "$1", "--price", JEV_PRICE)
    assert reserve(ledger, "refusing", "big-1").code == 0
    # A billed charge far beyond the booking's cap: the server refuses it, in nanos.
    refused = ledger("settle", "refusing", "big-1", "--outcome", "succeeded", "--billed", "$0.9")
    assert refused.code != 0
    assert "more than 100 times the booking's cap of $0.000280000" in refused.err, refused.err
    assert "$" in refused.err and not BARE_NANOS.search(refused.err), refused.err


def test_an_amount_out_of_range_shows_its_bounds_in_dollars(
    target: LedgerProcess, ledger: RunLedger
) -> None:
    # '--limit $0' was told 'must be between 1 and 4611686018427387904': nanos,
    # for an option written in dollars. (One past the top is the CLI's to refuse.)
    refused = ledger("lane", "put", "huge", "--limit", "$0", "--price", JEV_PRICE)
    assert refused.code == exits.EXIT_BAD_VALUE, refused.err
    assert refused.err == (
        "ledger: bad value for --limit (field lane.limit_nanos): "
        "must be between $0.000000001 and $4611686018.427387904\n"
    )
    # A count keeps its bounds as numbers.
    refused = ledger(
        "reserve",
        "huge",
        "h-1",
        "--model",
        "jev",
        "--request-bytes",
        str(2**41),
        "--max-output-tokens",
        "1",
    )
    assert "must be between 0 and 1099511627776" in refused.err, refused.err


@pytest.mark.parametrize("text", ["99999999999999999999999", str(2**63), "9" * 5_000])
def test_a_count_past_int64_is_too_large_not_a_non_number(text: str) -> None:
    # It said "is not a whole number" of a whole number with too many digits.
    with pytest.raises(exits.CliError) as refused:
        values.parse_count("--request-bytes", text)
    assert refused.value.exit_code == exits.EXIT_BAD_VALUE
    assert refused.value.message == (
        f"--request-bytes: {text[:64]!r} is too large (at most 9223372036854775807)"
    )


@pytest.mark.parametrize("text", ["12a", "1.5", ""])
def test_a_count_that_is_no_number_says_so(text: str) -> None:
    with pytest.raises(exits.CliError) as refused:
        values.parse_count("--request-bytes", text)
    assert refused.value.message == f"--request-bytes: {text!r} is not a whole number"


def test_a_repeated_reserve_says_it_booked_nothing() -> None:
    """A Reserve sent again under an id returns the first answer: the CLI
    said "admitted" as if it had just booked the hold."""
    response = pb.ReserveResponse(decision=pb.ADMITTED, hold_nanos=5, balance=pb.Balance(lane="a"))
    assert len(moves.reserve_lines("r-1", response)) == 2
    response.already_reserved = True
    said = moves.reserve_lines("r-1", response)
    assert said[-1] == (
        "(a repeat: an earlier Reserve under r-1 made this answer; this one booked nothing)"
    )
