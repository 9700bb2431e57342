"""docs/postgresql.md's walk-through is run, as tests/test_readme.py runs the README's.

Every `$ ` line of the one ```console block under "Two replicas on one machine"
runs, in order, as one bash script (`set -e`, so the first command that fails
fails the test and names itself) from an empty directory, with `.venv/bin` on
the PATH and no LEDGER_* variable of ours. The database name and the two ports
are swapped for a fresh database this test creates and drops and two free
ports; nothing else is changed.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from tests.storage.conftest import POSTGRES_URL, require_postgres
from tests.test_readme import console_blocks, section

pytestmark = pytest.mark.postgres

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "postgresql.md"
HEADING = "## Two replicas on one machine"
DOC_DATABASE = "ledger_demo"
DOC_PORTS = ("50051", "50052")
SCRIPT_SECONDS = 180


def walk_through() -> list[str]:
    blocks = console_blocks(section(DOC.read_text(), HEADING))
    assert len(blocks) == 1, "the walk-through must be exactly one ```console block"
    commands = [line.removeprefix("$ ") for line in blocks[0] if line.startswith("$ ")]
    assert commands, "the walk-through shows no command"
    return commands


def test_the_walk_through_creates_a_database_shares_the_keyring_and_reserves_on_both() -> None:
    shown = "\n".join(walk_through())
    assert f"createdb -h 127.0.0.1 -U postgres {DOC_DATABASE}" in shown
    assert "ledger migrate" in shown
    assert "cp -p data/a/grant-keys.json data/b/" in shown
    assert "ledger lane put recall" in shown
    for port in DOC_PORTS:
        assert re.search(rf"ledger reserve recall .*--server 127\.0\.0\.1:{port}", shown), port


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def database_name() -> Iterator[str]:
    """A name for the walk-through's database; whatever it made is dropped."""
    require_postgres()
    name = f"ledger_doc_{uuid.uuid4().hex[:10]}"
    yield name
    admin = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


@pytest.mark.parametrize("shell", ["bash", "sh"])
def test_every_walk_through_command_runs(
    database_name: str, tmp_path: pathlib.Path, shell: str
) -> None:
    """In bash and in a plain POSIX sh (dash, on Debian), as a reader may paste it."""
    url = make_url(POSTGRES_URL)
    if (url.host, url.port or 5432, url.username) != ("127.0.0.1", 5432, "postgres"):
        pytest.skip("the walk-through is written for postgres@127.0.0.1:5432")
    ports = [str(_free_port()), str(_free_port())]
    script = ["set -eu", "trap 'kill $(cat a.pid b.pid 2>/dev/null) 2>/dev/null || true' EXIT"]
    for command in walk_through():
        command = command.replace(DOC_DATABASE, database_name)
        for shown_port, port in zip(DOC_PORTS, ports, strict=True):
            command = command.replace(f"127.0.0.1:{shown_port}", f"127.0.0.1:{port}")
        script += [f"echo {shlex.quote('$ ' + command)}", command]
    environment = {key: value for key, value in os.environ.items() if not key.startswith("LEDGER_")}
    environment["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    done = subprocess.run(
        [shell, "-c", "\n".join(script)],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=SCRIPT_SECONDS,
        check=False,
    )
    logs = "".join(
        f"\n--- {name}\n{(tmp_path / name).read_text()}"
        for name in ("a.out", "b.out")
        if (tmp_path / name).exists()
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}{logs}"
    assert "admitted r-1" in done.stdout and "admitted r-2" in done.stdout, done.stdout
