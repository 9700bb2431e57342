"""Bulk seeding of a SQLite ledger: the service's one entry point for the benchmark.

The benchmark (`bench/`, outside the package) seeds a lane with a million
bookings far faster than the server could make them. It builds the rows
itself, from rows the application made (`ScratchLedger`), and hands them to
`insert_history`; it reads back what a server made of them (`recoveries`,
`booking_count`) and the log for its pure-fold figure (`log_batches`). Those
are the only places it touches the tables, and all of them are here, held to
the schema by mypy and the bench's tests.

Rows are dicts keyed by the tables' column names, as SQLAlchemy reads them.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from sqlalchemy import Engine, func, select

from ledger_service import server
from ledger_service.application.ledger import Ledger
from ledger_service.domain import chain
from ledger_service.domain.clock import ManualClock
from ledger_service.domain.events import Event
from ledger_service.settings import Settings
from ledger_service.storage import chaining, database, migrate, records
from ledger_service.storage.schema import bookings, events, lanes, recovery_manifests

Row = dict[str, Any]


class ScratchLedger:
    """The server's own store and application, on a fresh SQLite database in
    `directory`, with a clock the caller moves."""

    def __init__(self, directory: pathlib.Path, at_us: int) -> None:
        url = f"sqlite:///{directory}/scratch.db"
        self.store = server.build_store(Settings(database_url=url, data_dir=directory))
        migrate.upgrade(self.store.engine)
        self.clock = ManualClock(at_us)
        self.ledger = Ledger(self.store, self.clock)

    def close(self) -> None:
        self.store.close()

    def booking_rows(self, lane: str, reservation_id: str) -> tuple[Row, Row, Row]:
        """A booking's two events (in seq order) and its bookings row."""
        with self.store.engine.connect() as connection:
            found = connection.execute(
                select(events)
                .where(events.c.lane == lane, events.c.reservation_id == reservation_id)
                .order_by(events.c.seq)
            ).mappings()
            first, second = (dict(row) for row in found)
            booking = connection.execute(
                select(bookings).where(
                    bookings.c.lane == lane, bookings.c.reservation_id == reservation_id
                )
            ).mappings()
            return first, second, dict(booking.one())

    def lane_rows(self, lane: str) -> tuple[Row, Row]:
        """The lane's first event (lane_configured) and its lanes row."""
        with self.store.engine.connect() as connection:
            first = select(events).where(events.c.lane == lane).order_by(events.c.seq).limit(1)
            event = connection.execute(first).mappings().one()
            row = connection.execute(select(lanes).where(lanes.c.lane == lane)).mappings().one()
            return dict(event), dict(row)

    def insert_history(
        self, lane_event: Row, lane_row: Row, batches: Iterable[Sequence[tuple[Row, Row, Row]]]
    ) -> None:
        """`insert_history` into this scratch database."""
        _insert(self.store.engine, lane_event, lane_row, batches)


def canonical_text(event_row: Row) -> str:
    """The canonical text of an events row: what its hash seals."""
    return chain.canonical_event(records.event_from_row(event_row))


def insert_history(
    database_url: str,
    lane_event: Row,
    lane_row: Row,
    batches: Iterable[Sequence[tuple[Row, Row, Row]]],
) -> None:
    """Migrates a fresh SQLite database and inserts a lane (its lane_configured
    event and lanes row) and its bookings, each as (reserved event, settled
    event, bookings row), one transaction a batch; then sets the projections'
    position marker to the last event. Nothing is checked here: the caller
    makes the rows, and the server's start-up check compares them with the log.

    synchronous=OFF: a crash while seeding only loses scratch data.
    """
    if not database.is_sqlite(database_url):
        raise ValueError("a history is seeded into SQLite only")
    engine = database.create(database_url, database.EngineLimits(pool_size=1))
    try:
        migrate.upgrade(engine)
        _insert(engine, lane_event, lane_row, batches)
    finally:
        engine.dispose()


def _insert_sql(table: str, columns: Sequence[str]) -> str:
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


def _insert(
    engine: Engine,
    lane_event: Row,
    lane_row: Row,
    batches: Iterable[Sequence[tuple[Row, Row, Row]]],
) -> None:
    event_columns, lane_columns = list(lane_event), list(lane_row)
    booking_columns: list[str] = []
    last_seq = int(lane_event["seq"])
    connection = engine.raw_connection()
    try:
        cursor = connection.cursor()
        cursor.execute("PRAGMA synchronous=OFF")
        cursor.execute("BEGIN")
        cursor.execute(_insert_sql("events", event_columns), [lane_event[c] for c in event_columns])
        cursor.execute(_insert_sql("lanes", lane_columns), [lane_row[c] for c in lane_columns])
        cursor.execute("COMMIT")
        for batch in batches:
            if not batch:
                continue
            booking_columns = booking_columns or list(batch[0][2])
            cursor.execute("BEGIN")
            cursor.executemany(
                _insert_sql("events", event_columns),
                [tuple(event[c] for c in event_columns) for rows in batch for event in rows[:2]],
            )
            cursor.executemany(
                _insert_sql("bookings", booking_columns),
                [tuple(rows[2][c] for c in booking_columns) for rows in batch],
            )
            cursor.execute("COMMIT")
            last_seq = int(batch[-1][1]["seq"])
        cursor.execute("BEGIN")
        cursor.execute(
            "UPDATE projection_position SET last_seq = ? WHERE id = ?",
            (last_seq, chaining.POSITION_ROW_ID),
        )
        assert cursor.rowcount == 1, "the migrations made no position marker"
        cursor.execute("COMMIT")
        cursor.close()
    finally:
        connection.close()


def _count(database_url: str, query: Any) -> int:
    engine = database.create(database_url, database.EngineLimits(pool_size=1))
    try:
        with engine.connect() as connection:
            return int(connection.execute(query).scalar_one())
    finally:
        engine.dispose()


def recoveries(database_url: str) -> int:
    """How many recovery manifests the database holds: 0 unless a server found
    its projections inconsistent with its log."""
    return _count(database_url, select(func.count()).select_from(recovery_manifests))


def booking_count(database_url: str, lane: str) -> int:
    """How many bookings the lane holds."""
    return _count(database_url, select(func.count()).where(bookings.c.lane == lane))


def log_batches(database_url: str, batch_events: int, max_events: int) -> Iterator[list[Event]]:
    """The log's first `max_events` events in seq order, `batch_events` at a time."""
    engine = database.create(database_url, database.EngineLimits(pool_size=1))
    try:
        after = read = 0
        columns = [events.c[name] for name in records.EVENT_COLUMNS]
        with engine.connect() as connection:
            while read < max_events:
                query = select(*columns).where(events.c.seq > after).order_by(events.c.seq)
                limit = min(batch_events, max_events - read)
                batch = records.events_from_rows(connection.execute(query.limit(limit)))
                if not batch:
                    return
                yield batch
                after, read = batch[-1].seq, read + len(batch)
    finally:
        engine.dispose()
