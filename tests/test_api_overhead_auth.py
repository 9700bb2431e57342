"""The grant check remembers tokens that verified, and still refuses each one the
moment it is out of its time window; a token that failed is never remembered."""

from __future__ import annotations

import collections
from typing import Any

import grpc
import pytest

from ledger_service.api.auth import MAX_VERIFIED_GRANTS, AuthInterceptor
from ledger_service.domain.clock import ManualClock
from ledger_service.domain.grants import MAX_CLOCK_SKEW_US, Keyring, Scope, new_key
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb

START_US = 1_800_000_000_000_000
LIFETIME_US = 10_000_000
RESERVE = "/ledger.v1.Ledger/Reserve"


class _Details(
    collections.namedtuple("_Details", "method invocation_metadata"),
    grpc.HandlerCallDetails,
):
    pass


class Refused(Exception):
    pass


class _Context:
    def __init__(self, token: str) -> None:
        self._metadata = (("authorization", f"Bearer {token}"),)
        self.code: grpc.StatusCode | None = None

    def invocation_metadata(self) -> Any:
        return self._metadata

    def set_trailing_metadata(self, _metadata: Any) -> None:
        return None

    def abort(self, code: grpc.StatusCode, _details: str) -> None:
        self.code = code
        raise Refused()


@pytest.fixture
def keyring() -> Keyring:
    return Keyring(keys={"k1": new_key()}, signing_key_id="k1")


def _reserve(interceptor: AuthInterceptor, token: str) -> grpc.StatusCode:
    servicer = grpc.unary_unary_rpc_method_handler(
        lambda request, context: pb.ReserveResponse(),
        request_deserializer=pb.ReserveRequest.FromString,
    )
    handler = interceptor.intercept_service(lambda _: servicer, _Details(RESERVE, ()))
    assert handler is not None and handler.unary_unary is not None
    context = _Context(token)
    request = pb.ReserveRequest(lane="recall").SerializeToString()
    servicer_context: Any = context
    try:
        handler.unary_unary(request, servicer_context)
    except Refused:
        assert context.code is not None
        return context.code
    return grpc.StatusCode.OK


def _grant(keyring: Keyring, issued_at_us: int) -> str:
    return keyring.issue(
        ["recall"],
        [Scope.CHARGE],
        issued_at_us=issued_at_us,
        expires_at_us=issued_at_us + LIFETIME_US,
    )


def test_a_remembered_grant_still_expires(keyring: Keyring) -> None:
    clock = ManualClock(START_US)
    interceptor = AuthInterceptor(keyring, clock)
    token = _grant(keyring, START_US)
    assert _reserve(interceptor, token) is grpc.StatusCode.OK
    clock.advance_us(LIFETIME_US - 1)
    assert _reserve(interceptor, token) is grpc.StatusCode.OK
    clock.advance_us(1)
    assert _reserve(interceptor, token) is grpc.StatusCode.UNAUTHENTICATED


def test_a_remembered_grant_from_the_future_waits_for_its_time(keyring: Keyring) -> None:
    clock = ManualClock(START_US)
    interceptor = AuthInterceptor(keyring, clock)
    token = _grant(keyring, START_US)
    assert _reserve(interceptor, token) is grpc.StatusCode.OK
    clock.set_us(START_US - MAX_CLOCK_SKEW_US - 1)
    assert _reserve(interceptor, token) is grpc.StatusCode.UNAUTHENTICATED
    clock.set_us(START_US)
    assert _reserve(interceptor, token) is grpc.StatusCode.OK


def test_a_forged_token_is_refused_every_time(keyring: Keyring) -> None:
    interceptor = AuthInterceptor(keyring, ManualClock(START_US))
    token = _grant(keyring, START_US)
    forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    other = Keyring(keys={"k1": new_key()}, signing_key_id="k1")
    foreign = _grant(other, START_US)
    for _ in range(3):
        assert _reserve(interceptor, forged) is grpc.StatusCode.UNAUTHENTICATED
        assert _reserve(interceptor, foreign) is grpc.StatusCode.UNAUTHENTICATED
        assert _reserve(interceptor, token) is grpc.StatusCode.OK


def test_the_remembered_grants_are_bounded(keyring: Keyring) -> None:
    interceptor = AuthInterceptor(keyring, ManualClock(START_US))
    tokens = [_grant(keyring, START_US) for _ in range(MAX_VERIFIED_GRANTS + 5)]
    for token in tokens:
        assert _reserve(interceptor, token) is grpc.StatusCode.OK
    assert len(interceptor._keys[1]) <= MAX_VERIFIED_GRANTS  # the grants it remembers
    assert _reserve(interceptor, tokens[0]) is grpc.StatusCode.OK
