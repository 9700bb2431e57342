"""`ledger migrate` run while replicas serve: a migration's index must not stop
the moves. Migration 0008 built its index with a plain CREATE INDEX, whose
SHARE lock on `events` queued every append behind it: measured with three
replicas of the previous release serving 8 lane threads and 1,000,000 events,
the 3.6 s `ledger migrate` denied 22 Reserves and left 5 Settles unsent (their
holds left to expire). It is now built CONCURRENTLY on PostgreSQL."""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa
from alembic import command

from ledger_service.storage import database, migrate

pytestmark = pytest.mark.postgres


def _waiting_for_a_lock(admin: sa.Connection, marker: str) -> bool:
    query = sa.text(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND query ILIKE '%' || :marker || '%'"
    )
    return bool(admin.execute(query, {"marker": marker}).scalar())


def test_an_append_is_not_queued_behind_the_index_migration_0008_builds(
    postgres_schema_url: str,
) -> None:
    engine = sa.create_engine(postgres_schema_url)
    admin = sa.create_engine(postgres_schema_url, isolation_level="AUTOCOMMIT")
    try:
        config = migrate.alembic_config(engine)
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, "0007")
        with engine.connect() as in_flight, admin.connect() as watcher:
            # A move in flight elsewhere: it holds events' ROW EXCLUSIVE lock.
            in_flight.execute(sa.text("LOCK TABLE events IN ROW EXCLUSIVE MODE"))
            upgraded: list[migrate.Upgrade] = []
            upgrading = threading.Thread(target=lambda: upgraded.append(migrate.upgrade(engine)))
            upgrading.start()
            for _ in range(500):
                if _waiting_for_a_lock(watcher, "ix_events_lane_configured"):
                    break
                time.sleep(0.02)
            assert _waiting_for_a_lock(watcher, "ix_events_lane_configured")
            # The next move's append, while the index waits for the first.
            with engine.connect() as next_move:
                next_move.execute(sa.text("SET lock_timeout = '2s'"))
                next_move.execute(sa.text("LOCK TABLE events IN ROW EXCLUSIVE MODE"))
                next_move.rollback()
            in_flight.rollback()
            upgrading.join(30)
            assert not upgrading.is_alive()
        assert upgraded == [migrate.Upgrade("0007", "0008")]
        with admin.connect() as connection:
            valid = connection.execute(
                sa.text(
                    "SELECT indisvalid FROM pg_index WHERE indexrelid = "
                    "'ix_events_lane_configured'::regclass"
                )
            ).scalar()
        assert valid is True
    finally:
        engine.dispose()
        admin.dispose()


def test_replicas_migrating_together_take_turns_without_a_deadlock(
    postgres_schema_url: str,
) -> None:
    """Three `ledger migrate` at once on an empty database: waiting for the
    migration lock inside PostgreSQL was a transaction the CONCURRENTLY build
    waited for, a deadlock that failed two of the three (40P01)."""
    engines = [sa.create_engine(postgres_schema_url) for _ in range(3)]
    results: list[migrate.Upgrade | BaseException] = []

    def run(engine: sa.Engine) -> None:
        try:
            results.append(migrate.upgrade(engine))
        except BaseException as error:
            results.append(error)

    threads = [threading.Thread(target=run, args=(engine,)) for engine in engines]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        for engine in engines:
            engine.dispose()
    assert sorted(map(repr, results)) == sorted(
        [repr(migrate.Upgrade(None, "0008"))] + [repr(migrate.Upgrade("0008", "0008"))] * 2
    )


def test_migration_0008_waits_out_an_old_snapshot_past_the_statement_timeout(
    postgres_schema_url: str,
) -> None:
    """A CONCURRENTLY build waits for every transaction with an older snapshot
    (a pg_dump, a long export). Under the store's statement and lock timeouts
    (5 s) `ledger migrate` failed after 5 s ('the database is unavailable ...
    statement timeout') and left an invalid index behind, again each run while
    the snapshot lived."""
    engine = database.create(postgres_schema_url, database.EngineLimits(statement_timeout_ms=300))
    admin = sa.create_engine(postgres_schema_url, isolation_level="AUTOCOMMIT")
    try:
        config = migrate.alembic_config(engine)
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, "0007")
        with admin.connect() as snapshot, admin.connect() as watcher:
            snapshot.execute(sa.text("BEGIN ISOLATION LEVEL REPEATABLE READ"))
            snapshot.execute(sa.text("SELECT count(*) FROM events"))
            upgraded: list[migrate.Upgrade | BaseException] = []

            def run() -> None:
                try:
                    upgraded.append(migrate.upgrade(engine))
                except BaseException as error:
                    upgraded.append(error)

            upgrading = threading.Thread(target=run)
            upgrading.start()
            for _ in range(500):
                if _waiting_for_a_lock(watcher, "ix_events_lane_configured") or upgraded:
                    break
                time.sleep(0.02)
            # Several statement timeouts long: the build outlives them.
            upgrading.join(1.5)
            snapshot.execute(sa.text("COMMIT"))
            upgrading.join(30)
            assert not upgrading.is_alive()
        assert upgraded == [migrate.Upgrade("0007", "0008")]
    finally:
        engine.dispose()
        admin.dispose()
