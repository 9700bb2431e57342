"""A database URL whose search_path names a schema that does not exist yet
(docs/postgresql.md's `?options=-csearch_path%3Dledger` on a fresh database).
PostgreSQL answers, but refuses to create a table (3F000 invalid_schema_name):
`ledger migrate` said "the database is unavailable" and every replica logged
that the database "does not answer" every 5 s, though health's probe said it
answered. Both now name the missing schema and what to do, and a replica
waiting on it serves by itself once the schema is created."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import sqlalchemy as sa
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ledger_service.storage import translate
from tests import serving
from tests.storage.conftest import POSTGRES_URL, require_postgres

pytestmark = pytest.mark.postgres

SAID = "the schema the database URL's search_path names does not exist"


@pytest.fixture
def missing_schema() -> Iterator[tuple[str, str]]:
    """A schema name nobody has created, and a URL whose search_path names it."""
    require_postgres()
    schema = f"t_{uuid.uuid4().hex[:12]}"
    try:
        yield schema, f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"
    finally:
        admin = sa.create_engine(POSTGRES_URL)
        with admin.begin() as connection:
            connection.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


def _migrate(url: str) -> subprocess.CompletedProcess[str]:
    """`ledger migrate` on `url`, as an operator runs it."""
    ledger = Path(sys.executable).with_name("ledger")
    return subprocess.run(
        [str(ledger), "migrate", "--database-url", url],
        capture_output=True, text=True, timeout=60, check=False, env=serving.clean_env(),
    )  # fmt: skip


def test_migrate_names_the_missing_schema(missing_schema: tuple[str, str]) -> None:
    _, url = missing_schema
    refused = _migrate(url)
    assert refused.returncode == 2, refused
    said = refused.stderr.strip()
    assert len(said.splitlines()) == 1 and "Traceback" not in said, said
    assert SAID in said and "3F000" in said and "CREATE SCHEMA" in said, said
    assert "unavailable" not in said, said


@pytest.mark.parametrize(
    "command",
    [["verify"], ["snapshot"], ["rebuild"], ["recover", "--budget-seconds", "60"]],
    ids=lambda argv: argv[0],
)
def test_the_recovery_commands_name_the_missing_schema(
    missing_schema: tuple[str, str], command: list[str], tmp_path: Path
) -> None:
    """They said the database "holds no ledger schema yet (`ledger migrate`
    makes it)", and migrate then refused: the schema is the operator's to create."""
    _, url = missing_schema
    ledger = Path(sys.executable).with_name("ledger")
    refused = subprocess.run(
        [str(ledger), *command, "--database-url", url, "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=False, env=serving.clean_env(),
    )  # fmt: skip
    assert refused.returncode == 2, refused
    said = refused.stderr.strip()
    assert len(said.splitlines()) == 1 and "Traceback" not in said, said
    assert SAID in said and "CREATE SCHEMA" in said, said
    assert "ledger migrate" not in said, said


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_a_replica_names_the_missing_schema_and_serves_once_it_exists(
    missing_schema: tuple[str, str], tmp_path: Path
) -> None:
    schema, url = missing_schema
    env = serving.clean_env(LEDGER_DATABASE_URL=url, LEDGER_RECOVERY_CHECK_INTERVAL_SECONDS="0.5")
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        process, address = serving.spawn(tmp_path, "--insecure-no-auth", env=env, stderr=log)
    serving_status = health_pb2.HealthCheckResponse.SERVING
    try:
        assert _health(address) != serving_status
        logged = log_path.read_text()
        assert f"could not be brought up to date: {SAID}" in logged, logged
        assert "does not answer" not in logged, logged
        admin = sa.create_engine(POSTGRES_URL)
        with admin.begin() as connection:
            connection.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        admin.dispose()
        give_up = time.monotonic() + 30
        while _health(address) != serving_status:
            assert time.monotonic() < give_up, log_path.read_text()
            time.sleep(0.2)
        assert "Traceback" not in log_path.read_text()
    finally:
        serving.stop(process)


def test_a_replica_told_not_to_migrate_says_it_waits_for_the_schema(
    postgres_schema_url: str, tmp_path: Path
) -> None:
    """docs/postgresql.md: with --no-migrate, a database with no schema at all
    is waited for. The replica logged that the database "does not answer"
    (its clock's start and every recovery check) while it answered."""
    env = serving.clean_env(
        LEDGER_DATABASE_URL=postgres_schema_url, LEDGER_RECOVERY_CHECK_INTERVAL_SECONDS="0.5"
    )
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        process, _ = serving.spawn(
            tmp_path, "--insecure-no-auth", "--no-migrate", env=env, stderr=log
        )
    try:
        give_up = time.monotonic() + 30
        while "recovery check" not in log_path.read_text():
            assert time.monotonic() < give_up, log_path.read_text()
            time.sleep(0.1)
        logged = log_path.read_text()
        assert translate.NO_SCHEMA_YET in logged, logged
        assert "does not answer" not in logged and "database unavailable" not in logged, logged
    finally:
        serving.stop(process)


def test_health_turns_not_serving_when_the_ledgers_tables_are_gone(
    postgres_schema_url: str, tmp_path: Path
) -> None:
    """A database dropped and created again empty under a serving replica (a
    restore gone wrong, a wrong database swapped in): every call failed with
    STORE_UNAVAILABLE while health said SERVING. Once the schema is made again
    (`ledger migrate`), the replica serves by itself."""
    schema = postgres_schema_url.rsplit("%3D", 1)[1]
    env = serving.clean_env(
        LEDGER_DATABASE_URL=postgres_schema_url, LEDGER_RECOVERY_CHECK_INTERVAL_SECONDS="0.5"
    )
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        process, address = serving.spawn(tmp_path, "--insecure-no-auth", env=env, stderr=log)
    serving_status = health_pb2.HealthCheckResponse.SERVING
    try:
        assert _health(address) == serving_status
        admin = sa.create_engine(POSTGRES_URL)
        with admin.begin() as connection:
            connection.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
            connection.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        admin.dispose()
        give_up = time.monotonic() + 30
        while _health(address) == serving_status:
            assert time.monotonic() < give_up, log_path.read_text()
            time.sleep(0.2)
        assert translate.NO_SCHEMA_YET in log_path.read_text()
        migrated = _migrate(postgres_schema_url)
        assert migrated.returncode == 0, migrated
        while _health(address) != serving_status:
            assert time.monotonic() < give_up + 30, log_path.read_text()
            time.sleep(0.2)
        assert "Traceback" not in log_path.read_text()
    finally:
        serving.stop(process)
