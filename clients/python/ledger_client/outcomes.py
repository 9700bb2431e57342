"""How a model call's result becomes a ledger move: the one table.

A lane reports what it saw (the provider's HTTP status, whether usage came
back, or how the call failed) and `classify` answers with one of three moves:
settle at the real cost, refund (zero), or settle UNKNOWN (charged at the
hold, which the ledger caps by request bytes). Nothing else in the client
decides this.
"""

from __future__ import annotations

import dataclasses
import enum

from ledger_client.errors import invalid_argument
from ledger_client.settings import require_int

MAX_TOKENS = 10**12
MAX_AMOUNT_NANOS = 2**62
# Usage's token counts, each between 0 and MAX_TOKENS.
TOKEN_FIELDS = ("input_tokens", "output_tokens", "cached_input_tokens", "cache_write_tokens")


class Settlement(enum.Enum):
    SETTLE_SUCCEEDED = "settle_succeeded"
    SETTLE_UNKNOWN = "settle_unknown"
    REFUND = "refund"


class CallFailure(enum.Enum):
    """How the call went wrong before an HTTP answer came back, if it did."""

    NONE = "none"  # the provider answered; see the HTTP status
    NOT_SENT = "not_sent"  # known never to have left the lane
    TIMEOUT = "timeout"
    CONNECTION_LOST = "connection_lost"
    EXCEPTION = "exception"  # anything else: the call may have been sent


class StatusClass(enum.Enum):
    NO_ANSWER = "no_answer"
    SUCCESS = "2xx"
    CLIENT_ERROR = "4xx"
    SERVER_ERROR = "5xx"
    OTHER = "other"


