"""Local pricing with prompt-cache rates, the byte cap at the dearest input rate,
and provider usage blocks read into Usage."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
from ledger_client import ModelPrice, OutagePolicy, Settlement, Usage, convert, usage_of
from ledger_client.bookings import ReserveArguments
from ledger_client.journal import JournalEntry, Source, now_text
from ledger_client.outcomes import Ending
from ledger_client.pricing import cap_nanos

# Per million tokens: input 3,000,000, output 15,000,000, cache read 300,000,
# cache write 3,750,000 nanos (a provider's $3 / $15 / $0.30 / $3.75 per million).
CACHED_PRICE = ModelPrice(3_000_000, 15_000_000, 300_000, 3_750_000)
# 10,000 input tokens, of which 6,000 read from the cache and 2,000 written to it.
CACHED_USAGE = Usage(10_000, 500, cached_input_tokens=6_000, cache_write_tokens=2_000)
# 2,000 uncached * 3 + 6,000 * 0.3 + 2,000 * 3.75 + 500 output * 15, by hand.
CACHED_USAGE_NANOS = 6_000 + 1_800 + 7_500 + 7_500
assert CACHED_USAGE_NANOS == 22_800
# 35,000 request bytes at 3.5 bytes per token: 10,000 request tokens.
REQUEST_BYTES = 35_000
MAX_OUTPUT_TOKENS = 500
# Every request token at the dearest input rate (the cache write, 3.75), plus the output.
CACHED_CAP_NANOS = 10_000 * 3_750_000 // 1_000_000 + 500 * 15_000_000 // 1_000_000
assert CACHED_CAP_NANOS == 45_000


def real_cost(price: ModelPrice, usage: Usage) -> int:
    return price.real_cost(
        usage.input_tokens, usage.output_tokens, usage.cached_input_tokens, usage.cache_write_tokens
    )


# Pricing -------------------------------------------------------------------------


def test_each_kind_of_token_is_priced_at_its_own_rate() -> None:
    assert real_cost(CACHED_PRICE, CACHED_USAGE) == CACHED_USAGE_NANOS


def test_a_missing_cache_rate_is_the_input_rate() -> None:
    plain = ModelPrice(3_000_000, 15_000_000)
    assert real_cost(plain, CACHED_USAGE) == 10_000 * 3 + 500 * 15
    only_reads = ModelPrice(3_000_000, 15_000_000, cached_input_nanos_per_million_tokens=300_000)
    assert real_cost(only_reads, CACHED_USAGE) == 4_000 * 3 + 1_800 + 7_500


def test_each_part_rounds_up_on_its_own() -> None:
    # 1 token at each rate of 1 nano per million: four parts of 1e-6 nanos, each rounded up.
    price = ModelPrice(1, 1, 1, 1)
    assert price.real_cost(3, 1, cached_input_tokens=1, cache_write_tokens=1) == 4


def test_cached_tokens_are_parts_of_the_input() -> None:
    with pytest.raises(ValueError, match="parts of input_tokens"):
        CACHED_PRICE.real_cost(100, 0, cached_input_tokens=80, cache_write_tokens=30)


def test_the_cap_prices_every_request_token_at_the_dearest_input_rate() -> None:
    cap = cap_nanos(CACHED_PRICE, REQUEST_BYTES, MAX_OUTPUT_TOKENS, 3_500, 0)
    assert cap == CACHED_CAP_NANOS
    # A cache read dearer than the input (no provider does this, but the cap holds).
    odd = ModelPrice(1_000_000, 0, cached_input_nanos_per_million_tokens=5_000_000)
    assert cap_nanos(odd, REQUEST_BYTES, 0, 3_500, 0) == 50_000
    # Without cache rates the cap is the input rate, as before.
    assert cap_nanos(ModelPrice(1_000_000, 2_000_000), 3_500, 500, 3_500, 0) == 2_000


def test_the_cap_bounds_any_split_of_the_request_tokens() -> None:
    for cached in range(0, 10_001, 2_500):
        for written in range(0, 10_001 - cached, 2_500):
            usage = Usage(10_000, MAX_OUTPUT_TOKENS, None, cached, written)
            assert real_cost(CACHED_PRICE, usage) <= CACHED_CAP_NANOS


@pytest.mark.parametrize("rate", [-1, 10**15 + 1])
def test_cache_rates_are_bounded_like_the_others(rate: int) -> None:
    with pytest.raises(ValueError):
        ModelPrice(1, 1, cached_input_nanos_per_million_tokens=rate)
    with pytest.raises(ValueError):
        ModelPrice(1, 1, cache_write_nanos_per_million_tokens=rate)


def test_the_allowance_holds_the_dearest_cap_and_charges_the_cached_formula(
    tmp_path: pathlib.Path,
) -> None:
    policy = OutagePolicy.allowance(
        max_nanos=10**9,
        max_calls=10,
        journal_path=tmp_path / "journal.jsonl",
        prices={"model-a": CACHED_PRICE},
    )
    arguments = ReserveArguments("r-1", "model-a", REQUEST_BYTES, MAX_OUTPUT_TOKENS, None, None)
    hold = policy.local_hold_nanos(arguments)
    assert hold == CACHED_CAP_NANOS
    entry = JournalEntry("lane", arguments, Source.ALLOWANCE, hold, now_text())
    ending = Ending(Settlement.SETTLE_SUCCEEDED, 200, CACHED_USAGE)
    assert policy.local_charge_nanos(entry, ending) == CACHED_USAGE_NANOS


# Usage ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"input_tokens": 10, "cached_input_tokens": -1},
        {"input_tokens": 10, "cache_write_tokens": 10**13},
        {"input_tokens": 10, "cached_input_tokens": 6, "cache_write_tokens": 5},
        {"cached_input_tokens": 1},
    ],
)
def test_cache_counts_are_bounded_parts_of_the_input(fields: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        Usage(**fields)


def test_the_settle_request_carries_the_cache_counts() -> None:
    ending = Ending(Settlement.SETTLE_SUCCEEDED, 200, CACHED_USAGE)
    request = convert.settle_request("lane", "r-1", ending)
    assert (request.input_tokens, request.output_tokens) == (10_000, 500)
    assert (request.cached_input_tokens, request.cache_write_tokens) == (6_000, 2_000)


# Provider usage blocks -----------------------------------------------------------

OPENAI_CHAT = {
    "choices": [{"message": {"content": "..."}}],
    "usage": {
        "prompt_tokens": 10_000,  # every input token, the 6,000 cached ones included
        "completion_tokens": 500,  # every output token, the 120 reasoning ones included
        "total_tokens": 10_500,
        "prompt_tokens_details": {"cached_tokens": 6_000, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 120},
    },
}
OPENAI_RESPONSES = {
    "usage": {
        "input_tokens": 10_000,
        "input_tokens_details": {"cached_tokens": 6_000},
        "output_tokens": 500,
        "output_tokens_details": {"reasoning_tokens": 120},
    }
}
ANTHROPIC = {
    "content": [{"type": "text", "text": "..."}],
    "usage": {
        "input_tokens": 2_000,  # only the tokens after the last cache breakpoint
        "cache_read_input_tokens": 6_000,
        "cache_creation_input_tokens": 2_000,
        "cache_creation": {"ephemeral_5m_input_tokens": 2_000, "ephemeral_1h_input_tokens": 0},
        "output_tokens": 500,
    },
}


def test_openai_prompt_tokens_already_count_the_cache_and_reasoning() -> None:
    assert usage_of(OPENAI_CHAT) == Usage(10_000, 500, cached_input_tokens=6_000)
    assert usage_of(OPENAI_RESPONSES) == Usage(10_000, 500, cached_input_tokens=6_000)


def test_openai_cache_writes_are_read_as_parts_of_the_input() -> None:
    # The openai SDK the extra installs types `cache_write_tokens` beside
    # `cached_tokens` in both APIs; read as 0, the written tokens were priced
    # at the input rate, under-booking a lane whose cache-write rate is dearer.
    chat = {"prompt_tokens": 1_200, "completion_tokens": 30}
    chat["prompt_tokens_details"] = {"cached_tokens": 100, "cache_write_tokens": 1_000}
    usage = Usage(1_200, 30, cached_input_tokens=100, cache_write_tokens=1_000)
    assert usage_of({"usage": chat}) == usage
    responses = {"input_tokens": 1_200, "output_tokens": 30}
    responses["input_tokens_details"] = {"cached_tokens": 100, "cache_write_tokens": 1_000}
    assert usage_of({"usage": responses}) == usage
    price = ModelPrice(150_000_000, 600_000_000, 15_000_000, 187_500_000)
    assert real_cost(price, usage) == 100 * 150 + 100 * 15 + 1_000 * 375 // 2 + 30 * 600


def test_anthropic_input_tokens_exclude_the_cache_so_it_is_added() -> None:
    assert usage_of(ANTHROPIC) == CACHED_USAGE
    assert real_cost(CACHED_PRICE, CACHED_USAGE) == CACHED_USAGE_NANOS


def test_missing_or_null_cache_counts_are_zero() -> None:
    anthropic = {"usage": {"input_tokens": 40, "output_tokens": 7}}
    assert usage_of(anthropic) == Usage(40, 7)
    nulls = {"input_tokens": 40, "output_tokens": 7, "cache_read_input_tokens": None}
    assert usage_of({"usage": nulls}) == Usage(40, 7)
    openai = {"usage": {"prompt_tokens": 900, "completion_tokens": 100}}
    assert usage_of(openai) == Usage(900, 100)
    no_details = {"prompt_tokens": 900, "completion_tokens": 1, "prompt_tokens_details": None}
    assert usage_of({"usage": no_details}) == Usage(900, 1)


def test_the_usage_object_itself_is_read_too() -> None:
    usage = OPENAI_CHAT["usage"]
    assert isinstance(usage, dict)
    assert usage_of(usage) == usage_of(OPENAI_CHAT)


@pytest.mark.parametrize(
    "body",
    [
        None,
        {"error": {"message": "rate limited"}},
        {"usage": None},
        {"usage": {"total_tokens": 5}},
        {"usage": {"prompt_tokens": 0, "completion_tokens": 0}},
        {"usage": {"input_tokens": 0, "output_tokens": 3}},
    ],
)
def test_no_input_tokens_is_no_usage(body: dict[str, Any] | None) -> None:
    # The ledger refuses a SUCCEEDED settle without input tokens or a bill;
    # without usage the call is settled UNKNOWN at its hold instead.
    assert usage_of(body) is None


@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": "900", "completion_tokens": 1},
        {"prompt_tokens": 900.5, "completion_tokens": 1},
        {"prompt_tokens": 2.0**60, "completion_tokens": 1},
        {"prompt_tokens": True, "completion_tokens": 1},
        {"input_tokens": -1, "output_tokens": 1},
        {
            "prompt_tokens": 10,
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": 11},
        },
        {
            "prompt_tokens": 10,
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": 6, "cache_write_tokens": 5},
        },
        {"prompt_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": []},
    ],
)
def test_malformed_counts_are_refused(usage: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        usage_of({"usage": usage})


def test_an_integral_json_number_is_a_count() -> None:
    """900.0 and 1e2 are the counts JavaScript reads them as (the Node client's usageOf)."""
    usage = {"prompt_tokens": 900.0, "completion_tokens": 1e2, "prompt_tokens_details": None}
    assert usage_of({"usage": usage}) == Usage(900, 100)
    assert usage_of({"usage": {"input_tokens": 40.0, "output_tokens": -0.0}}) == Usage(40, 0)
