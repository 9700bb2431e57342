"""docs/security.md cannot rot: its `ledger` commands parse, and the grant ones run."""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest

from ledger_service import cli
from ledger_service.storage import keyring

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "security.md"


def documented_commands() -> list[list[str]]:
    """Every `$ ledger ...` line of the doc's console blocks, as argv (with continuations)."""
    text = re.sub(r"\\\n\s*", " ", DOC.read_text())
    commands = []
    for line in text.splitlines():
        if line.startswith("$ ledger "):
            command = line.removeprefix("$ ").split("#", 1)[0].split("<", 1)[0]
            commands.append(shlex.split(command)[1:])
    return commands


def test_the_doc_shows_every_grant_command() -> None:
    shown = {tuple(argv[:2]) for argv in documented_commands() if argv[0] == "grant"}
    for action in ("issue", "inspect", "rotate-key", "retire-key", "keys"):
        assert ("grant", action) in shown


@pytest.mark.parametrize("argv", documented_commands(), ids=" ".join)
def test_documented_commands_parse(argv: list[str]) -> None:
    cli.parser().parse_args(argv)


def test_documented_issue_commands_print_grants_that_inspect_accepts(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keyring.load_or_create(tmp_path)
    issues = [argv for argv in documented_commands() if argv[:2] == ["grant", "issue"]]
    assert issues
    for argv in issues:
        parsed = cli.parser().parse_args([*argv, "--data-dir", str(tmp_path)])
        assert parsed.run(parsed) == 0, argv
        token = capsys.readouterr().out.strip()
        parsed = cli.parser().parse_args(["grant", "inspect", token, "--data-dir", str(tmp_path)])
        assert parsed.run(parsed) == 0, argv
        assert "signature:  valid" in capsys.readouterr().out
