"""Grants: signed tokens that say which lanes a caller may touch, and how.

A grant names its lanes (or `*` for every lane), its scopes and its expiry, and
is signed with HMAC-SHA256 by a key of the server's keyring. The server is the
only party that issues grants and the only one that verifies them, so a shared
secret is enough, and verifying one is a hash and a constant-time compare: a few
microseconds, no database and no network (a lane's 2 s step must not spend
0.8 s asking who it is, as the recall post-mortem found).

The wire form is four dot-separated ASCII parts:

    lg1.<key id>.<claims, base64url JSON>.<HMAC-SHA256 of the first three parts, base64url>

The key id travels in the signed text, so a token cannot be moved to another
key. The signature is checked before the claims are parsed, so the JSON parser
only ever sees bytes this server signed.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import enum
import hashlib
import hmac
import json
import re
import secrets
from collections.abc import Iterable, Mapping

from ledger_service.domain.clock import MICROS_PER_SECOND

FORMAT = "lg1"
ALL_LANES = "*"
# Limits of the format: a grant is a short header value, never a payload.
MAX_GRANT_LENGTH = 4096
MAX_LANES_PER_GRANT = 64
MAX_LANE_LENGTH = 200
MIN_KEY_BYTES = 32
SIGNATURE_BYTES = 32
MAX_GRANT_LIFETIME_SECONDS = 10 * 366 * 86_400
# A grant issued by another replica whose clock runs a little ahead is still good.
MAX_CLOCK_SKEW_US = 60 * MICROS_PER_SECOND

_KEY_ID = re.compile(r"[A-Za-z0-9_-]{1,32}")
_BASE64URL = re.compile(r"[A-Za-z0-9_-]+")
# The same alphabet as lane names in policies.py.
_LANE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")
_CLAIM_NAMES = frozenset({"lanes", "scopes", "iat", "exp", "jti"})


class Scope(enum.Enum):
    """What a grant allows on its lanes. ADMIN allows everything on every lane."""

    CHARGE = "charge"  # Reserve, Settle, Refund
    READ = "read"  # GetBalance, GetBooking, ListEvents, WatchEvents
    ADMIN = "admin"  # LaneAdmin, TestClock, and charge and read on every lane


class Rejection(enum.Enum):
    """Why a grant was not accepted. Logged by the server, never sent."""

    MISSING = "missing"
    MALFORMED = "malformed"
    UNKNOWN_KEY = "unknown key id"
    BAD_SIGNATURE = "bad signature"
    EXPIRED = "expired"
    NOT_YET_VALID = "issued in the future"


class GrantRejected(Exception):
    def __init__(self, why: Rejection, key_id: str = "") -> None:
        super().__init__(why.value)
        self.why = why
        # The key id the grant names (UNKNOWN_KEY only): well-formed, so loggable.
        self.key_id = key_id


@dataclasses.dataclass(frozen=True)
class Grant:
    lanes: frozenset[str]
    scopes: frozenset[Scope]
    issued_at_us: int
    expires_at_us: int
    key_id: str
    # Random, so that two grants with the same claims differ (and can be told apart in logs).
    grant_id: str

    def allows(self, scope: Scope, lane: str) -> bool:
        """Whether this grant allows `scope` on `lane` (ALL_LANES: on every lane at once)."""
        if Scope.ADMIN in self.scopes:
            return True
        if scope not in self.scopes:
            return False
        return ALL_LANES in self.lanes or (lane != ALL_LANES and lane in self.lanes)


@dataclasses.dataclass(frozen=True)
class Keyring:
    """Several verification keys, one of which signs. Keys are never printed."""

    keys: Mapping[str, bytes] = dataclasses.field(repr=False)
    signing_key_id: str

    def __post_init__(self) -> None:
        if self.signing_key_id not in self.keys:
            raise ValueError("the signing key id is not in the keyring")
        for key_id, key in self.keys.items():
            if not _KEY_ID.fullmatch(key_id):
                raise ValueError("a key id must be 1 to 32 characters of [A-Za-z0-9_-]")
            if len(key) < MIN_KEY_BYTES:
                raise ValueError(f"a grant key must have at least {MIN_KEY_BYTES} bytes")

    def issue(
        self,
        lanes: Iterable[str],
        scopes: Iterable[Scope],
        *,
        issued_at_us: int,
        expires_at_us: int,
    ) -> str:
        """A signed grant. Raises ValueError for claims that could never verify."""
        claims = _claims(frozenset(lanes), frozenset(scopes), issued_at_us, expires_at_us)
        payload = _encode(json.dumps(claims, sort_keys=True, separators=(",", ":")).encode())
        signed = f"{FORMAT}.{self.signing_key_id}.{payload}"
        token = f"{signed}.{_encode(_sign(self.keys[self.signing_key_id], signed))}"
        if len(token) > MAX_GRANT_LENGTH:
            # Every server and both clients refuse a longer token as malformed.
            raise ValueError(
                f"the lanes' names make the grant {len(token)} characters long, past the "
                f"{MAX_GRANT_LENGTH} a grant may have: name fewer lanes, or shorter ones, "
                "in each grant"
            )
        return token

    def verify(self, token: str, now_us: int) -> Grant:
        """The grant `token` carries, if this keyring signed it and it is in force now.

        Raises GrantRejected. The signature is compared in constant time and is
        checked before the claims are parsed.
        """
        key_id, signed, signature = _split(token)
        key = self.keys.get(key_id)
        if key is None:
            raise GrantRejected(Rejection.UNKNOWN_KEY, key_id)
        if not hmac.compare_digest(_sign(key, signed), signature):
            raise GrantRejected(Rejection.BAD_SIGNATURE)
        grant = _parse(key_id, signed)
        if now_us >= grant.expires_at_us:
            raise GrantRejected(Rejection.EXPIRED)
        if grant.issued_at_us > now_us + MAX_CLOCK_SKEW_US:
            raise GrantRejected(Rejection.NOT_YET_VALID)
        return grant


def new_key() -> bytes:
    return secrets.token_bytes(MIN_KEY_BYTES)


def new_key_id() -> str:
    return "k" + secrets.token_hex(4)


def decode_unverified(token: str) -> Grant:
    """The claims of a well-formed grant, WITHOUT checking its signature or expiry.

    For `ledger grant inspect` and for logs; never for deciding anything.
    """
    key_id, signed, _signature = _split(token)
    return _parse(key_id, signed)


def _parse(key_id: str, signed: str) -> Grant:
    payload = signed.rsplit(".", 1)[1]
    try:
        claims = json.loads(_decode(payload))
    except (ValueError, UnicodeError, RecursionError) as error:
        raise GrantRejected(Rejection.MALFORMED) from error
    return _grant_of(claims, key_id)


def key_id_of(token: str) -> str:
    """The id of the key that signed a well-formed token. Raises GrantRejected."""
    return _split(token)[0]


def _split(token: str) -> tuple[str, str, bytes]:
    """(key id, the signed text, the signature bytes) of a well-formed token."""
    if not token:
        raise GrantRejected(Rejection.MISSING)
    if len(token) > MAX_GRANT_LENGTH or not token.isascii():
        raise GrantRejected(Rejection.MALFORMED)
    parts = token.split(".")
    if len(parts) != 4 or parts[0] != FORMAT or not _KEY_ID.fullmatch(parts[1]):
        raise GrantRejected(Rejection.MALFORMED)
    if not (_BASE64URL.fullmatch(parts[2]) and _BASE64URL.fullmatch(parts[3])):
        raise GrantRejected(Rejection.MALFORMED)
    signature = _decode(parts[3])
    if len(signature) != SIGNATURE_BYTES or _encode(signature) != parts[3]:
        # The second test refuses a non-canonical encoding of the same bytes.
        raise GrantRejected(Rejection.MALFORMED)
    return parts[1], ".".join(parts[:3]), signature


def _grant_of(claims: object, key_id: str) -> Grant:
    if not isinstance(claims, dict) or set(claims) != _CLAIM_NAMES:
        raise GrantRejected(Rejection.MALFORMED)
    lanes, scopes = claims["lanes"], claims["scopes"]
    issued_at, expires_at, grant_id = claims["iat"], claims["exp"], claims["jti"]
    if not (_is_list_of_str(lanes) and _is_list_of_str(scopes)):
        raise GrantRejected(Rejection.MALFORMED)
    if not (_is_int(issued_at) and _is_int(expires_at) and isinstance(grant_id, str)):
        raise GrantRejected(Rejection.MALFORMED)
    try:
        return Grant(
            lanes=_valid_lanes(frozenset(lanes)),
            scopes=frozenset(Scope(scope) for scope in scopes),
            issued_at_us=issued_at,
            expires_at_us=expires_at,
            key_id=key_id,
            grant_id=grant_id,
        )
    except ValueError as error:
        raise GrantRejected(Rejection.MALFORMED) from error


def _claims(
    lanes: frozenset[str], scopes: frozenset[Scope], issued_at_us: int, expires_at_us: int
) -> dict[str, object]:
    _valid_lanes(lanes)
    if not scopes:
        raise ValueError("a grant needs at least one scope")
    if not 0 <= issued_at_us < expires_at_us:
        raise ValueError("a grant must expire after it is issued")
    if expires_at_us - issued_at_us > MAX_GRANT_LIFETIME_SECONDS * MICROS_PER_SECOND:
        raise ValueError("a grant may live at most 3,660 days (ten years of 366 days)")
    return {
        "lanes": sorted(lanes),
        "scopes": sorted(scope.value for scope in scopes),
        "iat": issued_at_us,
        "exp": expires_at_us,
        "jti": secrets.token_hex(8),
    }


def _valid_lanes(lanes: frozenset[str]) -> frozenset[str]:
    if not 0 < len(lanes) <= MAX_LANES_PER_GRANT:
        raise ValueError(f"a grant names 1 to {MAX_LANES_PER_GRANT} lanes")
    for lane in lanes:
        if lane != ALL_LANES and not (len(lane) <= MAX_LANE_LENGTH and _LANE.fullmatch(lane)):
            raise ValueError(f"{lane!r} is not a lane name")
    return lanes


def _is_list_of_str(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sign(key: bytes, signed: str) -> bytes:
    return hmac.new(key, signed.encode("ascii"), hashlib.sha256).digest()


def _encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _decode(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as error:
        raise GrantRejected(Rejection.MALFORMED) from error
