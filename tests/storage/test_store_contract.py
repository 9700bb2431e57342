"""The storage contract, written once and run on SQLite and PostgreSQL."""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable

import pytest
import sqlalchemy as sa

from ledger_service.application.ledger import Ledger
from ledger_service.application.ports import EventQuery
from ledger_service.domain import replay
from ledger_service.domain.clock import ManualClock
from ledger_service.domain.errors import ReservationConflict, StoreUnavailable
from ledger_service.domain.events import Event, EventKind, Outcome
from ledger_service.domain.moves import RefundCommand, ReserveCommand, SettleCommand
from ledger_service.storage import migrate
from ledger_service.storage.sql import SqlStore
from tests.storage.conftest import RECALL

WINDOW_US = RECALL.window_us


def _all_events(ledger: Ledger) -> list[Event]:
    events: list[Event] = []
    while True:
        after = events[-1].seq if events else 0
        page = ledger.list_events(EventQuery(after_seq=after, limit=1000))
        if not page:
            return events
        events.extend(page)


def _reserve(
    rid: str, request_bytes: int = 35_000, estimate: int | None = None, lane: str = "recall"
) -> ReserveCommand:
    return ReserveCommand(lane, rid, "jev", request_bytes, 1000, estimate_nanos=estimate)


def test_schema_matches_models_alembic_check(store: SqlStore) -> None:
    migrate.check(store.engine)
    migrate.upgrade(store.engine)  # idempotent


def test_event_log_refuses_update_and_delete(ledger: Ledger, store: SqlStore) -> None:
    ledger.put_lane(RECALL)
    ledger.reserve(_reserve("r1"))
    for statement in ("UPDATE events SET amount_nanos = 0", "DELETE FROM events"):
        with pytest.raises(sa.exc.DBAPIError, match="append-only"), store.engine.begin() as c:
            c.execute(sa.text(statement))
    assert len(_all_events(ledger)) == 2


def test_one_answer_per_reservation_id_is_a_database_constraint(
    ledger: Ledger, store: SqlStore
) -> None:
    ledger.put_lane(RECALL)
    first = ledger.reserve(_reserve("r1")).event
    duplicate = dataclasses.replace(first, kind=EventKind.DENIED, seq=0)

    def insert_again(tx: object) -> None:
        tx.append(duplicate)  # type: ignore[attr-defined]

    with pytest.raises(StoreUnavailable):
        store.run(insert_again)


def test_moves_and_balance(ledger: Ledger, clock: ManualClock) -> None:
    ledger.put_lane(RECALL)
    admitted = ledger.reserve(_reserve("r1"))
    # 35,000 bytes / 3.5 = 10,000 tokens in at 0.1 $/M = 1,000; 1,000 out at 0.4 $/M = 400.
    assert admitted.admitted and admitted.event.cap_nanos == 1400
    assert admitted.balance.totals.held_nanos == 1400
    settled = ledger.settle(SettleCommand("recall", "r1", Outcome.SUCCEEDED, 9000, 200))
    assert settled.charged_nanos == 980
    assert settled.balance.spent_nanos == 980 and settled.balance.totals.held_nanos == 0
    ledger.reserve(_reserve("r2"))
    refunded = ledger.refund(RefundCommand("recall", "r2", http_status=403))
    assert refunded.balance.spent_nanos == 980
    clock.advance_us(WINDOW_US)
    assert ledger.balance("recall").spent_nanos == 0


def test_repeated_reserve_returns_first_answer_and_books_once(ledger: Ledger) -> None:
    ledger.put_lane(RECALL)
    first = ledger.reserve(_reserve("r1"))
    again = ledger.reserve(_reserve("r1"))
    assert again == dataclasses.replace(first, already_reserved=True)
    with pytest.raises(ReservationConflict):
        ledger.reserve(_reserve("r1", request_bytes=1))
    assert [e.kind for e in _all_events(ledger)] == [EventKind.LANE_CONFIGURED, EventKind.RESERVED]


def test_a_reserve_answer_says_whether_an_earlier_reserve_made_it(ledger: Ledger) -> None:
    """A lane's transport must not make the paid call again under a booking an
    earlier Reserve made (docs/semantics.md, Idempotency): the answer says so."""
    ledger.put_lane(dataclasses.replace(RECALL, limit_nanos=2000))
    assert not ledger.reserve(_reserve("r1")).already_reserved
    assert ledger.reserve(_reserve("r1")).already_reserved
    denied = ledger.reserve(_reserve("r2"))
    assert not denied.admitted and not denied.already_reserved
    resent = ledger.reserve(_reserve("r2"))
    assert not resent.admitted and resent.already_reserved


