"""PostgreSQL connections the server ends (pg_terminate_backend, as a failover
or a DBA does; docs/postgresql.md, Failures). A pooled connection killed while
idle is only found dead by the next call that uses it: each such call failed
with UNAVAILABLE (STORE_UNAVAILABLE), about one per pooled connection. The
store now runs such a call once more on a new connection, and a move whose
COMMIT was sent before its connection died is answered as its first run was
(its request id), never as a conflict."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, event, text
from sqlalchemy.exc import OperationalError

from ledger_service.application import deadlines
from ledger_service.application.ledger import Ledger
from ledger_service.domain.clock import ManualClock
from ledger_service.domain.errors import StoreUnavailable
from ledger_service.domain.moves import ReserveCommand
from ledger_service.storage import database, sql
from ledger_service.storage.sql import SqlStore
from tests.storage.conftest import RECALL, START_US

pytestmark = pytest.mark.postgres


class Backends:
    """The backend pids of one engine's connections: only these are terminated."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.pids: set[int] = set()
        event.listen(engine, "connect", self._on_connect)

    def _on_connect(self, dbapi_connection: Any, _record: Any) -> None:
        self.pids.add(dbapi_connection.info.backend_pid)

    def terminate(self, pids: set[int] | None = None) -> int:
        """Terminates them from a connection of its own; how many were alive."""
        url = self._engine.url.render_as_string(hide_password=False).replace("+psycopg", "")
        with psycopg.connect(url, autocommit=True) as admin:
            found = admin.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE pid = ANY(%s)",
                (sorted(self.pids if pids is None else pids),),
            ).fetchone()
        return int(found[0]) if found else 0


@pytest.fixture
def backends(postgres_store: SqlStore) -> Iterator[Backends]:
    postgres_store.engine.dispose()  # the migration's connection, made before the count
    yield Backends(postgres_store.engine)


def _reserve(rid: str) -> ReserveCommand:
    return ReserveCommand(RECALL.lane, rid, "jev", 7_000, 200)


def _fill_pool(ledger: Ledger, connections: int) -> None:
    """Leaves `connections` connections in the pool: as many calls at once."""
    barrier = threading.Barrier(connections)

    def hold(_tx: Any) -> None:
        barrier.wait(timeout=10)

    threads = [
        threading.Thread(target=lambda: ledger._store.run(hold, write=False))
        for _ in range(connections)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_calls_after_the_servers_backends_are_terminated_succeed(
    postgres_store: SqlStore, backends: Backends, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = Ledger(postgres_store, ManualClock(START_US))
    ledger.put_lane(RECALL)
    _fill_pool(ledger, 4)
    assert backends.terminate() == 4
    # Every pooled connection is dead now: a move, a read and a PutLane each succeed.
    assert ledger.reserve(_reserve("r-1")).admitted
    assert ledger.get_lane(RECALL.lane).lane == RECALL.lane
    assert ledger.put_lane(RECALL).lane == RECALL.lane
    _fill_pool(ledger, 4)
    assert backends.terminate() == 4
    for number in range(2, 10):
        assert ledger.reserve(_reserve(f"r-{number}")).admitted
    said = [r.getMessage() for r in caplog.records if "connection was lost" in r.getMessage()]
    assert said and "runs again on a new connection" in said[0], said


def _lose_connection_after_commit(
    monkeypatch: pytest.MonkeyPatch, backends: Backends, times: int
) -> list[int]:
    """The next `times` commits are sent and kept, and then their connection
    dies before the answer is read: the call cannot tell whether it was kept."""
    lost: list[int] = []
    commit = sql.SqlTransaction.commit

    def commit_then_die(tx: sql.SqlTransaction) -> None:
        commit(tx)
        if len(lost) < times:
            driver = tx._raw.connection.driver_connection
            assert isinstance(driver, psycopg.Connection)
            lost.append(driver.info.backend_pid)
            backends.terminate({driver.info.backend_pid})
            try:  # the driver finds its connection dead, as if it had died before the answer
                driver.execute("SELECT 1")
            except psycopg.OperationalError as error:
                raise OperationalError("COMMIT", None, error) from error
            raise AssertionError("the terminated connection answered")

    monkeypatch.setattr(sql.SqlTransaction, "commit", commit_then_die)
    return lost


def _event_count(store: SqlStore) -> int:
    with store.engine.connect() as connection:
        return int(connection.execute(text("SELECT count(*) FROM events")).scalar_one())


def test_a_move_whose_commit_was_kept_before_its_connection_died_gets_its_first_answer(
    postgres_store: SqlStore, backends: Backends, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = Ledger(postgres_store, ManualClock(START_US))
    ledger.put_lane(RECALL)
    before = _event_count(postgres_store)
    lost = _lose_connection_after_commit(monkeypatch, backends, times=1)
    answered = ledger.reserve(_reserve("r-1"))
    assert lost, "the commit's connection was not lost"
    # The run again found the kept booking: the first answer, booked once, and
    # this call's own, not an earlier Reserve's.
    assert answered.admitted and not answered.already_reserved
    assert _event_count(postgres_store) == before + 1
    assert ledger.reserve(_reserve("r-1")) == dataclasses.replace(answered, already_reserved=True)


def test_another_write_whose_commit_may_have_been_kept_is_not_run_again(
    postgres_store: SqlStore, backends: Backends, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write the ledger does not mark replayable (a reconcile file, whose
    second run would report other rows) fails instead: its caller decides."""
    runs: list[int] = []

    def work(tx: Any) -> None:
        runs.append(1)
        tx.execute_text("SELECT 1")

    _lose_connection_after_commit(monkeypatch, backends, times=1)
    with pytest.raises(StoreUnavailable):
        postgres_store.run(work)
    assert len(runs) == 1


def test_the_health_probe_after_the_servers_backends_are_terminated_answers(
    postgres_store: SqlStore, backends: Backends, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Health's probe on a connection that died since its last use (a mass
    pg_terminate_backend, a failover, under traffic: the checkout pings only
    a connection idle for a while) tries once more on a new connection: the
    database answers, so health must not be NOT_SERVING for a whole interval."""
    monkeypatch.setattr(database, "PING_AFTER_IDLE_SECONDS", 3600.0)  # no checkout ping
    postgres_store.ping(timeout_seconds=2.0)
    assert backends.terminate() >= 1
    postgres_store.ping(timeout_seconds=2.0)


def test_a_short_call_whose_connection_was_lost_runs_again(
    postgres_store: SqlStore, backends: Backends
) -> None:
    """A lane's call has 0.25 s: the run again waited for 2 s to be left (a
    handshake libpq could not cut shorter), so it never ran for one. A
    handshake now ends by the call's deadline (watchdog.DeadlineConnection)."""
    ledger = Ledger(postgres_store, ManualClock(START_US))
    ledger.put_lane(RECALL)
    _fill_pool(ledger, 4)
    assert backends.terminate() == 4
    with deadlines.answering_by(time.monotonic() + 0.5):
        assert ledger.reserve(_reserve("r-1")).admitted
