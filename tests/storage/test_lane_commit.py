"""A hot lane's moves in one replica committed together on PostgreSQL
(storage/lane_commit.py, docs/postgresql.md): moves of a lane that arrive while
one of that lane is under way queue in the process, holding no connection, and
the next leader runs them in one transaction. Each move still runs its own
rules in turn; a move refused before it wrote leaves the others of its batch
committed, one refused after writing is undone alone, and a move whose
deadline passes in the queue is never written."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from ledger_service.application import deadlines
from ledger_service.application.ledger import Ledger
from ledger_service.domain.clock import ManualClock
from ledger_service.domain.errors import BookingNotFound, InvalidArgument, StoreUnavailable
from ledger_service.domain.events import Outcome
from ledger_service.domain.moves import ReserveCommand, SettleCommand
from ledger_service.recovery.store import SqlRecoveryStore
from ledger_service.recovery.verify import Verifier
from ledger_service.storage.sql import SqlStore
from tests.storage.conftest import RECALL, START_US
from tests.storage.test_group_commit import _refused_after_appending
from tests.storage.test_pool_share import _waiting as _blocked

pytestmark = pytest.mark.postgres

WAIT_SECONDS = 10.0


@pytest.fixture
def ledger(postgres_store: SqlStore) -> Ledger:
    ledger = Ledger(postgres_store, ManualClock(START_US), verify_windows=True)
    ledger.put_lane(RECALL)
    return ledger


@pytest.fixture
def observer(postgres_schema_url: str) -> Iterator[sa.Connection]:
    """A connection of the test's own, outside the store's pool, committing each read."""
    engine = sa.create_engine(postgres_schema_url)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        yield connection
    engine.dispose()


def _reserve(ledger: Ledger, rid: str) -> Callable[[], object]:
    return lambda: ledger.reserve(ReserveCommand(RECALL.lane, rid, "jev", 7_000, 200))


def _at_the_lane(store: SqlStore, observer: sa.Connection) -> int:
    """Moves waiting: queued in the process, or at the lock in the database."""
    return store.queued_moves() + _blocked(observer)


@contextlib.contextmanager
def _lane_locked(observer: sa.Connection) -> Iterator[None]:
    """Another session holds the lane's row lock inside the block."""
    with observer.engine.connect() as holder:
        holder.execute(
            sa.text("SELECT lane FROM lanes WHERE lane = :lane FOR UPDATE"), {"lane": RECALL.lane}
        )
        yield
        holder.rollback()


def _started_in_order(
    store: SqlStore, observer: sa.Connection, calls: list[Callable[[], object]]
) -> tuple[list[threading.Thread], dict[int, object]]:
    """Starts `calls`, each once the ones before it wait, so they wait in
    this order; their threads, and each call's result or refusal by index."""
    outcomes: dict[int, object] = {}

    def call(index: int) -> None:
        try:
            outcomes[index] = calls[index]()
        except (InvalidArgument, BookingNotFound, StoreUnavailable) as error:
            outcomes[index] = error

    threads = []
    for index in range(len(calls)):
        threads.append(threading.Thread(target=call, args=(index,)))
        threads[-1].start()
        give_up = time.monotonic() + WAIT_SECONDS
        while _at_the_lane(store, observer) < index + 1:
            assert time.monotonic() < give_up, f"{_at_the_lane(store, observer)} moves wait"
            time.sleep(0.005)
    return threads, outcomes


def _behind_the_lane_lock(
    store: SqlStore, observer: sa.Connection, calls: list[Callable[[], object]]
) -> dict[int, object]:
    """Runs `calls` in order behind the lane's row lock, let go once all wait."""
    with _lane_locked(observer):
        threads, outcomes = _started_in_order(store, observer, calls)
    for thread in threads:
        thread.join(timeout=WAIT_SECONDS)
    return outcomes


def _transactions(observer: sa.Connection, reservation_ids: list[str]) -> int:
    """How many transactions wrote these bookings' events (each row's xmin)."""
    return int(
        observer.execute(
            sa.text(
                "SELECT count(DISTINCT xmin::text) FROM events WHERE reservation_id = ANY(:ids)"
            ),
            {"ids": reservation_ids},
        ).scalar_one()
    )


def _verified(store: SqlStore) -> None:
    report = Verifier(SqlRecoveryStore(store.engine)).verify(START_US)
    assert report.ok, report


def test_moves_of_one_lane_queued_in_a_replica_share_one_transaction(
    postgres_store: SqlStore, ledger: Ledger, observer: sa.Connection
) -> None:
    rids = [f"r-{number}" for number in range(5)]
    outcomes = _behind_the_lane_lock(
        postgres_store, observer, [_reserve(ledger, rid) for rid in rids]
    )
    assert all(outcomes[index].admitted for index in range(5)), outcomes  # type: ignore[attr-defined]
    # The first waits for the lock in its own transaction; the four that
    # queued behind it held no connection and commit together.
    assert _transactions(observer, rids[1:]) == 1
    assert _blocked(observer) == 0
    balance = ledger.balance(RECALL.lane)
    assert balance.totals.open_bookings == 5
    assert balance.totals.held_nanos == sum(
        outcomes[index].event.amount_nanos  # type: ignore[attr-defined]
        for index in range(5)
    )
    _verified(postgres_store)


