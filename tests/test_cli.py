"""End-to-end tests of the people CLI (`ledger lane|reserve|settle|refund|balance|history|
reconcile`).

A real server runs as a subprocess (`ledger serve --listen 127.0.0.1:0 --test-clock`
on a temporary SQLite data directory) and the CLI runs in process through
`ledger_service.cli.main`, so its stdout, stderr and exit code are all checked.
The `--follow` test runs the CLI as a subprocess, because it ends on Ctrl-C.
The TLS tests start two servers in process, one with TLS and one with mutual TLS,
with certificates made by the helpers of tests/security/certificates.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from cryptography.hazmat.primitives import serialization

from ledger_service import cli
from ledger_service.cli import connection, exits, reconcile, render, values
from ledger_service.domain.grants import decode_unverified
from ledger_service.domain.pricing import MAX_AMOUNT_NANOS
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.server import LedgerServer
from ledger_service.settings import Settings
from ledger_service.storage import keyring
from tests.freezing_proxy import FreezingProxy
from tests.security.certificates import Issued, issue, make_ca

LEDGER = pathlib.Path(sys.executable).parent / "ledger"
START_SECONDS = 30.0
STOP_SECONDS = 15.0
LISTENING = re.compile(r"ledger listening on (\S+:\d+)\n")
UNREACHABLE = re.compile(r"ledger: cannot reach the ledger at \S+: is `ledger serve` running\?\n")

# The lane every walk-through uses: $0.50 a day, JEV at $0.10 / $0.40 per million tokens.
# 7000 request bytes at 3.5 bytes per token are 2000 input tokens: 2000 * 100 = 200_000
# nanos, plus 200 output tokens * 400 = 80_000 nanos: a cap of 280_000 nanos.
JEV_PRICE = "jev=0.10/0.40"
CAP_NANOS = 280_000


@dataclasses.dataclass
class LedgerProcess:
    """A `ledger serve` subprocess with the test clock, on its own data directory."""

    process: subprocess.Popen[str]
    address: str
    data_dir: pathlib.Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=STOP_SECONDS)
        if self.process.stdout is not None:
            self.process.stdout.close()

    def log(self) -> str:
        return (self.data_dir / "server.log").read_text(errors="replace")


def server_environment() -> dict[str, str]:
    """The caller's environment without LEDGER_* settings, so the server uses its data dir."""
    return {key: value for key, value in os.environ.items() if not key.startswith("LEDGER_")}


def pointed_at(served: LedgerProcess) -> dict[str, str]:
    """An environment whose commands talk to `served`, with its admin grant."""
    return {
        **server_environment(),
        "LEDGER_SERVER": served.address,
        "LEDGER_DATA_DIR": str(served.data_dir),
    }


def run_ok(environment: dict[str, str], *arguments: str) -> str:
    """`ledger ARGUMENTS` as a process of its own, which must exit 0; its stdout."""
    done = subprocess.run(
        [str(LEDGER), *arguments], env=environment, capture_output=True, text=True,
        timeout=START_SECONDS, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done
    return done.stdout


def start_ledger_process(
    data_dir: pathlib.Path, settings: dict[str, str] | None = None, listen: str = "127.0.0.1:0"
) -> LedgerProcess:
    """Starts `ledger serve` on `listen` (port 0: any) and waits for its one
    'listening' line; `settings` are LEDGER_* variables for the server."""
    command = [
        str(LEDGER),
        "serve",
        "--listen",
        listen,
        "--data-dir",
        str(data_dir),
        "--test-clock",
    ]
    with (data_dir / "server.log").open("w") as log:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**server_environment(), **(settings or {})},
        )
    started = LedgerProcess(process, "", data_dir)
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], START_SECONDS)
    match = LISTENING.fullmatch(process.stdout.readline()) if ready else None
    if match is None:
        started.stop()
        raise AssertionError(f"the server did not start:\n{started.log()}")
    started.address = match.group(1)
    return started


@pytest.fixture(scope="module")
def ledger_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LedgerProcess]:
    started = start_ledger_process(tmp_path_factory.mktemp("ledger-cli"))
    yield started
    started.stop()


