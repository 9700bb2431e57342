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

import collections
import contextlib
import contextvars
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import Message

from ledger_service.api.errors import (
    Behaviour,
    decode_request,
    refuse_permission,
    refuse_unauthenticated,
    replace_behaviour,
)
from ledger_service.domain.clock import Clock
from ledger_service.domain.grants import (
    ALL_LANES,
    MAX_CLOCK_SKEW_US,
    Grant,
    GrantRejected,
    Keyring,
    Rejection,
    Scope,
)
from ledger_service.domain.policies import MAX_NAME_LENGTH
from ledger_service.generated.ledger.v1 import ledger_pb2

if TYPE_CHECKING:
    from ledger_service.api.pipeline import Continuation, Handler

log = logging.getLogger(__name__)

METADATA_KEY = "authorization"
SCHEME = "bearer"
UNAUTHENTICATED_MESSAGE = "a valid grant is required (metadata 'authorization: Bearer <grant>')"
# At most this many of a grant's lanes are named in a refusal.
NAMED_LANES = 5
# Tokens whose grants one server keeps verified (a few hundred bytes each).
MAX_VERIFIED_GRANTS = 1024
# Refusals logged in any one second; the rest are counted in one line after it.
MAX_REFUSALS_LOGGED_PER_SECOND = 10
OPEN_SERVICES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)


def is_open(method: str) -> bool:
    """Whether `method` belongs to a service that needs no grant (health,
    reflection): no grant checked, no grant's share, no drain."""
    return method.startswith(OPEN_SERVICES)


@dataclasses.dataclass(frozen=True)
class Rule:
    """The scope a method needs (or any of `also`), and the lane its request
    names (ALL_LANES: every lane)."""

    scope: Scope
    lane_of: Callable[[Any], str]
    also: frozenset[Scope] = frozenset()

    @functools.cached_property
    def scopes(self) -> frozenset[Scope]:
        # Made once a rule, not once a call (every call's grant is checked against it).
        return self.also | {self.scope}


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
# The verified grant of the call being served, for moves that record who made them.
_CURRENT_GRANT: contextvars.ContextVar[Grant | None] = contextvars.ContextVar(
    "ledger_current_grant", default=None
)


class RefusalLog:
    """The refusals' lines (INFO, unless told), at most `per_second` in any one
    second: a client with a bad grant, or a lane retrying a refused Settle, in a
    tight loop would otherwise fill the disk with them. Those left out are
    counted in one line, written with the next line logged or a second after the
    first one left out, whichever comes first (a burst that ends is counted
    too)."""

    def __init__(
        self,
        per_second: int = MAX_REFUSALS_LOGGED_PER_SECOND,
        monotonic: Callable[[], float] = time.monotonic,
        logger: logging.Logger | None = None,
        level: int = logging.INFO,
        what: str = "refusals",
        later: Callable[[float, Callable[[], None]], None] | None = None,
    ) -> None:
        self._per_second = per_second
        self._monotonic = monotonic
        self._later = later or _in_a_thread_later
        self._log = logger or log
        self._level = level
        self._what = what
        self._lock = threading.Lock()
        # When the last `per_second` lines were logged: one more may be logged
        # once the oldest of them is a second old, so that no second, whatever
        # instant it starts at, holds more (whole seconds of the monotonic clock
        # let a burst across one's end log twice as many within milliseconds).
        self._logged_at: collections.deque[float] = collections.deque(maxlen=per_second)
        self._left_out = 0
        # Counts the bursts (a first left out after a count was written): a
        # flush is for its own burst only, one already counted or a later one's.
        self._burst = 0

    def write(self, message: str, *args: object) -> None:
        with self._lock:
            now = self._monotonic()
            full = len(self._logged_at) >= self._per_second
            if full and (not self._logged_at or now - self._logged_at[0] < 1.0):
                self._left_out += 1
                if self._left_out == 1:
                    self._burst += 1
                    burst = self._burst
                    self._later(1.0, lambda: self._flush_burst(burst))
                return
            self._count_left_out()
            self._logged_at.append(now)
        self._log.log(self._level, message, *args)

    def _flush_burst(self, burst: int) -> None:
        """The flush due a second after `burst`'s first left out: nothing when
        that count was already written with the next second's first (a later
        second's count is then its own flush's, or the second after's)."""
        with self._lock:
            if burst == self._burst:
                self._count_left_out()

    def _count_left_out(self) -> None:
        left_out, self._left_out = self._left_out, 0
        if left_out:
            self._log.log(self._level, "%d more %s were not logged (at most %d a second)",
                          left_out, self._what, self._per_second)  # fmt: skip


