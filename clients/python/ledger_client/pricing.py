"""Local pricing, used only to bound the outage allowance.

The ledger prices every booking itself; a lane prices locally only while the
ledger cannot be reached, with the same formula and the same rounding (every
division rounds up), so that the allowance is never spent faster than the
ledger would book it.
"""

from __future__ import annotations

import dataclasses

TOKENS_PER_MILLION = 1_000_000
# bytes_per_token in thousandths: 3.5 bytes per token is 3500.
BYTES_PER_TOKEN_SCALE = 1000
DEFAULT_BYTES_PER_TOKEN_MILLI = 3500
MAX_PRICE_NANOS_PER_MILLION = 10**15


def ceil_div(numerator: int, denominator: int) -> int:
    assert denominator > 0
    assert numerator >= 0
    return -(-numerator // denominator)


@dataclasses.dataclass(frozen=True)
class ModelPrice:
    input_nanos_per_million_tokens: int
    output_nanos_per_million_tokens: int

    def __post_init__(self) -> None:
        for value in (self.input_nanos_per_million_tokens, self.output_nanos_per_million_tokens):
            if not 0 <= value <= MAX_PRICE_NANOS_PER_MILLION:
                raise ValueError(f"prices must be between 0 and {MAX_PRICE_NANOS_PER_MILLION}")

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
    """The most a request of this many bytes can cost: the ledger's byte cap."""
    tokens_in = request_tokens(request_bytes, bytes_per_token_milli, overhead_tokens)
    return price.price_input(tokens_in) + price.price_output(max_output_tokens)
