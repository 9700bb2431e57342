"""Pricing in integer nanos. Every division that prices a cost rounds up, so
the ledger never under-books by rounding."""

from __future__ import annotations

import dataclasses

TOKENS_PER_MILLION = 1_000_000
# bytes_per_token is kept in thousandths: 3.5 bytes per token is 3500.
BYTES_PER_TOKEN_SCALE = 1000
# The largest amount the ledger books (int64 with headroom for sums).
MAX_AMOUNT_NANOS = 2**62


def ceil_div(numerator: int, denominator: int) -> int:
    assert denominator > 0
    assert numerator >= 0
    return -(-numerator // denominator)


@dataclasses.dataclass(frozen=True)
class ModelPrice:
    input_nanos_per_million_tokens: int
    output_nanos_per_million_tokens: int

    def price_input(self, tokens: int) -> int:
        return ceil_div(tokens * self.input_nanos_per_million_tokens, TOKENS_PER_MILLION)

    def price_output(self, tokens: int) -> int:
        return ceil_div(tokens * self.output_nanos_per_million_tokens, TOKENS_PER_MILLION)

    def real_cost(self, input_tokens: int, output_tokens: int) -> int:
        return self.price_input(input_tokens) + self.price_output(output_tokens)


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
    """The most a request of this many bytes can cost: the "byte cap"."""
    tokens_in = request_tokens(request_bytes, bytes_per_token_milli, overhead_tokens)
    return price.price_input(tokens_in) + price.price_output(max_output_tokens)
