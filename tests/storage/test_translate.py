"""storage/translate.py: the one mapping from the drivers' exceptions to the
ledger's errors is complete, and tells damage from an outage."""

from __future__ import annotations

import sqlite3

import psycopg
import psycopg.errors
import pytest
import sqlalchemy.exc
from sqlalchemy.exc import DBAPIError

from ledger_service.domain.errors import LedgerError, StoreDamaged, StoreUnavailable
from ledger_service.storage import translate


def _subclasses(base: type[BaseException]) -> set[type[BaseException]]:
    found = {base}
    for sub in base.__subclasses__():
        found |= _subclasses(sub)
    return found


def _instance(error_class: type[BaseException]) -> BaseException:
    if issubclass(error_class, DBAPIError):
        return error_class("SELECT 1", None, sqlite3.Error("x"))
    return error_class("x")


@pytest.mark.parametrize(
    "base", [sqlite3.Error, psycopg.Error, sqlalchemy.exc.DBAPIError, sqlalchemy.exc.TimeoutError]
)
def test_every_exception_a_driver_or_the_pool_raises_meets_a_row(
    base: type[BaseException],
) -> None:
    for error_class in _subclasses(base):
        error = _instance(error_class)
        assert translate.row_of(error) is not None, error_class
        with pytest.raises(LedgerError), translate.translated():
            raise error


def test_every_row_is_reachable_and_names_a_domain_error() -> None:
    for raised, code, domain, _ in translate.MAPPING:
        assert issubclass(domain, LedgerError)
        earlier = translate.MAPPING[: translate.MAPPING.index((raised, code, domain, _))]
        assert (raised, code) not in [(row[0], row[1]) for row in earlier]
        if domain is StoreDamaged:
            assert code in translate.DAMAGE


def _sqlite_error(message: str) -> DBAPIError:
    return DBAPIError.instance("SELECT 1", None, sqlite3.DatabaseError(message), sqlite3.Error)


@pytest.mark.parametrize(
    "foreign",
    [
        _sqlite_error("database disk image is malformed"),
        _sqlite_error("file is not a database"),
        psycopg.errors.lookup("XX001")("bad page"),
        DBAPIError.instance("SELECT 1", None, psycopg.errors.lookup("XX002")("x"), psycopg.Error),
    ],
)
def test_a_damaged_store_is_told_as_damage_with_what_to_do(foreign: BaseException) -> None:
    with pytest.raises(StoreDamaged) as caught, translate.translated():
        raise foreign
    error = caught.value
    assert error.reason == "STORE_DAMAGED" and error.__cause__ is foreign
    assert "backup" in error.message and "docs/recovery.md" in error.message
    assert "SELECT" not in error.message
    assert not translate.is_retryable(error)


def test_sqlite_names_its_error_codes() -> None:
    connection = sqlite3.connect(":memory:")
    try:
        connection.execute("PRAGMA no_such_pragma")
        with pytest.raises(sqlite3.Error) as caught:
            connection.execute("SELECT no_such_function()")
    finally:
        connection.close()
    assert translate.driver_code(caught.value) == "SQLITE_ERROR"
    assert isinstance(translate.translate(caught.value), StoreUnavailable)


@pytest.mark.parametrize(
    "foreign",
    [
        sqlite3.OperationalError("no such table: main.bookings"),
        psycopg.errors.UndefinedTable('relation "bookings" does not exist'),
    ],
)
def test_a_missing_table_is_damage_once_the_schema_was_made(foreign: BaseException) -> None:
    assert translate.missing_table(foreign) == "'bookings'"
    assert not isinstance(translate.translate(foreign), StoreDamaged)
    assert not isinstance(translate.translate(foreign, lambda: False), StoreDamaged)
    damaged = translate.translate(foreign, lambda: True)
    assert isinstance(damaged, StoreDamaged) and "table 'bookings'" in damaged.message


def test_a_missing_table_the_schema_does_not_have_is_not_repeated() -> None:
    foreign = sqlite3.OperationalError("no such table: secret_stuff")
    assert translate.missing_table(foreign) == "a table"


@pytest.mark.parametrize("sqlstate", ["40001", "40P01", "55P03"])
def test_a_lost_race_is_unavailable_and_retryable(sqlstate: str) -> None:
    foreign = DBAPIError.instance(
        "SELECT 1", None, psycopg.errors.lookup(sqlstate)("x"), psycopg.Error
    )
    with pytest.raises(StoreUnavailable) as caught, translate.translated():
        raise foreign
    assert translate.is_retryable(caught.value)


