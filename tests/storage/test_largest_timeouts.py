"""The largest statement timeout the settings take still opens a PostgreSQL
connection: every timeout derived from it is an int of milliseconds there."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from ledger_service.settings import MAX_SETTING_COUNT
from ledger_service.storage import database


@pytest.mark.postgres
def test_a_connection_opens_at_the_largest_statement_timeout(postgres_schema_url: str) -> None:
    """statement_timeout_ms = 2^31 - 1 is accepted at start; the idle-in-transaction
    timeout made from it (four times as long) was out of PostgreSQL's range, and
    every connection was refused: a server that started and never served."""
    limits = database.EngineLimits(statement_timeout_ms=MAX_SETTING_COUNT)
    engine = database.create(postgres_schema_url, limits)
    try:
        with engine.connect() as connection:
            idle = connection.execute(sa.text("SHOW idle_in_transaction_session_timeout"))
            assert idle.scalar_one() != "0"
    finally:
        engine.dispose()
