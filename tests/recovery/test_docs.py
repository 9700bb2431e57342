"""docs/recovery.md's walk-through is run, so it cannot rot.

Every `$ ` line of the ```console blocks under "A walk-through" runs in order,
through `ledger_service.cli.main` (the same code as the `ledger` command, without
a process start per line), against a copy of the recovery suite's history whose
bookings table lost three quarters of its rows. A trailing `; echo "exit $?"`
adds the exit code as a last output line. Shown lines must match in order:
`<...>` matches any text within a line and a `…` line any number of lines.
"""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest

from ledger_service import cli
from tests.recovery.conftest import History

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "recovery.md"
HEADING = "## A walk-through"
ECHO_EXIT = '; echo "exit $?"'


def _steps() -> list[tuple[str, list[str]]]:
    lines = DOC.read_text().splitlines()
    start = lines.index(HEADING) + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("## "))
    steps: list[tuple[str, list[str]]] = []
    inside = False
    for line in lines[start:end]:
        if line.startswith("```"):
            inside = line == "```console"
        elif inside and line.startswith("$ "):
            steps.append((line[2:], []))
        elif inside:
            steps[-1][1].append(line)
    return steps


def _pattern(line: str) -> re.Pattern[str]:
    parts = re.split(r"<[^<>]+>", line)
    return re.compile(".*?".join(re.escape(part) for part in parts))


def _matches(expected: list[str], actual: list[str]) -> bool:
    if not expected:
        return not actual
    if expected[0] == "…":
        return any(_matches(expected[1:], actual[skip:]) for skip in range(len(actual) + 1))
    return (
        bool(actual)
        and _pattern(expected[0]).fullmatch(actual[0].rstrip()) is not None
        and _matches(expected[1:], actual[1:])
    )


def test_the_walk_through_runs_as_written(
    sqlite_history: History,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    history = sqlite_history
    history.sql(
        "DELETE FROM bookings WHERE reservation_id NOT IN "
        "(SELECT reservation_id FROM bookings ORDER BY reservation_id LIMIT 10)"
    )
    monkeypatch.setenv("LEDGER_DATABASE_URL", history.url)
    steps = _steps()
    assert len(steps) == 4
    for command, expected in steps:
        echo = command.endswith(ECHO_EXIT)
        argv = shlex.split(command.removesuffix(ECHO_EXIT))
        assert argv[0] == "ledger", command
        capsys.readouterr()
        code = cli.main(argv[1:])
        actual = capsys.readouterr().out.splitlines()
        if echo:
            actual.append(f"exit {code}")
        else:
            assert code == 0, command
        assert _matches(expected, actual), (command, actual)
