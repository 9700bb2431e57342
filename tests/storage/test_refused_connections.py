"""A PostgreSQL server that refuses a new connection for lack of slots
(53300 too_many_connections: max_connections, or the role's CONNECTION
LIMIT). Health turns NOT_SERVING; the operator must also read, at ERROR, what
is wrong and what to do. It used to be one WARNING with the driver's words
only ("database error (no code): ..."): libpq gives a refused connect no
SQLSTATE. The test makes a role of its own with CONNECTION LIMIT 1 and holds
that one connection; roles are cluster-wide, so it drops the role after."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import psycopg
import pytest
import sqlalchemy as sa

from ledger_service.domain.errors import StoreUnavailable
from ledger_service.storage import database
from ledger_service.storage.sql import SqlStore
from tests.storage.conftest import POSTGRES_URL, require_postgres

pytestmark = pytest.mark.postgres

PASSWORD = "not-in-any-log"


@pytest.fixture
def limited_role_url() -> Iterator[str]:
    """The test database's URL as a fresh role that may hold one connection."""
    require_postgres()
    role = f"ledger_limited_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(POSTGRES_URL)
    with admin.begin() as connection:
        connection.exec_driver_sql(
            f"CREATE ROLE {role} LOGIN PASSWORD '{PASSWORD}' CONNECTION LIMIT 1"
        )
    try:
        yield (
            sa.make_url(POSTGRES_URL)
            .set(username=role, password=PASSWORD)
            .render_as_string(hide_password=False)
        )
    finally:
        with admin.begin() as connection:
            connection.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = :r"
                ),
                {"r": role},
            )
            connection.exec_driver_sql(f"DROP ROLE {role}")
        admin.dispose()


def test_a_connection_refused_for_too_many_connections_is_one_error_line_saying_what_to_do(
    limited_role_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    plain = (
        sa.make_url(limited_role_url)
        .set(drivername="postgresql")
        .render_as_string(hide_password=False)
    )
    engine = database.create(limited_role_url, database.EngineLimits(pool_size=2))
    store = SqlStore(engine)
    try:
        with psycopg.connect(plain), caplog.at_level(logging.WARNING):
            for _probe in range(3):  # one line an interval, not one a probe
                with pytest.raises(StoreUnavailable):
                    store.ping()
    finally:
        store.close()
    told = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert len(told) == 1, told
    assert "refused" in told[0] and "too many connections" in told[0], told
    assert "53300" in told[0] and "max_connections" in told[0], told
    assert "pool_size" in told[0], told
    assert PASSWORD not in " ".join(record.getMessage() for record in caplog.records)


def test_health_stays_not_serving_while_moves_are_refused_a_connection(
    limited_role_url: str,
) -> None:
    """The health probe runs on a connection already open, so it passes while
    every move that needs a new one is refused. Like a move refused with a
    class 53 code, a connect refused for lack of slots (which libpq gives no
    code) holds health NOT_SERVING (sql.RESOURCE_HOLD_SECONDS): with 2 replicas
    under 12 lane threads and max_connections filled, health was SERVING for
    13 of 15 s while 291 calls failed STORE_UNAVAILABLE."""
    engine = database.create(limited_role_url, database.EngineLimits(pool_size=2))
    store = SqlStore(engine)
    try:
        store.ping()  # the pool's one connection: the role's one slot
        held = engine.raw_connection()  # busy: the move needs a new connection
        try:
            with pytest.raises(StoreUnavailable):
                store.run(lambda tx: tx.execute_text("SELECT 1"), replayable=True, lane="a")
        finally:
            held.close()
        with pytest.raises(StoreUnavailable):
            store.ping()  # on the connection held above: it answers
    finally:
        store.close()
