"""The count behind each grant's share of the server's calls, and the places
all grants share (api/shares.py)."""

from __future__ import annotations

import pytest

from ledger_service.api.shares import CallShares
from ledger_service.domain.errors import TooManyCalls
from ledger_service.settings import Settings

# Places enough that the total never refuses: one grant's share alone.
ROOMY = 1_000


def test_a_grant_takes_its_share_and_the_next_is_refused() -> None:
    shares = CallShares(2, ROOMY, 1)
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
    shares = CallShares(1, ROOMY, 1)
    shares.take("a")
    shares.take("b")
    with pytest.raises(TooManyCalls):
        shares.take("a")
    assert shares.running() == 2


def test_a_grant_with_no_call_running_is_forgotten() -> None:
    shares = CallShares(3, ROOMY, 1)
    for owner in ("a", "b", "c"):
        shares.take(owner)
        shares.give_back(owner)
    assert shares.running() == 0
    assert shares._running == {}


def _flood(shares: CallShares, owner: str) -> int:
    """Takes calls of `owner` until one is refused; how many it took."""
    taken = 0
    while True:
        try:
            shares.take(owner)
        except TooManyCalls:
            return taken
        taken += 1


def test_two_grants_at_their_share_leave_a_third_a_place() -> None:
    """Two floods whose calls never end took every thread of the pool before
    (2 x 96 of the 176 threads it had then): the last places are kept for
    grants running few."""
    shares = CallShares(4, 12, 4)  # open: 8; calm: fewer than 1
    assert (_flood(shares, "flood-a"), _flood(shares, "flood-b")) == (4, 4)
    shares.take("calm")
    with pytest.raises(TooManyCalls) as refused:
        shares.take("calm")  # it runs one: a calm grant's few
    assert "last places are for grants running fewer than 1" in refused.value.message
    assert shares.running() == 9


def test_flooding_grants_at_the_defaults_leave_calm_grants_places() -> None:
    settings = Settings(database_url="sqlite://")
    shares = CallShares(
        settings.max_calls_per_grant, settings.grant_calls_total, settings.grant_calls_reserved
    )
    # The figures docs/semantics.md states (limits, calls at once).
    assert (shares.total, shares.reserved, shares.calm) == (208, 16, 4)
    floods = [_flood(shares, f"flood-{n}") for n in range(5)]
    assert floods == [96, 96, 4, 4, 4]  # the first two had their whole shares
    assert _flood(shares, "calm") == 4  # five floods leave a calm grant 4
    assert _flood(shares, "newcomer") == 0
    assert shares.running() == 208
    # Every place has a thread of the pool, beside the streams' and a few more.
    assert settings.rpc_threads > shares.total + settings.max_watchers


def test_two_lane_clients_at_their_own_bound_are_never_refused() -> None:
    """Each lane client keeps at most 64 calls in flight: two of them, on
    grants of their own, both busy, stay inside the open places."""
    settings = Settings(database_url="sqlite://")
    shares = CallShares(
        settings.max_calls_per_grant, settings.grant_calls_total, settings.grant_calls_reserved
    )
    for _ in range(64):
        shares.take("recall")
        shares.take("dreaming")
    shares.take("filter")
    assert shares.running() == 129


def test_the_total_never_passes_its_bound() -> None:
    shares = CallShares(4, 12, 4)
    taken = [_flood(shares, f"grant-{n}") for n in range(20)]
    assert taken == [4, 4] + [1] * 4 + [0] * 14
    assert shares.running() == shares.total == 12
    with pytest.raises(TooManyCalls):
        shares.take("newcomer")  # no place left, even for a grant running none
    assert shares.running() == 12


def test_a_place_given_back_goes_to_the_grants_running_few() -> None:
    shares = CallShares(4, 12, 4)
    _flood(shares, "flood-a")
    _flood(shares, "flood-b")
    for calm in ("calm-a", "calm-b", "calm-c", "calm-d"):
        shares.take(calm)
    shares.give_back("flood-a")
    # The reserve is in use: the flood that gave one back may not take it again ...
    with pytest.raises(TooManyCalls):
        shares.take("flood-a")
    shares.take("calm-e")  # ... a grant running none may.
    for calm in ("calm-a", "calm-b", "calm-c", "calm-d", "calm-e"):
        shares.give_back(calm)
    # The calm grants gave theirs back: the open places are the floods' again.
    shares.take("flood-a")
    assert shares.running() == 8
    assert shares._running == {"flood-a": 4, "flood-b": 4}
