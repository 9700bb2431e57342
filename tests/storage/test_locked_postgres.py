"""A table of the ledger locked by another session (`LOCK TABLE bookings IN
ACCESS EXCLUSIVE MODE` held in an open transaction: a migration, a DBA's
maintenance). Every move waits for the lock and fails at its deadline. Health
stayed SERVING (the probe's SELECT 1 passes) and the log said only
"canceling statement due to user request". Now the write probe, which asks
with a short lock_timeout, turns health NOT_SERVING while it cannot take the
locks a move takes, the log names the lock and the timeout, and health turns
SERVING again by itself when the lock is released."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import psycopg
import pytest

from ledger_service.application.ledger import Ledger
from ledger_service.domain.clock import ManualClock
from ledger_service.domain.errors import StoreUnavailable
from ledger_service.domain.moves import ReserveCommand
from ledger_service.storage import database, migrate
from ledger_service.storage.sql import SqlStore
from tests.storage.conftest import RECALL, START_US

pytestmark = pytest.mark.postgres

DEADLINE_SECONDS = 2.0


@pytest.fixture
def store(postgres_schema_url: str) -> Iterator[SqlStore]:
    limits = database.EngineLimits(pool_size=4, statement_timeout_ms=1500)
    engine = database.create(postgres_schema_url, limits)
    migrate.upgrade(engine)
    sql_store = SqlStore(engine, request_deadline_seconds=DEADLINE_SECONDS)
    yield sql_store
    sql_store.close()


def _reserve(rid: str) -> ReserveCommand:
    return ReserveCommand(RECALL.lane, rid, "jev", 7_000, 200)


def _locker(store: SqlStore) -> psycopg.Connection:
    """Another session, holding `bookings` locked in an open transaction."""
    url = store.engine.url.render_as_string(hide_password=False).replace("+psycopg", "")
    options = database.source_url(store.engine).split("options=")[1].replace("%3D", "=")
    session = psycopg.connect(url, options=options)
    session.execute("LOCK TABLE bookings IN ACCESS EXCLUSIVE MODE")
    return session


def test_a_table_locked_by_another_session_is_not_serving_until_released(
    store: SqlStore, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = Ledger(store, ManualClock(START_US))
    ledger.put_lane(RECALL)
    assert ledger.reserve(_reserve("r-1")).admitted
    locker = _locker(store)
    try:
        with caplog.at_level(logging.WARNING):
            for rid in ("r-2", "r-3"):
                with pytest.raises(StoreUnavailable):
                    ledger.reserve(_reserve(rid))
            for _ in range(2):
                with pytest.raises(StoreUnavailable):
                    store.ping(timeout_seconds=DEADLINE_SECONDS)
        told = [r.getMessage() for r in caplog.records if "locked" in r.getMessage()]
        assert len(told) == 1, [r.getMessage() for r in caplog.records]
        assert "locked by another session" in told[0] and "'bookings'" in told[0], told
        assert "lock_timeout" in told[0], told
    finally:
        locker.close()
    with caplog.at_level(logging.INFO):
        store.ping(timeout_seconds=DEADLINE_SECONDS)
    assert "the database can be written again" in caplog.text
    assert ledger.reserve(_reserve("r-4")).admitted
