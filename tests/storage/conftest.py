"""One storage suite, run against SQLite and PostgreSQL (as eventsourcing does).

Each PostgreSQL test gets a schema of its own (search_path in the URL), so tests
never see each other's rows. Under CI=true an unreachable PostgreSQL fails the
PostgreSQL tests; elsewhere they are skipped with the reason.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from ledger_service.application.ledger import Ledger
from ledger_service.domain import chain
from ledger_service.domain.clock import ManualClock
from ledger_service.domain.policies import LanePolicy
from ledger_service.domain.pricing import ModelPrice
from ledger_service.recovery.walk import WalkedRange
from ledger_service.storage import database, migrate, translate
from ledger_service.storage.sql import SqlStore

POSTGRES_URL = os.environ.get(
    "LEDGER_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
START_US = 1_780_000_000_000_000
RECALL = LanePolicy(
    lane="recall",
    limit_nanos=500_000_000,
    prices={"jev": ModelPrice(100_000, 400_000)},
)


def _postgres_problem() -> str | None:
    engine = sa.create_engine(POSTGRES_URL, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as connection:
            connection.execute(sa.text("SELECT 1"))
    except sa.exc.SQLAlchemyError as error:
        where = database.redacted(POSTGRES_URL)
        return f"PostgreSQL at {where} is unreachable: {type(error).__name__}"
    finally:
        engine.dispose()
    return None


def require_postgres() -> None:
    problem = _postgres_problem()
    if problem is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{problem}; under CI=true the PostgreSQL tests must run")
    pytest.skip(problem)


@pytest.fixture
def postgres_schema_url() -> Iterator[str]:
    """A PostgreSQL URL whose search_path is a fresh, empty schema."""
    require_postgres()
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(POSTGRES_URL)
    with admin.begin() as connection:
        connection.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as connection:
            connection.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: object) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/ledger.db"
    url: str = request.getfixturevalue("postgres_schema_url")
    return url


@pytest.fixture
def postgres_store(postgres_schema_url: str) -> Iterator[SqlStore]:
    """A store on PostgreSQL alone, in a fresh schema."""
    engine = database.create(postgres_schema_url, database.EngineLimits(pool_size=4))
    migrate.upgrade(engine)
    store = SqlStore(engine)
    yield store
    store.close()


@pytest.fixture
def store(database_url: str) -> Iterator[SqlStore]:
    engine = database.create(database_url, database.EngineLimits(pool_size=16))
    migrate.upgrade(engine)
    sql_store = SqlStore(engine, request_deadline_seconds=10.0)
    yield sql_store
    sql_store.close()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START_US)


@pytest.fixture
def ledger(store: SqlStore, clock: ManualClock) -> Ledger:
    return Ledger(store, clock, verify_windows=True)


@pytest.fixture
def retried_codes(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """The SQLSTATE of every error the store retries, from now on, once per
    error (the store asks whether an error is retryable in two places)."""
    retried: list[str | None] = []
    seen: set[int] = set()
    is_retryable = translate.is_retryable

    def noting(error: BaseException) -> bool:
        answer = is_retryable(error)
        if answer and error.__cause__ is not None and id(error) not in seen:
            seen.add(id(error))
            retried.append(translate.driver_code(error.__cause__))
        return answer

    monkeypatch.setattr(translate, "is_retryable", noting)
    return retried


def altered_by_walk(walked: WalkedRange) -> list[int]:
    """The seqs a range's walk found no longer giving their hash."""
    content = chain.altered(0, "").reason
    return sorted(broken.seq for broken in walked.breaks if broken.reason == content)


@pytest.fixture
def harness(
    database_url: str,
    start_ledger_server: Callable[..., Any],
    harness_for: Callable[[Any], Any],
) -> Any:
    """The gRPC harness on a real server over `database_url` (both databases)."""
    return harness_for(start_ledger_server(database_url=database_url))
