"""Local pricing, used only to bound the outage allowance.

The ledger prices every booking itself; a lane prices locally only while the
ledger cannot be reached, with the same formula and the same rounding (every
division rounds up), so that the allowance is never spent faster than the
ledger would book it (ledger_service/domain/pricing.py is the original).

A price has an input and an output rate and, optionally, a rate for input
tokens read from the provider's prompt cache and one for input tokens written
to it (unset: the input rate), all in nanos per million tokens. A usage counts
every input token in `input_tokens` (the cached and cache-write ones are parts
of it) and every output token, reasoning tokens included, in `output_tokens`.
"""

from __future__ import annotations

import dataclasses

from ledger_client.settings import require_int

TOKENS_PER_MILLION = 1_000_000
# bytes_per_token in thousandths: 3.5 bytes per token is 3500.
BYTES_PER_TOKEN_SCALE = 1000
DEFAULT_BYTES_PER_TOKEN_MILLI = 3500
MAX_PRICE_NANOS_PER_MILLION = 10**15


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
    # None: such tokens cost the input rate, as on the ledger.
    cached_input_nanos_per_million_tokens: int | None = None
    cache_write_nanos_per_million_tokens: int | None = None

    def __post_init__(self) -> None:
        rates = (
            self.input_nanos_per_million_tokens,
            self.output_nanos_per_million_tokens,
            self.cached_input_nanos_per_million_tokens,
            self.cache_write_nanos_per_million_tokens,
        )
        for value in rates:
            if value is not None:
                require_int(value, "a price")
            if value is not None and not 0 <= value <= MAX_PRICE_NANOS_PER_MILLION:
                raise ValueError(f"prices must be between 0 and {MAX_PRICE_NANOS_PER_MILLION}")

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
        """The rate the cap prices every request token at: whichever of them
        the cache serves or writes, the cap stays an upper bound."""
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
        """The provider's formula: each kind of token at its own rate, each
        part rounded up on its own. The cached and cache-write tokens are
        parts of `input_tokens`."""
        uncached_tokens = input_tokens - cached_input_tokens - cache_write_tokens
        if uncached_tokens < 0:
            raise ValueError("cached and cache-write tokens are parts of input_tokens")
        return (
            self.price_input(uncached_tokens)
            + _priced(cached_input_tokens, self.cached_input_rate)
            + _priced(cache_write_tokens, self.cache_write_rate)
            + self.price_output(output_tokens)
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
    """The most a request of this many bytes can cost: the ledger's byte cap,
    with every request token at the dearest input rate."""
    tokens_in = request_tokens(request_bytes, bytes_per_token_milli, overhead_tokens)
    return _priced(tokens_in, price.dearest_input_rate) + price.price_output(max_output_tokens)