class CallNotSent(Exception):
    """Raise inside a model call block when the request never left the lane
    (e.g. it was refused locally before any byte was written): it is refunded.

    The reason is sent to the ledger's audit, so it must not carry secrets or
    provider text."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Usage:
    """What the provider reported: tokens, or the billed amount, or both.

    `input_tokens` counts EVERY input token, the cached and cache-write ones
    included; `cached_input_tokens` (read from the provider's prompt cache) and
    `cache_write_tokens` (written to it) are parts of it. `output_tokens`
    counts every output token, reasoning tokens included. `usage_of` (usage.py)
    reads a provider's usage block this way."""

    input_tokens: int = 0
    output_tokens: int = 0
    billed_nanos: int | None = None
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0

    def __post_init__(self) -> None:
        # A float or bool would pass the bounds and fail only as the Settle is
        # built, after the model call block, leaving its booking open.
        for name in TOKEN_FIELDS:
            value = getattr(self, name)
            require_int(value, name)
            if not 0 <= value <= MAX_TOKENS:
                raise ValueError(f"{name} must be between 0 and {MAX_TOKENS}")
        if self.cached_input_tokens + self.cache_write_tokens > self.input_tokens:
            raise ValueError(
                "cached_input_tokens + cache_write_tokens must be at most input_tokens"
            )
        if self.billed_nanos is not None:
            require_int(self.billed_nanos, "billed_nanos")
            if not 0 <= self.billed_nanos <= MAX_AMOUNT_NANOS:
                raise ValueError(f"billed_nanos must be between 0 and {MAX_AMOUNT_NANOS}")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One row: None matches anything. The first matching row wins."""

    failure: CallFailure | None
    status: StatusClass | None
    usage_present: bool | None
    settlement: Settlement
    why: str


# THE table. Order matters: a refusal is free even when usage came with it;
# known usage wins over any failure; everything else may have been billed.
RULES: tuple[Rule, ...] = (
    Rule(CallFailure.NOT_SENT, None, None, Settlement.REFUND, "never sent: costs nothing"),
    Rule(None, StatusClass.CLIENT_ERROR, None, Settlement.REFUND,
         "the provider refused it (any 4xx, 429 included): costs nothing"),
    Rule(None, None, True, Settlement.SETTLE_SUCCEEDED, "usage is known: real data wins"),
    Rule(CallFailure.NONE, StatusClass.SUCCESS, False, Settlement.SETTLE_UNKNOWN,
         "answered without usage: charged at the hold"),
    Rule(CallFailure.NONE, StatusClass.SERVER_ERROR, False, Settlement.SETTLE_UNKNOWN,
         "5xx without usage: may have run, charged at the hold"),
    Rule(CallFailure.TIMEOUT, None, False, Settlement.SETTLE_UNKNOWN,
         "timed out: may have run, charged at the hold"),
    Rule(CallFailure.CONNECTION_LOST, None, False, Settlement.SETTLE_UNKNOWN,
         "connection lost: may have run, charged at the hold"),
    Rule(CallFailure.EXCEPTION, None, False, Settlement.SETTLE_UNKNOWN,
         "an exception escaped: the call may have been sent"),
    Rule(None, None, None, Settlement.SETTLE_UNKNOWN,
         "nothing says it was free or measured: charged at the hold"),
)  # fmt: skip


def status_class(http_status: int) -> StatusClass:
    require_int(http_status, "http_status")
    if http_status == 0:
        return StatusClass.NO_ANSWER
    if not 100 <= http_status <= 599:
        raise ValueError("http_status must be 0 (no answer) or between 100 and 599")
    return {2: StatusClass.SUCCESS, 4: StatusClass.CLIENT_ERROR, 5: StatusClass.SERVER_ERROR}.get(
        http_status // 100, StatusClass.OTHER
    )


def rule_for(http_status: int, usage_present: bool, failure: CallFailure) -> Rule:
    status = status_class(http_status)
    for rule in RULES:
        if (
            rule.failure in (None, failure)
            and rule.status in (None, status)
            and rule.usage_present in (None, usage_present)
        ):
            return rule
    raise AssertionError("the last rule matches everything")


def classify(http_status: int, usage_present: bool, failure: CallFailure) -> Settlement:
    """The move for a call that ended this way (http_status 0: no HTTP answer)."""
    return rule_for(http_status, usage_present, failure).settlement


def status_of_exception(error: BaseException) -> int:
    """The HTTP status an exception carries, or 0: `status_code` (openai,
    anthropic), `response.status_code` (httpx, requests), `status` (aiohttp)
    or `http_status`, the first that is an HTTP status. So a provider's 429
    raised as an exception is still refunded, as the Node client does."""
    response = getattr(error, "response", None)
    for candidate in (
        getattr(error, "status_code", None),
        getattr(response, "status_code", None),
        getattr(error, "status", None),
        getattr(error, "http_status", None),
    ):
        if (
            isinstance(candidate, int)
            and not isinstance(candidate, bool)
            and 100 <= candidate <= 599
        ):
            return int(candidate)
    return 0


def failure_of_exception(error: BaseException) -> CallFailure:
    """How an exception escaping a model call block is read.

    Only CallNotSent proves the request never left: a refused connection is not
    taken as proof, because HTTP clients retry and an earlier attempt may have
    been sent.
    """
    if isinstance(error, CallNotSent):
        return CallFailure.NOT_SENT
    if isinstance(error, TimeoutError):
        return CallFailure.TIMEOUT
    if isinstance(error, ConnectionError):
        return CallFailure.CONNECTION_LOST
    return CallFailure.EXCEPTION


@dataclasses.dataclass(frozen=True)
class Ending:
    """How one booking ends: the move and what goes with it on the wire."""

    settlement: Settlement
    http_status: int = 0
    usage: Usage | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        status_class(self.http_status)
        if self.usage is not None and not isinstance(self.usage, Usage):
            # Made inside the block (call.answered): at the Settle it would
            # fail after the block, leaving the booking open.
            raise TypeError(
                f"usage must be a Usage or None, not a {type(self.usage).__name__}: read a "
                "provider's body or usage object with usage_of"
            )
        if self.settlement is Settlement.SETTLE_SUCCEEDED and self.usage is None:
            raise ValueError("a SUCCEEDED settlement needs the usage")
        if not isinstance(self.reason, str):
            raise invalid_argument("reason", "must be a string")
        if (
            self.settlement is Settlement.REFUND
            and self.http_status == 0
            and not self.reason.strip()
        ):
            # What the ledger would answer (RefundCommand in ledger_service/domain/moves.py).
            raise invalid_argument(
                "reason", "is required when http_status is 0 (a call that was never sent)"
            )


def ending_of(
    http_status: int, usage: Usage | None, failure: CallFailure, reason: str = ""
) -> Ending:
    """Classifies a result and packs what the ledger needs to record it."""
    settlement = classify(http_status, usage is not None, failure)
    if settlement is Settlement.REFUND:
        if status_class(http_status) is StatusClass.CLIENT_ERROR:
            return Ending(settlement, http_status, None, reason or "the provider refused the call")
        return Ending(settlement, 0, None, reason or "the call was never sent")
    return Ending(settlement, http_status, usage, reason)
