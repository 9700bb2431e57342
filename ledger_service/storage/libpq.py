"""PostgreSQL: the hot statements sent straight through libpq, in pipelines.

psycopg's cursor layer (query conversion, parameter dumpers, the prepare
manager, loaders, result set-up) cost about 50 µs of Python per statement,
more than half of a move's CPU on PostgreSQL. Here a statement is parsed once
per connection as a named prepared statement, its parameters go as text, and
its rows are read by psycopg's own column loaders, in C, without a cursor
(docs/benchmarks.md has the figures).

The transaction stays psycopg's and SQLAlchemy's: a pipeline that finds the
connection idle starts with BEGIN, a COMMIT sent here leaves psycopg's commit
nothing to do, and a failed statement leaves the transaction failed for
SQLAlchemy to roll back. Errors are psycopg's own classes (by SQLSTATE), so
translate.py sees what it always saw. psycopg's own statement preparing is
off (storage/database.py): its ROLLBACK would DEALLOCATE ALL.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import select
from collections.abc import Mapping, Sequence
from typing import Any

from psycopg import IsolationLevel, adapt, errors, postgres, pq
from psycopg.types.numeric import IntLoader

_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%%")
_IDLE = pq.TransactionStatus.IDLE
_TUPLES_OK = pq.ExecStatus.TUPLES_OK
_COMMAND_OK = pq.ExecStatus.COMMAND_OK
_SYNC = pq.ExecStatus.PIPELINE_SYNC
_PREPARED_KEY = "ledger_libpq_prepared"
_LOADER_KEY = "ledger_libpq_loader"


BYTEA = 17
BOOLEAN = 16
_NUMERIC = 1700
_XID8 = 5069
_VOID = 2278


class _NothingLoader(adapt.Loader):
    def load(self, data: Any) -> None:
        return None


# Columns are read by psycopg's loaders (C code with psycopg-binary), except
# where ours differ: a numeric is only ever a sum of integers, an xid8 a
# transaction id compared as an integer, a void (pg_advisory_xact_lock) nothing.
_ADAPTERS = adapt.AdaptersMap(postgres.adapters)
_ADAPTERS.register_loader(_NUMERIC, IntLoader)
_ADAPTERS.register_loader(_XID8, IntLoader)
_ADAPTERS.register_loader(_VOID, _NothingLoader)


class _Context:
    """What a Transformer reads of its context: our loaders, the connection's encoding."""

    def __init__(self, connection: Any) -> None:
        self.adapters = _ADAPTERS
        self.connection = connection


def _param(value: Any) -> bytes | None:
    if value is None:
        return None
    if value is True or value is False:
        return b"t" if value else b"f"
    if isinstance(value, int | str):
        return str(value).encode()
    if isinstance(value, bytes):
        return b"\\x" + value.hex().encode()
    if isinstance(value, list | tuple):
        return _array(value)
    raise TypeError(f"no text form for a parameter of type {type(value).__name__}")


def _array(values: Sequence[str]) -> bytes:
    """A text array's literal: each element quoted, its quotes and backslashes escaped."""
    quoted = ('"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"' for value in values)
    return ("{" + ",".join(quoted) + "}").encode()


class Statement:
    """One statement in libpq's form: `$n` placeholders and a name to prepare it by."""

    # Unique per process: threads may build statements at once (next() is atomic).
    _numbers = itertools.count(1)

    def __init__(
        self, pyformat_sql: str, types: Mapping[str, int], *, describe: bool = True
    ) -> None:
        """`types`: parameters' type OIDs where the SQL does not cast them.
        `describe`: whether its rows' column names are read (see Rows)."""
        self.describe = describe
        order: list[str] = []

        def number(match: re.Match[str]) -> str:
            name = match.group(1)
            if name is None:
                return "%"
            if name not in order:
                order.append(name)
            return f"${order.index(name) + 1}"

        self.sql = _PLACEHOLDER.sub(number, pyformat_sql).encode()
        self.order = tuple(order)
        self.types = [types.get(name, 0) for name in order]
        self.name = f"ledger_{next(Statement._numbers)}".encode()
        self._description: list[tuple[str]] | None = None

    def description_of(self, result: Any) -> list[tuple[str]] | None:
        """Its rows' column names, when asked for: read from its first result,
        as a prepared statement's never change."""
        if not self.describe or result.status != _TUPLES_OK:
            return None
        if self._description is None:
            self._description = [
                (result.fname(column).decode(),) for column in range(result.nfields)
            ]
        return self._description

    def params(self, values: Any) -> list[bytes | None]:
        # A move sends about 120 parameters, nearly all exact str or int: those
        # two are encoded inline (half the CPU of a _param call each); a bool,
        # an enum or any other type goes through _param.
        return [
            value.encode()
            if (kind := type(value := values[name])) is str
            else b"%d" % value
            if kind is int
            else _param(value)
            for name in self.order
        ]


