"""Another session holds the migration lock and keeps it: a replica or `ledger
migrate` frozen mid-migration (SIGSTOP, a paused VM), or any session that took
the same advisory key. Every start took the lock before it looked at the
schema, so a replica restarted on a schema already at head waited, silent and
not listening, for as long as the lock was held (measured: still waiting after
20 s, nothing in its log; `ledger migrate` too). Now a schema at head needs no
turn, and a start that must wait for one says who holds it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import Connection, Engine, text

from ledger_service.storage import database, migrate

pytestmark = pytest.mark.postgres

# A bound for a call that returns at once, so that a hang fails instead of stalling.
HANG_SECONDS = 30.0


@pytest.fixture
def engine(postgres_schema_url: str) -> Iterator[Engine]:
    made = database.create(postgres_schema_url, database.EngineLimits(pool_size=4))
    yield made
    made.dispose()


@pytest.fixture
def lock_holder(engine: Engine) -> Iterator[Connection]:
    """A session holding the migration lock until the test ends."""
    with engine.connect() as holder:
        holder.execute(text(f"SELECT pg_advisory_lock({migrate.MIGRATION_LOCK_KEY})"))
        holder.commit()
        yield holder
        holder.execute(text(f"SELECT pg_advisory_unlock({migrate.MIGRATION_LOCK_KEY})"))
        holder.commit()


def _in_thread(engine: Engine) -> tuple[threading.Thread, list[object]]:
    done: list[object] = []
    thread = threading.Thread(target=lambda: done.append(migrate.upgrade(engine)), daemon=True)
    thread.start()
    return thread, done


def test_a_schema_at_head_starts_while_another_session_holds_the_lock(engine: Engine) -> None:
    head = migrate.upgrade(engine).after
    with engine.connect() as holder:
        holder.execute(text(f"SELECT pg_advisory_lock({migrate.MIGRATION_LOCK_KEY})"))
        holder.commit()
        thread, done = _in_thread(engine)
        thread.join(HANG_SECONDS)
        assert done == [migrate.Upgrade(head, head)], "the start waited for the lock"
        holder.execute(text(f"SELECT pg_advisory_unlock({migrate.MIGRATION_LOCK_KEY})"))
        holder.commit()


def test_a_start_waiting_for_the_lock_says_which_session_holds_it(
    engine: Engine,
    lock_holder: Connection,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(migrate, "MIGRATION_LOCK_WAIT_LOG_SECONDS", 0.2)
    holder_pid = lock_holder.execute(text("SELECT pg_backend_pid()")).scalar_one()
    lock_holder.commit()
    caplog.set_level(logging.WARNING, logger="ledger.migrate")
    thread, done = _in_thread(engine)
    give_up = time.monotonic() + HANG_SECONDS
    while not any(f"pid {holder_pid}" in record.getMessage() for record in caplog.records):
        assert time.monotonic() < give_up, [record.getMessage() for record in caplog.records]
        time.sleep(0.05)
    assert not done, "a fresh schema was migrated without the lock"
    assert "migration lock" in caplog.records[-1].getMessage()
    lock_holder.execute(text(f"SELECT pg_advisory_unlock({migrate.MIGRATION_LOCK_KEY})"))
    lock_holder.commit()
    thread.join(HANG_SECONDS)
    assert len(done) == 1
