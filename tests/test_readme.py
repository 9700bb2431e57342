"""The README's walk-through is run, so the docs cannot rot.

Every `$ ` line of the one ```console block under "A five-minute walk-through" runs,
in order, as a real `ledger` process against a fresh server whose test clock is set
to the day the recall jam was found. The server's address reaches the commands
through LEDGER_SERVER (and its admin grant through LEDGER_DATA_DIR), so the README
shows plain commands. Each must exit 0 and print exactly the lines shown under it,
except the TRACE column of `ledger history`: a trace id is random, so any one (or `-`,
none) matches any other.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pathlib
import re
import shlex
import subprocess
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import timestamp_pb2

from ledger_service.cli import operate
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from tests.test_cli import LEDGER, LedgerProcess, start_ledger_process

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
WALK_THROUGH_HEADING = "## A five-minute walk-through"
# The day the recall jam was found; the README's times are this clock's.
CLOCK_AT = datetime.datetime(2026, 9, 24, 12, 0, tzinfo=datetime.UTC)
COMMAND_SECONDS = 60
MAX_README_LINES = 5000
MOVES = ("lane put", "reserve", "settle", "refund", "balance", "history")
# The last column of a `ledger history` row: a trace id (32 hex digits), or `-`.
TRACE_CELL = re.compile(r"  (?:-|[0-9a-f]{32})$")


@dataclasses.dataclass(frozen=True)
class Step:
    command: str
    output: tuple[str, ...]


def section(text: str, heading: str) -> list[str]:
    """The lines under `heading`, up to the next heading of the same level."""
    lines = text.splitlines()[:MAX_README_LINES]
    assert heading in lines, f"README.md has no {heading!r} section"
    start = lines.index(heading) + 1
    level = heading.split(" ")[0] + " "
    ends = [i for i in range(start, len(lines)) if lines[i].startswith(level)]
    return lines[start : ends[0] if ends else len(lines)]


def console_blocks(lines: list[str]) -> list[list[str]]:
    """The bodies of the ```console fences among `lines`."""
    blocks: list[list[str]] = []
    body: list[str] | None = None
    for line in lines:
        if body is None and line.strip() == "```console":
            body = []
        elif body is not None and line.strip() == "```":
            blocks.append(body)
            body = None
        elif body is not None:
            body.append(line)
    assert body is None, "a ```console block is never closed"
    return blocks


def walk_through() -> list[Step]:
    blocks = console_blocks(section(README.read_text(), WALK_THROUGH_HEADING))
    assert len(blocks) == 1, "the walk-through must be exactly one ```console block"
    steps: list[Step] = []
    for line in blocks[0]:
        if line.startswith("$ "):
            steps.append(Step(line.removeprefix("$ "), ()))
        else:
            assert steps, f"output before the first command: {line!r}"
            steps[-1] = Step(steps[-1].command, (*steps[-1].output, line.rstrip()))
    return steps


def test_the_walk_through_shows_every_move_as_a_plain_ledger_command() -> None:
    steps = walk_through()
    for step in steps:
        words = shlex.split(step.command)
        assert words[0] == "ledger", f"not a ledger command: {step.command}"
        assert not {"--server", "--grant"} & set(words), "the README shows plain commands"
        assert step.output, f"show what {step.command!r} prints"
    shown = " ".join(step.command for step in steps)
    for move in MOVES:
        assert f"ledger {move} " in shown, f"the walk-through lacks `ledger {move}`"


def test_the_configuration_section_names_every_flag_of_ledger_serve() -> None:
    documented = "\n".join(section(README.read_text(), "## Configuration"))
    commands = argparse.ArgumentParser().add_subparsers()
    operate.register(commands)
    serve_help = commands.choices["serve"].format_help()
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", serve_help)) - {"--help"}
    assert "--listen" in flags
    for flag in sorted(flags):
        assert f"`{flag}" in documented, f"document `ledger serve {flag}` in README.md"


def test_the_migrate_messages_name_the_newest_revision() -> None:
    # The README quotes `ledger migrate`'s lines; a new migration must move them with it.
    versions = README.parent / "migrations" / "versions"
    newest = max(path.name[:4] for path in versions.glob("[0-9][0-9][0-9][0-9]_*.py"))
    documented = "\n".join(section(README.read_text(), "## Configuration"))
    named = set(re.findall(r"revision (\d{4})(?: in|\s+\(up to date\))", documented))
    named |= set(re.findall(r"to\s+(\d{4}) in URL", documented))
    assert named == {newest}, f"README's `ledger migrate` lines name {sorted(named)}, not {newest}"


@pytest.fixture
def walk_through_server(tmp_path: pathlib.Path) -> Iterator[LedgerProcess]:
    started = start_ledger_process(tmp_path)
    try:
        set_clock(started)
        yield started
    finally:
        started.stop()


def set_clock(server: LedgerProcess) -> None:
    grant_path = server.data_dir / "admin.grant"
    grant = grant_path.read_text().strip() if grant_path.exists() else ""
    metadata = (("authorization", f"Bearer {grant}"),) if grant else ()
    at = timestamp_pb2.Timestamp(seconds=int(CLOCK_AT.timestamp()))
    with grpc.insecure_channel(server.address) as channel:
        pb_grpc.TestClockStub(channel).SetTime(at, metadata=metadata, timeout=COMMAND_SECONDS)


def test_every_walk_through_command_runs_and_prints_what_the_readme_shows(
    walk_through_server: LedgerProcess, tmp_path: pathlib.Path
) -> None:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("LEDGER_")}
    environment["LEDGER_SERVER"] = walk_through_server.address
    environment["LEDGER_DATA_DIR"] = str(walk_through_server.data_dir)
    for step in walk_through():
        words = shlex.split(step.command)
        done = subprocess.run(
            [str(LEDGER), *words[1:]],
            capture_output=True,
            text=True,
            env=environment,
            cwd=tmp_path,
            timeout=COMMAND_SECONDS,
            check=False,
        )
        assert done.returncode == 0, f"$ {step.command}\n{done.stderr}"
        printed = tuple(line.rstrip() for line in done.stdout.splitlines())
        assert comparable(step.command, printed) == comparable(step.command, step.output), (
            f"$ {step.command} now prints:\n{done.stdout}"
        )


def comparable(command: str, lines: tuple[str, ...]) -> tuple[str, ...]:
    """The lines, with the trace ids of a history table masked."""
    if not command.startswith("ledger history"):
        return lines
    return (*lines[:1], *(TRACE_CELL.sub("  <trace>", line) for line in lines[1:]))
