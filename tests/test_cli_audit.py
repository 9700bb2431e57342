"""What a first-use audit of the CLI found: values written in other scripts'
digits taken as numbers, a --timeout of NaN, a stdout that cannot be written
(closed, or a full disk) and a `ledger migrate` given a database it cannot use,
each of which ended in a traceback or a silently accepted value instead of one
line and a documented exit code.

The value tests need no server; the stdout and migrate tests run the CLI as a
subprocess, since only a real process has a real stdout. None needs a server:
a command that cannot reach one still has to say so on one line.
"""

from __future__ import annotations

import pathlib
import subprocess

import pytest

from ledger_service.cli import exits, values
from ledger_service.domain.grants import MAX_GRANT_LENGTH
from ledger_service.storage import keyring
from tests.test_cli import LEDGER, server_environment

COMMAND_SECONDS = 60
# Arabic-Indic and fullwidth digits: str.isdigit() and Decimal() take them, a ledger must not.
OTHER_DIGITS = ["$\u0661", "\u0665 USD", "\uff11n", "$\u0660.\u0665"]


@pytest.mark.parametrize("text", OTHER_DIGITS)
def test_an_amount_in_other_digits_is_refused(text: str) -> None:
    with pytest.raises(exits.CliError) as refused:
        values.parse_amount_nanos("--estimate", text)
    assert refused.value.exit_code == exits.EXIT_BAD_VALUE
    assert "is not an amount" in refused.value.message


def test_a_price_in_other_digits_is_refused() -> None:
    with pytest.raises(exits.CliError) as refused:
        values.parse_price("jev=\u0661/0.40")
    assert refused.value.exit_code == exits.EXIT_BAD_VALUE


@pytest.mark.parametrize("text", ["\u0661\u0660s", "\uff11d"])
def test_a_duration_in_other_digits_is_refused(text: str) -> None:
    with pytest.raises(exits.CliError) as refused:
        values.parse_duration("--ttl", text)
    assert refused.value.exit_code == exits.EXIT_BAD_VALUE


@pytest.mark.parametrize(
    ("parse", "text"),
    [
        (lambda text: values.parse_count("--request-bytes", text), "\u0661\u0660"),
        (values.parse_bytes_per_token, "\u0663.\u0665"),
        (values.parse_timeout_seconds, "\u0661"),
    ],
)
def test_a_number_in_other_digits_is_refused(parse: object, text: str) -> None:
    with pytest.raises(exits.CliError) as refused:
        parse(text)  # type: ignore[operator]
    assert refused.value.exit_code == exits.EXIT_BAD_VALUE


@pytest.mark.parametrize("text", ["nan", "NaN", "sNaN", "-nan"])
def test_a_timeout_of_nan_is_refused_on_one_line(text: str) -> None:
    with pytest.raises(exits.CliError) as refused:
        values.parse_timeout_seconds(text)
    assert refused.value.exit_code == exits.EXIT_BAD_VALUE
    assert refused.value.message.startswith(f"--timeout: {text!r} is not a number of seconds")


@pytest.mark.parametrize("text", ["1e-400", "0.0e5"])
def test_a_timeout_that_is_zero_as_a_float_is_refused(text: str) -> None:
    """'1e-400' passed as above 0 and went out as a deadline of 0 s: exit 3,
    'did not answer within 0 s', a mistake of the command line taken for an
    unreachable ledger."""
    with pytest.raises(exits.CliError) as refused:
        values.parse_timeout_seconds(text)
    assert refused.value.exit_code == exits.EXIT_BAD_VALUE


@pytest.mark.parametrize("text", ["0", "3600.5"])
def test_a_refused_timeout_states_the_range_it_takes(text: str) -> None:
    """`--timeout 0` was refused as 'not a number of seconds between 0 and
    3600', a range that reads as taking 0."""
    with pytest.raises(exits.CliError) as refused:
        values.parse_timeout_seconds(text)
    assert refused.value.message == (
        f"--timeout: {text!r} is not a number of seconds above 0 and at most 3600"
    )


def run_ledger(*arguments: str, **options: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LEDGER), *arguments],
        capture_output=True,
        text=True,
        env=server_environment(),
        timeout=COMMAND_SECONDS,
        check=False,
        **options,  # type: ignore[call-overload]
    )


