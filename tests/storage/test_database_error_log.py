"""A database that refuses every move (connections all taken, the server
down, a disk full) is told once, and then at most once every
throttle.ERROR_LOG_INTERVAL_SECONDS with a count, not once a call: two replicas
under a 12-thread load wrote 570 identical warnings each in the 20 s that
PostgreSQL's connection slots were all taken, and 600 in a 20 s stop.

The tests connect as a superuser, so a statement trigger refuses the INSERT
with PostgreSQL's code for a full disk (53100 disk_full)."""

from __future__ import annotations

import logging

import pytest

from ledger_service.application import throttle
from ledger_service.application.ledger import Ledger
from ledger_service.domain.clock import ManualClock
from ledger_service.domain.errors import StoreUnavailable
from ledger_service.domain.moves import ReserveCommand
from ledger_service.storage import sql
from ledger_service.storage.sql import SqlStore
from tests.storage.conftest import RECALL, START_US

pytestmark = pytest.mark.postgres

FULL = """
CREATE FUNCTION disk_full() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'could not extend file' USING ERRCODE = '53100'; END $$;
CREATE TRIGGER disk_full BEFORE INSERT ON events
  FOR EACH STATEMENT EXECUTE FUNCTION disk_full();
"""


def test_a_failing_database_is_logged_once_an_interval_with_a_count(
    postgres_store: SqlStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ledger = Ledger(postgres_store, ManualClock(START_US))
    ledger.put_lane(RECALL)
    with postgres_store.engine.begin() as connection:
        connection.exec_driver_sql(FULL)
    now = [1000.0]
    postgres_store._error_log.clock = lambda: now[0]

    def refused(count: int) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=sql.log.name):
            for index in range(count):
                with pytest.raises(StoreUnavailable):
                    ledger.reserve(ReserveCommand(RECALL.lane, f"r-{now[0]}-{index}", "jev", 7, 2))
        return [record.getMessage() for record in caplog.records]

    first = refused(40)
    assert len(first) == 1 and "53100" in first[0], first
    now[0] += throttle.ERROR_LOG_INTERVAL_SECONDS
    later = refused(5)
    assert len(later) == 1 and "53100" in later[0], later
    assert "39 more like it" in later[0], later
