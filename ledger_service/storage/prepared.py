"""Statements compiled once per dialect and run straight on the driver's cursor.

A move runs a dozen small statements. Through SQLAlchemy's execute each one
paid more in Python (coercion, the compiled cache lookup, result set-up) than
SQLite took to run it: profiled at ~150 µs of overhead per statement against
~10 µs of work. The hot statements are still written with SQLAlchemy's
expression language (one definition for both databases), compiled once per
dialect to SQL text, and executed on the DBAPI connection that SQLAlchemy's
transaction holds, so they share its transaction: on SQLite through its
cursor, on PostgreSQL straight through libpq (storage/libpq.py).

Driver errors are raised as SQLAlchemy's DBAPIError (with the SQL and the
parameters hidden), so callers keep one error model.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from sqlalchemy import Boolean, LargeBinary, Table, bindparam
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError, StatementError
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.sql import ClauseElement, Select
from sqlalchemy.sql.compiler import SQLCompiler

from ledger_service.storage import libpq


class Carrier(Protocol):
    """What a statement runs on: SQLAlchemy's Connection, or a PostgreSQL
    move batch's pooled connection alone (storage/sql.py's Pooled)."""

    @property
    def dialect(self) -> Dialect: ...

    @property
    def connection(self) -> PoolProxiedConnection: ...


class Prepared:
    """One statement's SQL text for one dialect, and how to pass it parameters."""

    def __init__(self, statement: ClauseElement, dialect: Dialect) -> None:
        compiled = statement.compile(dialect=dialect)
        assert isinstance(compiled, SQLCompiler)
        self.sql = str(compiled)
        self._positional = bool(compiled.positional)
        self._names: tuple[str, ...] = tuple(compiled.positiontup or ())
        self._in_order = operator.itemgetter(*self._names) if self._names else None
        # Values fixed in the statement itself (a LIMIT, a literal), by name.
        self._fixed = {name: value for name, value in compiled.params.items() if value is not None}
        self._dbapi_error: type[Exception] = dialect.loaded_dbapi.Error
        # A SELECT's column names, known here: the driver's description costs
        # an object per column on every row read.
        self.names: tuple[str, ...] | None = (
            tuple(statement.selected_columns.keys()) if isinstance(statement, Select) else None
        )
        # PostgreSQL runs it straight on libpq (storage/libpq.py).
        self._libpq = (
            libpq.Statement(self.sql, _uncast_types(compiled), describe=self.names is None)
            if dialect.name == "postgresql"
            else None
        )

    def libpq(self) -> libpq.Statement:
        assert self._libpq is not None, "a PostgreSQL statement"
        return self._libpq

    def _parameters(self, values: Mapping[str, Any]) -> Any:
        if self._fixed:
            values = {**self._fixed, **values}
        if not self._positional:
            return values
        if self._in_order is None:
            return ()
        ordered = self._in_order(values)
        return ordered if len(self._names) > 1 else (ordered,)

    def cursor(self, connection: Carrier, values: Mapping[str, Any]) -> Any:
        """Runs the statement in the connection's transaction; returns the cursor."""
        if self._libpq is not None:
            return pipelined(connection, [(self, values)])[0]
        cursor = connection.connection.driver_connection.cursor()  # type: ignore[union-attr]
        try:
            cursor.execute(self.sql, self._parameters(values))
        except self._dbapi_error as error:
            cursor.close()
            raise self._wrapped(error) from error
        return cursor

    def _wrapped(self, error: Exception) -> StatementError:
        """The driver's error as SQLAlchemy's, the SQL kept and the parameters hidden."""
        return DBAPIError.instance(self.sql, None, error, self._dbapi_error, hide_parameters=True)

    def run(self, connection: Carrier, values: Mapping[str, Any]) -> int:
        """Runs a statement that returns no rows; returns the rows it changed."""
        cursor = self.cursor(connection, values)
        count = int(cursor.rowcount)
        cursor.close()
        return count

    def run_many(self, connection: Carrier, rows: Sequence[Mapping[str, Any]]) -> None:
        """Runs a statement that returns no rows once for each of `rows`."""
        cursor = connection.connection.driver_connection.cursor()  # type: ignore[union-attr]
        try:
            cursor.executemany(self.sql, [self._parameters(values) for values in rows])
        except self._dbapi_error as error:
            raise self._wrapped(error) from error
        finally:
            cursor.close()

    def one(self, connection: Carrier, values: Mapping[str, Any]) -> Sequence[Any] | None:
        """The first row (a tuple), or None."""
        cursor = self.cursor(connection, values)
        try:
            row: Sequence[Any] | None = cursor.fetchone()
        finally:
            cursor.close()
        return row

    def mapping(self, connection: Carrier, values: Mapping[str, Any]) -> dict[str, Any] | None:
        """The first row as a dict by column name, or None."""
        cursor = self.cursor(connection, values)
        try:
            row = cursor.fetchone()
        finally:
            cursor.close()
        return self.as_mapping(row, cursor)

    def as_mapping(self, row: Sequence[Any] | None, cursor: Any) -> dict[str, Any] | None:
        """A row of this statement by column name, or None."""
        if row is None:
            return None
        names = self.names or [column[0] for column in cursor.description or ()]
        return dict(zip(names, row, strict=True))

    def all(self, connection: Carrier, values: Mapping[str, Any]) -> list[Sequence[Any]]:
        cursor = self.cursor(connection, values)
        try:
            rows: list[Sequence[Any]] = cursor.fetchall()
        finally:
            cursor.close()
        return rows