def test_aging_edge_to_the_microsecond(ledger: Ledger, clock: ManualClock) -> None:
    ledger.put_lane(RECALL)
    reserved_at = clock.now_us()
    ledger.reserve(_reserve("r1"))
    ledger.settle(SettleCommand("recall", "r1", Outcome.SUCCEEDED, billed_nanos=777))
    clock.set_us(reserved_at + WINDOW_US - 1)
    assert ledger.balance("recall").spent_nanos == 777
    clock.set_us(reserved_at + WINDOW_US)
    assert ledger.balance("recall").spent_nanos == 0


def test_sweep_records_expiry_once(ledger: Ledger, clock: ManualClock) -> None:
    ledger.put_lane(RECALL)
    ledger.reserve(_reserve("r1"))
    clock.advance_us(RECALL.hold_ttl_us)
    assert ledger.sweep(100) == 1
    assert ledger.sweep(100) == 0
    kinds = [e.kind for e in _all_events(ledger)]
    assert kinds.count(EventKind.EXPIRED) == 1
    assert ledger.balance("recall").totals.charged_nanos == 1400


def test_projection_equals_replay_of_the_log(ledger: Ledger, clock: ManualClock) -> None:
    """Invariant 1: incremental spent equals a replay of every event."""
    rng = random.Random(7)
    ledger.put_lane(dataclasses.replace(RECALL, limit_nanos=20_000))
    for step in range(150):
        rid = f"r{rng.randrange(40)}"
        move = rng.randrange(5)
        try:
            if move == 0:
                ledger.reserve(_reserve(rid, rng.randrange(1, 60_000), rng.choice([None, 500])))
            elif move == 1:
                ledger.settle(
                    SettleCommand("recall", rid, Outcome.SUCCEEDED, 10, rng.randrange(900))
                )
            elif move == 2:
                ledger.settle(SettleCommand("recall", rid, Outcome.UNKNOWN))
            elif move == 3:
                ledger.refund(RefundCommand("recall", rid, http_status=429))
            else:
                clock.advance_us(rng.choice([1, 60_000_000, 3_600_000_000]))
        except Exception as error:  # contract refusals are part of the walk
            assert type(error).__module__ == "ledger_service.domain.errors", (step, error)
        projected = ledger.balance("recall")
        rebuilt = replay.replay(_all_events(ledger)).totals("recall", clock.now_us())
        assert projected.totals == rebuilt, step


def _run_threads(count: int, target: Callable[[int], None]) -> None:
    errors: list[BaseException] = []

    def guarded(index: int) -> None:
        try:
            target(index)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors


def test_concurrent_reserves_never_overbook(ledger: Ledger) -> None:
    """Invariant 2 within one process: 8 threads race for one lane."""
    ledger.put_lane(dataclasses.replace(RECALL, limit_nanos=14_000))  # ten holds of 1,400
    admitted: list[str] = []
    lock = threading.Lock()

    def worker(index: int) -> None:
        for attempt in range(5):
            result = ledger.reserve(_reserve(f"t{index}-{attempt}"))
            if result.admitted:
                with lock:
                    admitted.append(result.event.reservation_id)

    _run_threads(8, worker)
    assert len(admitted) == 10
    assert ledger.balance("recall").spent_nanos == 14_000


def test_same_reservation_id_from_many_threads_books_once(ledger: Ledger) -> None:
    ledger.put_lane(RECALL)
    answers: list[object] = []

    def worker(_index: int) -> None:
        answers.append(ledger.reserve(_reserve("same")))

    _run_threads(8, worker)
    assert len({id(a) for a in answers}) == 8
    # One made the booking; the other seven are told they repeat its answer.
    [made] = [a for a in answers if not a.already_reserved]  # type: ignore[attr-defined]
    assert all(
        a == dataclasses.replace(made, already_reserved=True) for a in answers if a is not made
    )
    events = [e for e in _all_events(ledger) if e.reservation_id == "same"]
    assert len(events) == 1


