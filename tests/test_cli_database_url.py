"""`ledger` commands given a URI-form SQLite URL, as an operator types them:
one line naming the setting and the accepted form, exit 2, and no stray
`file:` directory made in the working directory."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from tests import serving

URL = "sqlite:///file:{dir}/ledger.db?mode=ro&uri=true"


@pytest.mark.parametrize(
    "command",
    [["serve", "--listen", "127.0.0.1:0"], ["migrate"], ["verify"], ["snapshot"]],
    ids=lambda argv: argv[0],
)
def test_a_uri_form_database_url_is_refused_in_one_line(
    tmp_path: pathlib.Path, command: list[str]
) -> None:
    data = tmp_path / "data"
    ledger = pathlib.Path(sys.executable).with_name("ledger")
    done = subprocess.run(
        [str(ledger), *command, "--data-dir", str(data),
         "--database-url", URL.format(dir=tmp_path)],
        cwd=tmp_path, env=serving.clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--database-url " in done.stderr, done.stderr
    assert "sqlite:////absolute/path/ledger.db" in done.stderr, done.stderr
    assert "no database" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "file:").exists()


@pytest.mark.parametrize(
    ("url", "named"),
    [("mysql://user:s3cret@db.example/ledger", "sqlite:/// or postgresql+psycopg://"),
     # Another PostgreSQL driver was an ImportError's traceback, exit 1, from
     # every command and from serve.
     ("postgresql+psycopg2://user:s3cret@127.0.0.1/ledger", "postgresql+psycopg:// URLs"),
     ("postgresql+asyncpg://user:s3cret@127.0.0.1/ledger", "postgresql+psycopg:// URLs")],
    ids=["mysql", "psycopg2", "asyncpg"],
)  # fmt: skip
@pytest.mark.parametrize(
    "command",
    [["serve", "--listen", "127.0.0.1:0"], ["migrate"], ["verify"], ["snapshot"], ["rebuild"],
     ["recover", "--budget-seconds", "60"]],
    ids=lambda argv: argv[0],
)  # fmt: skip
def test_a_database_url_of_another_kind_is_refused_in_one_line(
    tmp_path: pathlib.Path, command: list[str], url: str, named: str
) -> None:
    """A URL of a database or driver the ledger does not take is one line,
    exit 2, with no password and no traceback: verify, snapshot, rebuild and
    recover printed a ValueError's traceback, exit 1."""
    ledger = pathlib.Path(sys.executable).with_name("ledger")
    done = subprocess.run(
        [str(ledger), *command, "--data-dir", str(tmp_path / "data"), "--database-url", url],
        cwd=tmp_path, env=serving.clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert named in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "s3cret" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    "command",
    [["migrate"], ["verify"], ["snapshot"], ["rebuild"], ["recover", "--budget-seconds", "60"]],
    ids=lambda argv: argv[0],
)
def test_a_data_dir_that_the_database_url_variable_overrides_is_refused(
    tmp_path: pathlib.Path, command: list[str]
) -> None:
    """`ledger rebuild --data-dir other` with LEDGER_DATABASE_URL exported (as the
    PostgreSQL walk-through leaves it) rebuilt the variable's database, not the
    ledger the flag names, and never said which it had worked on."""
    ledger = pathlib.Path(sys.executable).with_name("ledger")
    exported = tmp_path / "exported"
    made = subprocess.run(
        [str(ledger), "migrate", "--data-dir", str(exported)],
        env=serving.clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    before = (exported / "ledger.db").read_bytes()
    named = tmp_path / "named"
    done = subprocess.run(
        [str(ledger), *command, "--data-dir", str(named)],
        env=serving.clean_env(LEDGER_DATABASE_URL=f"sqlite:///{exported}/ledger.db"),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done
    assert done.stderr.count("\n") == 1, done.stderr
    assert "--data-dir" in done.stderr and "LEDGER_DATABASE_URL" in done.stderr, done.stderr
    assert (exported / "ledger.db").read_bytes() == before
    assert not named.exists()
