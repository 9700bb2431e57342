"""The one interceptor that checks grants. No database, no network: an HMAC.

A caller sends `authorization: Bearer <grant>`. A missing, malformed, expired,
wrongly signed, tampered or unknown-key grant gets UNAUTHENTICATED before the
request is even decoded; a valid grant for another lane, or without the scope
the method needs, gets PERMISSION_DENIED once the request (which names the lane)
is decoded. Both carry a constant message and `ledger-reason`; the precise
cause goes to the server log only, so a caller learns nothing by probing.

Every method of the ledger's services has a rule in RULES; a method without one
(say, a new RPC nobody gave a rule yet) needs an admin grant. Health and
reflection need no grant.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import grpc
from google.protobuf.message import Message

from ledger_service.api.errors import REASON_KEY, Behaviour, replace_behaviour
from ledger_service.domain.clock import Clock
from ledger_service.domain.grants import (
    ALL_LANES,
    Grant,
    GrantRejected,
    Keyring,
    Rejection,
    Scope,
)
from ledger_service.generated.ledger.v1 import ledger_pb2

log = logging.getLogger(__name__)

METADATA_KEY = "authorization"
SCHEME = "bearer"
UNAUTHENTICATED_MESSAGE = "a valid grant is required (metadata 'authorization: Bearer <grant>')"
PERMISSION_DENIED_MESSAGE = "the grant does not allow this method on this lane"
OPEN_SERVICES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)


@dataclasses.dataclass(frozen=True)
class Rule:
    """The scope a method needs, and the lane its request names (ALL_LANES: every lane)."""

    scope: Scope
    lane_of: Callable[[Any], str]


def _named_lane(request: Any) -> str:
    lane: str = request.lane
    return lane


def _named_lane_or_every(request: Any) -> str:
    """An empty lane filter reads every lane, so it needs a grant for every lane."""
    lane: str = request.lane
    return lane or ALL_LANES


def _every_lane(request: Any) -> str:
    return ALL_LANES


ADMIN_ONLY = Rule(Scope.ADMIN, _every_lane)


def _method(service: str, method: str) -> str:
    return f"/{ledger_pb2.DESCRIPTOR.services_by_name[service].full_name}/{method}"


def _rules() -> dict[str, Rule]:
    rules = {
        _method("Ledger", "Reserve"): Rule(Scope.CHARGE, _named_lane),
        _method("Ledger", "Settle"): Rule(Scope.CHARGE, _named_lane),
        _method("Ledger", "Refund"): Rule(Scope.CHARGE, _named_lane),
        _method("Ledger", "GetBalance"): Rule(Scope.READ, _named_lane),
        _method("Ledger", "GetBooking"): Rule(Scope.READ, _named_lane),
        _method("Ledger", "ListEvents"): Rule(Scope.READ, _named_lane_or_every),
        _method("Ledger", "WatchEvents"): Rule(Scope.READ, _named_lane_or_every),
        _method("Ledger", "GetAudit"): Rule(Scope.READ, _named_lane),
        # A usage export names lanes row by row, beyond what one request field says.
        _method("Ledger", "Reconcile"): ADMIN_ONLY,
    }
    for service in ("LaneAdmin", "TestClock"):
        for method in ledger_pb2.DESCRIPTOR.services_by_name[service].methods:
            rules[_method(service, method.name)] = ADMIN_ONLY
    return rules


RULES: Mapping[str, Rule] = _rules()


def bearer_token(metadata: Any) -> str:
    """The grant in the call's metadata. Raises GrantRejected."""
    values = [value for key, value in metadata or () if key == METADATA_KEY]
    if not values:
        raise GrantRejected(Rejection.MISSING)
    if len(values) > 1 or not isinstance(values[0], str):
        raise GrantRejected(Rejection.MALFORMED)
    scheme, _, token = values[0].strip().partition(" ")
    if scheme.lower() != SCHEME:
        raise GrantRejected(Rejection.MALFORMED)
    return token.strip()


class AuthInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Verifies the grant of every call to the ledger's services.

    `clock` is the real clock even on a server with a test clock: moving the
    ledger's time must not expire (or revive) credentials.
    """

    def __init__(self, keyring: Keyring, clock: Clock) -> None:
        self._keyring = keyring
        self._clock = clock

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = handler_call_details.method
        handler = continuation(handler_call_details)
        if handler is None or method.startswith(OPEN_SERVICES):
            return handler
        try:
            token = bearer_token(handler_call_details.invocation_metadata)
            grant = self._keyring.verify(token, self._clock.now_us())
        except GrantRejected as rejection:
            log.info("refused %s: %s grant", method, rejection.why.value)
            # No deserializer: the request of an unknown caller is never decoded.
            return _refusing(handler)
        rule = RULES.get(method, ADMIN_ONLY)
        return replace_behaviour(
            handler,
            unary=lambda behaviour: _checked(behaviour, method, rule, grant),
            stream=lambda behaviour: _checked(behaviour, method, rule, grant),
            request_deserializer=handler.request_deserializer,
        )


def _refusing(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    def refuse(behaviour: Behaviour) -> Behaviour:
        def refused(request: Any, context: grpc.ServicerContext) -> Any:
            context.set_trailing_metadata(((REASON_KEY, "UNAUTHENTICATED"),))
            context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

        return refused

    return replace_behaviour(handler, unary=refuse, stream=refuse, request_deserializer=None)


def _checked(behaviour: Behaviour, method: str, rule: Rule, grant: Grant) -> Behaviour:
    def checked(request: Any, context: grpc.ServicerContext) -> Any:
        # A request stream names no single lane: only a grant for every lane will do.
        lane = rule.lane_of(request) if isinstance(request, Message) else ALL_LANES
        if not grant.allows(rule.scope, lane):
            log.info("refused %s: grant %s lacks %s", method, grant.grant_id, rule.scope.value)
            context.set_trailing_metadata(((REASON_KEY, "PERMISSION_DENIED"),))
            context.abort(grpc.StatusCode.PERMISSION_DENIED, PERMISSION_DENIED_MESSAGE)
        return behaviour(request, context)

    return checked
