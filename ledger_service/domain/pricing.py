"""Pricing in integer nanos. Every division that prices a cost rounds up, so
the ledger never under-books by rounding.

A model's price has an input and an output rate, and may have a rate for
input tokens read from the provider's prompt cache and one for input tokens
written to it, all in nanos per million tokens. A call's usage counts every
input token in `input_tokens` (the cached and cache-write ones are parts of
it) and every output token, reasoning tokens included, in `output_tokens`:
OpenAI's `prompt_tokens` and `completion_tokens` already count that way.
"""

from __future__ import annotations

import dataclasses
import decimal

TOKENS_PER_MILLION = 1_000_000
# bytes_per_token is kept in thousandths: 3.5 bytes per token is 3500.
BYTES_PER_TOKEN_SCALE = 1000
# The largest single amount the ledger takes (a limit, a hold, a charge).
MAX_AMOUNT_NANOS = 2**62
# The most any budget's window may hold: every sum the ledger keeps of a
# window (a lane, a parent, the audit's parts) stays within int64, with room
# for one more amount before the check refuses it.
MAX_WINDOW_SUM_NANOS = 2**62
NANOS_PER_USD = 10**9
# Dollars to nanos without rounding: any exponent, and Inexact raised where the
# default context would round (1e-999999999 to 0, 28 digits to fewer).
_EXACT = decimal.Context(
    prec=60, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN, traps=[decimal.Inexact]
)

# 10^19 is past int64 (and so past MAX_AMOUNT_NANOS): what a larger amount reads as.
_PAST_EVERY_BOUND_DIGITS = 19
_PAST_EVERY_BOUND: int = 10**_PAST_EVERY_BOUND_DIGITS


def usd_to_nanos(usd: decimal.Decimal) -> int | None:
    """A finite amount of dollars as whole nanos, or None when it is finer than
    one nano (or has more digits than any amount the ledger takes): never
    rounded to a neighbouring nano. One of 10^19 nanos or more, past every
    bound, comes back as +-10^19: int() of '1e999999999' would hold the GIL
    for minutes building a billion digits."""
    try:
        nanos = _EXACT.multiply(usd, NANOS_PER_USD)
    except decimal.Inexact:
        return None
    if nanos != _EXACT.to_integral_value(nanos):
        return None
    if nanos and nanos.adjusted() >= _PAST_EVERY_BOUND_DIGITS:
        return -_PAST_EVERY_BOUND if nanos.is_signed() else _PAST_EVERY_BOUND
    return int(nanos)


def usd_text(nanos: int) -> str:
    """Nanos, 0 or more, as a plain decimal number of dollars, as an export or a
    command line writes one: 4611686018427387904 -> '4611686018.427387904',
    10**9 -> '1'."""
    assert nanos >= 0
    whole, fraction = divmod(nanos, NANOS_PER_USD)
    return f"{whole}.{fraction:09d}".rstrip("0").rstrip(".")


def ceil_div(numerator: int, denominator: int) -> int:
    assert denominator > 0
    assert numerator >= 0
    return -(-numerator // denominator)


def _priced(tokens: int, nanos_per_million_tokens: int) -> int:
    return ceil_div(tokens * nanos_per_million_tokens, TOKENS_PER_MILLION)


@dataclasses.dataclass(frozen=True)
class ModelPrice:
    input_nanos_per_million_tokens: int
    output_nanos_per_million_tokens: int
    # None: such tokens cost the input rate.
    cached_input_nanos_per_million_tokens: int | None = None
    cache_write_nanos_per_million_tokens: int | None = None

    @property
    def cached_input_rate(self) -> int:
        rate = self.cached_input_nanos_per_million_tokens
        return self.input_nanos_per_million_tokens if rate is None else rate

    @property
    def cache_write_rate(self) -> int:
        rate = self.cache_write_nanos_per_million_tokens
        return self.input_nanos_per_million_tokens if rate is None else rate

    @property
    def dearest_input_rate(self) -> int:
        return max(
            self.input_nanos_per_million_tokens, self.cached_input_rate, self.cache_write_rate
        )

    def price_input(self, tokens: int) -> int:
        return _priced(tokens, self.input_nanos_per_million_tokens)

    def price_output(self, tokens: int) -> int:
        return _priced(tokens, self.output_nanos_per_million_tokens)

    def real_cost(
        self,
        input_tokens: int,
        output_tokens: int,
        cached_input_tokens: int = 0,
        cache_write_tokens: int = 0,
    ) -> int:
        """The provider's formula: each kind of token at its own rate. The
        cached and cache-write tokens are parts of `input_tokens`."""
        uncached = input_tokens - cached_input_tokens - cache_write_tokens
        assert uncached >= 0, "cached and cache-write tokens are parts of input_tokens"
        return (
            self.price_input(uncached)
            + _priced(cached_input_tokens, self.cached_input_rate)
            + _priced(cache_write_tokens, self.cache_write_rate)
            + self.price_output(output_tokens)
        )

    def has_cache_rates(self) -> bool:
        return (
            self.cached_input_nanos_per_million_tokens is not None
            or self.cache_write_nanos_per_million_tokens is not None
        )


def request_tokens(request_bytes: int, bytes_per_token_milli: int, overhead_tokens: int) -> int:
    """Pessimistic tokens for a request: ceil(bytes / bytes_per_token) + overhead."""
    return ceil_div(request_bytes * BYTES_PER_TOKEN_SCALE, bytes_per_token_milli) + overhead_tokens


def cap_nanos(
    price: ModelPrice,
    request_bytes: int,
    max_output_tokens: int,
    bytes_per_token_milli: int,
    overhead_tokens: int,
) -> int:
    """The most a request of this many bytes can cost: the "byte cap". Every
    input token is priced at the dearest input rate, so that the cap stays an
    upper bound whichever of them the cache serves or writes."""
    tokens_in = request_tokens(request_bytes, bytes_per_token_milli, overhead_tokens)
    return _priced(tokens_in, price.dearest_input_rate) + price.price_output(max_output_tokens)


def price_to_list(price: ModelPrice) -> list[int | None]:
    """A price as JSON keeps it: [input, output], with the cache rates only when set."""
    pair: list[int | None] = [
        price.input_nanos_per_million_tokens,
        price.output_nanos_per_million_tokens,
    ]
    if not price.has_cache_rates():
        return pair
    return [
        *pair,
        price.cached_input_nanos_per_million_tokens,
        price.cache_write_nanos_per_million_tokens,
    ]


def price_from_list(values: list[int | None]) -> ModelPrice:
    def rate(index: int) -> int | None:
        value = values[index] if len(values) > index else None
        return None if value is None else int(value)

    return ModelPrice(int(values[0] or 0), int(values[1] or 0), rate(2), rate(3))
