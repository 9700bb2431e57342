"""The migrations build exactly the schema the code declares (storage/schema.py),
on both databases: a table, column or index added to one and not the other is
a difference here, not a slow query or a failed insert in production."""

from __future__ import annotations

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from ledger_service.recovery import store
from ledger_service.storage import migrate, schema


def test_the_migrations_build_the_declared_schema(database_url: str) -> None:
    engine = sa.create_engine(database_url)
    try:
        migrate.upgrade(engine)
        with engine.connect() as connection:
            differences = compare_metadata(
                MigrationContext.configure(connection), schema.Base.metadata
            )
    finally:
        engine.dispose()
    assert differences == []


def test_counting_the_configured_lanes_reads_only_their_events(tmp_path: object) -> None:
    # The start-up assessment's count goes through the partial index of
    # configurations, not a scan of every event.
    engine = sa.create_engine(f"sqlite:///{tmp_path}/ledger.db")
    sent: list[str] = []
    sa.event.listen(
        engine,
        "before_cursor_execute",
        lambda *args: sent.append(args[2]) if "lane_configured" in args[2] else None,
    )
    try:
        migrate.upgrade(engine)
        sent.clear()
        store.SqlRecoveryStore(engine).facts()
        (statement,) = sent
        with engine.connect() as connection:
            plan = connection.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}").all()
    finally:
        engine.dispose()
    assert "USING INDEX ix_events_lane_configured" in " ".join(str(row[-1]) for row in plan)