@pytest.fixture
def target(ledger_process: LedgerProcess, monkeypatch: pytest.MonkeyPatch) -> LedgerProcess:
    """Points the CLI at the server through the environment, as a user's shell would."""
    for key in ("LEDGER_GRANT", "LEDGER_DATABASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("LEDGER_SERVER", ledger_process.address)
    # Where the server writes its admin grant once auth is on; the CLI reads it from there.
    monkeypatch.setenv("LEDGER_DATA_DIR", str(ledger_process.data_dir))
    return ledger_process


@dataclasses.dataclass(frozen=True)
class Run:
    code: int
    out: str
    err: str

    def json(self) -> dict[str, Any]:
        value = json.loads(self.out)
        assert isinstance(value, dict)
        return value


RunLedger = Callable[..., Run]


@pytest.fixture
def ledger(capsys: pytest.CaptureFixture[str]) -> Iterator[RunLedger]:
    """`ledger("balance", "recall")` runs the CLI in process and returns what it did."""

    def run(*arguments: str) -> Run:
        try:
            code = cli.main(list(arguments))
        except SystemExit as leaving:
            code = leaving.code if isinstance(leaving.code, int) else 1
        captured = capsys.readouterr()
        return Run(code, captured.out, captured.err)

    yield run


def one_line_error(run: Run) -> str:
    """The error a failing command printed: exactly one line, never a traceback."""
    assert run.code != 0, run
    assert run.out == ""
    assert "Traceback" not in run.err
    assert run.err.count("\n") == 1, run.err
    return run.err


def put_recall(ledger: RunLedger, lane: str, *extra: str) -> Run:
    run = ledger("lane", "put", lane, "--limit", "$0.50", "--price", JEV_PRICE, *extra)
    assert run.code == 0, run
    return run


def reserve(ledger: RunLedger, lane: str, reservation_id: str, *extra: str) -> Run:
    run = ledger(
        "reserve",
        lane,
        reservation_id,
        "--model",
        "jev",
        "--request-bytes",
        "7000",
        "--max-output-tokens",
        "200",
        *extra,
    )
    return run


# Values, without a server --------------------------------------------------


@pytest.mark.parametrize(
    ("text", "nanos"),
    [
        ("$0.50", 500_000_000),
        ("0.50 USD", 500_000_000),
        ("0.5usd", 500_000_000),
        ("$ 1", 1_000_000_000),
        ("0.000000001 USD", 1),
        ("$0.000001400", 1400),
        ("1400n", 1400),
        ("1400 nanos", 1400),
        ("$12345678.123456789", 12_345_678_123_456_789),
    ],
)
def test_amounts_parse_to_exact_nanos(text: str, nanos: int) -> None:
    assert values.parse_amount_nanos("--limit", text) == nanos


@pytest.mark.parametrize(
    "text",
    [
        "0.0000000001 USD",
        "$0.0000000005",
        # Finer than a nano past Decimal's 28 digits: never rounded to a whole nano.
        "$1.0000000000000000000000000001",
        "0.1000000000000000000000000000001 USD",
        "1.5n",
        "$5n",
        "0.5 EUR",
        "abc",
        "",
        "1e3",
        "9" * 80,
        "1",
    ],
)
def test_amounts_finer_than_a_nano_or_malformed_are_refused(text: str) -> None:
    with pytest.raises(exits.CliError) as refused:
        values.parse_amount_nanos("--limit", text)
    assert refused.value.exit_code == exits.EXIT_BAD_VALUE
    assert refused.value.message.startswith("--limit: ")


@pytest.mark.parametrize(
    ("text", "largest"),
    [
        # One nano past the ledger's bound (2^62 nanos) was sent, to be refused by the server.
        ("$4611686018.427387905", "$4611686018.427387904"),
        ("4611686018.427387905 USD", "4611686018.427387904 USD"),
        ("4611686018427387905n", "4611686018427387904n"),
        ("4611686018427387905 nanos", "4611686018427387904 nanos"),
        ("$9223372036.854775808", "$4611686018.427387904"),
        ("$ 10000000000", "$4611686018.427387904"),
        ("99999999999usd", "4611686018.427387904 usd"),
        ("99999999999999999999 nanos", "4611686018427387904 nanos"),
    ],
)
def test_an_amount_too_large_says_the_largest_in_the_unit_typed(text: str, largest: str) -> None:
    """It said only "is too large": the bound, in dollars for a dollar amount.
    The bound is the ledger's (MAX_AMOUNT_NANOS), not the wire's int64."""
    with pytest.raises(exits.CliError) as refused:
        values.parse_amount_nanos("--limit", text)
    assert refused.value.exit_code == exits.EXIT_BAD_VALUE
    assert refused.value.message == f"--limit: {text!r} is too large (at most {largest})"
    assert values.parse_amount_nanos("--limit", largest) == MAX_AMOUNT_NANOS


@pytest.mark.parametrize("text", ["jev=1000000.000000001/1", "jev=10000000000/1"])
def test_a_price_too_large_says_the_largest_in_usd_per_million_tokens(text: str) -> None:
    with pytest.raises(exits.CliError) as refused:
        values.parse_price(text)
    number = text.removeprefix("jev=").removesuffix("/1")
    assert refused.value.message == (
        f"--price jev input: {number!r} is too large (at most 1000000)"
    )
    assert values.parse_price("jev=1000000/1")[1].input_nanos_per_million_tokens == 10**15


NEGATIVE_AMOUNTS = ["-$1", "$-1", "-1n", "- $0.25", "$ -0.25", "-0.5 USD"]


@pytest.mark.parametrize("text", NEGATIVE_AMOUNTS)
def test_a_negative_amount_is_refused_whichever_side_its_sign(text: str) -> None:
    """No amount the CLI sends (a limit, estimate, bill, charge or price) may be
    negative: '-$1' and '$-1' are the same mistake, refused the same way."""
    with pytest.raises(exits.CliError) as refused:
        values.parse_amount_nanos("--limit", text)
    assert refused.value.exit_code == exits.EXIT_BAD_VALUE
    assert refused.value.message == f"--limit: {text!r} is negative: an amount is 0 or more"


def test_amounts_print_as_usd_with_nine_decimals() -> None:
    assert render.usd(1400) == "$0.000001400"
    assert render.usd(500_000_000) == "$0.500000000"
    assert render.usd(0) == "$0.000000000"
    assert render.usd(-1) == "-$0.000000001"
    assert render.usd(12_345_000_000_001) == "$12345.000000001"


@pytest.mark.parametrize(
    ("text", "micros", "shown"),
    [
        ("90s", 90_000_000, "90s"),
        ("2m", 120_000_000, "2m"),
        ("24h", 86_400_000_000, "1d"),
        ("1d", 86_400_000_000, "1d"),
        ("250ms", 250_000, "250ms"),
        ("1.5s", 1_500_000, "1500ms"),
    ],
)
def test_durations_parse_and_print(text: str, micros: int, shown: str) -> None:
    value = values.parse_duration("--window", text)
    assert value.seconds * 1_000_000 + value.nanos // 1000 == micros
    assert render.duration_text(value) == shown


@pytest.mark.parametrize(
    "text", ["5x", "-1s", "1.0000001s", "1.0000000000000000000000000001s", "s", "99999999999d"]
)
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(exits.CliError, match=r"^--window: "):
        values.parse_duration("--window", text)


@pytest.mark.parametrize("text", ["24", "1.5", " 30 "])
def test_a_duration_without_a_unit_is_refused_showing_each_unit(text: str) -> None:
    # '--window 24' meant as hours was a 24-second window: a unit is never guessed.
    with pytest.raises(exits.CliError) as refused:
        values.parse_duration("--window", text)
    assert refused.value.exit_code == exits.EXIT_BAD_VALUE
    number = text.strip()
    assert refused.value.message == (
        f"--window: {number!r} has no unit (write {number}s, {number}m, {number}h or {number}d)"
    )


def test_prices_are_usd_per_million_tokens_or_nanos() -> None:
    model, price = values.parse_price("jev=0.10/0.40")
    assert (model, price.input_nanos_per_million_tokens) == ("jev", 100_000_000)
    assert price.output_nanos_per_million_tokens == 400_000_000
    model, price = values.parse_price("big/model=$3/15000000000n")
    assert (model, price.input_nanos_per_million_tokens) == ("big/model", 3_000_000_000)
    assert price.output_nanos_per_million_tokens == 15_000_000_000
    for text in ("jev", "jev=0.1", "=0.1/0.2", "jev=0.1/0.0000000001"):
        with pytest.raises(exits.CliError, match=r"^--price"):
            values.parse_price(text)


def test_grant_comes_from_the_flag_then_the_environment_then_the_admin_grant_file(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LEDGER_GRANT", raising=False)
    monkeypatch.setenv("LEDGER_DATA_DIR", str(tmp_path))
    assert connection.resolve_grant(None) == ("", "")
    (tmp_path / "admin.grant").write_text("from-file\n")
    assert connection.resolve_grant(None) == ("from-file", str(tmp_path / "admin.grant"))
    monkeypatch.setenv("LEDGER_GRANT", "from-env")
    assert connection.resolve_grant(None) == ("from-env", "LEDGER_GRANT")
    assert connection.resolve_grant("from-flag") == ("from-flag", "--grant")
    arguments = cli.parser().parse_args(["balance", "recall", "--server", "127.0.0.1:1"])
    with connection.connect(arguments) as session:
        assert session.metadata == (("authorization", "Bearer from-env"),)
        assert session.server == "127.0.0.1:1"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.mark.parametrize(
    "command",
    [
        ["balance", "recall"],
        ["lane", "list"],
        ["lane", "put", "recall", "--limit", "$0.50", "--price", JEV_PRICE],
        [
            "reserve",
            "recall",
            "r-1",
            "--model",
            "jev",
            "--request-bytes",
            "1",
            "--max-output-tokens",
            "1",
        ],
        ["history"],
    ],
)
def test_no_server_says_so_in_one_line(ledger: RunLedger, command: list[str]) -> None:
    address = f"127.0.0.1:{free_port()}"
    run = ledger(*command, "--server", address)
    assert UNREACHABLE.fullmatch(one_line_error(run))
    assert address in run.err
    assert run.code == exits.EXIT_UNREACHABLE


def test_migrate_on_a_database_that_does_not_answer_is_one_line(
    ledger: RunLedger, tmp_path: pathlib.Path
) -> None:
    url = f"postgresql+psycopg://postgres:s3cret@127.0.0.1:{free_port()}/nope"
    run = ledger("migrate", "--database-url", url, "--data-dir", str(tmp_path))
    assert one_line_error(run).startswith("ledger migrate: the database is unavailable (")
    assert "s3cret" not in run.err
    assert run.code == 2
    # What the driver said, so that the operator knows what to fix.
    assert "refused" in run.err.lower() or "connection" in run.err.lower(), run.err


@pytest.mark.postgres
@pytest.mark.parametrize("command", ["verify", "snapshot", "rebuild", "recover"])
def test_a_recovery_command_on_a_data_dir_with_no_database_creates_nothing(
    ledger: RunLedger, tmp_path: pathlib.Path, command: str
) -> None:
    nowhere = tmp_path / "nowhere"
    needed = ["--budget-seconds", "60"] if command == "recover" else []
    run = ledger(command, "--data-dir", str(nowhere), *needed)
    assert run.code == 2
    assert (
        one_line_error(run).strip() == f"ledger {command}: no database at {nowhere / 'ledger.db'}"
    )
    assert not nowhere.exists()


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--budget-seconds", "-1"],
         "--budget-seconds: the recovery budget must be a finite number of seconds >= 0"),
        (["--budget-seconds", "60", "--max-risk", "2"],
         "--max-risk: the largest acceptable risk score must be between 0 and 1"),
        (["--budget-seconds", "60", "--min-viable-sources", "0"],
         "--min-viable-sources: at least one viable source is needed"),
    ],
)  # fmt: skip
def test_a_bad_recovery_policy_is_refused_naming_its_flag_before_the_database(
    ledger: RunLedger, tmp_path: pathlib.Path, flags: list[str], said: str
) -> None:
    # `ledger recover --max-risk 2` opened the database first (a wrong --data-dir
    # said "no database" instead), then refused the policy without naming the flag.
    nowhere = tmp_path / "nowhere"
    run = ledger("recover", "--data-dir", str(nowhere), *flags)
    assert run.code == 2
    assert one_line_error(run).strip() == f"ledger recover: {said}"
    assert not nowhere.exists()


def test_verify_on_an_empty_database_file_says_there_is_none_and_leaves_it(
    ledger: RunLedger, tmp_path: pathlib.Path
) -> None:
    empty = tmp_path / "ledger.db"
    empty.touch()
    run = ledger("verify", "--data-dir", str(tmp_path))
    assert run.code == 2
    said = one_line_error(run).strip()
    assert said.startswith(f"ledger verify: {empty} is empty (0 bytes): there is no ledger in it")
    assert empty.stat().st_size == 0


def test_serve_on_an_empty_database_file_refuses_as_verify_does_and_leaves_it(
    ledger: RunLedger, tmp_path: pathlib.Path
) -> None:
    """A zero-byte ledger.db is most often a ledger lost (a copy to a full
    disk, a failed restore): `serve` does not make a new, empty ledger over
    it, as it does where no file is, and says what `verify` says. `ledger
    migrate`, asked in so many words, makes one (docs/recovery.md)."""
    empty = tmp_path / "ledger.db"
    empty.touch()
    settings = Settings(database_url=f"sqlite:///{empty}", data_dir=tmp_path, auth_enabled=False)
    with pytest.raises(ValueError) as refused:
        LedgerServer(settings)
    assert str(refused.value).startswith(f"{empty} is empty (0 bytes): there is no ledger in it")
    assert "backup" in str(refused.value) and "ledger migrate" in str(refused.value)
    assert empty.stat().st_size == 0
    assert ledger("migrate", "--data-dir", str(tmp_path)).code == 0
    assert ledger("verify", "--data-dir", str(tmp_path)).code == 0


def test_verify_on_a_database_that_is_not_there_says_what_the_server_said(
    ledger: RunLedger, tmp_path: pathlib.Path
) -> None:
    url = "postgresql+psycopg://postgres@127.0.0.1:5432/ledger_no_such_database?password=s3cret"
    run = ledger("verify", "--database-url", url, "--data-dir", str(tmp_path))
    said = one_line_error(run)
    assert said.startswith('ledger verify: the database "ledger_no_such_database" does not exist')
    assert "CREATE DATABASE" in said, said
    assert "s3cret" not in run.err
    assert run.code == 2


def test_a_server_that_never_answers_times_out(ledger: RunLedger) -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        began = time.monotonic()
        run = ledger("balance", "recall", "--server", address, "--timeout", "0.5")
        elapsed = time.monotonic() - began
    assert one_line_error(run) == (
        f"ledger: the ledger at {address} did not answer within 0.5 s (see --timeout)\n"
    )
    assert run.code == exits.EXIT_UNREACHABLE
    assert elapsed < 5


# Lanes ---------------------------------------------------------------------


