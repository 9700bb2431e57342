"""The commit horizon on PostgreSQL: the seq up to which every event is final.

Lanes append without a lock in common, so seqs are handed out in one order and
committed in another: seq 11 may be visible while seq 10 is still in flight. A
reader that moved past 10 would never see it. Readers therefore stop at the
horizon: every seq at or below it is either committed or will never exist (a
rolled-back append leaves a hole in the sequence).

How it moves (docs/postgresql.md, "Tailing without a global lock"):

- every append begins with APPEND_BEGINS: it holds the maintenance lock, then
  takes its xid, before it takes a seq;
- seqs that are visible and follow the horizon without a hole are final;
- a hole is final once every append that was in flight when the hole was
  first seen has ended: the hole's `Pending` notes the highest seq handed out
  then (`handed`) and a bound above every xid assigned by then. It resolves
  when the oldest running xid of the cluster reaches that bound (the cheap
  test, enough on a quiet cluster) or when no transaction of this database
  that holds the maintenance lock has an xid below it (pg_locks): xids are
  the cluster's, and another database's or another application's
  transaction holds none of the ledger's seqs.

The bound is an xid the reader takes for itself (pg_current_xact_id()), once
per hole: a snapshot's xmax will not do, since it is one past the latest
*completed* xid, and the newest appends run with xids at or above it and
appear in no snapshot's list of running xids. A transaction has one xid, so
only the first hole it sees gets a bound from it; a later one waits for the
next read's transaction (an earlier xid would bound appends that began after
it, and pass their seqs while they run).

The horizon only ever rises. One per process, shared by its readers.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from sqlalchemy import Connection, text

# The key of PostgreSQL's maintenance lock: every append holds it shared, so
# appends never wait for each other; a change of the projections' marker (a
# rebuild's claim and finish) holds it exclusive, so it waits for them. Its
# holders are the appends a hole may wait for.
EVENT_APPEND_LOCK_KEY = 0x4C454447  # "LEDG"
# First in every append's transaction: the maintenance lock, then an xid.
APPEND_BEGINS = text(
    f"SELECT pg_advisory_xact_lock_shared({EVENT_APPEND_LOCK_KEY}), pg_current_xact_id()"
)

# At most this many seqs are walked per statement; the next read walks on.
MAX_WALK = 10_000
# How long one read waits for in-flight appends below the seqs it asks for.
MAX_WAIT_SECONDS = 1.0

_HANDED = text(
    "SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM events_seq_seq"
)
# Above every xid assigned so far: an xid the reader's transaction takes now.
# NULL when it took one before (an earlier step of the same transaction): that
# xid is below those of appends that began since, so it bounds nothing new.
_BOUND = text(
    "SELECT CASE WHEN pg_current_xact_id_if_assigned() IS NULL "
    "THEN pg_current_xact_id()::text::bigint END"
)
_WALK = text(
    "SELECT pg_snapshot_xmin(s)::text::bigint, "
    "ARRAY(SELECT seq FROM events WHERE seq > :final AND seq <= :handed "
    "ORDER BY seq LIMIT :walk) FROM pg_current_snapshot() AS s"
)

# True when no append that may hold a seq handed out before `bound` still
# runs: no backend of this database holds the maintenance lock and an xid of
# its own (its ExclusiveLock on it) older than the bound. One holding the lock
# without an xid has not finished APPEND_BEGINS, so its seq comes after this
# statement, above the `handed` read before the bound was taken. A commit
# leaves the running transactions before its locks go, so the reader's next
# statement (read committed) sees what ended here. age() compares the 32-bit
# xids against one xid, which running xids and a pending bound are within 2^31
# of. Prepared transactions (pid NULL) would be lumped together: the ledger
# prepares none.
_APPENDS_ENDED = text(
    "SELECT NOT EXISTS (SELECT FROM pg_locks GROUP BY pid HAVING bool_or("
    "locktype = 'advisory' "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    f"AND classid = {EVENT_APPEND_LOCK_KEY >> 32} "
    f"AND objid = {EVENT_APPEND_LOCK_KEY & 0xFFFFFFFF} AND objsubid = 1) "
    "AND bool_or(locktype = 'transactionid' AND mode = 'ExclusiveLock' "
    "AND age(transactionid) > age((:bound % 4294967296)::text::xid)))"
)


def handed_seq(connection: Connection) -> int:
    """The highest seq handed out so far (0 before the first), whether its
    append committed, is in flight or rolled back: no event has a higher one."""
    return int(connection.execute(_HANDED).scalar_one())


@dataclasses.dataclass(frozen=True)
class Pending:
    """Seqs up to `handed` are final once no append with an xid below `bound`
    still runs (`bound`: an xid assigned after every one that could hold such
    a seq)."""

    handed: int
    bound: int


class CommitHorizon:
    def __init__(self) -> None:
        self._final = 0
        self._pending: Pending | None = None
        self._lock = threading.Lock()

    @property
    def final(self) -> int:
        return self._final

    def advance(self, connection: Connection, wanted: int | None = None) -> int:
        """Moves the horizon as far as the database allows and returns it.
        Waits (at most MAX_WAIT_SECONDS) while appends still in flight hold
        seqs at or below `wanted` (default: every seq handed out so far)."""
        give_up = time.monotonic() + MAX_WAIT_SECONDS
        pause = 0.001
        target: int | None = None
        while True:
            handed = handed_seq(connection)
            final = self._step(connection, handed)
            if target is None:  # what was handed out when the read began
                target = handed if wanted is None else min(wanted, handed)
            if final >= target or time.monotonic() + pause > give_up:
                return final
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _step(self, connection: Connection, handed: int) -> int:
        with self._lock:
            final, pending = self._final, self._pending
        xmin, seqs = connection.execute(
            _WALK, {"final": final, "handed": handed, "walk": MAX_WALK}
        ).one()
        reached = final
        if pending is not None and _appends_ended(connection, xmin, pending):
            # Everything handed out when the hole was seen has ended: the
            # seqs up to there that are not visible never will be.
            reached = max(reached, pending.handed)
            pending = None
        for seq in seqs:
            if seq <= reached:
                continue
            if seq != reached + 1:
                break
            reached = seq
        if reached < handed and pending is None:
            # A hole, or the walk stopped at MAX_WALK: either way, everything
            # handed out so far is final once the xids assigned by now have ended.
            # (A transaction that already took its xid leaves it to the next read.)
            bound = connection.execute(_BOUND).scalar_one()
            if bound is not None:
                pending = Pending(handed, int(bound))
        with self._lock:
            if reached > self._final:
                self._final = reached
            if self._pending is None or pending is None or self._final >= self._pending.handed:
                self._pending = pending
            return self._final


def _appends_ended(connection: Connection, xmin: int, pending: Pending) -> bool:
    """Whether every append that could hold a seq up to `pending.handed` has
    ended: first by the snapshot's xmin, then, while another transaction of
    the cluster holds it below the bound, by the locks the appends hold."""
    if xmin >= pending.bound:
        return True
    return bool(connection.execute(_APPENDS_ENDED, {"bound": pending.bound}).scalar_one())
