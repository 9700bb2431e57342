"""A move the watchdog cut at its deadline is logged as cut there, not as a
database that failed.

The watchdog shuts a frozen (or slow) transaction's socket at the call's
deadline; libpq then says "server closed the connection unexpectedly. This
probably means the server terminated abnormally". Logged bare, under a hot
lane's 0.25 s calls that line came every few seconds from a healthy
PostgreSQL, and told the operator it was crashing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
from sqlalchemy.engine import make_url

from ledger_service.application import deadlines
from ledger_service.domain.errors import StoreUnavailable
from ledger_service.storage import database, migrate
from ledger_service.storage.sql import SqlStore
from tests.freezing_proxy import FreezingProxy

pytestmark = pytest.mark.postgres


@pytest.fixture
def proxied_store(postgres_schema_url: str) -> Iterator[tuple[SqlStore, FreezingProxy]]:
    url = make_url(postgres_schema_url)
    proxy = FreezingProxy(url.host or "127.0.0.1", url.port or 5432)
    through = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    engine = database.create(through, database.EngineLimits(pool_size=2))
    migrate.upgrade(engine)
    store = SqlStore(engine)
    try:
        yield store, proxy
    finally:
        proxy.thaw()
        store.close()
        proxy.close()


@pytest.mark.parametrize("lane", ["recall", ""], ids=["lane batch", "lone call"])
def test_a_transaction_cut_at_its_deadline_is_logged_as_cut(
    proxied_store: tuple[SqlStore, FreezingProxy], lane: str, caplog: pytest.LogCaptureFixture
) -> None:
    store, proxy = proxied_store

    def select(tx: object) -> None:
        tx.execute_text("SELECT 1")  # type: ignore[attr-defined]

    store.run(select, replayable=True, lane=lane)  # a pooled connection, used just now
    proxy.freeze()
    with (
        caplog.at_level(logging.WARNING),
        deadlines.answering_by(time.monotonic() + 1.0),
        pytest.raises(StoreUnavailable),
    ):
        store.run(select, replayable=True, lane=lane)
    said = [record.getMessage() for record in caplog.records]
    assert any("at its deadline: this server ended the transaction" in line for line in said), said
