"""A lane's policy: its limit, window, hold TTL and prices."""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ledger_service.domain.clock import MICROS_PER_SECOND
from ledger_service.domain.errors import InvalidArgument
from ledger_service.domain.pricing import (
    BYTES_PER_TOKEN_SCALE,
    MAX_AMOUNT_NANOS,
    ModelPrice,
    price_from_list,
    price_to_list,
)

DEFAULT_WINDOW_US = 86_400 * MICROS_PER_SECOND
DEFAULT_HOLD_TTL_US = 120 * MICROS_PER_SECOND
DEFAULT_BYTES_PER_TOKEN_MILLI = 3500
DEFAULT_OVERHEAD_TOKENS = 0
# A SUCCEEDED charge above this many times its booking's cap is refused as
# usage no request could have produced (0: no bound). The cap prices request
# bytes, and an image or a file named by a short URL can cost far more tokens
# than its bytes suggest: a 200-byte image URL prices at 58 tokens and can
# bill about 1,600. 100 leaves room for that, and still refuses a misread
# usage such as 10^9 tokens on a 7,000-byte request.
DEFAULT_MAX_CHARGE_MULTIPLE = 100
MAX_CHARGE_MULTIPLE = 1_000_000

MIN_WINDOW_US = 1 * MICROS_PER_SECOND
MAX_WINDOW_US = 366 * 86_400 * MICROS_PER_SECOND
MIN_HOLD_TTL_US = 1000  # one millisecond
MAX_HOLD_TTL_US = 7 * 86_400 * MICROS_PER_SECOND
MIN_BYTES_PER_TOKEN_MILLI = 100  # 0.1 bytes per token
MAX_BYTES_PER_TOKEN_MILLI = 64_000
BYTES_PER_TOKEN_RANGE = "must be between 0.1 and 64"
MAX_OVERHEAD_TOKENS = 10_000_000
MAX_PRICE_NANOS_PER_MILLION = 10**15  # a million dollars per million tokens
MAX_MODELS = 256
MAX_NAME_LENGTH = 200
# A lane and its ancestors: at most this many budgets checked per Reserve.
MAX_BUDGET_DEPTH = 4

# Lane and model names: printable, no whitespace or control characters.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$")


class ExpireCharge(enum.Enum):
    HOLD = "hold"
    ZERO = "zero"


@dataclasses.dataclass(frozen=True)
class LanePolicy:
    lane: str
    limit_nanos: int
    prices: Mapping[str, ModelPrice]
    window_us: int = DEFAULT_WINDOW_US
    hold_ttl_us: int = DEFAULT_HOLD_TTL_US
    bytes_per_token_milli: int = DEFAULT_BYTES_PER_TOKEN_MILLI
    overhead_tokens: int = DEFAULT_OVERHEAD_TOKENS
    expire_charge: ExpireCharge = ExpireCharge.HOLD
    # The parent budget (another lane), if any: a Reserve must fit it too.
    parent: str | None = None
    max_charge_multiple: int = DEFAULT_MAX_CHARGE_MULTIPLE
    # Output only: the seq of the lane_configured event that set this policy.
    version: int = 0
    updated_at_us: int = 0

    def validate(self) -> None:
        """Raises InvalidArgument naming the first field that breaks a rule."""
        validate_name("lane.lane", self.lane)
        if not 0 < self.limit_nanos <= MAX_AMOUNT_NANOS:
            raise InvalidArgument("lane.limit_nanos", f"must be between 1 and {MAX_AMOUNT_NANOS}")
        if not MIN_WINDOW_US <= self.window_us <= MAX_WINDOW_US:
            raise InvalidArgument("lane.window", "must be between 1 second and 366 days")
        if not MIN_HOLD_TTL_US <= self.hold_ttl_us <= MAX_HOLD_TTL_US:
            raise InvalidArgument("lane.hold_ttl", "must be between 1 millisecond and 7 days")
        if self.hold_ttl_us > self.window_us:
            raise InvalidArgument("lane.hold_ttl", "must not be longer than the window")
        if not MIN_BYTES_PER_TOKEN_MILLI <= self.bytes_per_token_milli <= MAX_BYTES_PER_TOKEN_MILLI:
            raise InvalidArgument("lane.bytes_per_token", BYTES_PER_TOKEN_RANGE)
        if not 0 <= self.overhead_tokens <= MAX_OVERHEAD_TOKENS:
            raise InvalidArgument(
                "lane.overhead_tokens", f"must be between 0 and {MAX_OVERHEAD_TOKENS}"
            )
        if not 0 <= self.max_charge_multiple <= MAX_CHARGE_MULTIPLE:
            raise InvalidArgument(
                "lane.max_charge_multiple", f"must be between 0 and {MAX_CHARGE_MULTIPLE}"
            )
        validate_prices(self.prices)
        if self.parent is not None:
            validate_name("lane.parent", self.parent)
            if self.parent == self.lane:
                raise InvalidArgument("lane.parent", "a lane cannot be its own parent")

    def price_of(self, model: str) -> ModelPrice | None:
        return self.prices.get(model)


