"""A PostgreSQL URL naming a database that does not exist, or a role the
server refuses, is an operator's configuration error, not an outage: `ledger
serve` started NOT_SERVING and retried every 5 s for ever, logging that the
database "does not answer". At start, it and `ledger migrate` now exit 2 in
one line saying what is wrong and what to do, with no password in it.

libpq refuses such a connect with no SQLSTATE (psycopg's `sqlstate` is None),
so its words are what tell the cases apart (translate.misconfigured); the
codes count too, for an error that carries one. The process tests need the
PostgreSQL of LEDGER_TEST_POSTGRES_URL, and start no server that listens.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import psycopg
import pytest
import sqlalchemy as sa

from ledger_service.storage import translate
from tests.serving import clean_env
from tests.storage.conftest import POSTGRES_URL, require_postgres

LEDGER = pathlib.Path(sys.executable).with_name("ledger")
COMMAND_SECONDS = 60
# In the range of ports this suite's process tests may use; nothing listens there.
LISTEN = "127.0.0.1:41102"
PASSWORD = "s3cret-not-shown"
AT = 'connection failed: connection to server at "127.0.0.1", port 5432 failed: FATAL:  '


def _refused_connect(words: str) -> psycopg.OperationalError:
    return psycopg.OperationalError(AT + words)


@pytest.mark.parametrize(
    ("words", "named", "advice"),
    [
        ('database "ledger_x" does not exist', 'database "ledger_x"', "create it"),
        ('role "lane_x" does not exist', 'role "lane_x"', "check the role"),
        ('password authentication failed for user "lane_x"', 'role "lane_x"', "password"),
        ('Peer authentication failed for user "lane_x"', 'role "lane_x"', "check the role"),
        ('role "lane_x" is not permitted to log in', 'role "lane_x"', "LOGIN"),
        (
            'no pg_hba.conf entry for host "10.0.0.1", user "lane_x", database "l", no encryption',
            "pg_hba.conf",
            "pg_hba.conf",
        ),
    ],
)
def test_a_refused_connect_of_a_configuration_error_says_what_and_what_to_do(
    words: str, named: str, advice: str
) -> None:
    found = translate.misconfigured(_refused_connect(words))
    assert found is not None
    what, to_do = found
    assert named in what and advice in to_do, found


@pytest.mark.parametrize("code", ["3D000", "28000", "28P01"])
def test_the_sqlstates_of_a_configuration_error_are_one_too(code: str) -> None:
    error = psycopg.OperationalError("refused")
    error.sqlstate = code  # type: ignore[misc]
    assert translate.misconfigured(error) is not None


@pytest.mark.parametrize(
    "words",
    [
        "the database system is starting up",
        "Connection refused\n\tIs the server running on that host and accepting TCP/IP "
        "connections?",
        "sorry, too many clients already",
    ],
)
def test_an_outage_is_no_configuration_error(words: str) -> None:
    assert translate.misconfigured(_refused_connect(words)) is None
    assert translate.misconfigured(sa.exc.OperationalError("SELECT 1", {}, ValueError())) is None


def _url(role: str = "", database: str = "") -> str:
    url = sa.make_url(POSTGRES_URL).set(password=PASSWORD)
    url = url.set(username=role) if role else url
    url = url.set(database=database) if database else url
    return url.render_as_string(hide_password=False)


def _missing_database() -> str:
    return f"{sa.make_url(POSTGRES_URL).database}_missing"


def _ledger(tmp_path: pathlib.Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LEDGER), *argv], cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
        timeout=COMMAND_SECONDS, check=False,
    )  # fmt: skip


def _one_line(done: subprocess.CompletedProcess[str], command: str) -> str:
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ledger {command}: "), done.stderr
    assert PASSWORD not in done.stderr and "Traceback" not in done.stderr, done.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["serve", "migrate"])
def test_a_database_that_does_not_exist_ends_the_start_with_exit_2(
    tmp_path: pathlib.Path, command: str
) -> None:
    require_postgres()
    url = _url(database=_missing_database())
    extra = ("--listen", LISTEN) if command == "serve" else ()
    line = _one_line(_ledger(tmp_path, command, *extra, "--database-url", url), command)
    assert f'the database "{_missing_database()}" does not exist' in line, line
    assert "create it" in line and "does not answer" not in line, line


@pytest.mark.parametrize("command", ["serve", "migrate"])
def test_a_role_the_server_does_not_know_ends_the_start_with_exit_2(
    tmp_path: pathlib.Path, command: str
) -> None:
    require_postgres()
    url = _url(role="h2_no_such_role")
    extra = ("--listen", LISTEN) if command == "serve" else ()
    line = _one_line(_ledger(tmp_path, command, *extra, "--database-url", url), command)
    assert 'role "h2_no_such_role"' in line and "check the role" in line, line
