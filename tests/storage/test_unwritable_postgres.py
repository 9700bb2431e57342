"""A PostgreSQL database the ledger's role may read but not write: its INSERT
on a table revoked, the database made read-only (default_transaction_read_only,
a standby after a failover). Every move fails and only an operator can fix it,
so health must turn NOT_SERVING, with one log line saying what to do, and turn
SERVING again by itself once the writes are allowed. The probe used to be a
bare SELECT 1, which such a database answers: health stayed SERVING while
every move was refused.

The tests connect as a superuser, whom privileges do not stop, so a statement
trigger refuses the INSERT with the code PostgreSQL gives a revoked privilege
(42501 insufficient_privilege); a statement trigger fires for an INSERT of no
rows too, as a revoked privilege stops one. A server out of disk, memory or
connections (SQLSTATE class 53) refuses every move too; no test can fill the
disk here, so the same trigger raises its codes."""

from __future__ import annotations

import logging

import pytest
from sqlalchemy import text

from ledger_service.application.ledger import Ledger
from ledger_service.domain.clock import ManualClock
from ledger_service.domain.errors import StoreUnavailable
from ledger_service.domain.moves import ReserveCommand
from ledger_service.storage import sql
from ledger_service.storage.sql import SqlStore
from tests.storage.conftest import RECALL, START_US

pytestmark = pytest.mark.postgres

REFUSE = """
CREATE FUNCTION refuse_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION '{message}'
  USING ERRCODE = '{code}'; END $$;
CREATE TRIGGER refuse_insert BEFORE INSERT ON events
  FOR EACH STATEMENT EXECUTE FUNCTION refuse_insert();
"""
ALLOW = "DROP TRIGGER refuse_insert ON events; DROP FUNCTION refuse_insert();"


def _execute(store: SqlStore, sql: str) -> None:
    with store.engine.begin() as connection:
        connection.exec_driver_sql(sql)


def _reserve(rid: str) -> ReserveCommand:
    return ReserveCommand(RECALL.lane, rid, "jev", 7_000, 200)


@pytest.mark.parametrize(
    ("code", "message", "words"),
    [
        ("42501", "permission denied for table events", "may not write a table"),
        # Class 53: a full disk, as no test can make one; memory and connections.
        ("53100", "could not extend file: No space left on device", "disk is full"),
        ("53200", "out of memory", "out of memory"),
        ("53300", "too many connections", "too many connections"),
    ],
)
def test_a_database_it_may_not_write_is_not_serving_until_it_may(
    postgres_store: SqlStore,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    code: str,
    message: str,
    words: str,
) -> None:
    ledger = Ledger(postgres_store, ManualClock(START_US))
    ledger.put_lane(RECALL)
    assert ledger.reserve(_reserve("r-1")).admitted
    postgres_store.ping()
    _execute(postgres_store, REFUSE.format(code=code, message=message))
    with caplog.at_level(logging.ERROR):
        for rid in ("r-2", "r-3"):
            with pytest.raises(StoreUnavailable):
                ledger.reserve(_reserve(rid))
    with pytest.raises(StoreUnavailable):
        postgres_store.ping()
    told = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert len(told) == 1, told
    assert "THE DATABASE CANNOT BE WRITTEN" in told[0] and code in told[0], told
    assert words in told[0], told
    _execute(postgres_store, ALLOW)
    monkeypatch.setattr(sql, "RESOURCE_HOLD_SECONDS", 0.0)  # class 53's hold: below
    postgres_store.ping()
    assert ledger.reserve(_reserve("r-4")).admitted
    with postgres_store.engine.connect() as connection:
        assert connection.execute(text("SELECT count(*) FROM events")).scalar_one() == 3


