"""One grant's share of PostgreSQL's pool (storage/pool_shares.py): an owner's
calls hold at most `share` connections, its next waits for one of them until
its deadline, and other owners' calls, and calls of no owner, never wait for it."""

from __future__ import annotations

import threading
import time

import pytest

from ledger_service.domain.errors import StoreUnavailable
from ledger_service.storage.pool_shares import PoolShares

WAIT_SECONDS = 30.0


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
    shares = PoolShares(2, owners)
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
    shares = PoolShares(1, owners)
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
