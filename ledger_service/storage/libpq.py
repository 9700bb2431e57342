"""PostgreSQL: the hot statements sent straight through libpq, in pipelines.

psycopg's cursor layer (query conversion, parameter dumpers, the prepare
manager, loaders, result set-up) cost about 50 µs of Python per statement,
more than half of a move's CPU on PostgreSQL. Here a statement is parsed once
per connection as a named prepared statement, its parameters go as text, and
its rows are read by column type: the handful of types the schema uses
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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from psycopg import IsolationLevel, errors, pq

_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%%")
_IDLE = pq.TransactionStatus.IDLE
_TUPLES_OK = pq.ExecStatus.TUPLES_OK
_COMMAND_OK = pq.ExecStatus.COMMAND_OK
_SYNC = pq.ExecStatus.PIPELINE_SYNC
_PREPARED_KEY = "ledger_libpq_prepared"


def _text(value: bytes) -> str:
    return value.decode()


def _bytea(value: bytes) -> bytes:
    return bytes.fromhex(value[2:].decode())  # the hex form: \x0a1b...


def _bool(value: bytes) -> bool:
    return value == b"t"


def _nothing(_value: bytes) -> None:
    return None


BYTEA = 17
BOOLEAN = 16

# Column readers by type OID: the types our statements return.
_READERS: dict[int, Callable[[bytes], Any]] = {
    20: int,  # int8
    21: int,  # int2
    23: int,  # int4
    26: int,  # oid
    1700: int,  # numeric: only sums of integers are selected
    5069: int,  # xid8
    25: _text,  # text
    1043: _text,  # varchar
    1042: _text,  # bpchar
    19: _text,  # name
    BYTEA: _bytea,
    BOOLEAN: _bool,
    2278: _nothing,  # void, e.g. pg_advisory_xact_lock
}


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
    `describe`: whether its column names are read into `description` (a
    statement compiled from a SELECT knows its own: storage/prepared.py)."""

    __slots__ = ("_next", "description", "rowcount", "rows")

    def __init__(self, result: Any, describe: bool = True) -> None:
        self.rowcount = int(result.command_tuples if result.command_tuples is not None else -1)
        self.rows: list[tuple[Any, ...]] = []
        self._next = 0
        self.description: list[tuple[str]] = []
        if result.status != _TUPLES_OK:
            return
        columns = range(result.nfields)
        readers = [_READERS[result.ftype(column)] for column in columns]
        if describe:
            self.description = [(result.fname(column).decode(),) for column in columns]
        value = result.get_value
        for row in range(result.ntuples):
            self.rows.append(
                tuple(
                    None if (raw := value(row, column)) is None else readers[column](raw)
                    for column in columns
                )
            )

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
    return [
        Rows(result, statement.describe)
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
