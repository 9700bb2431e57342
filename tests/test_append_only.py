"""Events are append-only: the database itself refuses UPDATE and DELETE on them,
not just the code (SQLite here; tests/storage covers PostgreSQL)."""

from __future__ import annotations

import contextlib
import pathlib
import sqlite3
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

REFUSALS = (
    "UPDATE events SET amount_nanos = 0",
    "UPDATE events SET kind = 'refunded' WHERE kind = 'settled'",
    "DELETE FROM events",
    "DELETE FROM events WHERE kind = 'reserved'",
)


@pytest.fixture
def database_file(server: Any, ledger_harness: Any) -> pathlib.Path:
    """The server's SQLite file, with a few events in it."""
    ledger_harness.make_lane()
    ledger_harness.reserve("r1")
    ledger_harness.settle("r1", input_tokens=1_000)
    ledger_harness.reserve("r2")
    path = pathlib.Path(server.settings.data_dir) / "ledger.db"
    assert path.exists()
    return path


@contextlib.contextmanager
def sqlite_connection(path: pathlib.Path) -> Iterator[sqlite3.Connection]:
    connection = sqlite3.connect(path, timeout=10)
    try:
        yield connection
    finally:
        connection.close()


def snapshot(path: pathlib.Path) -> list[tuple[Any, ...]]:
    with sqlite_connection(path) as connection:
        return connection.execute("SELECT * FROM events ORDER BY seq").fetchall()


@pytest.mark.parametrize("statement", REFUSALS)
def test_sqlite_refuses_changing_events(database_file: pathlib.Path, statement: str) -> None:
    before = snapshot(database_file)
    assert len(before) == 4
    with sqlite_connection(database_file) as connection:
        with pytest.raises(sqlite3.DatabaseError) as caught:
            connection.execute(statement)
            connection.commit()
        connection.rollback()
    assert "append-only" in str(caught.value)
    assert snapshot(database_file) == before


def test_the_refusal_reaches_sqlalchemy_too(database_file: pathlib.Path) -> None:
    engine = sa.create_engine(f"sqlite:///{database_file}")
    try:
        for statement in REFUSALS:
            with pytest.raises(sa.exc.DBAPIError) as caught, engine.begin() as connection:
                connection.execute(sa.text(statement))
            assert "append-only" in str(caught.value.orig)
        with engine.connect() as connection:
            count = connection.execute(sa.text("SELECT count(*) FROM events")).scalar_one()
        assert count == 4
    finally:
        engine.dispose()


def test_appending_still_works_through_the_ledger(
    database_file: pathlib.Path, ledger_harness: Any
) -> None:
    ledger_harness.refund("r2", 403)
    assert len(snapshot(database_file)) == 5