def _in_a_thread_later(delay_seconds: float, action: Callable[[], None]) -> None:
    timer = threading.Timer(delay_seconds, action)
    timer.daemon = True
    timer.start()


def asked_lane(request: Any) -> str:
    """The lane a request names (its `lane`, or its Lane's), for a refusal's
    words; empty when it names none (a reconcile's rows name their own)."""
    if not isinstance(request, Message) or "lane" not in request.DESCRIPTOR.fields_by_name:
        return ""
    lane: object = getattr(request, "lane", "")
    if isinstance(lane, Message):
        lane = getattr(lane, "lane", "")
    return lane if isinstance(lane, str) else ""


def _shown(lane: str) -> str:
    # The lane is the caller's, not checked yet: its echo is bounded (a lane name
    # is at most MAX_NAME_LENGTH), or a long one would overflow gRPC's trailers.
    return repr(lane if len(lane) <= MAX_NAME_LENGTH else lane[:MAX_NAME_LENGTH] + "...")


def refusal(grant: Grant, method: str, rule: Rule, lane: str, asked: str = "") -> str:
    """What a refused caller is told: the scope the method needs on the lane,
    and what its own grant holds. Nothing of the keyring or of other grants.
    A method that needs a scope on every lane (`lane` is ALL_LANES) names the
    lane the request `asked` for, if any: "on every lane" alone read as if the
    request had named none."""
    name = method.rsplit("/", 1)[-1]
    if lane != ALL_LANES:
        what, where = f"{name} on lane {_shown(lane)}", "there"
    else:
        what = f"{name} on lane {_shown(asked)}" if asked else name
        where = "on every lane"
    needed = " or ".join(scope.value for scope in sorted(rule.scopes, key=lambda s: s.value))
    held = ", ".join(sorted(scope.value for scope in grant.scopes))
    names = sorted(grant.lanes)
    lanes = ", ".join("every lane" if name == ALL_LANES else name for name in names[:NAMED_LANES])
    if len(names) > NAMED_LANES:
        lanes += f" and {len(names) - NAMED_LANES} more"
    return f"{what} needs the {needed} scope {where}; this grant has {held} on {lanes}"


def current_grant_id() -> str:
    """The id of the grant the current call was verified with; "" on a server
    without auth (--insecure-no-auth)."""
    grant = _CURRENT_GRANT.get()
    return grant.grant_id if grant is not None else ""


def _method(service: str, method: str) -> str:
    return f"/{ledger_pb2.DESCRIPTOR.services_by_name[service].full_name}/{method}"


