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
  decoders raise it as such (records.UnreadableRow). So is a table of the
  schema gone (SQLite's "no such table", PostgreSQL's 42P01 undefined_table),
  once `ledger migrate` has made the schema: before that, every table is
  missing and the migration ends the outage (a server started with
  --no-migrate waits for it). Retrying cannot help; an operator must restore
  a backup.
- SumOutOfRange: a sum of amounts passed what the database's integers hold
  (SQLite's "integer overflow"; PostgreSQL's 22003 numeric_value_out_of_range),
  which only a request that would take a budget past the largest sum the
  ledger keeps can cause (a lane's window made longer, say). The caller's
  field is named where the request is known (application/ledger.py).
- StoreUnavailable, retryable: a transaction lost a race (serialization
  failure, deadlock, lock timeout) and may be run again at once.
- StoreUnavailable: anything else the database or the pool raised. Among
  those, a PostgreSQL that refuses every write (a privilege, a read-only
  database, SQLSTATE class 53: no disk, memory or connections) is named in
  words by `cannot_write`, and turns health NOT_SERVING (SqlStore).

The driver's message and code go to the log only: SQL, URLs and paths never
reach a caller.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg
from sqlalchemy import Engine, text
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
from ledger_service.storage.schema import Base

ANY = "*"
# SQLite reports an overflowing SUM as a plain SQLITE_ERROR: told by its message.
INTEGER_OVERFLOW = "integer overflow"
# And a missing table too ("no such table: bookings"); PostgreSQL says 42P01.
MISSING_TABLE = "no such table"
MISSING_TABLE_CODES = frozenset({MISSING_TABLE, "42P01"})

# (the exception, the driver's code for it or ANY, the domain error, retryable at once)
MAPPING: tuple[tuple[type[BaseException], str, type[LedgerError], bool], ...] = (
    (sqlite3.DatabaseError, "SQLITE_CORRUPT", StoreDamaged, False),
    (sqlite3.DatabaseError, "SQLITE_NOTADB", StoreDamaged, False),
    (sqlite3.Error, INTEGER_OVERFLOW, SumOutOfRange, False),
    # A missing table: an outage here; damage once the schema was made (translate).
    (sqlite3.Error, MISSING_TABLE, StoreUnavailable, False),
    (sqlite3.Error, ANY, StoreUnavailable, False),
    (psycopg.Error, "XX001", StoreDamaged, False),
    (psycopg.Error, "XX002", StoreDamaged, False),
    (psycopg.Error, "42P01", StoreUnavailable, False),  # undefined_table
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
# A table of a made schema gone: what it is, and what to do (`ledger migrate`
# makes no table of a revision it has recorded; a rebuild writes into tables).
MISSING_TABLE_DAMAGE = (
    "the table {table} of the ledger's schema is missing (dropped, or left out of a restore)"
)
MISSING_TABLE_ADVICE = (
    "stop the ledger and restore the database from a backup; neither `ledger migrate` "
    "nor `ledger rebuild` makes a table again (docs/recovery.md)"
)

# SQLite's codes for a file this process may not write (a read-only file or
# mount, a WAL file it cannot open, a file made immutable while open, whose
# writes fail with an I/O error, as on a failing disk or past the process's
# file-size limit, EFBIG; a full disk, SQLITE_FULL): not damage, and not
# healed by a retry, but by an operator (SqlStore.check_writable looks again).
CANNOT_WRITE = frozenset(
    {"SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM", "SQLITE_IOERR", "SQLITE_FULL"}
)

# SQLite's code for a write lock another connection held past the busy timeout.
SQLITE_BUSY = "SQLITE_BUSY"

# PostgreSQL's codes for a database the ledger's role may read but not write:
# a privilege revoked (42501 insufficient_privilege) or a read-only database
# (25006 read_only_sql_transaction: default_transaction_read_only, a standby
# after a failover); and class 53, insufficient_resources, a server out of
# disk, memory or connections. Not healed by a retry, but by an operator:
# health is NOT_SERVING until SqlStore's probe may write again. Each says what
# is wrong and what to do, for the log line.
CANNOT_WRITE_CONDITIONS: dict[str, tuple[str, str]] = {
    "42501": (
        "the ledger's role may not write a table (42501 insufficient_privilege)",
        "grant the ledger's role INSERT and UPDATE on its tables",
    ),
    "25006": (
        "the database is read-only (25006 read_only_sql_transaction)",
        "make the database writable (a read-only database, or a standby)",
    ),
    "53100": (
        "the database server's disk is full (53100 disk_full)",
        "free disk space where PostgreSQL keeps its data and write-ahead log",
    ),
    "53200": (
        "the database server is out of memory (53200 out_of_memory)",
        "give PostgreSQL memory (fewer connections, a smaller work_mem)",
    ),
    "53300": (
        "the database server has too many connections (53300 too_many_connections)",
        "raise max_connections, or lower the replicas' pool_size",
    ),
}
# Of those, the ones the write probe cannot see: all of class 53. Its
# statements write no row, need little memory and run on a connection already
# open, so they pass on a full disk, a server short of memory, or one with no
# connection left for a move's new one.
INSUFFICIENT_RESOURCES_CLASS = "53"
# Class 53's other codes (53400 configuration_limit_exceeded, ...).
INSUFFICIENT_RESOURCES = (
    "the database server lacks a resource ({code}, class 53 insufficient_resources)",
    "see PostgreSQL's log for which, and give it more",
)


# libpq's words for a connect the server refused for lack of connection slots
# (53300: the role's CONNECTION LIMIT, or max_connections): a refused connect
# carries no SQLSTATE, so its words are all there is to tell it by. The last is
# what a role without SUPERUSER meets first, superuser_reserved_connections
# (3 by default) before max_connections.
TOO_MANY_CONNECTIONS_WORDS = (
    "too many connections",
    "too many clients already",
    "remaining connection slots are reserved",
)
CONNECT_REFUSED = (
    "the database server refused a new connection: too many connections "
    "(53300 too_many_connections)",
    "raise max_connections (or the role's CONNECTION LIMIT), or lower the pool "
    "(pool_size and pool_max_overflow, times the replicas)",
)


# PostgreSQL's code for a database that answers but has no schema where the
# URL's search_path points (3F000 invalid_schema_name, "no schema has been
# selected to create in"): a fresh database with `?options=-csearch_path%3Dx`
# before anyone ran CREATE SCHEMA x. Retried as an outage, since the server
# serves by itself once the schema exists, but said as what it is.
MISSING_SCHEMA_CODE = "3F000"
MISSING_SCHEMA = (
    "the schema the database URL's search_path names does not exist "
    "(3F000 invalid_schema_name): create it (CREATE SCHEMA) or correct the URL's options"
)


# A table missing before the schema was made (translated as an outage, not
# as damage): a server started with --no-migrate on an empty database.
NO_SCHEMA_YET = "the database answers but holds no ledger schema yet (`ledger migrate` makes it)"


def search_path_missing(engine: Engine) -> bool:
    """PostgreSQL: whether no schema the search_path names exists
    (current_schema() is NULL). A read then meets 42P01 as if the schema were
    not migrated yet, though `ledger migrate` cannot make it (3F000)."""
    if engine.dialect.name != "postgresql":
        return False
    try:
        with engine.connect() as connection:
            return connection.execute(text("SELECT current_schema()")).scalar() is None
    except DBAPIError:
        return False


def unavailable_words(error: BaseException, outage: str) -> str:
    """What a StoreUnavailable says is wrong, for the log and the local
    commands: `outage` (the caller's words for a database that does not
    answer), or, for a database that answers, MISSING_SCHEMA or NO_SCHEMA_YET."""
    code = _schema_missing_code(error)
    if not code:
        return outage
    return MISSING_SCHEMA if code == MISSING_SCHEMA_CODE else NO_SCHEMA_YET


def schema_missing(error: BaseException) -> bool:
    """Whether a StoreUnavailable comes from a database that answers but lacks
    the ledger's schema (or the schema its URL names): no move can be served."""
    return bool(_schema_missing_code(error))


def _schema_missing_code(error: BaseException) -> str:
    cause = error.__cause__ if isinstance(error, LedgerError) else error
    if cause is None or isinstance(error, StoreDamaged):
        return ""
    code = driver_code(cause)
    return code if code == MISSING_SCHEMA_CODE or code in MISSING_TABLE_CODES else ""


def connect_refused(error: BaseException) -> tuple[str, str] | None:
    """What is wrong and what to do when PostgreSQL refused a new connection
    for lack of connection slots (CONNECT_REFUSED); None for another error."""
    driver = driver_error(error)
    if not isinstance(driver, psycopg.OperationalError) or driver_code(error):
        return None
    text = str(driver)
    if any(words in text for words in TOO_MANY_CONNECTIONS_WORDS):
        return CONNECT_REFUSED
    return None


# A connect refused for the URL itself: a database that does not exist (3D000
# invalid_catalog_name), a role unknown, refused or not allowed to log in
# (28000 invalid_authorization_specification, 28P01 invalid_password).
# An operator's configuration error, which no retry mends: a start ends on it
# (exit 2). libpq's refusal of a connect carries no SQLSTATE, so its words
# tell the cases apart; each pattern names the database or role (never the
# password, which libpq's words never hold), with what to do.
_ROLE_ADVICE = (
    "check the role (the user of LEDGER_DATABASE_URL or --database-url): create it, "
    "or name one the server knows"
)
MISCONFIGURED: tuple[tuple[re.Pattern[str], str, str], ...] = (
    (
        re.compile(r'database "([^"]*)" does not exist'),
        'the database "{0}" does not exist (3D000 invalid_catalog_name)',
        'create it (CREATE DATABASE "{0}"), or name an existing one in LEDGER_DATABASE_URL '
        "(--database-url)",
    ),
    (
        re.compile(r'password authentication failed for user "([^"]*)"'),
        'the server refused the password of the role "{0}" (28P01 invalid_password)',
        "check the role's password in LEDGER_DATABASE_URL (--database-url)",
    ),
    (
        re.compile(r'role "([^"]*)" does not exist'),
        'the role "{0}" does not exist (28000 invalid_authorization_specification)',
        _ROLE_ADVICE,
    ),
    (
        re.compile(r'role "([^"]*)" is not permitted to log in'),
        'the role "{0}" may not log in (28000 invalid_authorization_specification)',
        'check the role, or give it LOGIN (ALTER ROLE "{0}" LOGIN)',
    ),
    (
        re.compile(r'(\w+) authentication failed for user "([^"]*)"'),
        'the server refused the role "{1}" ({0} authentication; 28000 '
        "invalid_authorization_specification)",
        _ROLE_ADVICE,
    ),
    (
        re.compile(r'no pg_hba\.conf entry for host "([^"]*)", user "([^"]*)", database "([^"]*)"'),
        'the server\'s pg_hba.conf has no entry for the role "{1}" on the database "{2}" '
        'from host "{0}" (28000 invalid_authorization_specification)',
        "check the role and database, or add an entry to pg_hba.conf",
    ),
)
# Said for a code that came without words the patterns know.
MISCONFIGURED_CODES: dict[str, tuple[str, str]] = {
    "3D000": (
        "the database does not exist (3D000 invalid_catalog_name)",
        "create it, or name an existing one in LEDGER_DATABASE_URL (--database-url)",
    ),
    "28000": (
        "the server refused the role (28000 invalid_authorization_specification)",
        _ROLE_ADVICE,
    ),
    "28P01": (
        "the server refused the role's password (28P01 invalid_password)",
        "check the role's password in LEDGER_DATABASE_URL (--database-url)",
    ),
}


def misconfigured(error: BaseException) -> tuple[str, str] | None:
    """What is wrong and what to do when PostgreSQL refused the URL itself (a
    database that does not exist, a role refused: MISCONFIGURED); None for
    another error, an outage among them."""
    cause = error.__cause__ if isinstance(error, LedgerError) else error
    driver = driver_error(cause) if cause is not None else None
    if not isinstance(driver, psycopg.Error):
        return None
    words = str(driver)
    for pattern, what, advice in MISCONFIGURED:
        found = pattern.search(words)
        if found is not None:
            return what.format(*found.groups()), advice.format(*found.groups())
    return MISCONFIGURED_CODES.get(driver_code(driver))


def cannot_write(error: BaseException) -> tuple[str, str] | None:
    """What a PostgreSQL error that refuses every write says is wrong and
    what to do about it, in words (CANNOT_WRITE_CONDITIONS); None for another."""
    if not isinstance(driver_error(error), psycopg.Error):
        return None
    code = driver_code(error)
    if code in CANNOT_WRITE_CONDITIONS:
        return CANNOT_WRITE_CONDITIONS[code]
    if unseen_by_probe(error):
        what, advice = INSUFFICIENT_RESOURCES
        return what.format(code=code), advice
    return None


def unseen_by_probe(error: BaseException) -> bool:
    """Whether `error` is a PostgreSQL refusal the write probe cannot see
    (class 53, insufficient_resources): moves meet it while the probe passes."""
    code = driver_code(error)
    return (
        isinstance(driver_error(error), psycopg.Error)
        and len(code) == 5
        and code.startswith(INSUFFICIENT_RESOURCES_CLASS)
    )


# PostgreSQL's codes for a statement stopped while it waited: lock_timeout
# (55P03 lock_not_available), or a cancel at statement_timeout or at the
# call's deadline (57014 query_canceled, "canceling statement due to user
# request" when the watchdog sent it). Most often it waited for a lock another
# session holds; SqlStore's write probe then asks whether one blocks moves.
WAITED_CODES = frozenset({"55P03", "57014"})

# PostgreSQL's codes for a connection the server ended: 57P01 admin_shutdown
# (pg_terminate_backend, a fast shutdown, a failover) and 57P02
# crash_shutdown; class 08 is connection_exception. libpq's own "the
# connection is lost" and "server closed the connection unexpectedly" carry
# no code. SqlStore runs such a call once more, on a new connection.
LOST_CONNECTION_CODES = frozenset({"57P01", "57P02"})

# Python's sqlite3 names the error code (sqlite_errorname) when SQLite raised it;
# an exception made elsewhere carries only SQLite's message.
# Python's own "Could not decode to UTF-8 column" is a text column whose bytes
# are not UTF-8, which the ledger never writes: a damaged page.
_SQLITE_MESSAGES = {
    "database disk image is malformed": "SQLITE_CORRUPT",
    "file is not a database": "SQLITE_NOTADB",
    "Could not decode to UTF-8 column": "SQLITE_CORRUPT",
}
# What a connection says for a schema whose damaged text SQLite quoted in its
# error, which Python's sqlite3 then failed to decode (a UnicodeDecodeError).
DAMAGED_SCHEMA_TEXT = "database disk image is malformed (its schema's text is not UTF-8)"


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
    text = " ".join(_without_sql(driver_error(cause)).split())
    return text[:MAX_DRIVER_MESSAGE]


def _without_sql(error: BaseException) -> str:
    """PostgreSQL's message, detail and hint: the cause and what to do. Its
    CONTEXT ("SQL statement ...", the function it ran in) and LINE (the query
    under a caret) are SQL, which the log leaves out. A connect that failed
    has no diagnostics: libpq's own words then."""
    diag = getattr(error, "diag", None) if isinstance(error, psycopg.Error) else None
    primary = diag.message_primary if diag is not None else None
    if diag is None or not primary:
        return str(error)
    parts = [primary]
    parts += [f"DETAIL: {diag.message_detail}"] if diag.message_detail else []
    parts += [f"HINT: {diag.message_hint}"] if diag.message_hint else []
    return " ".join(parts)


def driver_code(error: BaseException) -> str:
    """The driver's code for `error`: a SQLSTATE, or SQLite's primary code name."""
    error = driver_error(error)
    if isinstance(error, sqlite3.Error):
        if str(error) == INTEGER_OVERFLOW:
            return INTEGER_OVERFLOW
        if str(error).startswith(MISSING_TABLE):
            return MISSING_TABLE
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


# A file that fails integrity_check, or that SQLite finds corrupt, is not made
# whole by a rebuild (an index, or a page of the log, may be what is damaged;
# `ledger rebuild` refuses such a file, and SQLite's REINDEX fails on it too).
INTEGRITY_ADVICE = "stop the ledger and restore the database from a backup (docs/recovery.md)"
# The most of SQLite's integrity_check lines a verification reads and repeats.
MAX_INTEGRITY_PROBLEMS = 10


def integrity_damage(problems: list[str]) -> StoreDamaged:
    """SQLite's PRAGMA integrity_check found `problems` (its own lines, which
    name pages, rows and indexes, never data): the file is damaged."""
    # "*** in database main ***" heads the findings of a damaged structure.
    problems = [problem for problem in problems if not problem.startswith("*** ")] or problems
    first = " ".join(problems[0].split())[:MAX_DRIVER_MESSAGE]
    more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
    return StoreDamaged(
        f"the SQLite database file is corrupt (PRAGMA integrity_check: {first}{more})",
        INTEGRITY_ADVICE,
    )


# The table a driver's message names as missing: SQLite's "no such table:
# main.bookings", PostgreSQL's 'relation "bookings" does not exist'.
_MISSING_TABLE_NAME = re.compile(r'no such table: (?:\w+\.)?(\w+)|relation "(?:[^"]*\.)?([^"]+)"')


def missing_table(error: BaseException) -> str:
    """The table of the ledger's schema a foreign `error` says is missing,
    quoted ("'bookings'"), or "a table" (the name unknown, or not one of the
    schema's: the message never repeats other text of the driver's); "" for
    an error of another kind."""
    if driver_code(error) not in MISSING_TABLE_CODES:
        return ""
    found = _MISSING_TABLE_NAME.search(str(driver_error(error)))
    name = next((group for group in found.groups() if group), "") if found else ""
    return repr(name) if name in Base.metadata.tables else "a table"


def schema_recorded(engine: Engine) -> bool:
    """Whether `ledger migrate` has made the ledger's schema in this database:
    Alembic has recorded a revision. False when that cannot be read."""
    try:
        with engine.connect() as connection:
            found = connection.execute(text("SELECT version_num FROM alembic_version"))
            return found.first() is not None
    except DBAPIError:
        return False


def translate(
    error: BaseException, schema_made: Callable[[], bool] | None = None
) -> LedgerError | None:
    """The domain error for a foreign `error`; None for one the table does not
    name. `schema_made`, when given, says whether the schema was ever made:
    then a missing table is damage (asked only when one is missing)."""
    foreign = foreign_cause(error) if isinstance(error, LedgerError) else error
    if schema_made is not None and foreign is not None and not isinstance(error, StoreDamaged):
        table = missing_table(foreign)
        if table and schema_made():
            return StoreDamaged(MISSING_TABLE_DAMAGE.format(table=table), MISSING_TABLE_ADVICE)
    if isinstance(error, LedgerError):
        return error
    row = row_of(error)
    if row is None:
        return None
    domain = row[2]
    if domain is StoreDamaged:
        code = driver_code(error)
        # verify's integrity_check fails on a corrupt SQLite file and a rebuild
        # refuses it: only a backup helps, as for what integrity_check finds.
        advice = INTEGRITY_ADVICE if code.startswith("SQLITE_") else DAMAGE_ADVICE
        return StoreDamaged(DAMAGE.get(code, "the database is damaged"), advice)
    if domain is SumOutOfRange:
        return moves.sum_out_of_range("")
    return StoreUnavailable()


def foreign_cause(error: BaseException) -> BaseException | None:
    """The foreign error a translated domain error was made from; None for a
    domain error the code raised itself."""
    cause = error.__cause__ if isinstance(error, LedgerError) else None
    return cause if cause is not None and row_of(cause) is not None else None


def lock_wait_gave_up(error: BaseException) -> bool:
    """Whether the foreign error behind a translated one is SQLite's
    SQLITE_BUSY: another connection held the write lock for as long as the
    busy handler waited (a `sqlite3` shell or script with BEGIN IMMEDIATE open)."""
    cause = error.__cause__ if isinstance(error, LedgerError) else error
    return cause is not None and driver_code(cause) == SQLITE_BUSY


def is_retryable(error: BaseException) -> bool:
    """Whether the foreign error behind a translated one (its __cause__) may be
    run again at once: a transaction that lost a race."""
    cause = error.__cause__ if isinstance(error, LedgerError) else error
    if cause is None:
        return False
    row = row_of(cause)
    return row is not None and row[3]


def lost_connection(error: BaseException) -> bool:
    """Whether foreign `error` (or the one behind a translated error) says the
    PostgreSQL connection died: its session, and any transaction it had open,
    are gone."""
    cause = error.__cause__ if isinstance(error, LedgerError) else error
    driver = driver_error(cause) if cause is not None else None
    if not isinstance(driver, psycopg.OperationalError):
        return False
    code = driver_code(driver)
    return not code or code in LOST_CONNECTION_CODES or code.startswith("08")


@contextmanager
def translated(engine: Engine | None = None) -> Iterator[None]:
    """Runs the block; a foreign error MAPPING names leaves it as a domain error
    (the foreign one its __cause__). Domain errors and bugs pass unchanged, but
    for a missing table of `engine`'s made schema, which is damage (the
    engine, when given, is asked whether the schema was made)."""
    try:
        yield
    except Exception as error:
        probe = None if engine is None else (lambda: schema_recorded(engine))
        domain = translate(error, probe)
        if domain is None or domain is error:
            raise
        raise domain from (foreign_cause(error) or error)
