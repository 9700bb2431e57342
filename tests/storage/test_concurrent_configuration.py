"""PutLane on PostgreSQL replicas: two configurations that each pass the nesting
check alone must not both commit when together they break it, and a lane's
first PutLane sent to two replicas at once records one version.

Each test orders the transactions for certain: a row lock held from outside
queues the first PutLane, and the test waits until PostgreSQL shows each one
waiting before it lets them go."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa

from ledger_service.application.ledger import Ledger
from ledger_service.application.ports import EventQuery
from ledger_service.domain.clock import ManualClock
from ledger_service.domain.errors import InvalidArgument
from ledger_service.domain.policies import MAX_BUDGET_DEPTH, LanePolicy
from ledger_service.storage import database, migrate
from ledger_service.storage.sql import SqlStore
from tests.storage.conftest import RECALL, START_US

pytestmark = pytest.mark.postgres
WAIT_SECONDS = 10.0


def lane(name: str, parent: str | None = None) -> LanePolicy:
    return dataclasses.replace(RECALL, lane=name, parent=parent)


@pytest.fixture
def ledger_pg(postgres_schema_url: str) -> Iterator[Ledger]:
    """A store whose deadline outlasts the test's own waits."""
    engine = database.create(postgres_schema_url, database.EngineLimits(pool_size=4))
    migrate.upgrade(engine)
    store = SqlStore(engine, request_deadline_seconds=3 * WAIT_SECONDS)
    yield Ledger(store, ManualClock(START_US))
    store.close()


@pytest.fixture
def outside(postgres_schema_url: str) -> Iterator[tuple[sa.Connection, sa.Connection]]:
    """Two connections of the test's own, beside the store's pool: one holds a
    row lock, the other (autocommit, so that each look sees afresh) watches."""
    engine = sa.create_engine(postgres_schema_url)
    with engine.connect() as holder, engine.connect() as watcher:
        yield holder, watcher.execution_options(isolation_level="AUTOCOMMIT")
    engine.dispose()


def _waiting(watcher: sa.Connection) -> int:
    """Backends of this database waiting for a lock."""
    found = watcher.execute(
        sa.text(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE NOT l.granted AND a.datname = current_database()"
        )
    ).scalar_one()
    return int(found)


def _until_waiting(connection: sa.Connection, count: int) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while _waiting(connection) < count:
        assert time.monotonic() < deadline, "the PutLane never queued"
        time.sleep(0.01)


def _in_thread(call: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    answer: list[object] = []

    def run() -> None:
        try:
            answer.append(call())
        except Exception as error:
            answer.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, answer


def _depth(ledger: Ledger, name: str) -> int:
    depth, parent = 1, ledger.get_lane(name).parent
    while parent is not None:
        depth, parent = depth + 1, ledger.get_lane(parent).parent
    return depth


def test_two_puts_that_each_fit_cannot_nest_budgets_too_deep(
    ledger_pg: Ledger, outside: tuple[sa.Connection, sa.Connection]
) -> None:
    holder, watcher = outside
    """a <- b and c <- d exist. Putting a under e (e-a-b) and c under b
    (a-b-c-d) each fit four levels alone; together they make e-a-b-c-d."""
    for policy in (lane("e"), lane("a"), lane("b", "a"), lane("c"), lane("d", "c")):
        ledger_pg.put_lane(policy)
    holder.execute(sa.text("SELECT 1 FROM lanes WHERE lane = 'a' FOR UPDATE"))
    first, first_answer = _in_thread(lambda: ledger_pg.put_lane(lane("a", "e")))
    _until_waiting(watcher, 1)
    second, second_answer = _in_thread(lambda: ledger_pg.put_lane(lane("c", "b")))
    _until_waiting(watcher, 2)
    holder.rollback()
    first.join(WAIT_SECONDS)
    second.join(WAIT_SECONDS)
    assert isinstance(first_answer[0], LanePolicy), first_answer
    assert isinstance(second_answer[0], InvalidArgument), second_answer
    assert second_answer[0].field == "lane.parent"
    assert _depth(ledger_pg, "d") <= MAX_BUDGET_DEPTH


def test_a_first_put_sent_twice_at_once_records_one_version(
    ledger_pg: Ledger, outside: tuple[sa.Connection, sa.Connection]
) -> None:
    holder, watcher = outside
    ledger_pg.put_lane(lane("team"))
    holder.execute(sa.text("SELECT 1 FROM lanes WHERE lane = 'team' FOR UPDATE"))
    new = lane("fresh", "team")
    threads = []
    for waiting in (1, 2):
        threads.append(_in_thread(lambda: ledger_pg.put_lane(new)))
        _until_waiting(watcher, waiting)
    holder.rollback()
    for thread, _ in threads:
        thread.join(WAIT_SECONDS)
    answers = [answer[0] for _, answer in threads]
    assert all(isinstance(answer, LanePolicy) for answer in answers), answers
    assert len({answer.version for answer in answers}) == 1  # type: ignore[union-attr]
    configured = ledger_pg.list_events(EventQuery(lane="fresh", kinds=("lane_configured",)))
    assert len(configured) == 1