# A full disk refuses only the rows a move writes: its trigger fires for each
# row, so the probe's INSERT of no row passes, as it does on a real full disk.
# So do a server out of memory (a move's work needs more than the probe's) and
# one out of connections (the probe's is open; a move's new one is refused).
REFUSE_ROWS = """
CREATE FUNCTION refuse_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION '{message}'
  USING ERRCODE = '{code}'; END $$;
CREATE TRIGGER refuse_insert BEFORE INSERT ON events
  FOR EACH ROW EXECUTE FUNCTION refuse_insert();
"""


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ("53100", "could not extend file: No space left on device"),
        ("53200", "out of memory"),
        ("53300", "sorry, too many clients already"),
        ("53400", "configuration limit exceeded"),
    ],
)
def test_a_lack_of_resources_the_probe_cannot_see_is_not_serving_while_moves_meet_it(
    postgres_store: SqlStore, monkeypatch: pytest.MonkeyPatch, code: str, message: str
) -> None:
    """The write probe's INSERT of no row needs no room, little memory and no
    new connection: it passed while moves were refused for lack of disk (and
    still did for memory or connections), and health said SERVING while they
    failed. A move refused for lack of any resource (class 53) now holds
    health NOT_SERVING, probe after probe, until no move has met it for
    sql.RESOURCE_HOLD_SECONDS."""
    monkeypatch.setattr(sql, "RESOURCE_HOLD_SECONDS", 3600.0)
    ledger = Ledger(postgres_store, ManualClock(START_US))
    ledger.put_lane(RECALL)
    assert ledger.reserve(_reserve("r-1")).admitted
    _execute(postgres_store, REFUSE_ROWS.format(code=code, message=message))
    with pytest.raises(StoreUnavailable):
        ledger.reserve(_reserve("r-2"))
    for _probe in range(3):  # every probe, not every other one
        with pytest.raises(StoreUnavailable):
            postgres_store.ping()
    _execute(postgres_store, ALLOW)
    monkeypatch.setattr(sql, "RESOURCE_HOLD_SECONDS", 0.0)  # the hold has passed
    postgres_store.ping()
    assert ledger.reserve(_reserve("r-3")).admitted


# What a read meets on a real server when its sort spills past temp_file_limit.
SPILLED = (
    "DO $$ BEGIN RAISE EXCEPTION 'temporary file size exceeds temp_file_limit (0kB)' "
    "USING ERRCODE = '53400'; END $$"
)


def test_a_read_refused_for_lack_of_resources_leaves_health_serving(
    postgres_store: SqlStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A read whose sort spilled past temp_file_limit (53400), or that ran out
    of memory, says nothing of moves: measured on a running server, one
    `ledger history --limit 10000` held health NOT_SERVING for 10 s while
    every Reserve was admitted, logging "THE DATABASE CANNOT BE WRITTEN", and
    the recovery check's read did it again every 30 s. Only a move's (or a
    connect's) class-53 refusal holds health."""
    monkeypatch.setattr(sql, "RESOURCE_HOLD_SECONDS", 3600.0)
    ledger = Ledger(postgres_store, ManualClock(START_US))
    ledger.put_lane(RECALL)

    def spill(tx: object) -> None:
        tx._connection.exec_driver_sql(SPILLED)  # type: ignore[attr-defined]

    with caplog.at_level(logging.ERROR), pytest.raises(StoreUnavailable):
        postgres_store.run(spill, write=False)
    assert not [r for r in caplog.records if "CANNOT BE WRITTEN" in r.getMessage()]
    postgres_store.ping()
    assert ledger.reserve(_reserve("r-1")).admitted


# A refusal met inside a trigger's own statement: PostgreSQL's error then
# carries "CONTEXT: SQL statement "INSERT INTO ..." PL/pgSQL function ...".
REFUSE_NESTED = """
CREATE TABLE refused_copy (n int);
CREATE FUNCTION refuse_copy() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'permission denied for table refused_copy'
  USING ERRCODE = '42501'; END $$;
CREATE TRIGGER refuse_copy BEFORE INSERT ON refused_copy
  FOR EACH STATEMENT EXECUTE FUNCTION refuse_copy();
CREATE FUNCTION refuse_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO refused_copy VALUES (1); RETURN NULL; END $$;
CREATE TRIGGER refuse_insert BEFORE INSERT ON events
  FOR EACH STATEMENT EXECUTE FUNCTION refuse_insert();
"""


def test_the_unwritable_line_keeps_the_cause_and_leaves_out_the_sql(
    postgres_store: SqlStore, caplog: pytest.LogCaptureFixture
) -> None:
    """The log line says what is wrong and what to do; the driver's CONTEXT
    (the statement and the function it ran in) is SQL, not a cause."""
    ledger = Ledger(postgres_store, ManualClock(START_US))
    ledger.put_lane(RECALL)
    _execute(postgres_store, REFUSE_NESTED)
    with caplog.at_level(logging.ERROR), pytest.raises(StoreUnavailable):
        ledger.reserve(_reserve("r-1"))
    told = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert len(told) == 1, told
    assert "permission denied for table refused_copy. Health is NOT_SERVING" in told[0], told
    for sql_text in ("CONTEXT", "SQL statement", "INSERT INTO", "PL/pgSQL"):
        assert sql_text not in told[0], told
