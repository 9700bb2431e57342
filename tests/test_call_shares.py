"""The count behind each grant's share of the server's calls (api/shares.py)."""

from __future__ import annotations

import pytest

from ledger_service.api.shares import CallShares
from ledger_service.domain.errors import TooManyCalls


def test_a_grant_takes_its_share_and_the_next_is_refused() -> None:
    shares = CallShares(2)
    shares.take("a")
    shares.take("a")
    with pytest.raises(TooManyCalls) as refused:
        shares.take("a")
    assert refused.value.reason == "TOO_MANY_CALLS"
    assert "this grant has 2 calls running" in refused.value.message
    # The refused call was not counted: one ending frees one place.
    shares.give_back("a")
    shares.take("a")
    assert shares.running() == 2


def test_grants_do_not_share_a_share() -> None:
    shares = CallShares(1)
    shares.take("a")
    shares.take("b")
    with pytest.raises(TooManyCalls):
        shares.take("a")
    assert shares.running() == 2


def test_a_grant_with_no_call_running_is_forgotten() -> None:
    shares = CallShares(3)
    for owner in ("a", "b", "c"):
        shares.take(owner)
        shares.give_back(owner)
    assert shares.running() == 0
    assert shares._running == {}
