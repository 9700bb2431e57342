"""docs/observability.md cannot rot: its console block runs against a lane in the
jam's situation and prints what the doc shows, and every metric the server makes
is documented."""

from __future__ import annotations

import inspect
import pathlib
import re
import shlex
from typing import Any

import pytest

from ledger_service import cli
from ledger_service.api import tracing
from ledger_service.server import LedgerServer
from tests.observability.jam import make_jam

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "observability.md"


def console_steps() -> list[tuple[str, list[str]]]:
    """(command, expected output lines) of every `$ ` line in the doc's console blocks."""
    steps: list[tuple[str, list[str]]] = []
    inside = False
    for line in DOC.read_text().splitlines():
        if line.startswith("```"):
            inside = line == "```console"
            continue
        if not inside:
            continue
        if line.startswith("$ "):
            steps.append((line.removeprefix("$ "), []))
        else:
            steps[-1][1].append(line)
    return steps


def test_the_console_block_prints_what_the_doc_shows(
    traced_server: LedgerServer,
    ledger: Any,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    make_jam(ledger)
    monkeypatch.setenv("LEDGER_SERVER", f"127.0.0.1:{traced_server.port}")
    monkeypatch.setenv("LEDGER_GRANT", traced_server.admin_grant)
    monkeypatch.chdir(tmp_path)
    steps = console_steps()
    assert [command.split()[:2] for command, _ in steps] == [
        ["ledger", "audit"],
        ["ledger", "report"],
    ]
    for command, expected in steps:
        assert cli.main(shlex.split(command)[1:]) == 0, command
        assert capsys.readouterr().out.splitlines() == expected, command
    assert (tmp_path / "recall.html").read_text().startswith("<!DOCTYPE html>")


def test_every_metric_is_documented() -> None:
    made = re.findall(r'create_\w+\(\s*"([^"]+)"', inspect.getsource(tracing.RpcMetrics))
    assert len(made) == 10
    documented = DOC.read_text()
    for name in made:
        assert f"| `{name}` |" in documented, name
