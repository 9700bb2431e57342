"""The commit horizon on PostgreSQL: the seq up to which every event is final.

Lanes append without a lock in common, so seqs are handed out in one order and
committed in another: seq 11 may be visible while seq 10 is still in flight. A
reader that moved past 10 would never see it. Readers therefore stop at the
horizon: every seq at or below it is either committed or will never exist (a
rolled-back append leaves a hole in the sequence).

How it moves (docs/postgresql.md, "Tailing without a global lock"):

- every appending transaction has its xid before it takes a seq (the
  maintenance lock statement calls pg_current_xact_id() first);
- seqs that are visible and follow the horizon without a hole are final;
- a hole is final once every transaction that was in flight when the hole was
  first seen has ended: the hole's `Pending` notes the highest seq handed out
  then (`handed`) and a bound above every xid assigned by then, and resolves
  when the oldest running xid reaches that bound.

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


@dataclasses.dataclass(frozen=True)
class Pending:
    """Seqs up to `handed` are final once no xid below `bound` still runs
    (`bound`: an xid assigned after every one that could hold such a seq)."""

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
            handed = int(connection.execute(_HANDED).scalar_one())
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
        if pending is not None and xmin >= pending.bound:
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
