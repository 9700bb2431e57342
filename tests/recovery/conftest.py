"""Fixtures for the recovery tests.

The databases come from the storage suite (SQLite, and a fresh PostgreSQL
schema per test); `history` is a ledger with some past on one of them; the
helpers here are the ways the tests break things.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from ledger_service.application.ledger import Ledger
from ledger_service.domain.clock import ManualClock, SystemClock
from ledger_service.domain.events import Outcome
from ledger_service.domain.moves import (
    CorrectCommand,
    RefundCommand,
    ReserveCommand,
    SettleCommand,
)
from ledger_service.domain.policies import LanePolicy
from ledger_service.domain.pricing import ModelPrice
from ledger_service.recovery.rebuild import Recovery, RecoverySettings
from ledger_service.recovery.store import SqlRecoveryStore
from ledger_service.storage import database, migrate
from ledger_service.storage.sql import SqlStore
from tests.storage import conftest as storage_fixtures
from tests.storage.conftest import POSTGRES_URL, RECALL, START_US, require_postgres

# The storage suite's database fixtures, shared by name.
database_url = storage_fixtures.database_url
postgres_schema_url = storage_fixtures.postgres_schema_url
__all__ = ["POSTGRES_URL", "database_url", "postgres_schema_url", "require_postgres"]

# Dreaming's model has prompt-cache prices, so the folds carry them too.
DREAMING = dataclasses.replace(
    RECALL,
    lane="dreaming",
    limit_nanos=2_000_000,
    prices={"jev": ModelPrice(100_000, 400_000, 10_000, 125_000)},
)


@dataclasses.dataclass
class History:
    """A ledger with a past: lanes, and bookings ended every way there is."""

    url: str
    engine: sa.Engine
    store: SqlStore
    ledger: Ledger
    clock: ManualClock

    def recovery(self, owner: str = "test", **settings: object) -> Recovery:
        values: dict[str, object] = {"batch_events": 25, "sample_events": 50}
        values.update(settings)
        return Recovery(
            SqlRecoveryStore(self.engine, batch_rows=25),
            SystemClock(),
            RecoverySettings(**values),  # type: ignore[arg-type]
            owner,
        )

    def sql(self, *statements: str) -> None:
        with self.engine.begin() as connection:
            for statement in statements:
                connection.execute(sa.text(statement))

    def scalar(self, statement: str) -> object:
        with self.engine.connect() as connection:
            return connection.execute(sa.text(statement)).scalar()

    def tamper_event(self, seq: int, amount_nanos: int) -> None:
        """UPDATE an event with the append-only guard out of the way, as an
        attacker with the database's password could."""
        if self.engine.dialect.name == "sqlite":
            self.sql(
                "DROP TRIGGER events_refuse_update",
                f"UPDATE events SET amount_nanos = {amount_nanos} WHERE seq = {seq}",
                """CREATE TRIGGER events_refuse_update BEFORE UPDATE ON events
                   BEGIN SELECT RAISE(ABORT, 'events are append-only'); END""",
            )
        else:
            self.sql(
                "ALTER TABLE events DISABLE TRIGGER events_refuse_update_delete",
                f"UPDATE events SET amount_nanos = {amount_nanos} WHERE seq = {seq}",
                "ALTER TABLE events ENABLE TRIGGER events_refuse_update_delete",
            )

    def projected_amounts(self) -> dict[tuple[str, str], int]:
        with self.engine.connect() as connection:
            rows = connection.execute(
                sa.text("SELECT lane, reservation_id, amount_nanos FROM bookings")
            )
            return {(lane, rid): int(amount) for lane, rid, amount in rows}


def fill(ledger: Ledger, clock: ManualClock, bookings: int = 40) -> None:
    ledger.put_lane(RECALL)
    ledger.put_lane(DREAMING)
    for index in range(bookings):
        lane = "recall" if index % 4 else "dreaming"
        rid = f"r{index}"
        ledger.reserve(ReserveCommand(lane, rid, "jev", 35_000, 1000))
        clock.advance_us(1_000_000)
        ending = index % 5
        if ending == 0:
            ledger.settle(
                SettleCommand(
                    lane, rid, Outcome.SUCCEEDED, 9000, 200,
                    cached_input_tokens=6000, cache_write_tokens=1000,
                )
            )  # fmt: skip
        elif ending == 1:
            ledger.settle(SettleCommand(lane, rid, Outcome.UNKNOWN))
        elif ending == 2:
            ledger.refund(RefundCommand(lane, rid, 429))
        elif ending == 3:
            ledger.settle(SettleCommand(lane, rid, Outcome.SUCCEEDED, billed_nanos=700))
        # ending 4: left open; some of them expire below.
    clock.advance_us(RECALL.hold_ttl_us)
    ledger.sweep(100)
    # An operator's corrections: of a real charge, and of an estimate.
    ledger.correct(CorrectCommand("dreaming", "r0", 321, "the bill", "c-0"), "grant-1")
    ledger.correct(CorrectCommand("recall", "r1", 0, "never billed", "c-1"), "grant-1")
    ledger.put_lane(dataclasses.replace(RECALL, limit_nanos=RECALL.limit_nanos * 2))


def open_history(url: str, now_us: int | None = None, bookings: int = 40) -> Iterator[History]:
    """A history on `url`: filled now, or (now_us given) already there."""
    engine = database.create(url, database.EngineLimits(pool_size=4))
    migrate.upgrade(engine)
    store = SqlStore(engine, request_deadline_seconds=10.0)
    clock = ManualClock(START_US if now_us is None else now_us)
    ledger = Ledger(store, clock)
    if now_us is None:
        fill(ledger, clock, bookings)
    try:
        yield History(url, engine, store, ledger, clock)
    finally:
        store.close()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, int]:
    """One filled SQLite history per session; each test gets a copy of the file."""
    path = tmp_path_factory.mktemp("template") / "ledger.db"
    for history in open_history(f"sqlite:///{path}"):
        now_us = history.clock.now_us()
    return path, now_us


def _copied(template: tuple[pathlib.Path, int], target: pathlib.Path) -> Iterator[History]:
    source, now_us = template
    for suffix in ("", "-wal", "-shm"):
        if source.with_name(source.name + suffix).exists():
            shutil.copyfile(source.with_name(source.name + suffix), f"{target}{suffix}")
    yield from open_history(f"sqlite:///{target}", now_us)


@pytest.fixture
def history(
    database_url: str, sqlite_template: tuple[pathlib.Path, int], tmp_path: pathlib.Path
) -> Iterator[History]:
    """On SQLite and on PostgreSQL."""
    if database_url.startswith("sqlite"):
        yield from _copied(sqlite_template, tmp_path / "copy.db")
    else:
        # A shorter past: PostgreSQL commits cost more, and the cases are the same.
        yield from open_history(database_url, bookings=20)


@pytest.fixture
def sqlite_history(
    sqlite_template: tuple[pathlib.Path, int], tmp_path: pathlib.Path
) -> Iterator[History]:
    """On SQLite only: for what does not depend on the dialect."""
    yield from _copied(sqlite_template, tmp_path / "copy.db")


def policy_lane(lane: str, **fields: object) -> LanePolicy:
    return dataclasses.replace(RECALL, lane=lane, **fields)  # type: ignore[arg-type]
