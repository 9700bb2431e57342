"""The token logic alone (ledger_service.domain.grants): no server, an injected clock."""

from __future__ import annotations

import base64
import json
import timeit

import pytest

from ledger_service.domain import grants
from ledger_service.domain.grants import (
    ALL_LANES,
    GrantRejected,
    Keyring,
    Rejection,
    Scope,
    decode_unverified,
    new_key,
)

NOW_US = 1_800_000_000_000_000
HOUR_US = 3_600_000_000
KEYRING = Keyring({"k1": b"k" * 32, "k2": b"j" * 32}, "k2")


def issue(lanes: list[str], scopes: list[Scope], *, keyring: Keyring = KEYRING) -> str:
    return keyring.issue(lanes, scopes, issued_at_us=NOW_US, expires_at_us=NOW_US + HOUR_US)


def rejection_of(token: str, now_us: int = NOW_US, keyring: Keyring = KEYRING) -> Rejection:
    with pytest.raises(GrantRejected) as caught:
        keyring.verify(token, now_us)
    return caught.value.why


def test_a_grant_round_trips() -> None:
    grant = KEYRING.verify(issue(["recall", "filter"], [Scope.CHARGE]), NOW_US)
    assert grant.lanes == {"recall", "filter"}
    assert grant.scopes == {Scope.CHARGE}
    assert grant.key_id == "k2"
    assert (grant.issued_at_us, grant.expires_at_us) == (NOW_US, NOW_US + HOUR_US)
    assert grant.allows(Scope.CHARGE, "recall")
    assert not grant.allows(Scope.READ, "recall")
    assert not grant.allows(Scope.CHARGE, "dreaming")
    assert not grant.allows(Scope.CHARGE, ALL_LANES)
    assert not grant.allows(Scope.CHARGE, "")


def test_admin_allows_everything_and_star_covers_every_lane() -> None:
    admin = KEYRING.verify(issue([ALL_LANES], [Scope.ADMIN]), NOW_US)
    for scope in Scope:
        assert admin.allows(scope, "anything")
        assert admin.allows(scope, ALL_LANES)
    reader = KEYRING.verify(issue([ALL_LANES], [Scope.READ]), NOW_US)
    assert reader.allows(Scope.READ, ALL_LANES)
    assert reader.allows(Scope.READ, "recall")
    assert not reader.allows(Scope.CHARGE, "recall")
    assert not reader.allows(Scope.ADMIN, ALL_LANES)


def test_expiry_follows_the_injected_clock_to_the_microsecond() -> None:
    token = issue(["recall"], [Scope.READ])
    KEYRING.verify(token, NOW_US + HOUR_US - 1)
    assert rejection_of(token, NOW_US + HOUR_US) is Rejection.EXPIRED
    assert rejection_of(token, NOW_US + 10 * HOUR_US) is Rejection.EXPIRED
    # Issued in the future beyond the allowed skew: refused too.
    early = NOW_US - grants.MAX_CLOCK_SKEW_US - 1
    assert rejection_of(token, early) is Rejection.NOT_YET_VALID


def test_every_changed_character_is_refused() -> None:
    token = issue(["recall"], [Scope.CHARGE])
    for position in range(len(token)):
        for replacement in {"A", "B", "-", "_", ".", "="} - {token[position]}:
            changed = token[:position] + replacement + token[position + 1 :]
            assert rejection_of(changed) in {
                Rejection.MALFORMED,
                Rejection.BAD_SIGNATURE,
                Rejection.UNKNOWN_KEY,
            }, (position, replacement)


def test_claims_changed_under_the_same_signature_are_refused() -> None:
    prefix, key_id, payload, signature = issue(["recall"], [Scope.CHARGE]).split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=="))
    for change in ({"lanes": ["*"]}, {"scopes": ["admin"]}, {"exp": claims["exp"] * 2}):
        forged = base64.urlsafe_b64encode(json.dumps({**claims, **change}).encode()).decode()
        token = ".".join((prefix, key_id, forged.rstrip("="), signature))
        assert rejection_of(token) is Rejection.BAD_SIGNATURE
    # Moving the signature to another key id of the same keyring does not work either.
    assert rejection_of(".".join((prefix, "k1", payload, signature))) is Rejection.BAD_SIGNATURE


def test_keys_and_key_ids() -> None:
    token = issue(["recall"], [Scope.CHARGE])
    other = Keyring({"k2": new_key()}, "k2")
    assert rejection_of(token, keyring=other) is Rejection.BAD_SIGNATURE
    assert rejection_of(token, keyring=Keyring({"k9": new_key()}, "k9")) is Rejection.UNKNOWN_KEY
    # Rotation: a keyring that signs with k3 still verifies what k2 signed.
    rotated = Keyring({**KEYRING.keys, "k3": new_key()}, "k3")
    rotated.verify(token, NOW_US)
    assert rotated.verify(issue(["recall"], [Scope.READ], keyring=rotated), NOW_US).key_id == "k3"


