"""The one translation of the database's exceptions into the ledger's errors.

Every storage path runs its database work inside `translated()`. MAPPING is the
whole translation, first matching row wins: a driver exception (bare, or
wrapped by SQLAlchemy as `DBAPIError.orig`), and the driver's code for it,
become one domain error. tests/storage/test_translate.py holds that every
exception class the drivers and SQLAlchemy can raise meets a row.

What a caller is told, from the most to the least specific:

- StoreDamaged: the database says its own content is broken (SQLite's
  SQLITE_CORRUPT "database disk image is malformed" and SQLITE_NOTADB "file is
  not a database"; PostgreSQL's XX001 data_corrupted and XX002
  index_corrupted). A row that breaks its table's schema is damage too: the
  decoders raise it as such (records.UnreadableRow). Retrying cannot help; an
  operator must restore a backup.
- SumOutOfRange: a sum of amounts passed what the database's integers hold
  (SQLite's "integer overflow"; PostgreSQL's 22003 numeric_value_out_of_range),
  which only a request that would take a budget past the largest sum the
  ledger keeps can cause (a lane's window made longer, say). The caller's
  field is named where the request is known (application/ledger.py).
- StoreUnavailable, retryable: a transaction lost a race (serialization
  failure, deadlock, lock timeout) and may be run again at once.
- StoreUnavailable: anything else the database or the pool raised.

The driver's message and code go to the log only: SQL, URLs and paths never
reach a caller.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from ledger_service.domain import moves
from ledger_service.domain.errors import (
    DAMAGE_ADVICE,
    LedgerError,
    StoreDamaged,
    StoreUnavailable,
    SumOutOfRange,
)

ANY = "*"
# SQLite reports an overflowing SUM as a plain SQLITE_ERROR: told by its message.
INTEGER_OVERFLOW = "integer overflow"

# (the exception, the driver's code for it or ANY, the domain error, retryable at once)
MAPPING: tuple[tuple[type[BaseException], str, type[LedgerError], bool], ...] = (
    (sqlite3.DatabaseError, "SQLITE_CORRUPT", StoreDamaged, False),
    (sqlite3.DatabaseError, "SQLITE_NOTADB", StoreDamaged, False),
    (sqlite3.Error, INTEGER_OVERFLOW, SumOutOfRange, False),
    (sqlite3.Error, ANY, StoreUnavailable, False),
    (psycopg.Error, "XX001", StoreDamaged, False),
    (psycopg.Error, "XX002", StoreDamaged, False),
    (psycopg.Error, "22003", SumOutOfRange, False),  # numeric_value_out_of_range
    (psycopg.Error, "40001", StoreUnavailable, True),  # serialization_failure
    (psycopg.Error, "40P01", StoreUnavailable, True),  # deadlock_detected
    (psycopg.Error, "55P03", StoreUnavailable, True),  # lock_not_available
    (psycopg.Error, ANY, StoreUnavailable, False),
    (PoolTimeoutError, ANY, StoreUnavailable, False),  # no connection free in time
    (DBAPIError, ANY, StoreUnavailable, False),  # a driver error of no driver above
)

# What each damage code means, for the log and the caller's message.
DAMAGE: dict[str, str] = {
    "SQLITE_CORRUPT": "the SQLite database file is corrupt (database disk image is malformed)",
    "SQLITE_NOTADB": "the SQLite database file is not a database (its header is damaged)",
    "XX001": "PostgreSQL reports corrupted data (XX001 data_corrupted)",
    "XX002": "PostgreSQL reports a corrupted index (XX002 index_corrupted)",
}
# Said to the caller and in the log: what to do about a damaged store.

# SQLite's codes for a file this process may not write (a read-only file or
# mount, a WAL file it cannot open, a file made immutable while open, whose
# writes fail with an I/O error, as on a failing disk): not damage, and not
# healed by a retry, but by an operator (SqlStore.check_writable looks again).
CANNOT_WRITE = frozenset({"SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM", "SQLITE_IOERR"})

# Python's sqlite3 names the error code (sqlite_errorname) when SQLite raised it;
# an exception made elsewhere carries only SQLite's message.
_SQLITE_MESSAGES = {
    "database disk image is malformed": "SQLITE_CORRUPT",
    "file is not a database": "SQLITE_NOTADB",
}


def driver_error(error: BaseException) -> BaseException:
    """The driver's own exception: SQLAlchemy's `orig` when it wrapped one."""
    if isinstance(error, DBAPIError) and isinstance(error.orig, BaseException):
        return error.orig
    return error


# The longest driver message a log line or a local command repeats.
MAX_DRIVER_MESSAGE = 300


def driver_message(error: BaseException) -> str:
    """The driver's own words for `error` (a translated error's cause), on one
    line: for the server's log and the local commands, never for a caller.
    libpq's say what is wrong ('database "x" does not exist', 'too many
    connections') and never hold the password."""
    cause = error.__cause__ if isinstance(error, LedgerError) else error
    if cause is None:
        return ""
    text = " ".join(str(driver_error(cause)).split())
    return text[:MAX_DRIVER_MESSAGE]


