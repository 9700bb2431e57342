"""The cap formula, exactly, with no I/O.

    cap = price_in(ceil(request_bytes / bytes_per_token) + overhead_tokens)
          + price_out(max_output_tokens)

Every division that prices a cost rounds up (ceil), each one on its own: the
bytes-to-tokens division, the input price and the output price. The reference
below is written from the contract with Fraction, independently of pricing.py.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ledger_service.domain import policies
from ledger_service.domain.errors import InvalidArgument
from ledger_service.domain.pricing import ModelPrice, cap_nanos, ceil_div, request_tokens

JEV = ModelPrice(input_nanos_per_million_tokens=100_000, output_nanos_per_million_tokens=400_000)
DEFAULT_BYTES_PER_TOKEN_MILLI = 3500


def reference_cap(
    price_in: int,
    price_out: int,
    request_bytes: int,
    max_output_tokens: int,
    bytes_per_token: Fraction,
    overhead_tokens: int,
) -> int:
    tokens_in = math.ceil(Fraction(request_bytes) / bytes_per_token) + overhead_tokens
    return math.ceil(Fraction(tokens_in * price_in, 1_000_000)) + math.ceil(
        Fraction(max_output_tokens * price_out, 1_000_000)
    )


def test_ceil_div_rounds_up_and_is_exact_on_multiples() -> None:
    assert ceil_div(0, 7) == 0
    assert ceil_div(1, 7) == 1
    assert ceil_div(7, 7) == 1
    assert ceil_div(8, 7) == 2
    assert ceil_div(10**30 + 1, 10**30) == 2


def test_request_bytes_round_up_to_whole_tokens() -> None:
    # 7 bytes at 3.5 bytes per token are exactly 2 tokens; one byte more is a third.
    assert request_tokens(7, DEFAULT_BYTES_PER_TOKEN_MILLI, 0) == 2
    assert request_tokens(8, DEFAULT_BYTES_PER_TOKEN_MILLI, 0) == 3
    assert request_tokens(0, DEFAULT_BYTES_PER_TOKEN_MILLI, 0) == 0


def test_bytes_per_token_one_is_the_hard_bound_one_token_per_byte() -> None:
    for request_bytes in (0, 1, 2, 999, 300_000):
        assert request_tokens(request_bytes, 1000, 0) == request_bytes
    # With 1.0 and a price of one nano per token the cap is the byte count itself.
    one_nano = ModelPrice(1_000_000, 0)
    assert cap_nanos(one_nano, 300_001, 0, 1000, 0) == 300_001


def test_overhead_tokens_are_added_before_the_input_price_rounds() -> None:
    # 0 bytes + 1 overhead token at 0.1 nano per token: ceil(0.1) = 1 nano.
    assert cap_nanos(JEV, 0, 0, DEFAULT_BYTES_PER_TOKEN_MILLI, 1) == 1
    # 10 overhead tokens cost ceil(1.0) = 1, 11 cost ceil(1.1) = 2.
    assert cap_nanos(JEV, 0, 0, DEFAULT_BYTES_PER_TOKEN_MILLI, 10) == 1
    assert cap_nanos(JEV, 0, 0, DEFAULT_BYTES_PER_TOKEN_MILLI, 11) == 2
    assert request_tokens(7, DEFAULT_BYTES_PER_TOKEN_MILLI, 5) == 7


def test_input_and_output_prices_round_up_separately() -> None:
    # 1 input token (0.1 nano) and 1 output token (0.4 nano): 1 + 1, not ceil(0.5) = 1.
    assert cap_nanos(JEV, 1, 1, 1000, 0) == 2
    assert JEV.price_input(1) == 1
    assert JEV.price_output(1) == 1
    assert JEV.price_input(10) == 1
    assert JEV.price_output(5) == 2
    assert JEV.real_cost(1, 1) == 2


def test_a_large_recall_request_caps_exactly() -> None:
    # 300 KB at 3.5 bytes per token: ceil(85714.28...) = 85715 tokens,
    # ceil(8571.5) = 8572 nanos in, 1000 output tokens = 400 nanos out.
    assert request_tokens(300_000, DEFAULT_BYTES_PER_TOKEN_MILLI, 0) == 85_715
    assert cap_nanos(JEV, 300_000, 1000, DEFAULT_BYTES_PER_TOKEN_MILLI, 0) == 8_972


@given(
    price_in=st.integers(0, 10**15),
    price_out=st.integers(0, 10**15),
    request_bytes=st.integers(0, 2**40),
    max_output_tokens=st.integers(0, 10**12),
    bytes_per_token_milli=st.integers(100, 64_000),
    overhead_tokens=st.integers(0, 10_000_000),
)
def test_cap_matches_the_contract_formula_exactly(
    price_in: int,
    price_out: int,
    request_bytes: int,
    max_output_tokens: int,
    bytes_per_token_milli: int,
    overhead_tokens: int,
) -> None:
    expected = reference_cap(
        price_in,
        price_out,
        request_bytes,
        max_output_tokens,
        Fraction(bytes_per_token_milli, 1000),
        overhead_tokens,
    )
    price = ModelPrice(price_in, price_out)
    assert (
        cap_nanos(price, request_bytes, max_output_tokens, bytes_per_token_milli, overhead_tokens)
        == expected
    )


@given(
    price_in=st.integers(0, 10**9),
    price_out=st.integers(0, 10**9),
    input_tokens=st.integers(0, 10**9),
    output_tokens=st.integers(0, 10**9),
)
def test_real_cost_never_under_books(
    price_in: int, price_out: int, input_tokens: int, output_tokens: int
) -> None:
    price = ModelPrice(price_in, price_out)
    exact = Fraction(input_tokens * price_in + output_tokens * price_out, 1_000_000)
    cost = price.real_cost(input_tokens, output_tokens)
    assert cost >= exact
    # Two separate ceilings add at most one nano each.
    assert cost < exact + 2


@pytest.mark.parametrize(
    ("wire", "milli"), [(3.5, 3500), (1.0, 1000), (0.1, 100), (4.125, 4125), (64.0, 64_000)]
)
def test_bytes_per_token_is_kept_in_exact_thousandths(wire: float, milli: int) -> None:
    assert policies.bytes_per_token_milli(wire) == milli


@pytest.mark.parametrize(
    "wire",
    [
        3.3333,
        3.4999999999,
        0.0999999999,
        64.0000000001,
        float("nan"),
        float("inf"),
        1e306,
        -1.7976931348623157e308,
    ],
)
def test_bytes_per_token_that_cannot_be_kept_exactly_is_refused(wire: float) -> None:
    """Within a hair of a thousandth is still not one: rounding 3.4999999999 up
    would price a request one token short of what the lane was told."""
    with pytest.raises(InvalidArgument) as caught:
        policies.bytes_per_token_milli(wire)
    assert caught.value.field == "lane.bytes_per_token"


@pytest.mark.parametrize("wire", [5e-324, 0.0005, 0.0999999999, -3.5, 64.0000000001, 1e306])
def test_bytes_per_token_out_of_range_is_told_its_range(wire: float) -> None:
    """A value outside 0.1-64 is told the range, not a decimal rule that no
    decimal could satisfy there."""
    with pytest.raises(InvalidArgument) as caught:
        policies.bytes_per_token_milli(wire)
    assert caught.value.detail == policies.BYTES_PER_TOKEN_RANGE
