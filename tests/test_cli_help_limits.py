"""The most a `ledger` option takes is the most its --help states: the
stated number is accepted, one more is refused (exit 2) before any call."""

from __future__ import annotations

import re

import pytest

from ledger_service.cli import main, parser
from ledger_service.cli.exits import EXIT_BAD_VALUE, EXIT_UNREACHABLE
from ledger_service.cli.reconcile import RECONCILE_TIMEOUT_SECONDS
from ledger_service.cli.values import (
    DEFAULT_TIMEOUT_SECONDS,
    CliError,
    parse_bytes_per_token,
    parse_timeout_seconds,
)
from ledger_service.domain.policies import BYTES_PER_TOKEN_RANGE

# Nothing listens on port 1: a value past the check fails to connect, exit 3.
NOWHERE = ("--server", "127.0.0.1:1")
CASES = [
    (("history",), "--limit", ("--timeout", "1")),
    (("audit", "recall"), "--biggest", ("--timeout", "1")),
    # Never written: nothing answers at NOWHERE. (/dev/null is refused: not a regular file.)
    (("report", "recall", "--html", "report.html"), "--biggest", ("--timeout", "1")),
    (("balance", "recall"), "--timeout", ()),
]


def stated_most(command: tuple[str, ...], option: str, capsys: pytest.CaptureFixture[str]) -> int:
    with pytest.raises(SystemExit):
        main([command[0], "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    found = re.search(rf"{option} \S+ .*?at most (\d+)\)", help_text)
    assert found, f"`ledger {command[0]} --help` states no most for {option}"
    return int(found.group(1))


def exit_of(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as stop:
        return int(stop.code or 0)


@pytest.mark.parametrize(("command", "option", "extra"), CASES)
def test_the_stated_most_is_the_enforced_one(
    command: tuple[str, ...],
    option: str,
    extra: tuple[str, ...],
    capsys: pytest.CaptureFixture[str],
) -> None:
    most = stated_most(command, option, capsys)
    base = [*command, *NOWHERE, *extra]
    assert exit_of([*base, option, str(most)]) == EXIT_UNREACHABLE
    assert exit_of([*base, option, str(most + 1)]) == EXIT_BAD_VALUE
    assert f"{option}:" in capsys.readouterr().err


# One command line of each kind that talks to a server, as short as its parser takes.
TALKING = [
    ("balance", "recall"),
    ("history",),
    ("reserve", "recall", "r-1", "--model", "jev", "--request-bytes", "1",
     "--max-output-tokens", "1"),
    ("settle", "recall", "r-1", "--outcome", "unknown"),
    ("refund", "recall", "r-1", "--http-status", "429"),
    ("correct", "recall", "r-1", "--charge", "1n", "--reason", "the bill"),
    ("lane", "put", "recall", "--limit", "$1", "--price", "jev=0.10/0.40"),
    ("lane", "show", "recall"),
    ("lane", "list"),
    ("audit", "recall"),
    ("report", "recall", "--html", "report.html"),
    ("reconcile", "usage.csv"),
]  # fmt: skip


@pytest.mark.parametrize("command", TALKING, ids=" ".join)
def test_each_command_waits_the_default_timeout_its_help_states(
    command: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    """reconcile's longer default once set the --timeout option every command
    shares (argparse's parents share their actions): `ledger balance` then waited
    120 s for a server that did not answer, not the 5 its --help states."""
    words = command[: 2 if command[0] == "lane" else 1]
    with pytest.raises(SystemExit):
        main([*words, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    stated = re.search(r"--timeout SECONDS per call \(default (\d+),", help_text)
    assert stated, f"`ledger {' '.join(words)} --help` states no default --timeout"
    arguments = parser().parse_args(list(command))
    assert parse_timeout_seconds(arguments.timeout) == int(stated.group(1))
    expected = RECONCILE_TIMEOUT_SECONDS if words == ("reconcile",) else DEFAULT_TIMEOUT_SECONDS
    assert int(stated.group(1)) == expected


@pytest.mark.parametrize("text", ["99999999999999", "-1", "1e3"])
def test_a_bytes_per_token_past_its_pattern_is_told_the_range(text: str) -> None:
    """-1 or a huge value was told only that it was 'not a number like 3.5'."""
    with pytest.raises(CliError) as refused:
        parse_bytes_per_token(text)
    assert str(refused.value).endswith(BYTES_PER_TOKEN_RANGE), str(refused.value)