def subtree(
    lane: str, children_of: Callable[[str], Iterable[str]], max_depth: int
) -> list[list[str]]:
    """The lane and the lanes below it, level by level, at most `max_depth`
    levels; a lane met twice is kept at its first level."""
    levels: list[list[str]] = [[lane]]
    seen = {lane}
    while len(levels) < max_depth:
        below = sorted({child for parent in levels[-1] for child in children_of(parent)} - seen)
        if not below:
            break
        seen.update(below)
        levels.append(below)
    return levels


def members(lane: str, children_of: Callable[[str], Iterable[str]]) -> list[str]:
    """A budget's lanes: the lane and every lane below it (`subtree`'s levels,
    MAX_BUDGET_DEPTH at most), nearest first."""
    return [name for level in subtree(lane, children_of, MAX_BUDGET_DEPTH) for name in level]


def validate_name(field: str, value: str) -> None:
    if not value:
        raise InvalidArgument(field, "is required")
    if len(value) > MAX_NAME_LENGTH:
        raise InvalidArgument(field, f"must be at most {MAX_NAME_LENGTH} characters")
    if not _NAME.fullmatch(value):
        raise InvalidArgument(
            field, "must start with a letter or digit and use only letters, digits and ._:/@+-"
        )


def validate_prices(prices: Mapping[str, ModelPrice]) -> None:
    if not prices:
        raise InvalidArgument("lane.prices", "must name at least one model")
    if len(prices) > MAX_MODELS:
        raise InvalidArgument("lane.prices", f"must name at most {MAX_MODELS} models")
    for model, price in prices.items():
        try:
            validate_name("lane.prices", model)
        except InvalidArgument as refused:  # which of up to MAX_MODELS models
            detail = f"model {model[:MAX_NAME_LENGTH]!r} {refused.detail}"
            raise InvalidArgument("lane.prices", detail) from None
        for name, value in (
            ("input_nanos_per_million_tokens", price.input_nanos_per_million_tokens),
            ("output_nanos_per_million_tokens", price.output_nanos_per_million_tokens),
            ("cached_input_nanos_per_million_tokens", price.cached_input_nanos_per_million_tokens),
            ("cache_write_nanos_per_million_tokens", price.cache_write_nanos_per_million_tokens),
        ):
            if value is not None and not 0 <= value <= MAX_PRICE_NANOS_PER_MILLION:
                raise InvalidArgument(
                    f"lane.prices[{model}].{name}",
                    f"must be between 0 and {MAX_PRICE_NANOS_PER_MILLION}",
                )


def bytes_per_token_milli(value: float) -> int:
    """Converts the wire's double to thousandths, refusing what it cannot keep exactly."""
    if not math.isfinite(value):
        raise InvalidArgument("lane.bytes_per_token", "must be a finite number")
    scaled = value * BYTES_PER_TOKEN_SCALE
    # Out of range is told as such, before a decimal rule no value there could meet.
    if not MIN_BYTES_PER_TOKEN_MILLI <= scaled <= MAX_BYTES_PER_TOKEN_MILLI:
        raise InvalidArgument("lane.bytes_per_token", BYTES_PER_TOKEN_RANGE)
    milli = round(scaled)
    # A decimal of three places comes back as the very same double; anything
    # else, however close, is a different number and not kept.
    if milli / BYTES_PER_TOKEN_SCALE != value:
        raise InvalidArgument("lane.bytes_per_token", "must have at most three decimals")
    return milli


def policy_to_dict(policy: LanePolicy) -> dict[str, Any]:
    """A JSON-ready form, stored in the lane_configured event."""
    return {
        "lane": policy.lane,
        "limit_nanos": policy.limit_nanos,
        "window_us": policy.window_us,
        "hold_ttl_us": policy.hold_ttl_us,
        "bytes_per_token_milli": policy.bytes_per_token_milli,
        "overhead_tokens": policy.overhead_tokens,
        "expire_charge": policy.expire_charge.value,
        "parent": policy.parent,
        "max_charge_multiple": policy.max_charge_multiple,
        "prices": {model: price_to_list(price) for model, price in sorted(policy.prices.items())},
    }


def policy_from_dict(data: Mapping[str, Any], version: int, updated_at_us: int) -> LanePolicy:
    return LanePolicy(
        lane=data["lane"],
        limit_nanos=int(data["limit_nanos"]),
        window_us=int(data["window_us"]),
        hold_ttl_us=int(data["hold_ttl_us"]),
        bytes_per_token_milli=int(data["bytes_per_token_milli"]),
        overhead_tokens=int(data["overhead_tokens"]),
        expire_charge=ExpireCharge(data["expire_charge"]),
        parent=data.get("parent"),
        # A policy recorded before the field existed reads as the default, as
        # a PutLane that leaves it unset does.
        max_charge_multiple=int(data.get("max_charge_multiple", DEFAULT_MAX_CHARGE_MULTIPLE)),
        prices={model: price_from_list(values) for model, values in data["prices"].items()},
        version=version,
        updated_at_us=updated_at_us,
    )
