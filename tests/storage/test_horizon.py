"""The commit horizon on PostgreSQL (storage/horizon.py) on a log longer than one walk."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ledger_service.application.ledger import Ledger
from ledger_service.domain import moves
from ledger_service.domain.clock import ManualClock
from ledger_service.storage import database, horizon, migrate
from ledger_service.storage.sql import SqlStore
from tests.storage.conftest import RECALL, START_US

pytestmark = pytest.mark.postgres


@pytest.fixture
def postgres_store(postgres_schema_url: str) -> Iterator[SqlStore]:
    engine = database.create(postgres_schema_url, database.EngineLimits(pool_size=4))
    migrate.upgrade(engine)
    store = SqlStore(engine)
    yield store
    store.close()


def test_a_fresh_horizon_jumps_over_a_log_longer_than_one_walk(
    postgres_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = Ledger(postgres_store, ManualClock(START_US))
    ledger.put_lane(RECALL)
    for index in range(12):
        ledger.reserve(moves.ReserveCommand(RECALL.lane, f"r-{index}", "jev", 1000, 10))
    # Three seqs a walk, and no waiting: each advance is one step.
    monkeypatch.setattr(horizon, "MAX_WALK", 3)
    monkeypatch.setattr(horizon, "MAX_WAIT_SECONDS", 0.0)
    fresh = horizon.CommitHorizon()
    with postgres_store.engine.connect() as connection:
        assert fresh.advance(connection) == 3  # the first walk
        # Nothing was in flight when it stopped: the whole log is final.
        assert fresh.advance(connection) == 13
