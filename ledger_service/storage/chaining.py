"""What every append does besides the INSERT: seal the event into its lane's
hash chain, and keep the projections' marker honest.

The lane's previous hash is read from the log itself (the last event of the
lane, by the (lane, seq) index), not kept on the lanes row: the lanes table is
a projection that a recovery may have to rebuild, and the chain must not depend
on what it is checking. The read is consistent because a lane's appends are
serialized: on PostgreSQL by the lane's row lock (or, for a lane with no row
yet, an advisory lock on its name), on SQLite by the database's single writer.

The marker (projection_position) says whether the projections are current. On
SQLite every batch of appends also advances its `last_seq` (once, at the
batch's end: storage/writer.py). On PostgreSQL appends only read its
state, under the maintenance lock held shared, so that lanes share no row:
its `last_seq` moves only with a rebuild, and while current the projections
cover the whole log.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, bindparam, func, select, update

from ledger_service.domain import chain
from ledger_service.domain.errors import RecoveryRequired
from ledger_service.storage.prepared import Carrier, Prepared, Statements
from ledger_service.storage.schema import events, projection_position

POSITION_ROW_ID = 1
STATE_CURRENT = "current"
STATE_REBUILDING = "rebuilding"

_STATEMENTS = Statements(
    head=select(events.c.hash)
    .where(events.c.lane == bindparam("lane"))
    .order_by(events.c.seq.desc())
    .limit(1),
    advance=update(projection_position)
    .where(
        projection_position.c.id == POSITION_ROW_ID,
        projection_position.c.state == STATE_CURRENT,
    )
    .values(last_seq=bindparam("seq")),
    advance_to_end=update(projection_position)
    .where(
        projection_position.c.id == POSITION_ROW_ID,
        projection_position.c.state == STATE_CURRENT,
    )
    .values(last_seq=select(func.max(events.c.seq)).scalar_subquery()),
    state=select(projection_position.c.state).where(projection_position.c.id == POSITION_ROW_ID),
)


def head_statement(connection: Carrier) -> Prepared:
    """lane_head's statement, for a caller that runs it among others."""
    return _STATEMENTS("head", connection)


def lane_head(connection: Connection, lane: str) -> str:
    """The hash of the lane's last event, or "" when it has none."""
    row = _STATEMENTS("head", connection).one(connection, {"lane": lane})
    return (row[0] if row is not None else None) or chain.GENESIS_HASH


def advance_position(connection: Connection, seq: int) -> None:
    """Records that the projections now include event `seq`, in the append's
    transaction. Refuses (and so rolls the append back) unless the projections
    are current: a rebuild is running, or the marker is gone."""
    if _STATEMENTS("advance", connection).run(connection, {"seq": seq}) != 1:
        raise RecoveryRequired()


def require_current(connection: Connection) -> None:
    """What advance_position refuses on, without advancing: RecoveryRequired
    unless the projections are current."""
    check_state(_STATEMENTS("state", connection).one(connection, {}))


def state_statement(connection: Carrier) -> Prepared:
    """The marker's state, for a caller that runs it among others (check_state)."""
    return _STATEMENTS("state", connection)


def check_state(row: Sequence[Any] | None) -> None:
    """RecoveryRequired unless the marker's row says the projections are current."""
    if row is None or row[0] != STATE_CURRENT:
        raise RecoveryRequired()


def advance_position_to_log_end(connection: Connection) -> None:
    """advance_position to the log's last event: once at the end of a batch
    of appends that each checked require_current in the same transaction."""
    if _STATEMENTS("advance_to_end", connection).run(connection, {}) != 1:
        raise RecoveryRequired()
