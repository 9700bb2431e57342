"""One grant's share of PostgreSQL's pool (storage/pool_shares.py): an owner's
calls hold at most `share` connections, its next waits for one of them until
its deadline, and other owners' calls, and calls of no owner, never wait for it.
Owners together hold at most the pool, its last connection kept for an owner
holding none; a connection given back goes to the waiting owner holding the
fewest, and an owner's calls get theirs in the order they came."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from ledger_service.domain.errors import StoreUnavailable
from ledger_service.storage.pool_shares import PoolShares

WAIT_SECONDS = 30.0
# The pool's connections at the defaults, and one owner's share.
POOL = 20
SHARE = 16


class Owners:
    """The current owner, per thread, as the grant is per call."""

    def __init__(self) -> None:
        self._local = threading.local()

    def be(self, owner: str) -> None:
        self._local.owner = owner

    def __call__(self) -> str:
        return getattr(self._local, "owner", "")


def test_an_owner_holds_its_share_and_waits_for_more_until_its_deadline() -> None:
    owners = Owners()
    shares = PoolShares(2, POOL, owners)
    owners.be("flood")
    taken = [shares.take(time.monotonic() + WAIT_SECONDS) for _ in range(2)]
    assert taken == ["flood", "flood"]
    with pytest.raises(StoreUnavailable):
        shares.take(time.monotonic() + 0.05)
    owners.be("calm")
    assert shares.take(time.monotonic()) == "calm"  # no wait: its own share
    owners.be("")
    assert [shares.take(time.monotonic()) for _ in range(5)] == [""] * 5  # never counted
    shares.give_back("flood")
    owners.be("flood")
    assert shares.take(time.monotonic()) == "flood"  # the place given back


def test_a_call_given_back_lets_a_waiting_call_of_its_owner_in() -> None:
    owners = Owners()
    shares = PoolShares(1, POOL, owners)
    owners.be("flood")
    shares.take(time.monotonic() + WAIT_SECONDS)
    got: list[str] = []

    def wait_for_one() -> None:
        owners.be("flood")
        got.append(shares.take(time.monotonic() + WAIT_SECONDS))

    waiting = [threading.Thread(target=wait_for_one) for _ in range(2)]
    for thread in waiting:
        thread.start()
    shares.give_back("flood")
    # One came in; the other waits for it.
    give_up = time.monotonic() + WAIT_SECONDS
    while not got and time.monotonic() < give_up:
        time.sleep(0.001)
    assert got == ["flood"]
    shares.give_back("flood")
    for thread in waiting:
        thread.join(WAIT_SECONDS)
    assert got == ["flood", "flood"]


def _take_as(shares: PoolShares, owners: Owners, owner: str, calls: int) -> None:
    owners.be(owner)
    for _ in range(calls):
        assert shares.take(time.monotonic()) == owner


def _refused(shares: PoolShares, owners: Owners, owner: str) -> bool:
    """Whether a call of `owner` that may not wait finds no connection."""
    owners.be(owner)
    try:
        shares.take(time.monotonic())
    except StoreUnavailable:
        return True
    shares.give_back(owner)
    return False


class Waiting:
    """Calls waiting in threads, in the order started, each started once the
    one before it waits; `got` lists the calls handed a connection."""

    def __init__(self, shares: PoolShares, owners: Owners) -> None:
        self.shares = shares
        self.owners = owners
        self.got: list[str] = []
        self.threads: list[threading.Thread] = []

    def start(self, owner: str, name: str) -> None:
        def wait() -> None:
            self.owners.be(owner)
            self.shares.take(time.monotonic() + WAIT_SECONDS)
            self.got.append(name)

        before = self.shares.waiting(owner)
        thread = threading.Thread(target=wait)
        thread.start()
        self.threads.append(thread)
        _until(lambda: self.shares.waiting(owner) > before)

    def handed(self, count: int) -> list[str]:
        _until(lambda: len(self.got) >= count)
        return self.got

    def join(self) -> None:
        for thread in self.threads:
            thread.join(WAIT_SECONDS)


def _held(share: int, pool: int, held: dict[str, int]) -> tuple[PoolShares, Owners, Waiting]:
    """Shares of which each owner of `held` holds as many connections."""
    owners = Owners()
    shares = PoolShares(share, pool, owners)
    for owner, calls in held.items():
        _take_as(shares, owners, owner, calls)
    return shares, owners, Waiting(shares, owners)


def _until(condition: Callable[[], bool]) -> None:
    give_up = time.monotonic() + WAIT_SECONDS
    while not condition():
        assert time.monotonic() < give_up, "never came"
        time.sleep(0.001)


def test_two_flooding_owners_leave_a_calm_owner_a_connection() -> None:
    """Two floods whose calls never end took the whole pool (16 + 4): the
    last connection is kept for an owner holding none."""
    shares, owners, _ = _held(SHARE, POOL, {"flood-a": SHARE, "flood-b": POOL - SHARE - 1})
    assert _refused(shares, owners, "flood-a")  # its share
    assert _refused(shares, owners, "flood-b")  # the last one, kept
    owners.be("calm")
    assert shares.take(time.monotonic()) == "calm"
    assert _refused(shares, owners, "calm-too")  # the pool is taken
    for owner in ("flood-a", "flood-b", "calm"):
        shares.give_back(owner)
    assert shares.waiting("flood-a") == 0 and len(shares._owners) == 2


def test_a_connection_given_back_goes_to_the_owner_holding_fewest() -> None:
    shares, _, waiting = _held(3, 6, {"a": 3, "b": 2, "c": 1})
    waiting.start("b", "b1")  # came first, but holds more
    waiting.start("c", "c1")
    waiting.start("calm", "calm1")
    shares.give_back("a")  # the pool's last: to the owner holding none
    assert waiting.handed(1) == ["calm1"]
    shares.give_back("a")  # the pool's last again: kept
    assert (shares.waiting("b"), shares.waiting("c")) == (1, 1)
    shares.give_back("a")
    assert waiting.handed(2) == ["calm1", "c1"]  # c holds 1, b 2
    shares.give_back("calm")
    assert waiting.handed(3) == ["calm1", "c1", "b1"]
    waiting.join()


def test_owners_holding_as_many_are_served_longest_waiting_first() -> None:
    shares, _, waiting = _held(2, 4, {"a": 2, "b": 1, "c": 1})
    waiting.start("c", "c1")
    waiting.start("b", "b1")
    shares.give_back("a")
    shares.give_back("a")
    assert waiting.handed(1) == ["c1"]  # both hold 1: c's call came first
    shares.give_back("c")
    assert waiting.handed(2) == ["c1", "b1"]
    waiting.join()


def test_an_owners_calls_get_connections_in_the_order_they_came() -> None:
    """Woken by a condition, a call could wait past later ones: one that came
    while the connection was on its way to a waiting call took it first."""
    shares, owners, waiting = _held(1, POOL, {"flood": 1})
    for n in range(3):
        waiting.start("flood", f"f{n}")
    for n in range(3):
        shares.give_back("flood")
        assert _refused(shares, owners, "flood")  # a later call waits its turn
        assert waiting.handed(n + 1) == [f"f{m}" for m in range(n + 1)]
    waiting.join()
    shares.give_back("flood")
    assert not shares._owners


def test_a_call_past_its_deadline_leaves_its_place() -> None:
    shares, owners, waiting = _held(1, POOL, {"flood": 1})
    waiting.start("flood", "late")
    assert _refused(shares, owners, "flood")
    assert shares.waiting("flood") == 1  # the one with time left still waits
    shares.give_back("flood")
    assert waiting.handed(1) == ["late"]
    waiting.join()
    shares.give_back("flood")
    assert not shares._owners