def _uncast_types(compiled: SQLCompiler) -> dict[str, int]:
    """The parameters SQLAlchemy leaves without a cast on psycopg, which
    psycopg types from the Python value: their type OIDs for libpq."""
    found = {}
    for name, bind in compiled.binds.items():
        if isinstance(bind.type, LargeBinary):
            found[name] = libpq.BYTEA
        elif isinstance(bind.type, Boolean):
            found[name] = libpq.BOOLEAN
    return found


# A statement, or how to build it for a dialect (by name) where they differ.
StatementSource = ClauseElement | Callable[[str], ClauseElement]


def upsert(table: Table, keys: tuple[str, ...]) -> Callable[[str], ClauseElement]:
    """INSERT ... ON CONFLICT (keys) DO UPDATE of every other column, per dialect."""

    def build(dialect_name: str) -> ClauseElement:
        dialect_insert = sqlite.insert if dialect_name == "sqlite" else postgresql.insert
        statement = dialect_insert(table).values(
            {column.name: bindparam(column.name) for column in table.c}
        )
        return statement.on_conflict_do_update(
            index_elements=list(keys),
            set_={
                column.name: statement.excluded[column.name]
                for column in table.c
                if column.name not in keys
            },
        )

    return build


class Statements:
    """Named statements, each compiled on first use for each dialect."""

    def __init__(self, **statements: StatementSource) -> None:
        self._statements = statements
        self._compiled: dict[tuple[str, str], Prepared] = {}
        self._lock = threading.Lock()

    def __call__(self, name: str, connection: Carrier) -> Prepared:
        dialect = connection.dialect
        key = (name, dialect.name)
        prepared = self._compiled.get(key)
        if prepared is None:
            with self._lock:
                prepared = self._compiled.get(key)
                if prepared is None:
                    source = self._statements[name]
                    statement = source if isinstance(source, ClauseElement) else source(key[1])
                    prepared = Prepared(statement, dialect)
                    self._compiled[key] = prepared
        return prepared


Call = tuple[Prepared, Mapping[str, Any]]


def pipelined(connection: Carrier, calls: Sequence[Call]) -> list[Any]:
    """PostgreSQL: runs `calls` in order in one round trip (storage/libpq.py)
    and returns their results, read, with a cursor's fetchone and fetchall.
    The server runs each statement after the one before it has finished, so a
    statement after a lock sees what was committed before the lock was granted."""
    pooled = connection.connection
    first = calls[0][0]
    try:
        return libpq.pipeline(
            pooled.driver_connection,
            pooled.info,
            [(statement.libpq(), statement._parameters(values)) for statement, values in calls],
        )
    except first._dbapi_error as error:
        raise first._wrapped(error) from error


def fetched_mapping(call: Call, cursor: Any) -> dict[str, Any] | None:
    """The first row of `call`'s cursor that `pipelined` returned, by column name, or None."""
    row = cursor.fetchone()
    cursor.close()
    return call[0].as_mapping(row, cursor)