def _rules() -> dict[str, Rule]:
    rules = {
        _method("Ledger", "Reserve"): Rule(Scope.CHARGE, _named_lane),
        _method("Ledger", "Settle"): Rule(Scope.CHARGE, _named_lane),
        _method("Ledger", "Refund"): Rule(Scope.CHARGE, _named_lane),
        # A lane that spends reads its own balance and bookings to choose its
        # fallback: charge allows them on the grant's lanes, as read does.
        _method("Ledger", "GetBalance"): Rule(Scope.READ, _named_lane, frozenset({Scope.CHARGE})),
        _method("Ledger", "GetBooking"): Rule(Scope.READ, _named_lane, frozenset({Scope.CHARGE})),
        _method("Ledger", "ListEvents"): Rule(Scope.READ, _named_lane_or_every),
        _method("Ledger", "WatchEvents"): Rule(Scope.READ, _named_lane_or_every),
        _method("Ledger", "GetAudit"): Rule(Scope.READ, _named_lane),
        # A usage export names lanes row by row, beyond what one request field says.
        _method("Ledger", "Reconcile"): ADMIN_ONLY,
        # An operator's correction of a charge: never a lane's own grant.
        _method("Ledger", "Correct"): ADMIN_ONLY,
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

    The grant is read and verified on every call inside the wrapped behaviour,
    where the call's metadata is, not while the handler is chosen: the wrapper
    depends on the method alone, so `pipeline.MethodPipeline` can build it once
    for every call. It decodes the request itself, and only once the grant is
    verified: the request of an unknown caller is never decoded.

    While the keyring stays the same, a token whose signature verified once
    verifies again: the grants of recent tokens are kept (at most
    MAX_VERIFIED_GRANTS) and only their time window is checked on later calls.
    A new keyring (`use`: a key rotated or retired) comes with an empty cache.
    That spares each call the signature, base64 and JSON work of a full check
    (docs/benchmarks.md, "The fast path, measured").
    """

    def __init__(self, keyring: Keyring, clock: Clock) -> None:
        self._clock = clock
        self._refusals = RefusalLog()
        # The keyring and the grants it verified, swapped together.
        self._keys: tuple[Keyring, dict[str, Grant]] = (keyring, {})

    def use(self, keyring: Keyring) -> None:
        """Verifies with `keyring` from now on. The grants verified before are
        forgotten: one whose key was retired must not be let in again."""
        self._keys = (keyring, {})

    def intercept_service(
        self,
        continuation: Continuation,
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        method = handler_call_details.method
        handler = continuation(handler_call_details)
        if handler is None or is_open(method):
            return handler
        rule = RULES.get(method, ADMIN_ONLY)
        decode = handler.request_deserializer
        return replace_behaviour(
            handler,
            unary=lambda behaviour: self._checked(behaviour, method, rule, decode),
            stream=lambda behaviour: self._checked(
                self._granted_stream(behaviour), method, rule, decode
            ),
            request_deserializer=None,
        )

    def _granted_stream(self, behaviour: Behaviour) -> Behaviour:
        """`behaviour`, with the call's grant current while its stream is read too
        (inner layers may start the servicer only at the first message), and
        the stream ended, before its next message, once the grant's key is no
        longer in the keyring: a retired key's grants are refused at once."""

        def streamed(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            grant = _CURRENT_GRANT.get()
            assert grant is not None, "_checked makes the call's grant current first"
            responses = behaviour(request, context)

            def read() -> Iterator[Any]:
                token = _CURRENT_GRANT.set(grant)
                try:
                    for response in responses:
                        if grant.key_id not in self._keys[0].keys:
                            log.info(
                                "ended a stream of grant %s: its key was retired", grant.grant_id
                            )
                            refuse_unauthenticated(context, UNAUTHENTICATED_MESSAGE)
                        yield response
                finally:
                    close = getattr(responses, "close", None)
                    if close is not None:  # as `yield from` would: the stream's slot is freed
                        close()
                    with contextlib.suppress(ValueError):  # closed from another context
                        _CURRENT_GRANT.reset(token)

            return read()

        return streamed

    def _grant(self, method: str, context: grpc.ServicerContext) -> Grant:
        """The call's verified grant; ends the call with UNAUTHENTICATED without one."""
        try:
            return self._verify(bearer_token(context.invocation_metadata()))
        except GrantRejected as rejection:
            if rejection.why is Rejection.UNKNOWN_KEY:
                # Most often a key rotated on another replica and not copied here.
                self._refusals.write(
                    "refused %s: its grant is signed by key %s, which this server's keyring "
                    "does not hold (retired here, or added on another replica: copy that "
                    "replica's grant-keys.json into this one's data directory, taken within "
                    "a health check; docs/security.md)",
                    method,
                    rejection.key_id,
                )
            else:
                self._refusals.write("refused %s: %s grant", method, rejection.why.value)
            refuse_unauthenticated(context, UNAUTHENTICATED_MESSAGE)
            raise  # unreachable: abort raises

    def _verify(self, token: str) -> Grant:
        """Keyring.verify, remembering the grants of tokens that verified. Raises GrantRejected."""
        now_us = self._clock.now_us()
        keyring, verified = self._keys
        grant = verified.get(token)
        if grant is None:
            grant = keyring.verify(token, now_us)
            if len(verified) >= MAX_VERIFIED_GRANTS:
                verified.clear()
            verified[token] = grant
            return grant
        # Keyring.verify's own time checks, on the grant it returned before.
        if now_us >= grant.expires_at_us:
            raise GrantRejected(Rejection.EXPIRED)
        if grant.issued_at_us > now_us + MAX_CLOCK_SKEW_US:
            raise GrantRejected(Rejection.NOT_YET_VALID)
        return grant

    def _checked(
        self,
        behaviour: Behaviour,
        method: str,
        rule: Rule,
        decode: Callable[[bytes], Any] | None,
    ) -> Behaviour:
        def checked(request: Any, context: grpc.ServicerContext) -> Any:
            grant = self._grant(method, context)
            if decode is not None:
                request = decode_request(request, decode, context)
            # A request stream names no single lane: only a grant for every lane will do.
            lane = rule.lane_of(request) if isinstance(request, Message) else ALL_LANES
            if not any(grant.allows(scope, lane) for scope in rule.scopes):
                self._refusals.write(
                    "refused %s: grant %s lacks %s on the lane asked for",
                    method,
                    grant.grant_id,
                    " or ".join(sorted(scope.value for scope in rule.scopes)),
                )
                refuse_permission(context, refusal(grant, method, rule, lane, asked_lane(request)))
            token = _CURRENT_GRANT.set(grant)
            try:
                return behaviour(request, context)
            finally:
                _CURRENT_GRANT.reset(token)

        return checked