def test_lane_put_show_and_list(target: LedgerProcess, ledger: RunLedger) -> None:
    put = put_recall(ledger, "lanes-a")
    assert "limit            $0.500000000 per 1d (rolling)" in put.out
    assert "price jev        in $0.100000000 / out $0.400000000 per million tokens" in put.out
    shown = ledger("lane", "show", "lanes-a")
    assert shown.code == 0
    assert shown.out == put.out
    as_json = ledger("lane", "show", "lanes-a", "--json").json()
    assert as_json["limit_nanos"] == 500_000_000
    assert as_json["prices"] == {
        "jev": {
            "input_nanos_per_million_tokens": 100_000_000,
            "output_nanos_per_million_tokens": 400_000_000,
        }
    }
    assert as_json["window"] == "86400s"
    assert as_json["expire_charge"] == "HOLD"
    listed = ledger("lane", "list")
    assert listed.code == 0
    assert listed.out.splitlines()[0].split() == [
        "LANE",
        "PARENT",
        "LIMIT",
        "WINDOW",
        "HOLD",
        "TTL",
        "MODELS",
        "VERSION",
        "UPDATED",
        "(UTC)",
    ]
    assert any(
        line.split()[:4] == ["lanes-a", "-", "$0.500000000", "1d"]
        for line in listed.out.splitlines()
    )
    listed_json = ledger("lane", "list", "--json").json()
    lanes = listed_json["lanes"]
    assert isinstance(lanes, list)
    assert "lanes-a" in [lane["lane"] for lane in lanes]


def test_lane_put_takes_every_option(target: LedgerProcess, ledger: RunLedger) -> None:
    run = ledger(
        "lane",
        "put",
        "lanes-b",
        "--limit",
        "2000000000n",
        "--price",
        "jev=100n/400n",
        "--price",
        "big=$3/$15",
        "--window",
        "2h",
        "--hold-ttl",
        "90s",
        "--bytes-per-token",
        "1.25",
        "--overhead-tokens",
        "64",
        "--expire-charge",
        "zero",
        "--json",
    )
    assert run.code == 0, run
    lane = run.json()
    assert lane["limit_nanos"] == 2_000_000_000
    assert lane["window"] == "7200s"
    assert lane["hold_ttl"] == "90s"
    assert lane["bytes_per_token"] == 1.25
    assert lane["overhead_tokens"] == 64
    assert lane["expire_charge"] == "ZERO"
    assert lane["prices"] == {
        "big": {
            "input_nanos_per_million_tokens": 3_000_000_000,
            "output_nanos_per_million_tokens": 15_000_000_000,
        },
        "jev": {"input_nanos_per_million_tokens": 100, "output_nanos_per_million_tokens": 400},
    }
    # Putting again replaces the policy and bumps the version.
    again = ledger("lane", "put", "lanes-b", "--limit", "$1", "--price", JEV_PRICE, "--json")
    assert again.json()["version"] > lane["version"]
    assert again.json()["limit_nanos"] == 1_000_000_000


def test_a_parent_budget_is_set_shown_and_listed(target: LedgerProcess, ledger: RunLedger) -> None:
    ledger("lane", "put", "team", "--limit", "300000n", "--price", JEV_PRICE)
    child = put_recall(ledger, "team-recall", "--parent", "team")
    assert "parent           team (a reserve must fit its budget too)" in child.out.splitlines()
    assert ledger("lane", "show", "team-recall").out == child.out
    assert ledger("lane", "show", "team-recall", "--json").json()["parent"] == "team"
    assert "parent" not in ledger("lane", "show", "team").out
    rows = [line.split() for line in ledger("lane", "list").out.splitlines()]
    assert ["team-recall", "team", "$0.500000000"] in [row[:3] for row in rows]
    assert ["team", "-", "$0.000300000"] in [row[:3] for row in rows]
    # The child's own budget has room; its parent's does not.
    assert reserve(ledger, "team-recall", "p-1").code == 0
    denied = reserve(ledger, "team-recall", "p-2")
    assert denied.code == exits.EXIT_DENIED
    assert denied.out.startswith("denied p-2 by the budget of team: budget exhausted: "), denied
    # A put replaces the whole policy: without --parent the lane has none.
    assert "parent" not in put_recall(ledger, "team-recall").out


# The moves -----------------------------------------------------------------


def test_reserve_settle_refund_and_balance(target: LedgerProcess, ledger: RunLedger) -> None:
    put_recall(ledger, "moves")
    admitted = reserve(ledger, "moves", "r-1")
    assert admitted.code == 0, admitted
    assert admitted.out.startswith("admitted r-1: hold $0.000280000 (cap $0.000280000), expires ")
    assert "spent $0.000280000 of $0.500000000" in admitted.out

    settled = ledger(
        "settle",
        "moves",
        "r-1",
        "--outcome",
        "succeeded",
        "--input-tokens",
        "1800",
        "--output-tokens",
        "150",
        "--http-status",
        "200",
    )
    assert settled.code == 0, settled
    # 1800 * 100 + 150 * 400 = 240_000 nanos: the real cost, not the hold.
    assert settled.out.splitlines()[0] == "settled r-1: charged $0.000240000"

    assert reserve(ledger, "moves", "r-2", "--estimate", "$0.0001", "--ttl", "30s").code == 0
    refunded = ledger("refund", "moves", "r-2", "--http-status", "403")
    assert refunded.code == 0, refunded
    assert refunded.out.splitlines()[0] == "refunded r-2: charged $0.000000000"
    assert "spent $0.000240000 of $0.500000000" in refunded.out

    assert reserve(ledger, "moves", "r-3").code == 0
    never_sent = ledger("refund", "moves", "r-3", "--reason", "the lane gave up")
    assert never_sent.code == 0, never_sent

    balance = ledger("balance", "moves", "--json").json()
    assert balance["spent_nanos"] == 240_000
    assert balance["charged_nanos"] == 240_000
    assert balance["held_nanos"] == 0
    assert balance["available_nanos"] == 500_000_000 - 240_000
    text = ledger("balance", "moves")
    assert text.code == 0
    assert "available      $0.499760000" in text.out.splitlines()


def test_an_unknown_outcome_is_charged_its_hold_never_more(
    target: LedgerProcess, ledger: RunLedger
) -> None:
    put_recall(ledger, "unknowns")
    assert reserve(ledger, "unknowns", "u-1").code == 0
    run = ledger(
        "settle", "unknowns", "u-1", "--outcome", "unknown", "--http-status", "504", "--json"
    )
    assert run.code == 0, run
    assert run.json()["charged_nanos"] == CAP_NANOS
    assert run.json()["state"] == "SETTLED_UNKNOWN"
    assert reserve(ledger, "unknowns", "u-2").code == 0
    lower = ledger("settle", "unknowns", "u-2", "--outcome", "unknown", "--billed", "1000n")
    assert lower.out.splitlines()[0] == "settled unknown u-2: charged $0.000001000"


def test_a_denial_is_an_answer_with_exit_code_4(target: LedgerProcess, ledger: RunLedger) -> None:
    ledger("lane", "put", "tight", "--limit", "300000n", "--price", JEV_PRICE)
    assert reserve(ledger, "tight", "t-1").code == 0
    denied = reserve(ledger, "tight", "t-2")
    assert denied.code == exits.EXIT_DENIED
    assert denied.err == ""
    assert denied.out.startswith("denied t-2: budget exhausted: ")
    assert "retry after " in denied.out
    never = ledger(
        "reserve",
        "tight",
        "t-3",
        "--model",
        "jev",
        "--request-bytes",
        "7000000",
        "--max-output-tokens",
        "0",
        "--json",
    )
    assert never.code == exits.EXIT_DENIED
    assert never.json()["denial_reason"] == "HOLD_EXCEEDS_LIMIT"
    assert "retry_after" not in never.json()


# History -------------------------------------------------------------------