def driver_code(error: BaseException) -> str:
    """The driver's code for `error`: a SQLSTATE, or SQLite's primary code name."""
    error = driver_error(error)
    if isinstance(error, sqlite3.Error):
        if str(error) == INTEGER_OVERFLOW:
            return INTEGER_OVERFLOW
        name = str(getattr(error, "sqlite_errorname", "") or "")
        primary = name.split("_")[:2]  # SQLITE_CORRUPT_INDEX -> SQLITE_CORRUPT
        if len(primary) == 2:
            return "_".join(primary)
        text = str(error)
        return next((code for message, code in _SQLITE_MESSAGES.items() if message in text), "")
    return str(getattr(error, "sqlstate", "") or getattr(error, "pgcode", "") or "")


def row_of(
    error: BaseException,
) -> tuple[type[BaseException], str, type[LedgerError], bool] | None:
    """The first MAPPING row `error` (or the driver error it wraps) meets."""
    code = driver_code(error)
    for candidate in (driver_error(error), error):
        for row in MAPPING:
            raised, row_code, _, _ = row
            if isinstance(candidate, raised) and row_code in (ANY, code):
                return row
    return None


def translate(error: BaseException) -> LedgerError | None:
    """The domain error for a foreign `error`; None for one the table does not name."""
    if isinstance(error, LedgerError):
        return error
    row = row_of(error)
    if row is None:
        return None
    domain = row[2]
    if domain is StoreDamaged:
        return StoreDamaged(
            DAMAGE.get(driver_code(error), "the database is damaged"), DAMAGE_ADVICE
        )
    if domain is SumOutOfRange:
        return moves.sum_out_of_range("")
    return StoreUnavailable()


def foreign_cause(error: BaseException) -> BaseException | None:
    """The foreign error a translated domain error was made from; None for a
    domain error the code raised itself."""
    cause = error.__cause__ if isinstance(error, LedgerError) else None
    return cause if cause is not None and row_of(cause) is not None else None


def is_retryable(error: BaseException) -> bool:
    """Whether the foreign error behind a translated one (its __cause__) may be
    run again at once: a transaction that lost a race."""
    cause = error.__cause__ if isinstance(error, LedgerError) else error
    if cause is None:
        return False
    row = row_of(cause)
    return row is not None and row[3]


@contextmanager
def translated() -> Iterator[None]:
    """Runs the block; a foreign error MAPPING names leaves it as a domain error
    (the foreign one its __cause__). Domain errors and bugs pass unchanged."""
    try:
        yield
    except LedgerError:
        raise
    except Exception as error:
        domain = translate(error)
        if domain is None:
            raise
        raise domain from error
