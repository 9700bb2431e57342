"""PostgreSQL's hot statements sent straight through libpq (storage/libpq.py):
the values they read back, their errors, and the transaction they share with
SQLAlchemy and psycopg."""

from __future__ import annotations

import enum
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy import bindparam, column, func, literal, select, table, text
from sqlalchemy.dialects import postgresql

from ledger_service.storage import database, prepared
from tests.storage.conftest import POSTGRES_URL, require_postgres

pytestmark = pytest.mark.postgres

_THINGS = table("things", column("id"), column("name"), column("blob"), column("flag"))
_STATEMENTS = prepared.Statements(
    values=select(
        literal(2**62, sa.BigInteger),
        literal(-7, sa.Integer),
        literal("lane é", sa.String),
        literal(b"\x00\xffab", sa.LargeBinary),
        literal(True, sa.Boolean),
        sa.null(),
    ),
    echo=select(
        bindparam("number", type_=sa.BigInteger),
        bindparam("word", type_=sa.String),
        bindparam("blob", type_=sa.LargeBinary),
        bindparam("flag", type_=sa.Boolean),
        bindparam("nothing", type_=sa.BigInteger),
    ),
    total=text("SELECT sum(id) AS total, count(*) AS n FROM things"),
    insert=text("INSERT INTO things (id, name) VALUES (:id, :name)"),
    named=select(_THINGS.c.name).where(_THINGS.c.id == bindparam("id")),
    isolation=select(func.current_setting("transaction_isolation")),
    lock=text("SELECT pg_advisory_xact_lock(42)"),
    elements=select(
        func.array_length(bindparam("words", type_=postgresql.ARRAY(sa.String)), 1),
        func.array_to_string(bindparam("words", type_=postgresql.ARRAY(sa.String)), "|"),
    ),
)


@pytest.fixture
def engine(postgres_schema_url: str) -> Iterator[sa.Engine]:
    engine = database.create(postgres_schema_url, database.EngineLimits(pool_size=1))
    with engine.begin() as connection:
        connection.execute(
            text("CREATE TABLE things (id bigint PRIMARY KEY, name text, blob bytea, flag boolean)")
        )
    yield engine
    engine.dispose()


def _one(connection: sa.Connection, name: str, **values: object) -> object:
    return _STATEMENTS(name, connection).one(connection, values)


def test_values_read_back_as_psycopg_would_give_them(engine: sa.Engine) -> None:
    with engine.begin() as connection:
        assert _one(connection, "values") == (2**62, -7, "lane é", b"\x00\xffab", True, None)
        sent = {"number": -(2**63), "word": "ü'\\%s", "blob": b"\\x", "flag": False}
        assert _one(connection, "echo", **sent, nothing=None) == (*sent.values(), None)
        assert _one(connection, "lock") == (None,)


def test_a_sum_of_bigints_reads_as_an_exact_int(engine: sa.Engine) -> None:
    with engine.begin() as connection:
        for id_ in (2**62, 2**62 - 1, 3):
            _STATEMENTS("insert", connection).run(connection, {"id": id_, "name": "x"})
        row = _STATEMENTS("total", connection).one(connection, {})
        assert row is not None and tuple(row) == (2**63 + 2, 3) and type(row[0]) is int


def test_rows_by_column_name_from_a_select_and_from_a_text_statement(engine: sa.Engine) -> None:
    # A SELECT's names come from the compiled statement, a text one's from its result.
    with engine.begin() as connection:
        _STATEMENTS("insert", connection).run(connection, {"id": 5, "name": "x"})
        assert _STATEMENTS("named", connection).mapping(connection, {"id": 5}) == {"name": "x"}
        assert _STATEMENTS("total", connection).mapping(connection, {}) == {"total": 5, "n": 1}


class _Size(enum.IntEnum):
    BIG = 2**40


def test_an_int_or_str_of_a_subclass_goes_as_its_text(engine: sa.Engine) -> None:
    with engine.begin() as connection:
        sent = {"number": _Size.BIG, "word": "w", "blob": b"", "flag": True, "nothing": None}
        assert _one(connection, "echo", **sent) == (2**40, "w", b"", True, None)


