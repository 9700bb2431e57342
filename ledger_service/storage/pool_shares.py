"""Each grant's share of PostgreSQL's pool of connections.

A call holds one of the pool's connections for its whole transaction, and a
move waits in it for its lane's lock. One grant's calls on a slow or locked
lane (up to `max_calls_per_grant`, 96, at once) took every connection of the
pool (20), and every other lane's call waited for one until its deadline and
failed. So one owner's calls hold at most `share` connections at once; its
others wait here for one of them to end, at most until their deadline, and
then fail as a call that found no connection free does (StoreUnavailable).
A call of no owner (health, the sweeper, a server without grants) is not
counted. SQLite needs no share: its moves queue in turn for the one writer,
and its reads wait on no other call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ledger_service.domain.errors import StoreUnavailable


class _Holding:
    """One owner's connections held, and its calls waiting for one (woken by
    `freed`, made for the first of them: a lone call needs none)."""

    def __init__(self) -> None:
        self.held = 0
        self.waiting = 0
        self.freed: threading.Condition | None = None


class PoolShares:
    """Connections each owner's calls hold, and the share none may pass. One
    entry per owner with a call holding or waiting (bounded by the server's
    threads). `owner` names the current call's owner ("" for none)."""

    def __init__(self, share: int, owner: Callable[[], str]) -> None:
        self.share = share
        self.owner = owner
        self._lock = threading.Lock()
        self._owners: dict[str, _Holding] = {}

    def take(self, deadline: float) -> str:
        """Takes one of the current owner's share, waited for until `deadline`
        (time.monotonic()), and returns the owner to give it back for ("":
        none taken). Raises StoreUnavailable when none came free by then."""
        owner = self.owner()
        if not owner:
            return owner
        with self._lock:
            holding = self._owners.get(owner)
            if holding is None:
                holding = self._owners[owner] = _Holding()
            if holding.held >= self.share:
                self._wait(owner, holding, deadline)
            holding.held += 1
        return owner

    def _wait(self, owner: str, holding: _Holding, deadline: float) -> None:
        """Waits (the lock held) until `owner` holds less than its share."""
        if holding.freed is None:
            holding.freed = threading.Condition(self._lock)
        holding.waiting += 1
        try:
            free = holding.freed.wait_for(
                lambda: holding.held < self.share, deadline - time.monotonic()
            )
        finally:
            holding.waiting -= 1
        if not free:
            self._forget_idle(owner, holding)
            raise StoreUnavailable()

    def give_back(self, owner: str) -> None:
        """Gives back what `take` took for `owner`, waking one of its waiters."""
        if not owner:
            return
        with self._lock:
            holding = self._owners[owner]
            holding.held -= 1
            if holding.waiting:
                assert holding.freed is not None, "a waiting call made it"
                holding.freed.notify()
            self._forget_idle(owner, holding)

    def _forget_idle(self, owner: str, holding: _Holding) -> None:
        if not holding.held and not holding.waiting:
            del self._owners[owner]
