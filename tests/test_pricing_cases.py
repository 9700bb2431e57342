"""The server computes every cap and charge of clients/cases/pricing.json, the
cases both clients' local pricing is checked against: so the clients price as
the ledger does (ledger_service/domain/pricing.py is the original)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from ledger_service.domain.pricing import ModelPrice, cap_nanos, request_tokens

CASES: dict[str, Any] = json.loads(
    (pathlib.Path(__file__).resolve().parent.parent / "clients/cases/pricing.json").read_text(
        encoding="utf-8"
    )
)


def price_of(case: dict[str, Any]) -> ModelPrice:
    price = case["price"]

    def rate(name: str) -> int | None:
        value = price.get(name)
        return None if value is None else int(value)

    return ModelPrice(
        int(price["input"]), int(price["output"]), rate("cached_input"), rate("cache_write")
    )


def usage_of(case: dict[str, Any]) -> tuple[int, int, int, int]:
    usage = case["usage"]
    return (
        int(usage["input_tokens"]),
        int(usage["output_tokens"]),
        int(usage["cached_input_tokens"]),
        int(usage["cache_write_tokens"]),
    )


@pytest.mark.parametrize("case", CASES["caps"], ids=lambda case: case["name"])
def test_the_server_gives_each_cap(case: dict[str, Any]) -> None:
    request_bytes = int(case["request_bytes"])
    bytes_per_token_milli = int(case["bytes_per_token_milli"])
    overhead_tokens = int(case["overhead_tokens"])
    tokens = request_tokens(request_bytes, bytes_per_token_milli, overhead_tokens)
    assert tokens == int(case["request_tokens"])
    cap = cap_nanos(
        price_of(case),
        request_bytes,
        int(case["max_output_tokens"]),
        bytes_per_token_milli,
        overhead_tokens,
    )
    assert cap == int(case["cap_nanos"])


@pytest.mark.parametrize("case", CASES["charges"], ids=lambda case: case["name"])
def test_the_server_gives_each_charge(case: dict[str, Any]) -> None:
    assert price_of(case).real_cost(*usage_of(case)) == int(case["charge_nanos"])


@pytest.mark.parametrize("case", CASES["refused_charges"], ids=lambda case: case["name"])
def test_the_server_refuses_cache_parts_above_the_input(case: dict[str, Any]) -> None:
    with pytest.raises(AssertionError):
        price_of(case).real_cost(*usage_of(case))


def test_the_cases_cover_the_edges() -> None:
    caps, charges = CASES["caps"], CASES["charges"]
    milli = {case["bytes_per_token_milli"] for case in caps}
    # bytes_per_token at both ends of its range, and the largest request the
    # ledger takes priced past int64 (the server refuses it; nobody may wrap).
    assert {"100", "1000", "3500", "64000"} <= milli
    assert any(
        int(case["request_bytes"]) == 2**40
        and int(case["max_output_tokens"]) == 10**12
        and int(case["overhead_tokens"]) == 10**7
        and int(case["cap_nanos"]) >= 2**63
        for case in caps
    )
    assert any(int(case["overhead_tokens"]) > 0 for case in caps)
    # The dearest-rate cap: a cache rate above the input rate decides it.
    assert any(
        max(int(case["price"].get(k) or 0) for k in ("cached_input", "cache_write"))
        > int(case["price"]["input"])
        for case in caps
    )
    with_cache = [case for case in charges if "cached_input" in case["price"]]
    assert with_cache and any("cached_input" not in case["price"] for case in charges)