def test_history_is_an_aligned_table(target: LedgerProcess, ledger: RunLedger) -> None:
    put_recall(ledger, "story")
    reserve(ledger, "story", "s-1")
    ledger("settle", "story", "s-1", "--outcome", "succeeded", "--input-tokens", "10")
    reserve(ledger, "story", "s-2")
    ledger("refund", "story", "s-2", "--http-status", "429")
    run = ledger("history", "story")
    assert run.code == 0, run
    lines = run.out.splitlines()
    assert lines[0].split() == [
        "SEQ",
        "TIME",
        "(UTC)",
        "KIND",
        "RESERVATION",
        "AMOUNT",
        "SPENT",
        "AFTER",
        "OUTCOME",
        "TRACE",
    ]
    assert [line.split()[2] for line in lines[1:]] == [
        "lane_configured",
        "reserved",
        "settled",
        "reserved",
        "refunded",
    ]
    # Every column starts at the same offset on every line.
    for name in ("KIND", "RESERVATION", "AMOUNT", "OUTCOME"):
        offset = lines[0].index(name)
        assert all(line[offset - 2 : offset] == "  " and line[offset] != " " for line in lines)
    settled = lines[3].split()
    assert settled[3:7] == ["s-1", "$0.000001000", "$0.000001000", "succeeded"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", settled[1])
    assert lines[5].split()[3:7] == ["s-2", "$0.000000000", "$0.000001000", "http"]

    one = ledger("history", "story", "--reservation-id", "s-2")
    assert [line.split()[2] for line in one.out.splitlines()[1:]] == ["reserved", "refunded"]
    newest = ledger("history", "story", "--limit", "2")
    assert [line.split()[2] for line in newest.out.splitlines()[1:]] == ["reserved", "refunded"]
    everyone = ledger("history")
    assert "LANE" in everyone.out.splitlines()[0]
    assert any(line.split()[2:4] == ["story", "refunded"] for line in everyone.out.splitlines())


def test_history_of_a_lane_needs_only_a_read_grant(
    target: LedgerProcess, ledger: RunLedger
) -> None:
    """docs/security.md: `read` is what a dashboard needs for ListEvents."""
    put_recall(ledger, "read-only")
    reserve(ledger, "read-only", "r-1")
    issued = ledger(
        "grant", "issue", "--lane", "read-only", "--scope", "read",
        "--data-dir", str(target.data_dir),
    )  # fmt: skip
    assert issued.code == 0, issued
    run = ledger("history", "read-only", "--json", "--grant", issued.out.strip())
    assert run.code == 0, run
    assert [json.loads(line)["kind"] for line in run.out.splitlines()] == [
        "lane_configured",
        "reserved",
    ]


def test_history_json_is_one_event_per_line(target: LedgerProcess, ledger: RunLedger) -> None:
    put_recall(ledger, "story-json")
    reserve(ledger, "story-json", "j-1")
    run = ledger("history", "story-json", "--json")
    events = [json.loads(line) for line in run.out.splitlines()]
    assert [event["kind"] for event in events] == ["lane_configured", "reserved"]
    assert events[1]["amount_nanos"] == CAP_NANOS
    assert events[1]["reservation_id"] == "j-1"
    assert events[0]["seq"] < events[1]["seq"]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _follower(arguments: list[str], environment: dict[str, str]) -> subprocess.Popen[str]:
    """`ledger history ... --follow`, which ends on Ctrl-C, as a process of its own."""
    return subprocess.Popen(
        [str(LEDGER), "history", *arguments, "--follow"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
        # Ctrl-C as at a terminal, even when these tests run where SIGINT is
        # ignored (a job sent to the background without job control), which
        # the follower would inherit.
        preexec_fn=_default_sigint,
    )


def test_history_follow_tails_until_ctrl_c(target: LedgerProcess, ledger: RunLedger) -> None:
    put_recall(ledger, "tail")
    environment = {**os.environ, "LEDGER_SERVER": target.address}
    follower = _follower(["tail"], environment)
    try:
        assert follower.stdout is not None
        lines = [follower.stdout.readline() for _ in range(2)]
        assert lines[0].startswith("SEQ")
        assert "lane_configured" in lines[1]
        assert reserve(ledger, "tail", "f-1").code == 0
        ready, _, _ = select.select([follower.stdout], [], [], 10)
        assert ready, "the new event did not arrive"
        assert follower.stdout.readline().split()[2:4] == ["reserved", "f-1"]
        follower.send_signal(signal.SIGINT)
        _, err = follower.communicate(timeout=10)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.communicate()
    assert follower.returncode == 0, err
    assert "Traceback" not in err


def test_history_follow_ends_when_the_server_freezes(tmp_path: pathlib.Path) -> None:
    """A server that stops answering (frozen, or behind a network that drops every
    packet) ends a follow with one line and exit 3, found by the CLI's keepalive
    pings: the stream has no deadline, so nothing else would end it."""
    # The server accepts client pings as often as every client_ping_min_interval_seconds.
    served = start_ledger_process(tmp_path, {"LEDGER_CLIENT_PING_MIN_INTERVAL_SECONDS": "1"})
    host, port = served.address.rsplit(":", 1)
    proxy = FreezingProxy(host, int(port))
    environment = {
        **server_environment(),
        "LEDGER_SERVER": f"127.0.0.1:{proxy.port}",
        "LEDGER_DATA_DIR": str(tmp_path),
        "LEDGER_CLIENT_KEEPALIVE_SECONDS": "2",
    }
    follower = _follower([], environment)
    try:
        assert follower.stdout is not None
        assert follower.stdout.readline().startswith("SEQ")
        proxy.freeze()
        started = time.monotonic()
        _, err = follower.communicate(timeout=30)
        took = time.monotonic() - started
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.communicate()
        proxy.close()
        served.stop()
    assert follower.returncode == exits.EXIT_UNREACHABLE, err
    assert "Traceback" not in err
    assert err.count("\n") == 1, err
    assert f"the ledger at 127.0.0.1:{proxy.port} " in err, err
    assert took < 15, took


def test_history_follow_goes_on_through_a_server_restart(tmp_path: pathlib.Path) -> None:
    """A stop ends every stream SHUTTING_DOWN, "open it again, after the last seq
    you saw": the follow did not (exit 1, "try again"); now it does, and prints
    what the restarted server writes, once and in order."""
    port = free_port()
    first = start_ledger_process(tmp_path, listen=f"127.0.0.1:{port}")
    environment = {
        **server_environment(),
        "LEDGER_SERVER": first.address,
        "LEDGER_DATA_DIR": str(tmp_path),
    }

    def cli(*arguments: str) -> None:
        done = subprocess.run([str(LEDGER), *arguments], env=environment, capture_output=True)
        assert done.returncode == 0, done

    def reserve_one(reservation_id: str) -> None:
        cli("reserve", "again", reservation_id, "--model", "jev", "--request-bytes", "7000",
            "--max-output-tokens", "200")  # fmt: skip

    cli("lane", "put", "again", "--limit", "$1", "--price", JEV_PRICE)
    follower = _follower(["again"], environment)
    second: LedgerProcess | None = None
    try:
        assert follower.stdout is not None and follower.stderr is not None
        assert follower.stdout.readline().startswith("SEQ")
        assert "lane_configured" in follower.stdout.readline()
        reserve_one("before-stop")
        assert follower.stdout.readline().split()[2:4] == ["reserved", "before-stop"]
        first.stop()
        assert "is stopping; following again after seq" in follower.stderr.readline()
        second = start_ledger_process(tmp_path, listen=f"127.0.0.1:{port}")
        reserve_one("after-restart")
        assert follower.stdout.readline().split()[2:4] == ["reserved", "after-restart"]
        follower.send_signal(signal.SIGINT)
        out, err = follower.communicate(timeout=10)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.communicate()
        first.stop()
        if second is not None:
            second.stop()
    assert follower.returncode == 0, err
    assert out == "" and "Traceback" not in err


class _Down(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    """What a call to a server that is not back gets."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def trailing_metadata(self) -> tuple[()]:
        return ()


def test_a_follow_whose_server_does_not_come_back_says_where_to_resume(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ledger_service.cli import reading

    class Ledger:
        looks = 0

        def ListEvents(self, request: pb.ListEventsRequest, **options: Any) -> None:
            Ledger.looks += 1
            assert request.after_seq in (0, 41) and options["wait_for_ready"]
            raise _Down()

    monkeypatch.setattr(reading, "FOLLOW_RESUME_SECONDS", 0.2)
    monkeypatch.setattr(reading, "FOLLOW_RESUME_TRY_SECONDS", 0.05)
    session = connection.Session("127.0.0.1:1", Ledger(), None, 5.0, ())  # type: ignore[arg-type]
    arguments = reading.argparse.Namespace(lane="again")
    with pytest.raises(exits.CliError) as ended:
        reading._wait_for_return(arguments, session, 41)
    assert ended.value.exit_code == exits.EXIT_UNREACHABLE
    assert ended.value.message.endswith("; resume with --after-seq 41")
    assert Ledger.looks >= 1
    # Before the first listing printed anything, --after-seq 0 would replay the whole log.
    with pytest.raises(exits.CliError) as ended:
        reading._wait_for_return(arguments, session, 0, printed=False)
    assert ended.value.message.endswith("; run the command again")


def test_a_follow_looks_for_its_stopped_server_at_least_once_a_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A follow whose server stopped waits for it (FOLLOW_RESUME_SECONDS), looking
    every FOLLOW_RESUME_TRY_SECONDS; but the CLI's channel had gRPC's own
    reconnect backoff (1 s, growing 1.6 times a failure up to 120 s), so the
    looks found no connection to try: with the server down 25 s, the follow
    printed the first event after its restart 7 s late, and under two restarts
    in a row (SIGTERM, then SIGKILL soon after) two of three follows printed
    nothing more for the 9 s the test ran on. A server back within the minute
    could be missed whole. The channel now tries a connection at least once a
    look."""
    from ledger_service.cli import reading

    given: dict[str, Any] = {}
    real = grpc.insecure_channel

    def channel(target: str, options: Any = ()) -> grpc.Channel:
        given.update(options)
        return real(target, options=options)

    monkeypatch.setattr(connection.grpc, "insecure_channel", channel)
    for variable in ("LEDGER_TLS_CA", "LEDGER_TLS_CLIENT_CERT", "LEDGER_TLS_CLIENT_KEY"):
        monkeypatch.delenv(variable, raising=False)
    arguments = reading.argparse.Namespace(
        server="127.0.0.1:1", grant="lg1.key.payload.signature", timeout=None
    )
    with connection.connect(arguments):
        pass
    look_ms = reading.FOLLOW_RESUME_TRY_SECONDS * 1000
    assert given.get("grpc.max_reconnect_backoff_ms", 120_000) <= look_ms
    assert given.get("grpc.initial_reconnect_backoff_ms", 1000) <= look_ms


class _Stopping(_Down):
    """What a call to a draining server gets: SHUTTING_DOWN, it did no work."""

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        from ledger_service.api.errors import REASON_KEY
        from ledger_service.domain.errors import ShuttingDown

        return ((REASON_KEY, ShuttingDown.reason),)


def test_a_follow_whose_server_stops_while_it_lists_goes_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ledger history --follow` lists the newest events before it streams. Under
    a write load on another replica that listing took seconds (one ListEvents a
    probe of the newest, each waiting for the appends in flight), and a SIGTERM
    to the replica meanwhile ended the follow, printing nothing ("the server is
    shutting down; try again", exit 3), where a stop of its stream is waited
    for. Now the listing waits for the server the same way and is made again."""
    from ledger_service.cli import reading

    class Ledger:
        lists = 0
        looks = 0

        def ListEvents(
            self, request: pb.ListEventsRequest, **options: Any
        ) -> pb.ListEventsResponse:
            if options.get("wait_for_ready"):  # the look for the server's return
                Ledger.looks += 1
                return pb.ListEventsResponse()
            Ledger.lists += 1
            if Ledger.lists == 1:
                raise _Stopping()
            events = [pb.Event(seq=seq, lane="again", kind="reserved") for seq in (5, 7)]
            return pb.ListEventsResponse(events=[e for e in events if e.seq > request.after_seq])

    followed: list[int] = []

    def follow(arguments: Any, session: Any, after_seq: int, *rest: Any) -> int:
        followed.append(after_seq)
        return 0

    monkeypatch.setattr(reading, "follow", follow)
    monkeypatch.setattr(reading, "FOLLOW_RESUME_TRY_SECONDS", 0.05)
    session = connection.Session("127.0.0.1:1", Ledger(), None, 5.0, ())  # type: ignore[arg-type]
    arguments = reading.argparse.Namespace(
        lane="again", reservation_id=None, limit="50", after_seq=None, follow=True, json=True
    )
    assert reading.history(arguments, session) == 0
    out, err = capsys.readouterr()
    assert [json.loads(line)["seq"] for line in out.splitlines()] == [5, 7]
    assert followed == [7]
    assert Ledger.looks == 1
    assert err == (
        "ledger: the ledger at 127.0.0.1:1 is stopping; listing again once it answers"
        " (at most 60 s)\n"
    )


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "ten", "1e9"])
def test_a_bad_client_keepalive_is_refused_before_any_call(
    target: LedgerProcess, ledger: RunLedger, monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    monkeypatch.setenv("LEDGER_CLIENT_KEEPALIVE_SECONDS", text)
    run = ledger("history")
    assert one_line_error(run).startswith("ledger: LEDGER_CLIENT_KEEPALIVE_SECONDS: ")
    assert run.code == exits.EXIT_BAD_VALUE


def test_a_keepalive_faster_than_the_server_takes_names_the_variable(
    target: LedgerProcess, ledger: RunLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gRPC says 'Too many pings' when the server ends the connection GOAWAY
    too_many_pings: the CLI said 'cannot reach the ledger ... is `ledger serve`
    running?' (exit 3) of a server that runs, and a retry meets the same. The
    line names the variable to fix, exit 2."""
    newest = ledger("history", "--json", "--limit", "1").out.splitlines()
    last_seq = json.loads(newest[-1])["seq"] if newest else 0
    monkeypatch.setenv("LEDGER_CLIENT_KEEPALIVE_SECONDS", "0.1")
    # From the log's last seq: a quiet stream (a seq past it is refused).
    run = ledger("history", "--follow", "--after-seq", str(last_seq))
    assert run.out.startswith("SEQ ") and run.out.count("\n") == 1  # the header, no event
    assert run.err == (
        f"ledger: the ledger at {target.address} ended the connection: pinged too often "
        "(GOAWAY too_many_pings); set LEDGER_CLIENT_KEEPALIVE_SECONDS at or above the "
        "server's client_ping_min_interval_seconds (4 by default)\n"
    )
    assert run.code == exits.EXIT_BAD_VALUE


def test_a_follow_from_past_the_log_says_so(target: LedgerProcess, ledger: RunLedger) -> None:
    """A --after-seq from another ledger, or from before a restore, followed
    silently forever; the server now refuses it, and the line names the flag."""
    run = ledger("history", "--follow", "--after-seq", str(2**62))
    # The error alone: no header of a table that never comes above it.
    assert run.out == ""
    assert run.err.startswith(
        f"ledger: bad value for --after-seq (field after_seq): {2**62} is past the end "
        "of this ledger's log, whose last seq is "
    )
    assert run.code == exits.EXIT_BAD_VALUE  # a value to fix, as the CLI's own refusals


def test_a_refused_follow_prints_its_error_alone(target: LedgerProcess, ledger: RunLedger) -> None:
    """A resumed follow the server refuses (here: no such lane) printed the
    table's header, then the error; the header waits for the stream to be accepted."""
    run = ledger("history", "nowhere", "--follow", "--after-seq", "0")
    assert run.out == ""
    assert one_line_error(run).startswith("ledger: lane 'nowhere' does not exist (LANE_NOT_FOUND)")
    assert run.code == exits.EXIT_FAILED


def test_the_client_keepalive_pings_no_faster_than_the_server_accepts() -> None:
    """The default interval keeps a margin over the server's default
    client_ping_min_interval_seconds, the fastest it takes a client's pings
    without GOAWAY too_many_pings."""
    options = dict(connection.keepalive_options(connection.DEFAULT_KEEPALIVE_SECONDS))
    server_default = Settings.__dataclass_fields__["client_ping_min_interval_seconds"].default
    assert options["grpc.keepalive_time_ms"] >= 1.25 * server_default * 1000
    assert options["grpc.http2.max_pings_without_data"] == 0


# Errors --------------------------------------------------------------------


def test_a_missing_parent_says_to_create_it_first(target: LedgerProcess, ledger: RunLedger) -> None:
    # The README's '--parent judge' on a fresh ledger said only that there is no such lane.
    run = ledger(
        "lane", "put", "child-1", "--limit", "$1", "--price", JEV_PRICE, "--parent", "judge"
    )
    assert one_line_error(run) == (
        "ledger: bad value for --parent (field lane.parent): there is no lane named 'judge': "
        "create the parent first, as a lane with its own limit\n"
    )
    assert run.code == exits.EXIT_BAD_VALUE


def test_a_mistake_exits_alike_whether_the_cli_or_the_server_finds_it(
    target: LedgerProcess, ledger: RunLedger
) -> None:
    # '--limit abc' was exit 2 (the CLI's parse) but '--limit $0' exit 1 (the
    # server's INVALID_ARGUMENT): the same mistake, a value to fix, told apart.
    local = ledger("lane", "put", "alike", "--limit", "abc", "--price", JEV_PRICE)
    remote = ledger("lane", "put", "alike", "--limit", "$0", "--price", JEV_PRICE)
    assert one_line_error(remote).startswith("ledger: bad value for --limit (field "), remote
    assert local.code == remote.code == exits.EXIT_BAD_VALUE, (local, remote)


@pytest.mark.parametrize(
    "command",
    [
        ["balance", "nowhere"],
        ["lane", "show", "nowhere"],
        ["history", "nowhere"],
        [
            "reserve",
            "nowhere",
            "r-1",
            "--model",
            "jev",
            "--request-bytes",
            "1",
            "--max-output-tokens",
            "1",
        ],
        ["settle", "nowhere", "r-1", "--outcome", "unknown"],
        ["refund", "nowhere", "r-1", "--http-status", "403"],
    ],
)
def test_an_unknown_lane_is_one_line(
    target: LedgerProcess, ledger: RunLedger, command: list[str]
) -> None:
    run = ledger(*command)
    # And what to do about it: a misspelled name is the usual cause.
    assert one_line_error(run) == (
        "ledger: lane 'nowhere' does not exist (LANE_NOT_FOUND): "
        "`ledger lane list` shows the lanes, `ledger lane put` creates one\n"
    )
    assert run.code == exits.EXIT_FAILED


def test_an_unknown_booking_is_one_line(target: LedgerProcess, ledger: RunLedger) -> None:
    put_recall(ledger, "bookings")
    run = ledger("settle", "bookings", "ghost", "--outcome", "unknown")
    assert "BOOKING_NOT_FOUND" in one_line_error(run)


@pytest.mark.parametrize(
    ("command", "option"),
    [
        (
            [
                "reserve",
                "checks",
                "r-1",
                "--model",
                "gpt",
                "--request-bytes",
                "5",
                "--max-output-tokens",
                "1",
            ],
            "--model",
        ),
        (
            [
                "reserve",
                "checks",
                "r-1",
                "--model",
                "jev",
                "--request-bytes",
                "5",
                "--max-output-tokens",
                "1",
                "--ttl",
                "1h",
            ],
            "--ttl",
        ),
        (
            [
                "reserve",
                "checks",
                "has space",
                "--model",
                "jev",
                "--request-bytes",
                "5",
                "--max-output-tokens",
                "1",
            ],
            "RESERVATION_ID",
        ),
        (
            # With usage: a SUCCEEDED settle without any is refused for that first.
            [
                "settle",
                "checks",
                "c-1",
                "--outcome",
                "succeeded",
                "--input-tokens",
                "10",
                "--http-status",
                "403",
            ],
            "--http-status",
        ),
        (["refund", "checks", "c-1"], "--reason"),
        (["lane", "put", "checks-2", "--limit", "$0", "--price", JEV_PRICE], "--limit"),
        (
            ["lane", "put", "checks-2", "--limit", "$1", "--price", JEV_PRICE, "--hold-ttl", "2d"],
            "--hold-ttl",
        ),
        (["lane", "put", "bad lane", "--limit", "$1", "--price", JEV_PRICE], "LANE"),
        (
            ["lane", "put", "checks-2", "--limit", "$1", "--price", JEV_PRICE, "--parent", "nope"],
            "--parent",
        ),
    ],
)
def test_a_bad_value_names_the_option_the_server_refused(
    target: LedgerProcess, ledger: RunLedger, command: list[str], option: str
) -> None:
    put_recall(ledger, "checks")
    if not reserve(ledger, "checks", "c-1").out:
        pytest.fail("setup: could not reserve c-1")
    run = ledger(*command)
    error = one_line_error(run)
    assert error.startswith(f"ledger: bad value for {option} (field "), error
    # A value to fix, exit 2, whether the CLI or the server found it.
    assert run.code == exits.EXIT_BAD_VALUE


@pytest.mark.parametrize(
    ("command", "start"),
    [
        (["lane", "put", "x", "--limit", "$0.0000000001", "--price", JEV_PRICE], "--limit: "),
        (["lane", "put", "x", "--limit", "$1", "--price", "jev"], "--price: "),
        (
            ["lane", "put", "x", "--limit", "$1", "--price", JEV_PRICE, "--price", JEV_PRICE],
            "--price: ",
        ),
        (
            ["lane", "put", "x", "--limit", "$1", "--price", JEV_PRICE, "--window", "5x"],
            "--window: ",
        ),
        (
            [
                "lane",
                "put",
                "x",
                "--limit",
                "$1",
                "--price",
                JEV_PRICE,
                "--bytes-per-token",
                "3.5555",
            ],
            "--bytes-per-token: ",
        ),
        (
            [
                "reserve",
                "x",
                "r",
                "--model",
                "jev",
                "--request-bytes",
                "ten",
                "--max-output-tokens",
                "1",
            ],
            "--request-bytes: ",
        ),
        (["history", "--limit", "0"], "--limit: "),
        # A negative count is as malformed as a negative amount: exit 2, no call.
        (["history", "--after-seq", "-1"], "--after-seq: '-1' is negative"),
        (["history", "--limit", "-1"], "--limit: '-1' is negative"),
        (["history", "x", "--follow", "--after-seq", "-1"], "--after-seq: '-1' is negative"),
        (
            [
                "reserve",
                "x",
                "r",
                "--model",
                "jev",
                "--request-bytes",
                "-5",
                "--max-output-tokens",
                "1",
            ],
            "--request-bytes: '-5' is negative",
        ),
        (
            [
                "reserve",
                "x",
                "r",
                "--model",
                "jev",
                "--request-bytes",
                "5",
                "--max-output-tokens",
                "-1",
            ],
            "--max-output-tokens: '-1' is negative",
        ),
        (
            ["settle", "x", "r", "--outcome", "succeeded", "--output-tokens", "-1"],
            "--output-tokens: '-1' is negative",
        ),
        (
            ["settle", "x", "r", "--outcome", "unknown", "--http-status", "-504"],
            "--http-status: '-504' is negative",
        ),
        (["refund", "x", "r", "--http-status", "-1"], "--http-status: '-1' is negative"),
        (
            ["lane", "put", "x", "--limit", "$1", "--price", JEV_PRICE, "--overhead-tokens", "-1"],
            "--overhead-tokens: '-1' is negative",
        ),
        (
            [
                "lane",
                "put",
                "x",
                "--limit",
                "$1",
                "--price",
                JEV_PRICE,
                "--max-charge-multiple",
                "-1",
            ],
            "--max-charge-multiple: '-1' is negative",
        ),
        # Past the ledger's bound (2^62 nanos): refused here, not sent for the server to refuse.
        (
            ["lane", "put", "x", "--limit", "$4611686018.427387905", "--price", JEV_PRICE],
            "--limit: '$4611686018.427387905' is too large (at most $4611686018.427387904)",
        ),
        (
            ["settle", "x", "r", "--outcome", "succeeded", "--billed", "4611686018427387905n"],
            "--billed: '4611686018427387905n' is too large (at most 4611686018427387904n)",
        ),
        (["audit", "x", "--biggest", "-1"], "--biggest: '-1' is negative"),
        (["balance", "x", "--timeout", "-1"], "--timeout: "),
        # The wire's 0 means "the default five": the CLI cannot ask for none.
        (["audit", "x", "--biggest", "0"], "--biggest: must be between 1 and 100"),
    ],
)
def test_a_malformed_value_is_refused_before_any_call(
    target: LedgerProcess, ledger: RunLedger, command: list[str], start: str
) -> None:
    run = ledger(*command)
    assert one_line_error(run).startswith(f"ledger: {start}")
    assert run.code == exits.EXIT_BAD_VALUE


@pytest.mark.parametrize("text", ["-$1", "$-1"])
@pytest.mark.parametrize("joined", [True, False], ids=["--limit=V", "--limit V"])
def test_a_negative_amount_is_a_usage_error_naming_its_option(
    target: LedgerProcess, ledger: RunLedger, text: str, joined: bool
) -> None:
    """README's exit codes: 2 for a malformed value on the command line, whichever
    way it is written, and before any call (the server would answer 1)."""
    limit = [f"--limit={text}"] if joined else ["--limit", text]
    run = ledger("lane", "put", "negative", *limit, "--price", JEV_PRICE)
    assert one_line_error(run) == (
        f"ledger: --limit: {text!r} is negative: an amount is 0 or more\n"
    )
    assert run.code == exits.EXIT_BAD_VALUE


@pytest.mark.parametrize(
    ("command", "said"),
    [
        ([], "ledger: the following arguments are required: COMMAND (see `ledger --help`)"),
        (["balance"], "ledger balance: the following arguments are required: LANE "
                      "(see `ledger balance --help`)"),
        (["settle", "recall", "r-1"], "ledger settle: the following arguments are required: "
                                      "--outcome (see `ledger settle --help`)"),
        (["grant", "issue", "--lane", "recall", "--scope", "nope"],
         "ledger grant issue: argument --scope: invalid choice: 'nope' (choose from 'charge', "
         "'read', 'admin') (see `ledger grant issue --help`)"),
        (["lane", "show", "recall", "extra"],
         "ledger lane show: unrecognized arguments: extra (see `ledger lane show --help`)"),
        (["snapshot", "--keep", "3"],
         "ledger snapshot: unrecognized arguments: --keep 3 (see `ledger snapshot --help`)"),
    ],
)  # fmt: skip
def test_a_usage_error_is_one_line_naming_what_is_wrong(
    ledger: RunLedger, command: list[str], said: str
) -> None:
    """README: exit 2 for a malformed command line, and one line, not argparse's
    usage block (every command's usage is in its --help)."""
    run = ledger(*command)
    assert one_line_error(run) == said + "\n"
    assert run.code == exits.EXIT_BAD_VALUE


def test_a_contradicting_move_fails_with_its_reason(
    target: LedgerProcess, ledger: RunLedger
) -> None:
    put_recall(ledger, "contradictions")
    reserve(ledger, "contradictions", "x-1")
    assert ledger("refund", "contradictions", "x-1", "--http-status", "403").code == 0
    run = ledger("settle", "contradictions", "x-1", "--outcome", "succeeded", "--input-tokens", "5")
    assert one_line_error(run).endswith("(BOOKING_ALREADY_ENDED)\n")
    conflict = reserve(ledger, "contradictions", "x-1", "--estimate", "1n")
    assert one_line_error(conflict).endswith("(RESERVATION_ID_REUSED)\n")


def test_a_missing_or_refused_grant_is_one_line(
    target: LedgerProcess,
    ledger: RunLedger,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: pathlib.Path,
) -> None:
    monkeypatch.setenv("LEDGER_DATA_DIR", str(tmp_path))
    missing = ledger("lane", "list")
    assert "needs a grant and none was found: pass --grant" in one_line_error(missing)
    assert missing.code == exits.EXIT_FAILED
    refused = ledger("lane", "list", "--grant", "not-a-grant")
    assert "refused the grant from --grant (" in one_line_error(refused)
    # A grant of another keyring: the hint names its key and whose keyring to ask.
    other = tmp_path / "other"
    keyring.load_or_create(other)
    issued = ledger(
        "grant", "issue", "--lane", "recall", "--scope", "read", "--data-dir", str(other)
    )
    foreign = issued.out.strip()
    key_id = decode_unverified(foreign).key_id
    said = one_line_error(ledger("lane", "list", "--grant", foreign))
    assert f"refused the grant from --grant, signed by key {key_id} (" in said, said
    assert "`ledger grant inspect --data-dir DIR`, DIR that server's data directory" in said


def test_an_expired_grant_is_one_line_saying_when_it_expired_and_what_to_do(
    target: LedgerProcess, ledger: RunLedger
) -> None:
    """The server's refusal is the same for every bad grant (docs/security.md);
    the CLI holds the grant, so it reads its expiry itself and says so."""
    from ledger_service.domain.grants import Scope
    from ledger_service.storage import keyring

    hour_us = 3_600_000_000
    issued_at_us = (int(time.time()) - 7200) * 1_000_000
    expired = keyring.load(target.data_dir).issue(
        ["recall"], [Scope.READ], issued_at_us=issued_at_us, expires_at_us=issued_at_us + hour_us
    )
    run = ledger("balance", "recall", "--grant", expired)
    line = one_line_error(run)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime((issued_at_us + hour_us) // 1_000_000))
    assert f"the grant from --grant expired at {when}" in line, line
    assert "ledger grant issue" in line, line
    assert run.code == exits.EXIT_FAILED


def test_the_server_option_wins_over_the_environment(
    target: LedgerProcess, ledger: RunLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LEDGER_SERVER", f"127.0.0.1:{free_port()}")
    assert ledger("lane", "list").code == exits.EXIT_UNREACHABLE
    assert ledger("lane", "list", "--server", target.address).code == 0


def test_json_values_keep_amounts_as_integers() -> None:
    event = pb.Event(seq=7, kind="settled", amount_nanos=2**62, outcome=pb.UNKNOWN)
    event.billed_nanos = 0
    value = render.message_json(event)
    assert value["amount_nanos"] == 2**62
    assert value["billed_nanos"] == 0
    assert "estimate_nanos" not in value
    assert "occurred_at" not in value
    assert value["outcome"] == "UNKNOWN"


def test_an_rpc_error_without_a_status_is_still_one_line() -> None:
    arguments = cli.parser().parse_args(["balance", "recall", "--server", "127.0.0.1:9"])
    with connection.connect(arguments) as session:
        error = connection.explain(grpc.RpcError(), session)
    assert error.message == "the call to the ledger at 127.0.0.1:9 failed"


class _Unavailable(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    """A server that answered: it cannot take the call now (its database, or its stop)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the ledger's database did not answer"

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("ledger-reason", self.reason),)


@pytest.mark.parametrize("reason", ["STORE_UNAVAILABLE", "SHUTTING_DOWN"])
def test_an_unavailable_server_exits_3_so_a_script_tries_again(reason: str) -> None:
    """UNAVAILABLE with a reason is the retry answer of errors.json, not a refusal:
    the exit status is the one for "try again", as for a server that did not answer."""
    arguments = cli.parser().parse_args(["balance", "recall", "--server", "127.0.0.1:9"])
    with connection.connect(arguments) as session:
        error = connection.explain(_Unavailable(reason), session)
    assert error.exit_code == exits.EXIT_UNREACHABLE
    assert error.message == f"the ledger's database did not answer ({reason})"


# Reconcile -----------------------------------------------------------------


def booked_for_reconciling(ledger: RunLedger, lane: str) -> None:
    """u-1 charged its hold (UNKNOWN), s-1 its real cost, o-1 still open."""
    put_recall(ledger, lane)
    assert reserve(ledger, lane, "u-1").code == 0
    assert ledger("settle", lane, "u-1", "--outcome", "unknown").code == 0
    assert reserve(ledger, lane, "s-1").code == 0
    settled = ledger("settle", lane, "s-1", "--outcome", "succeeded", "--input-tokens", "10")
    assert settled.code == 0
    assert reserve(ledger, lane, "o-1").code == 0


def test_reconcile_dry_run_then_apply(
    target: LedgerProcess, ledger: RunLedger, tmp_path: pathlib.Path
) -> None:
    booked_for_reconciling(ledger, "bill")
    export = tmp_path / "usage.csv"
    export.write_text(
        "reservation_id,billed_usd\nu-1,0.00019\ns-1,0.000001\no-1,0.0001\nghost,0.0001\n"
    )
    dry = ledger("reconcile", str(export), "--lane", "bill", "--dry-run")
    assert dry.code == 0, dry
    lines = dry.out.splitlines()
    assert lines[0].split() == ["LINE", "LANE", "RESERVATION", "STATUS", "BEFORE", "->", "AFTER",
                                "MESSAGE"]  # fmt: skip
    assert lines[1].split() == ["2", "bill", "u-1", "corrected", "$0.000280000", "->",
                                "$0.000190000"]  # fmt: skip
    assert lines[2].split()[:7] == ["3", "bill", "s-1", "matched", "$0.000001000", "->",
                                    "$0.000001000"]  # fmt: skip
    assert lines[3].split()[:4] == ["4", "bill", "o-1", "open"]
    assert lines[4].split()[:5] == ["5", "bill", "ghost", "unmatched", "-"]
    assert "no such booking in this lane" in lines[4]
    assert lines[6:] == [
        "dry run: nothing changed; without --dry-run this file would apply: "
        "1 corrected, 1 matched, 1 unmatched, 0 disagreeing",
        "estimated before  $0.000280000",
        "real after        $0.000190000",
        "difference        -$0.000090000",
    ]
    assert ledger("balance", "bill", "--json").json()["charged_nanos"] == CAP_NANOS + 1000

    applied = ledger("reconcile", str(export), "--lane", "bill", "--json")
    assert applied.code == 0, applied
    response = applied.json()
    assert response["applied"] is True
    assert response["corrected_count"] == 1
    assert response["difference_nanos"] == -90_000
    assert [row["line"] for row in response["rows"]] == [2, 3, 4, 5]
    assert ledger("balance", "bill", "--json").json()["charged_nanos"] == 190_000 + 1000
    # An operator's move: the audit names the grant that made it, as a correction's does.
    history = [json.loads(line) for line in ledger("history", "bill", "--json").out.splitlines()]
    [reconciled] = [event for event in history if event["kind"] == "reconciled"]
    assert reconciled["grant_id"]
    again = ledger("reconcile", str(export), "--lane", "bill")
    assert again.code == 0
    assert again.out.splitlines()[1].split()[3] == "matched"
    assert "\napplied: 0 corrected, 2 matched, 1 unmatched, 0 disagreeing\n" in again.out


def test_reconcile_lane_is_the_lane_of_rows_naming_none_not_a_filter(
    target: LedgerProcess, ledger: RunLedger, tmp_path: pathlib.Path
) -> None:
    """ReconcileRequest.default_lane (the proto): `--lane` fills in rows that name
    no lane; a row naming its own lane is reconciled there. README and --help say so."""
    booked_for_reconciling(ledger, "home")
    booked_for_reconciling(ledger, "away")
    export = tmp_path / "mixed.csv"
    export.write_text("reservation_id,lane,billed_nanos\nu-1,,100\nu-1,away,200\n")
    dry = ledger("reconcile", str(export), "--lane", "home", "--dry-run")
    assert dry.code == 0, dry
    rows = [line.split()[:4] for line in dry.out.splitlines()[1:3]]
    assert rows == [["2", "home", "u-1", "corrected"], ["3", "away", "u-1", "corrected"]]
    help_text = " ".join(ledger("reconcile", "--help").out.split())
    assert "the lane of rows that name none (not a filter" in help_text
    readme = " ".join((pathlib.Path(__file__).parents[1] / "README.md").read_text().split())
    assert "`--lane LANE` is the lane of the rows that name none, not a filter" in readme


def test_reconcile_bad_rows_exit_1_with_their_lines_and_fields(
    target: LedgerProcess, ledger: RunLedger, tmp_path: pathlib.Path
) -> None:
    booked_for_reconciling(ledger, "bad-bill")
    export = tmp_path / "usage.jsonl"
    export.write_text(
        '{"lane": "bad-bill", "reservation_id": "u-1", "billed_nanos": 5}\n'
        '{"lane": "bad-bill", "reservation_id": "u-1", "billed_usd": "0.0000000001"}\n'
        "\n"
        "not json\n"
    )
    run = ledger("reconcile", str(export))
    assert run.code == exits.EXIT_FAILED
    assert run.err == "ledger: not applied: 2 bad rows (lines 2, 4); nothing changed\n"
    rows = [line.split() for line in run.out.splitlines()[1:4]]
    assert rows[0][:4] == ["1", "bad-bill", "u-1", "not_applied"]
    assert rows[1][:6] == ["2", "bad-bill", "u-1", "bad", "-", "billed_usd:"]
    assert rows[2][:6] == ["4", "-", "-", "bad", "-", "content:"]
    assert "not applied: the file has bad rows, so nothing changed: 2 bad, 1 not checked" in run.out
    assert ledger("balance", "bad-bill", "--json").json()["charged_nanos"] == CAP_NANOS + 1000
    # A dry run of the same file fails the same way: it would not apply.
    assert ledger("reconcile", str(export), "--dry-run", "--json").code == exits.EXIT_FAILED


def test_reconcile_rows_without_a_lane_say_to_pass_lane(
    target: LedgerProcess, ledger: RunLedger, tmp_path: pathlib.Path
) -> None:
    # An export with no lane column, without --lane: each row said only 'lane: is required'.
    booked_for_reconciling(ledger, "no-lane")
    export = tmp_path / "usage.csv"
    export.write_text("reservation_id,billed_nanos\nu-1,100\n")
    run = ledger("reconcile", str(export))
    assert run.code == exits.EXIT_FAILED
    assert run.err == (
        "ledger: not applied: 1 bad row (line 2); nothing changed; "
        "rows that name no lane need --lane LANE\n"
    )
    assert ledger("reconcile", str(export), "--lane", "no-lane", "--dry-run").code == 0


def test_reconcile_refuses_an_unknown_lane_up_front(
    target: LedgerProcess, ledger: RunLedger, tmp_path: pathlib.Path
) -> None:
    # `--lane nosuch` reported every row "no such booking in this lane" and exited 0.
    export = tmp_path / "usage.csv"
    export.write_text("reservation_id,billed_nanos\nu-1,100\n")
    for dry_run in ([], ["--dry-run"]):
        run = ledger("reconcile", str(export), "--lane", "nosuch", *dry_run)
        assert run.code == exits.EXIT_FAILED, run
        assert run.out == ""
        assert run.err.startswith("ledger: lane 'nosuch' does not exist (LANE_NOT_FOUND)"), run


def test_reconcile_refuses_what_it_cannot_send(
    target: LedgerProcess, ledger: RunLedger, tmp_path: pathlib.Path
) -> None:
    unknown = tmp_path / "usage.txt"
    unknown.write_text("reservation_id,billed_nanos\nx,1\n")
    run = ledger("reconcile", str(unknown))
    assert "cannot tell the format" in one_line_error(run)
    assert run.code == exits.EXIT_BAD_VALUE
    huge = tmp_path / "huge.csv"
    with huge.open("wb") as out:
        out.truncate(reconcile.MAX_EXPORT_BYTES + 1)
    run = ledger("reconcile", str(huge))
    assert one_line_error(run) == (
        f"ledger: FILE: {huge} is larger than 4 MiB: split the export into smaller files\n"
    )
    assert run.code == exits.EXIT_BAD_VALUE
    missing = ledger("reconcile", str(tmp_path / "nowhere.csv"))
    assert "FILE: there is no file" in one_line_error(missing)
    headless = tmp_path / "headless.csv"
    headless.write_text("lane,billed_nanos\nx,1\n")
    run = ledger("reconcile", str(headless))
    assert one_line_error(run).startswith("ledger: bad value for FILE (field content): ")


# TLS -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Pem:
    """The files of the TLS tests: a CA, its client, and a rogue CA with its own client."""

    ca: pathlib.Path
    rogue_ca: pathlib.Path
    client_cert: pathlib.Path
    client_key: pathlib.Path
    rogue_cert: pathlib.Path
    rogue_key: pathlib.Path
    server_cert: pathlib.Path
    server_key: pathlib.Path


@pytest.fixture(scope="module")
def pem(tmp_path_factory: pytest.TempPathFactory) -> Pem:
    directory = tmp_path_factory.mktemp("pem")

    def write(name: str, content: bytes) -> pathlib.Path:
        path = directory / name
        path.write_bytes(content)
        path.chmod(0o600)
        return path

    def pair(name: str, issued: Issued) -> tuple[pathlib.Path, pathlib.Path]:
        return write(f"{name}.pem", issued.certificate_pem), write(f"{name}.key", issued.key_pem)

    ca, rogue_ca = make_ca("ledger test CA"), make_ca("rogue CA")
    client_cert, client_key = pair("client", issue(ca, "lane recall", server=False))
    rogue_cert, rogue_key = pair("rogue", issue(rogue_ca, "lane recall", server=False))
    # Issued to localhost and 127.0.0.1.
    server_cert, server_key = pair("server", issue(ca, "localhost", server=True))
    return Pem(
        write("ca.pem", ca.certificate_pem),
        write("rogue-ca.pem", rogue_ca.certificate_pem),
        client_cert,
        client_key,
        rogue_cert,
        rogue_key,
        server_cert,
        server_key,
    )


@pytest.fixture(scope="module")
def tls_servers(
    pem: Pem, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, LedgerServer]]:
    """'tls': serves TLS; 'mutual': demands a client certificate signed by the test CA."""
    servers: dict[str, LedgerServer] = {}
    try:
        for name, client_ca in (("tls", None), ("mutual", pem.ca)):
            data_dir = tmp_path_factory.mktemp(f"ledger-{name}")
            settings = Settings(
                database_url=f"sqlite:///{data_dir}/ledger.db",
                data_dir=data_dir,
                listen="127.0.0.1:0",
                tls_cert_path=pem.server_cert,
                tls_key_path=pem.server_key,
                tls_client_ca_path=client_ca,
            )
            servers[name] = LedgerServer(settings)
            servers[name].start()
        yield servers
    finally:
        for server in servers.values():
            server.stop(0)


def aim_at(server: LedgerServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """Clears the LEDGER_* settings, points LEDGER_DATA_DIR at the server's admin grant."""
    for key in [key for key in os.environ if key.startswith("LEDGER_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("LEDGER_DATA_DIR", str(server.settings.data_dir))
    return f"127.0.0.1:{server.port}"


def test_tls_round_trip_and_the_name_checked(
    tls_servers: dict[str, LedgerServer],
    pem: Pem,
    ledger: RunLedger,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    address = aim_at(tls_servers["tls"], monkeypatch)
    tls = ("--server", address, "--tls-ca", str(pem.ca))
    put = ledger("lane", "put", "secure", "--limit", "$0.50", "--price", JEV_PRICE, *tls)
    assert put.code == 0, put
    assert ledger("balance", "secure", *tls, "--tls-server-name", "localhost").code == 0
    elsewhere = ledger("balance", "secure", *tls, "--tls-server-name", "ledger.example")
    assert one_line_error(elsewhere) == (
        f"ledger: TLS: the certificate of the ledger at {address} is not issued to "
        "ledger.example (see --tls-server-name)\n"
    )
    # A TLS setting to fix, not a server to wait for: retrying never helps (exit 2, not 3).
    assert elsewhere.code == exits.EXIT_BAD_VALUE
    plaintext = ledger("balance", "secure", "--server", address)
    assert one_line_error(plaintext) == (
        f"ledger: the ledger at {address} serves TLS and this command spoke plaintext: "
        "pass --tls-ca (and --tls-cert and --tls-key if it demands a client certificate)\n"
    )
    assert plaintext.code == exits.EXIT_BAD_VALUE


def test_a_wrong_ca_is_one_line(
    tls_servers: dict[str, LedgerServer],
    pem: Pem,
    ledger: RunLedger,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    address = aim_at(tls_servers["tls"], monkeypatch)
    monkeypatch.setenv("LEDGER_TLS_CA", str(pem.rogue_ca))
    run = ledger("lane", "list", "--server", address)
    assert one_line_error(run) == (
        f"ledger: TLS: the certificate of the ledger at {address} is not signed by the CA in "
        "LEDGER_TLS_CA (CERTIFICATE_VERIFY_FAILED)\n"
    )
    assert run.code == exits.EXIT_BAD_VALUE
    # The option wins over the environment.
    assert ledger("lane", "list", "--server", address, "--tls-ca", str(pem.ca)).code == 0


def test_mutual_tls_round_trip(
    tls_servers: dict[str, LedgerServer],
    pem: Pem,
    ledger: RunLedger,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LEDGER_SERVER", aim_at(tls_servers["mutual"], monkeypatch))
    monkeypatch.setenv("LEDGER_TLS_CA", str(pem.ca))
    monkeypatch.setenv("LEDGER_TLS_CLIENT_CERT", str(pem.client_cert))
    monkeypatch.setenv("LEDGER_TLS_CLIENT_KEY", str(pem.client_key))
    put = ledger("lane", "put", "mutual", "--limit", "$0.50", "--price", JEV_PRICE)
    assert put.code == 0, put
    assert reserve(ledger, "mutual", "m-1").code == 0

    monkeypatch.setenv("LEDGER_TLS_CLIENT_CERT", str(pem.rogue_cert))
    monkeypatch.setenv("LEDGER_TLS_CLIENT_KEY", str(pem.rogue_key))
    rogue = ledger("balance", "mutual")
    assert one_line_error(rogue).endswith(
        "closed the connection during the handshake: does it trust the CA of the client "
        "certificate in LEDGER_TLS_CLIENT_CERT?\n"
    )
    assert rogue.code == exits.EXIT_BAD_VALUE
    flags = ("--tls-cert", str(pem.client_cert), "--tls-key", str(pem.client_key))
    assert ledger("balance", "mutual", *flags).code == 0

    monkeypatch.delenv("LEDGER_TLS_CLIENT_CERT")
    monkeypatch.delenv("LEDGER_TLS_CLIENT_KEY")
    none = ledger("balance", "mutual")
    assert one_line_error(none).endswith(
        "closed the connection during the handshake: does it demand a client certificate "
        "(--tls-cert and --tls-key)?\n"
    )
    assert none.code == exits.EXIT_BAD_VALUE


def test_tls_to_a_plaintext_server_says_so(
    target: LedgerProcess, pem: Pem, ledger: RunLedger
) -> None:
    run = ledger("lane", "list", "--tls-ca", str(pem.ca))
    assert one_line_error(run) == (
        f"ledger: TLS: the ledger at {target.address} does not speak TLS "
        "(WRONG_VERSION_NUMBER); leave out --tls-ca, --tls-cert and --tls-key\n"
    )
    assert run.code == exits.EXIT_BAD_VALUE


def test_a_server_that_closes_without_tls_is_still_unreachable(
    ledger: RunLedger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection closed by something that does not speak TLS either (a proxy with
    no backend) may answer later: exit 3, try again, not a TLS setting to fix."""
    for key in [key for key in os.environ if key.startswith("LEDGER_")]:
        monkeypatch.delenv(key)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        stop = False

        def close_every_connection() -> None:
            while not stop:
                try:
                    accepted, _ = listener.accept()
                except OSError:
                    return
                accepted.close()

        closer = threading.Thread(target=close_every_connection, daemon=True)
        closer.start()
        run = ledger("lane", "list", "--server", address, "--timeout", "2")
        stop = True
    assert run.code == exits.EXIT_UNREACHABLE, run
    assert "Traceback" not in run.err


def test_bad_tls_options_are_refused_before_any_call(
    pem: Pem, ledger: RunLedger, monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    for key in [key for key in os.environ if key.startswith("LEDGER_")]:
        monkeypatch.delenv(key)
    # The traditional PEM form says it is encrypted only in a header inside it.
    private = serialization.load_pem_private_key(pem.client_key.read_bytes(), password=None)
    encrypted_key = tmp_path / "encrypted.key"
    encrypted_key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    cases = [
        (["--tls-cert", str(pem.client_cert)], "--tls-cert needs --tls-key: "),
        (["--tls-key", str(pem.client_key)], "--tls-key needs --tls-cert: "),
        (["--tls-ca", str(tmp_path / "none.pem")], "--tls-ca: there is no file "),
        (["--tls-ca", str(pem.client_key)], "--tls-ca: "),
        (["--tls-ca", str(pem.ca), "--tls-cert", str(pem.ca), "--tls-key", str(pem.ca)],
         "--tls-key: "),
        (["--tls-server-name", "localhost"], "--tls-server-name needs --tls-ca"),
        # A key of another certificate once reached gRPC, which printed its own
        # log lines and "Failed to create security handshaker", naming no option.
        (["--tls-ca", str(pem.ca), "--tls-cert", str(pem.client_cert),
          "--tls-key", str(pem.rogue_key)],
         f"--tls-key {pem.rogue_key} is not the key of the certificate in --tls-cert"),
        (["--tls-ca", str(pem.ca), "--tls-cert", str(pem.client_cert),
          "--tls-key", str(encrypted_key)],
         f"--tls-key {encrypted_key}: is encrypted; gRPC needs an unencrypted key"),
    ]  # fmt: skip
    for options, start in cases:
        run = ledger("lane", "list", "--server", "127.0.0.1:9", *options)
        assert one_line_error(run).startswith(f"ledger: {start}"), (options, run)
        assert run.code == exits.EXIT_BAD_VALUE


def test_a_taken_port_is_one_clear_line_and_exit_status_1(
    ledger_process: LedgerProcess, tmp_path: pathlib.Path
) -> None:
    """A second `ledger serve` on the same address (a newcomer's second `make
    run`) says why in one line, without a traceback."""
    finished = subprocess.run(
        [str(LEDGER), "serve", "--listen", ledger_process.address, "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=server_environment(),
        timeout=START_SECONDS + STOP_SECONDS,
        check=False,
    )
    assert finished.returncode == 1
    assert f"ledger: cannot listen on {ledger_process.address}: the port is taken" in (
        finished.stderr
    )
    # The causes are alternatives, and read as such (they once read as both true).
    alternatives = "(is another ledger running?) or the address is not this machine's;"
    assert alternatives in finished.stderr
    # And what to do: pick another address, and tell the commands about it.
    assert "choose another with --listen HOST:PORT or LEDGER_LISTEN" in finished.stderr
    assert "LEDGER_SERVER" in finished.stderr
    assert "Traceback" not in finished.stderr
    assert "ledger listening" not in finished.stdout