def test_a_pipeline_runs_in_order_in_the_connections_transaction(engine: sa.Engine) -> None:
    with engine.connect() as connection:
        with connection.begin():
            calls: list[prepared.Call] = [
                (_STATEMENTS("insert", connection), {"id": 1, "name": "one"}),
                (_STATEMENTS("named", connection), {"id": 1}),
            ]
            cursors = prepared.pipelined(connection, calls)
            assert cursors[1].fetchone() == ("one",)
        with connection.begin() as transaction:
            _STATEMENTS("insert", connection).run(connection, {"id": 2, "name": "two"})
            transaction.rollback()
        with connection.begin():
            assert _one(connection, "named", id=1) == ("one",)  # committed
            assert _one(connection, "named", id=2) is None  # rolled back


def test_statements_stay_prepared_across_a_rollback(engine: sa.Engine) -> None:
    # psycopg's ROLLBACK deallocates every statement on the connection once it
    # has prepared one of its own (after 5 runs of a query): the engine turns
    # its preparing off.
    with engine.connect() as connection:
        for attempt in range(3):
            with connection.begin() as transaction:
                assert _one(connection, "named", id=attempt) is None
                for n in range(8):
                    connection.execute(text("SELECT :n"), {"n": n})  # psycopg's path
                transaction.rollback()


def test_an_error_is_psycopgs_own_and_the_next_transaction_goes_on(engine: sa.Engine) -> None:
    with engine.connect() as connection:
        with connection.begin():
            _STATEMENTS("insert", connection).run(connection, {"id": 1, "name": "one"})
        with pytest.raises(sa.exc.IntegrityError) as caught, connection.begin():
            calls: list[prepared.Call] = [
                (_STATEMENTS("named", connection), {"id": 5}),
                (_STATEMENTS("insert", connection), {"id": 1, "name": "again"}),
                (_STATEMENTS("total", connection), {}),
            ]
            prepared.pipelined(connection, calls)
        assert type(caught.value.orig).__name__ == "UniqueViolation"
        assert "again" not in str(caught.value)  # parameters hidden
        with connection.begin():
            assert _one(connection, "total") == (1, 1)


def test_a_transaction_with_an_isolation_level_keeps_it(engine: sa.Engine) -> None:
    with engine.connect() as connection:
        serial = connection.execution_options(isolation_level="REPEATABLE READ")
        with serial.begin():
            assert _one(serial, "isolation") == ("repeatable read",)
    with engine.begin() as connection:
        assert _one(connection, "isolation") == ("read committed",)


def test_a_read_only_transaction_stays_read_only(engine: sa.Engine) -> None:
    with engine.connect() as connection:
        read_only = connection.execution_options(postgresql_readonly=True)
        with pytest.raises(sa.exc.DBAPIError) as caught, read_only.begin():
            _STATEMENTS("insert", read_only).run(read_only, {"id": 1, "name": "one"})
        assert type(caught.value.orig).__name__ == "ReadOnlySqlTransaction"
    with engine.begin() as connection:
        _STATEMENTS("insert", connection).run(connection, {"id": 1, "name": "one"})


def test_text_reads_the_same_on_a_database_of_another_encoding() -> None:
    require_postgres()
    admin = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    name = f"latin_{uuid.uuid4().hex[:8]}"
    with admin.connect() as connection:
        connection.execute(
            text(
                f"CREATE DATABASE {name} ENCODING 'LATIN1' TEMPLATE template0"
                " LC_COLLATE 'C' LC_CTYPE 'C'"
            )
        )
    engine = database.create(
        sa.make_url(POSTGRES_URL).set(database=name), database.EngineLimits(pool_size=1)
    )
    try:
        with engine.begin() as connection:
            connection.execute(text("CREATE TABLE things (id bigint PRIMARY KEY, name text)"))
            connection.execute(text("INSERT INTO things VALUES (1, :name)"), {"name": "é à"})
            assert _one(connection, "named", id=1) == ("é à",)
    finally:
        engine.dispose()
        with admin.connect() as connection:
            connection.execute(text(f"DROP DATABASE {name} WITH (FORCE)"))
        admin.dispose()


def test_a_list_goes_as_a_text_array_with_every_element_intact(engine: sa.Engine) -> None:
    words = ["team", 'a "quoted" lane', "back\\slash", "comma,brace}", ""]
    with engine.begin() as connection:
        assert _one(connection, "elements", words=words) == (5, "|".join(words))
