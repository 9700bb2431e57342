"""What every append does besides the INSERT: seal the event into its lane's
hash chain, and advance the projections' position marker (SQLite's group
commit checks the marker current at a batch's first append and advances it
once, at the batch's end: storage/sql.py, WriterMemo).

The lane's previous hash is read from the log itself (the last event of the
lane, by the (lane, seq) index), not kept on the lanes row: the lanes table is
a projection that a recovery may have to rebuild, and the chain must not depend
on what it is checking. The read is consistent because appends are serialized:
on PostgreSQL by the advisory lock `append` takes first (held to commit, and a
READ COMMITTED statement after it sees every earlier append), on SQLite by the
database's single writer. Inside one transaction it also sees the
transaction's own earlier appends. A writer that remembers the head it wrote
last (storage/sql.py, WriterMemo) reads it only once.
"""

from __future__ import annotations

from sqlalchemy import Connection, bindparam, func, select, update

from ledger_service.domain import chain
from ledger_service.domain.errors import RecoveryRequired
from ledger_service.storage.prepared import Statements
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
    row = _STATEMENTS("state", connection).one(connection, {})
    if row is None or row[0] != STATE_CURRENT:
        raise RecoveryRequired()


def advance_position_to_log_end(connection: Connection) -> None:
    """advance_position to the log's last event: once at the end of a batch
    of appends that each checked require_current in the same transaction."""
    if _STATEMENTS("advance_to_end", connection).run(connection, {}) != 1:
        raise RecoveryRequired()