def test_an_outage_is_unavailable_and_not_retried_at_once() -> None:
    for foreign in (
        DBAPIError.instance(
            "SELECT 1", None, sqlite3.OperationalError("database is locked"), sqlite3.Error
        ),
        psycopg.OperationalError("connection refused"),
        sqlalchemy.exc.TimeoutError("pool"),
    ):
        with pytest.raises(StoreUnavailable) as caught, translate.translated():
            raise foreign
        assert not isinstance(caught.value, StoreDamaged)
        assert not translate.is_retryable(caught.value)


def test_domain_errors_and_bugs_pass_unchanged() -> None:
    refusal = StoreUnavailable()
    with pytest.raises(StoreUnavailable) as caught, translate.translated():
        raise refusal
    assert caught.value is refusal
    with pytest.raises(KeyError), translate.translated():
        raise KeyError("a bug")


def test_integrity_check_damage_names_sqlites_first_finding_not_its_heading() -> None:
    """integrity_check heads its findings with the database's name when
    the structure is damaged; the sentence names the first finding."""
    damage = translate.integrity_damage(
        ["*** in database main ***", "Multiple uses for byte 3279 of page 32", "Page 33: x"]
    )
    assert "(PRAGMA integrity_check: Multiple uses for byte 3279 of page 32 and 1 more)" in (
        damage.message
    ), damage.message


@pytest.mark.parametrize(
    ("foreign", "lost"),
    [
        (psycopg.errors.AdminShutdown("terminating connection"), True),  # 57P01
        (psycopg.errors.CrashShutdown("crash"), True),  # 57P02
        (psycopg.errors.ConnectionFailure("failure"), True),  # 08006
        (psycopg.OperationalError("the connection is lost"), True),  # libpq's, no code
        (psycopg.errors.QueryCanceled("canceling statement"), False),  # 57014
        (psycopg.errors.LockNotAvailable("lock timeout"), False),  # 55P03
        (psycopg.errors.InsufficientPrivilege("permission denied"), False),
        (sqlite3.OperationalError("disk I/O error"), False),
    ],
)
def test_a_connection_the_server_ended_is_told_as_lost(foreign: BaseException, lost: bool) -> None:
    wrapped = DBAPIError("SELECT 1", None, foreign)
    assert translate.lost_connection(foreign) is lost
    assert translate.lost_connection(wrapped) is lost
    with pytest.raises(StoreUnavailable) as raised, translate.translated():
        raise wrapped
    assert translate.lost_connection(raised.value) is lost


@pytest.mark.parametrize(
    ("sqlstate", "words"),
    [
        ("53100", "disk is full"),
        ("53200", "out of memory"),
        ("53300", "too many connections"),
        ("53400", "lacks a resource (53400"),
        ("42501", "may not write"),
        ("25006", "read-only"),
    ],
)
def test_a_server_that_refuses_every_write_is_told_so_in_words(sqlstate: str, words: str) -> None:
    """Class 53 (a full disk, no memory, no connection left) refuses every
    move as a revoked privilege does: the store turns health NOT_SERVING."""
    foreign = DBAPIError.instance(
        "INSERT", None, psycopg.errors.lookup(sqlstate)("could not extend file"), psycopg.Error
    )
    with pytest.raises(StoreUnavailable) as caught, translate.translated():
        raise foreign
    assert not translate.is_retryable(caught.value)
    condition = translate.cannot_write(caught.value.__cause__ or foreign)
    assert condition is not None and words in condition[0], condition
    assert translate.cannot_write(psycopg.errors.QueryCanceled("x")) is None
    assert translate.cannot_write(sqlite3.OperationalError("database or disk is full")) is None


@pytest.mark.parametrize(
    "words",
    [
        "sorry, too many clients already",
        'too many connections for role "ledger"',
        'too many connections for database "ledger"',
        # Also 53300, and what a role without SUPERUSER meets first with the default
        # superuser_reserved_connections (3): PostgreSQL 15, then 16 and later.
        "remaining connection slots are reserved for non-replication superuser connections",
        "remaining connection slots are reserved for roles with the SUPERUSER attribute",
        "remaining connection slots are reserved for roles with privileges of the "
        '"pg_use_reserved_connections" role',
    ],
)
def test_every_connect_refused_for_lack_of_slots_is_told_as_such(words: str) -> None:
    refused = psycopg.OperationalError(
        f'connection failed: connection to server at "127.0.0.1", port 5432 failed: FATAL:  {words}'
    )
    assert translate.connect_refused(refused) == translate.CONNECT_REFUSED