def test_a_full_disk_on_stdout_is_one_line_and_status_1(tmp_path: pathlib.Path) -> None:
    """`grant issue` prints a grant and needs no server; /dev/full refuses every write."""
    keyring.load_or_create(tmp_path)
    issue = ["grant", "issue", "--lane", "x", "--scope", "read", "--data-dir", str(tmp_path)]
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [str(LEDGER), *issue],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            env=server_environment(),
            timeout=COMMAND_SECONDS,
            check=False,
        )
    assert done.returncode == exits.EXIT_FAILED
    assert "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("ledger: cannot write to stdout"), done.stderr


def test_a_closed_stdout_is_not_a_traceback(tmp_path: pathlib.Path) -> None:
    done = subprocess.run(
        ["bash", "-c", f"'{LEDGER}' balance recall --server 127.0.0.1:1 >&-"],
        capture_output=True,
        text=True,
        env=server_environment(),
        timeout=COMMAND_SECONDS,
        check=False,
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == exits.EXIT_UNREACHABLE, done.stderr


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        (["--database-url", "bogus://x"], "sqlite:/// or postgresql+psycopg://"),
        (["--data-dir", "/proc/no-such-dir"], "/proc/no-such-dir"),
    ],
)
def test_migrate_refuses_a_database_it_cannot_use_on_one_line(
    arguments: list[str], says: str
) -> None:
    done = run_ledger("migrate", *arguments)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert says in done.stderr
    assert done.returncode == exits.EXIT_BAD_VALUE


@pytest.mark.parametrize("grant", ["lg1.a\nb", "lg1.\u00e9\u00e9", "lg1.a b"])
def test_a_grant_with_a_character_no_grant_has_is_refused_naming_its_source(grant: str) -> None:
    """gRPC refuses such a header itself: a C-core log line and 'Invalid metadata (INTERNAL)'."""
    done = run_ledger("balance", "recall", "--server", "127.0.0.1:1", "--grant", grant)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("ledger: --grant: not a grant"), done.stderr
    assert done.returncode == exits.EXIT_BAD_VALUE


def test_a_grant_longer_than_any_grant_is_refused_before_it_is_sent() -> None:
    """Past 8 KiB of headers gRPC refuses some calls at random with RESOURCE_EXHAUSTED
    (soft metadata limit), so the same bad grant was sometimes UNAUTHENTICATED."""
    grant = "lg1.k1." + "a" * MAX_GRANT_LENGTH + ".b"
    done = run_ledger("balance", "recall", "--server", "127.0.0.1:1", "--grant", grant)
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("ledger: --grant: not a grant"), done.stderr
    assert grant not in done.stderr
    assert done.returncode == exits.EXIT_BAD_VALUE


@pytest.mark.parametrize("grant", ["", "  "])
def test_an_empty_grant_is_refused_not_replaced_by_the_admin_grant(grant: str) -> None:
    done = run_ledger("balance", "recall", "--server", "127.0.0.1:1", "--grant", grant)
    assert done.stderr.startswith("ledger: --grant: is empty"), done.stderr
    assert done.returncode == exits.EXIT_BAD_VALUE


@pytest.mark.parametrize(
    ("server", "source"),
    [
        ("notaport", "--server"),
        ("127.0.0.1:99999", "--server"),
        ("127.0.0.1:0", "--server"),
        ("127.0.0.1:", "--server"),
        ("", "--server"),
        # A URL: gRPC would read 'http' as a host name and find nobody there.
        ("http://127.0.0.1:50051", "--server"),
        ("grpc://localhost:50051", "--server"),
        ("127.0.0.1:50051/ledger", "--server"),
        # A broken host: it was 'cannot reach the ledger', exit 3.
        ("[::1:50051", "--server"),
        ("::1:50051", "--server"),
        ("127.0.0.1 :50051", "--server"),
    ],
)
def test_a_server_address_that_is_not_host_port_is_a_bad_value_not_unreachable(
    server: str, source: str
) -> None:
    """It was 'cannot reach the ledger at notaport: is `ledger serve` running?', exit 3,
    or, for an empty --server, a silent fall back to the default address."""
    done = run_ledger("balance", "recall", "--server", server, "--timeout", "2")
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"ledger: {source}: {server!r} is not HOST:PORT"), done.stderr
    assert done.returncode == exits.EXIT_BAD_VALUE


@pytest.mark.parametrize("server", ["127.0.0.1:1", "[::1]:1", "localhost:1", "unix:/nonexistent"])
def test_a_well_formed_server_address_nobody_answers_is_still_unreachable(server: str) -> None:
    done = run_ledger("balance", "recall", "--server", server, "--timeout", "2")
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.returncode == exits.EXIT_UNREACHABLE, done.stderr