class Rows:
    """A statement's result, read: what the callers of a cursor use of it.
    `description`: its column names, as a cursor's (empty when not asked for:
    a statement compiled from a SELECT knows its own, storage/prepared.py)."""

    __slots__ = ("_next", "description", "rowcount", "rows")

    def __init__(
        self, result: Any, loader: Any, description: list[tuple[str]] | None = None
    ) -> None:
        self.rowcount = int(result.command_tuples if result.command_tuples is not None else -1)
        self._next = 0
        self.description = description or []
        if result.status != _TUPLES_OK:
            self.rows: list[tuple[Any, ...]] = []
            return
        loader.set_pgresult(result)
        self.rows = loader.load_rows(0, result.ntuples, tuple)

    def fetchone(self) -> tuple[Any, ...] | None:
        if self._next >= len(self.rows):
            return None
        self._next += 1
        return self.rows[self._next - 1]

    def fetchall(self) -> list[tuple[Any, ...]]:
        rest, self._next = self.rows[self._next :], len(self.rows)
        return rest

    def close(self) -> None:
        pass


def _begin(driver: Any) -> bytes:
    """The BEGIN psycopg would send: the connection's transaction characteristics."""
    parts = [b"BEGIN"]
    if driver.isolation_level is not None:
        level = IsolationLevel(driver.isolation_level).name.replace("_", " ")
        parts.append(b"ISOLATION LEVEL " + level.encode())
    if driver.read_only is not None:
        parts.append(b"READ ONLY" if driver.read_only else b"READ WRITE")
    if driver.deferrable is not None:
        parts.append(b"DEFERRABLE" if driver.deferrable else b"NOT DEFERRABLE")
    return b" ".join(parts)


def pipeline(
    driver: Any, info: dict[str, Any], calls: Sequence[tuple[Statement, Any]]
) -> list[Rows]:
    """Runs `calls` in order in one round trip on psycopg connection `driver`
    (begun first if idle) and returns their rows. `info` lives as long as the
    connection: it remembers which statements are prepared on it. Raises the
    first statement error, as psycopg would."""
    pgconn = driver.pgconn
    prepared: set[bytes] = info.setdefault(_PREPARED_KEY, set())
    # The statements not yet prepared on this connection, each once.
    preparing = list({s.name: s for s, _ in calls if s.name not in prepared}.values())
    with driver.lock:
        pgconn.enter_pipeline_mode()
        try:
            if not driver.autocommit and pgconn.transaction_status == _IDLE:
                pgconn.send_query_params(_begin(driver), None)
            for statement in preparing:
                pgconn.send_prepare(statement.name, statement.sql, statement.types)
            for statement, values in calls:
                pgconn.send_query_prepared(statement.name, statement.params(values))
            pgconn.pipeline_sync()
            results = _exchange(pgconn)
        finally:
            _leave_pipeline(pgconn)
    replies = results[-len(calls) :]
    made = results[-len(calls) - len(preparing) : -len(calls)]
    prepared.update(
        statement.name
        for statement, result in zip(preparing, made, strict=True)
        if result.status == _COMMAND_OK
    )
    error = next((result for result in results if result.status not in _ANSWERED), None)
    if error is not None:
        raised = errors.error_from_result(error, encoding=driver.info.encoding)
        if isinstance(raised, errors.InvalidSqlStatementName):
            prepared.clear()  # someone ran DEALLOCATE: the next transaction prepares again
        raise raised
    # One per connection, as its prepared set: it keeps the loaders it found by type.
    loader = info.get(_LOADER_KEY)
    if loader is None:
        loader = info[_LOADER_KEY] = adapt.Transformer(_Context(driver))
    return [
        Rows(result, loader, statement.description_of(result))
        for (statement, _), result in zip(calls, replies, strict=True)
    ]


_ANSWERED = (_TUPLES_OK, _COMMAND_OK)


def _leave_pipeline(pgconn: Any) -> None:
    # On a broken connection results are still pending: it is discarded anyway.
    if pgconn.pipeline_status:
        with contextlib.suppress(errors.OperationalError):
            pgconn.exit_pipeline_mode()


def _exchange(pgconn: Any) -> list[Any]:
    """Sends what is queued and reads every result up to the pipeline's sync."""
    socket = pgconn.socket
    while pgconn.flush():
        select.select([socket], [socket], [])
        pgconn.consume_input()
    results: list[Any] = []
    while True:
        while pgconn.is_busy():
            select.select([socket], [], [])
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:
            continue  # the end of one statement's results
        if result.status == _SYNC:
            return results
        results.append(result)