def test_lane_policy_change_is_an_event_and_keeps_old_bookings_prices(
    ledger: Ledger, clock: ManualClock
) -> None:
    ledger.put_lane(RECALL)
    ledger.reserve(_reserve("old"))
    cheaper = dataclasses.replace(RECALL, prices={"jev": RECALL.prices["jev"].__class__(1, 1)})
    assert ledger.put_lane(cheaper).version > 1
    settled = ledger.settle(SettleCommand("recall", "old", Outcome.SUCCEEDED, 1_000_000, 0))
    assert settled.charged_nanos == 100_000  # priced as reserved: 0.1 $/M
    assert ledger.put_lane(cheaper) == ledger.get_lane("recall")  # unchanged: no new event
    kinds = [e.kind for e in _all_events(ledger)]
    assert kinds.count(EventKind.LANE_CONFIGURED) == 2


def test_a_locked_lane_gives_unavailable_within_the_deadline(
    database_url: str, ledger: Ledger
) -> None:
    """A request that cannot get its lane in time fails fast; it never hangs."""
    from ledger_service.storage import database

    ledger.put_lane(RECALL)
    limits = database.EngineLimits(statement_timeout_ms=300, sqlite_busy_timeout_ms=300)
    engine = database.create(database_url, limits)
    impatient_engine = database.create(database_url, limits)
    impatient = Ledger(SqlStore(impatient_engine, request_deadline_seconds=1.0), ledger.clock)
    holder = engine.connect().execution_options(ledger_write=True)
    try:
        holder.begin()  # on SQLite: BEGIN IMMEDIATE, the write lock
        if holder.dialect.name != "sqlite":
            holder.execute(sa.text("SELECT * FROM lanes WHERE lane = 'recall' FOR UPDATE"))
        with pytest.raises(StoreUnavailable):
            impatient.reserve(_reserve("blocked"))
    finally:
        holder.rollback()
        holder.close()
        engine.dispose()
        impatient_engine.dispose()
    assert ledger.reserve(_reserve("after")).admitted


def test_a_write_lock_held_elsewhere_gives_unavailable_by_the_request_deadline(
    database_url: str, ledger: Ledger
) -> None:
    """With the engine's own waits at their defaults (SQLite's busy timeout 5 s),
    a move behind another connection's lock ends by its 1 s request deadline."""
    from ledger_service.storage import database

    ledger.put_lane(RECALL)
    engine = database.create(database_url, database.EngineLimits())
    impatient_engine = database.create(database_url, database.EngineLimits())
    impatient = Ledger(SqlStore(impatient_engine, request_deadline_seconds=1.0), ledger.clock)
    impatient.reserve(_reserve("warm"))  # the writer's memory loaded before the lock
    holder = engine.connect().execution_options(ledger_write=True)
    try:
        holder.begin()
        if holder.dialect.name != "sqlite":
            holder.execute(sa.text("SELECT * FROM lanes WHERE lane = 'recall' FOR UPDATE"))
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            impatient.reserve(_reserve("blocked"))
        waited = time.monotonic() - started
    finally:
        holder.rollback()
        holder.close()
        engine.dispose()
        impatient_engine.dispose()
    assert waited < 2.5, f"waited {waited:.2f} s past a 1 s request deadline"


@pytest.mark.postgres
def test_store_errors_never_carry_the_password(postgres_schema_url: str) -> None:
    """Only PostgreSQL URLs carry a password; SQLite's are file paths."""
    from ledger_service.storage import database

    url = sa.engine.make_url(postgres_schema_url)
    wrong = url.set(password="s3cret-password", port=1)
    engine = database.create(wrong.render_as_string(hide_password=False), database.EngineLimits())
    broken = SqlStore(engine, request_deadline_seconds=1.0)
    with pytest.raises(StoreUnavailable) as caught:
        broken.ping()
    assert "s3cret" not in str(caught.value) and "s3cret" not in repr(caught.value)
    assert "s3cret" not in database.redacted(wrong)
    broken.close()


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://ledger:s3cret@db:5432/ledger",
        "postgresql+psycopg://ledger@db:5432/ledger?password=s3cret",
        "postgresql+psycopg://ledger@db/ledger?sslmode=require&sslpassword=s3cret&password=s3cret",
    ],
)
def test_a_redacted_url_hides_every_password_it_carries(url: str) -> None:
    from ledger_service.storage import database

    shown = database.redacted(url)
    assert "s3cret" not in shown and "***" in shown, shown
    assert "db" in shown and "ledger" in shown


def test_lanes_are_listed_in_pages(ledger: Ledger) -> None:
    for index in range(5):
        ledger.put_lane(dataclasses.replace(RECALL, lane=f"lane-{index}"))
    first = ledger.list_lanes("", 2)
    rest = ledger.list_lanes(first[-1].lane, 10)
    assert [p.lane for p in [*first, *rest]] == [f"lane-{i}" for i in range(5)]