def test_a_move_refused_before_writing_leaves_its_batch_committed(
    postgres_store: SqlStore, ledger: Ledger, observer: sa.Connection
) -> None:
    unknown = SettleCommand(RECALL.lane, "nobody", Outcome.SUCCEEDED, 10, 10)
    outcomes = _behind_the_lane_lock(
        postgres_store,
        observer,
        [
            _reserve(ledger, "first"),
            _reserve(ledger, "before"),
            lambda: ledger.settle(unknown),
            _reserve(ledger, "after"),
        ],
    )
    assert isinstance(outcomes[2], BookingNotFound), outcomes
    assert outcomes[1].admitted and outcomes[3].admitted, outcomes  # type: ignore[attr-defined]
    assert _transactions(observer, ["before", "after"]) == 1
    _verified(postgres_store)


def test_a_move_refused_after_writing_is_undone_alone(
    postgres_store: SqlStore, ledger: Ledger, observer: sa.Connection
) -> None:
    def refused() -> Any:
        return postgres_store.run(_refused_after_appending, replayable=True, lane=RECALL.lane)

    outcomes = _behind_the_lane_lock(
        postgres_store,
        observer,
        [_reserve(ledger, "first"), _reserve(ledger, "before"), refused, _reserve(ledger, "after")],
    )
    assert isinstance(outcomes[2], InvalidArgument), outcomes
    assert outcomes[1].admitted and outcomes[3].admitted, outcomes  # type: ignore[attr-defined]
    # Its batch was rolled back and the others ran again, together.
    assert _transactions(observer, ["before", "after"]) == 1
    configured = observer.execute(
        sa.text("SELECT count(*) FROM events WHERE kind = 'lane_configured'")
    ).scalar_one()
    assert configured == 1  # the lane's own PutLane only
    _verified(postgres_store)


def test_a_queued_move_whose_deadline_passes_holds_no_connection_and_is_never_written(
    postgres_store: SqlStore, ledger: Ledger, observer: sa.Connection
) -> None:
    def short() -> object:
        with deadlines.answering_by(time.monotonic() + 0.5):
            return _reserve(ledger, "short")()

    with _lane_locked(observer):
        threads, outcomes = _started_in_order(
            postgres_store, observer, [_reserve(ledger, "first"), short]
        )
        # Only the first waits in the database; the short one in the process.
        assert _blocked(observer) == 1
        threads[1].join(timeout=WAIT_SECONDS)
        assert isinstance(outcomes[1], StoreUnavailable), outcomes
    threads[0].join(timeout=WAIT_SECONDS)
    assert outcomes[0].admitted, outcomes  # type: ignore[attr-defined]
    found = observer.execute(
        sa.text("SELECT count(*) FROM events WHERE reservation_id = 'short'")
    ).scalar_one()
    assert found == 0


def test_a_batch_of_moves_opens_no_sqlalchemy_connection(
    ledger: Ledger, postgres_store: SqlStore
) -> None:
    """A batch holds a pooled connection alone: SQLAlchemy's Connection and
    transaction around it cost a move 30-40 us of CPU for nothing its
    statements, sent through libpq, use (docs/benchmarks.md). (A server's
    moves do not check their windows against a full sum, which SQLAlchemy
    runs: the fixture's ledger does.)"""
    ledger = Ledger(postgres_store, ManualClock(START_US))
    opened: list[sa.Connection] = []

    def on_connect(connection: sa.Connection) -> None:
        opened.append(connection)

    sa.event.listen(postgres_store.engine, "engine_connect", on_connect)
    try:
        for number in range(3):
            assert _reserve(ledger, f"r-{number}")().admitted  # type: ignore[attr-defined]
            ledger.settle(
                SettleCommand(
                    RECALL.lane,
                    f"r-{number}",
                    Outcome.SUCCEEDED,
                    input_tokens=100,
                    output_tokens=50,
                    http_status=200,
                )
            )
    finally:
        sa.event.remove(postgres_store.engine, "engine_connect", on_connect)
    assert opened == []


def test_a_move_whose_statement_the_watch_interrupted_is_unavailable(
    postgres_store: SqlStore, ledger: Ledger
) -> None:
    """A move's statement run through SQLAlchemy and cancelled at its
    deadline (57014) has its connection invalidated there (database.py's
    handle_error): the batch rolled back on it found no driver connection
    and the move was answered INTERNAL (AttributeError), seen 8 s after a
    frozen PostgreSQL was thawed. It is UNAVAILABLE, and the lane serves on."""

    def slow(tx: Any) -> None:
        tx.execute_text("SELECT pg_sleep(5)")

    with deadlines.answering_by(time.monotonic() + 1.0), pytest.raises(StoreUnavailable):
        postgres_store.run(slow, replayable=True, lane=RECALL.lane)
    assert _reserve(ledger, "after")().admitted  # type: ignore[attr-defined]