@pytest.mark.parametrize(
    "token",
    [
        "",
        "Bearer",
        "lg1",
        "lg1.k2..",
        "lg1.k2.e30.",
        "lg2.k2.e30.AAAA",
        "lg1.k 2.e30.AAAA",
        "lg1.k2.e30=.AAAA",
        "lg1.k2.e30.AAAA.AAAA",
        "lg1.k2.e30." + "A" * 43,
        "lg1.k2.é.AAAA",
        "x" * 5000,
    ],
)
def test_malformed_tokens_are_refused_before_any_key_is_used(token: str) -> None:
    assert rejection_of(token) in {Rejection.MISSING, Rejection.MALFORMED, Rejection.BAD_SIGNATURE}


@pytest.mark.parametrize(
    "claims",
    [
        [],
        {"lanes": ["recall"], "scopes": ["charge"], "iat": 1, "exp": 2},
        {"lanes": ["recall"], "scopes": ["charge"], "iat": 1, "exp": "2", "jti": ""},
        {"lanes": ["recall"], "scopes": ["charge"], "iat": True, "exp": 2, "jti": ""},
        {"lanes": ["recall"], "scopes": ["root"], "iat": 1, "exp": 2, "jti": ""},
        {"lanes": [], "scopes": ["charge"], "iat": 1, "exp": 2, "jti": ""},
        {"lanes": ["re call"], "scopes": ["charge"], "iat": 1, "exp": 2, "jti": ""},
        {"lanes": [7], "scopes": ["charge"], "iat": 1, "exp": 2, "jti": ""},
        {"lanes": ["recall"], "scopes": ["charge"], "iat": 1, "exp": 2, "jti": "", "x": 1},
    ],
)
def test_signed_but_malformed_claims_are_refused(claims: object) -> None:
    """Even a correctly signed token must carry exactly the claims this server writes."""
    payload = grants._encode(json.dumps(claims).encode())
    signed = f"lg1.k2.{payload}"
    token = f"{signed}.{grants._encode(grants._sign(KEYRING.keys['k2'], signed))}"
    assert rejection_of(token) is Rejection.MALFORMED


def test_issue_refuses_claims_that_could_never_verify() -> None:
    for lanes, scopes in (([], [Scope.READ]), (["recall"], []), (["bad lane"], [Scope.READ])):
        with pytest.raises(ValueError):
            issue(lanes, scopes)
    with pytest.raises(ValueError):
        KEYRING.issue(["recall"], [Scope.READ], issued_at_us=NOW_US, expires_at_us=NOW_US)
    with pytest.raises(ValueError):
        Keyring({"k1": b"short"}, "k1")
    with pytest.raises(ValueError):
        Keyring({"k1": new_key()}, "k2")


def test_inspect_decodes_without_trusting() -> None:
    grant = decode_unverified(
        issue(["recall"], [Scope.CHARGE], keyring=Keyring({"x": new_key()}, "x"))
    )
    assert grant.lanes == {"recall"} and grant.key_id == "x"


def test_the_keyring_never_prints_its_keys() -> None:
    assert "kkkk" not in repr(KEYRING) and "jjjj" not in repr(KEYRING)


def test_verification_takes_microseconds() -> None:
    """The seed's lane lost 0.8 s of a 2.0 s step looking grants up; here it is an HMAC."""
    token = issue(["recall"], [Scope.CHARGE, Scope.READ])
    rounds = 2000
    seconds = min(timeit.repeat(lambda: KEYRING.verify(token, NOW_US), number=rounds, repeat=3))
    micros_per_verification = seconds / rounds * 1e6
    assert micros_per_verification < 500, micros_per_verification


def test_issue_refuses_a_grant_longer_than_any_server_takes() -> None:
    """A grant's lanes (64 of 200 characters) may spell a token past
    MAX_GRANT_LENGTH (4,096), which every server and client refuses as
    malformed: `ledger grant issue` printed such a grant (17,517 characters)
    with exit 0. The longest it issues verifies; one character more is refused."""
    prefixes = [f"lane-{index:02d}-" for index in range(20)]
    accepted: tuple[str, list[str]] | None = None
    for extra in range(190):
        lanes = [prefix + "x" * extra for prefix in prefixes]
        try:
            accepted = (issue(lanes, [Scope.CHARGE]), lanes)
        except ValueError as error:
            assert "4096" in str(error)
            break
    else:
        raise AssertionError("issue never refused a grant past MAX_GRANT_LENGTH")
    assert accepted is not None
    token, lanes = accepted
    assert len(token) <= grants.MAX_GRANT_LENGTH
    assert KEYRING.verify(token, NOW_US).lanes == set(lanes)
