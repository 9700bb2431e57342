"""The most a `ledger` option takes is the most its --help states: the
stated number is accepted, one more is refused (exit 2) before any call."""

from __future__ import annotations

import re

import pytest

from ledger_service.cli import main
from ledger_service.cli.exits import EXIT_BAD_VALUE, EXIT_UNREACHABLE

# Nothing listens on port 1: a value past the check fails to connect, exit 3.
NOWHERE = ("--server", "127.0.0.1:1")
CASES = [
    (("history",), "--limit", ("--timeout", "1")),
    (("audit", "recall"), "--biggest", ("--timeout", "1")),
    (("report", "recall", "--html", "/dev/null"), "--biggest", ("--timeout", "1")),
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
