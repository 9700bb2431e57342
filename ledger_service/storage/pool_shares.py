"""Each grant's share of PostgreSQL's pool of connections, and who gets a
connection when the pool is contended.

A call holds one of the pool's connections for its whole transaction, and a
move waits in it for its lane's lock. One grant's calls on a slow or locked
lane (up to `max_calls_per_grant`, 96, at once) took every connection of the
pool (20), and every other lane's call waited for one until its deadline and
failed. So:

- one owner's calls hold at most `share` connections at once;
- owners' calls together hold at most the pool's connections, and the last
  free one goes only to an owner holding none: two floods (16 + 3) still
  leave a third, calm grant a connection at once, though none of theirs ends;
- a connection given back goes to the waiting owner holding the fewest
  (ties: the one whose first call has waited longest), and an owner's calls
  get theirs in the order they came. An owner alone gets its whole share.

A call waits here at most until its deadline, then fails as a call that
found no connection free does (StoreUnavailable). A call of no owner (health,
the sweeper, a server without grants) is not counted and never waits here.
SQLite needs no share: its moves queue in turn for the one writer, and its
reads wait on no other call.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable

from ledger_service.domain.errors import StoreUnavailable


class _Waiter:
    """One call waiting for a connection, woken once it is handed one."""

    def __init__(self, arrival: int, lock: threading.Lock) -> None:
        self.arrival = arrival
        self.handed = False
        self.woken = threading.Condition(lock)


class _Holding:
    """One owner's connections held, and its calls waiting, first come first."""

    def __init__(self) -> None:
        self.held = 0
        self.waiting: collections.deque[_Waiter] = collections.deque()


class PoolShares:
    """Connections each owner's calls hold, the share none may pass, and the
    pool they share. One entry per owner with a call holding or waiting
    (bounded by the server's threads). `owner` names the current call's owner
    ("" for none)."""

    def __init__(self, share: int, pool: int, owner: Callable[[], str]) -> None:
        self.share = share
        self.pool = pool
        self.owner = owner
        self._lock = threading.Lock()
        self._owners: dict[str, _Holding] = {}
        self._held = 0  # by every owner
        self._waiting = 0  # every owner's calls waiting
        self._arrivals = itertools.count()

    def take(self, deadline: float) -> str:
        """Takes one of the current owner's share, waited for until `deadline`
        (time.monotonic()), and returns the owner to give it back for ("":
        none taken). Raises StoreUnavailable when none came by then."""
        owner = self.owner()
        if not owner:
            return owner
        with self._lock:
            holding = self._owners.get(owner)
            if holding is None:
                holding = self._owners[owner] = _Holding()
            if not holding.waiting and self._may_take(holding):
                self._hand(holding)
            else:
                self._wait(owner, holding, deadline)
        return owner

    def waiting(self, owner: str) -> int:
        """Calls of `owner` waiting for a connection."""
        with self._lock:
            holding = self._owners.get(owner)
            return len(holding.waiting) if holding is not None else 0

    def _may_take(self, holding: _Holding) -> bool:
        """Whether `holding`'s owner may have one more connection now: below its
        share, and the pool's last free one only if it holds none, so that
        owners whose calls never end (locked lanes) still leave a newcomer one."""
        free = self.pool - self._held
        return holding.held < self.share and (free > 1 or (free == 1 and not holding.held))

    def _hand(self, holding: _Holding) -> None:
        assert self._may_take(holding), "a share and the pool are never passed"
        holding.held += 1
        self._held += 1

    def _wait(self, owner: str, holding: _Holding, deadline: float) -> None:
        """Waits (the lock held) until `give_back` hands this call a connection."""
        waiter = _Waiter(next(self._arrivals), self._lock)
        holding.waiting.append(waiter)
        self._waiting += 1
        handed = waiter.woken.wait_for(lambda: waiter.handed, deadline - time.monotonic())
        if handed:
            return
        holding.waiting.remove(waiter)
        self._waiting -= 1
        self._forget_idle(owner, holding)
        raise StoreUnavailable()

    def give_back(self, owner: str) -> None:
        """Gives back what `take` took for `owner`, and hands the connection
        to the waiting call that comes next, if any may have it."""
        if not owner:
            return
        with self._lock:
            holding = self._owners[owner]
            holding.held -= 1
            self._held -= 1
            self._forget_idle(owner, holding)
            self._hand_to_next()

    def _hand_to_next(self) -> None:
        """One connection came free: its waiting call is the first of the
        owner holding the fewest, of those that may take one (O(owners))."""
        if not self._waiting:
            return  # the usual case: no scan
        eligible = [
            holding
            for holding in self._owners.values()
            if holding.waiting and self._may_take(holding)
        ]
        if not eligible:
            return
        chosen = min(eligible, key=lambda holding: (holding.held, holding.waiting[0].arrival))
        waiter = chosen.waiting.popleft()
        self._waiting -= 1
        self._hand(chosen)
        waiter.handed = True
        waiter.woken.notify()

    def _forget_idle(self, owner: str, holding: _Holding) -> None:
        if not holding.held and not holding.waiting:
            del self._owners[owner]
