"""Bad input is refused with InvalidArgument naming the field, before any I/O."""

from __future__ import annotations

import dataclasses

import pytest

from ledger_service.domain import moves
from ledger_service.domain.errors import InvalidArgument
from ledger_service.domain.events import Outcome
from ledger_service.domain.policies import LanePolicy
from ledger_service.domain.pricing import MAX_AMOUNT_NANOS, ModelPrice

RESERVE = moves.ReserveCommand("recall", "r1", "jev", 10_000, 500)
SETTLE = moves.SettleCommand("recall", "r1", Outcome.SUCCEEDED, 10, 10)
REFUND = moves.RefundCommand("recall", "r1", 403)
DAY_US = 86_400_000_000
LANE = LanePolicy(lane="recall", limit_nanos=500_000_000, prices={"jev": ModelPrice(1, 1)})


def field_refused(value: object) -> str:
    with pytest.raises(InvalidArgument) as caught:
        value.validate()  # type: ignore[attr-defined]
    return caught.value.field


def test_valid_commands_and_policy_pass() -> None:
    for value in (RESERVE, SETTLE, REFUND, LANE):
        value.validate()  # type: ignore[attr-defined]
    moves.RefundCommand("recall", "r1", 0, "never sent").validate()
    moves.SettleCommand("recall", "r1", Outcome.UNKNOWN, http_status=503).validate()
    for status in (100, 399, 500, 599):
        moves.SettleCommand("recall", "r1", Outcome.UNKNOWN, http_status=status).validate()
    for status in (400, 499):
        moves.RefundCommand("recall", "r1", status).validate()


@pytest.mark.parametrize(
    "changes",
    [
        {"limit_nanos": 1},
        {"limit_nanos": MAX_AMOUNT_NANOS},
        {"window_us": 1_000_000, "hold_ttl_us": 1_000_000},
        {"window_us": 366 * DAY_US},
        {"hold_ttl_us": 1_000},
        {"window_us": 7 * DAY_US, "hold_ttl_us": 7 * DAY_US},
        # A hold_ttl may be as long as the window, never longer.
        {"window_us": 60_000_000, "hold_ttl_us": 60_000_000},
        {"bytes_per_token_milli": 100},
        {"bytes_per_token_milli": 64_000},
        {"overhead_tokens": 10**7},
        {"max_charge_multiple": 0},
        {"max_charge_multiple": 10**6},
    ],
)
def test_a_lane_policy_at_the_edge_of_each_range_is_taken(changes: dict[str, object]) -> None:
    dataclasses.replace(LANE, **changes).validate()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"request_bytes": -1}, "request_bytes"),
        ({"max_output_tokens": -1}, "max_output_tokens"),
        ({"estimate_nanos": -1}, "estimate_nanos"),
        ({"ttl_us": 0}, "ttl"),
        ({"ttl_us": -5}, "ttl"),
        ({"reservation_id": ""}, "reservation_id"),
        ({"reservation_id": "has space"}, "reservation_id"),
        ({"reservation_id": "x" * 201}, "reservation_id"),
        ({"lane": ""}, "lane"),
        ({"model": ""}, "model"),
    ],
)
def test_reserve_names_the_bad_field(changes: dict[str, object], field: str) -> None:
    assert field_refused(dataclasses.replace(RESERVE, **changes)) == field  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"input_tokens": -1}, "input_tokens"),
        ({"output_tokens": -1}, "output_tokens"),
        ({"billed_nanos": -1}, "billed_nanos"),
        ({"http_status": -1}, "http_status"),
        ({"http_status": 99}, "http_status"),
        ({"http_status": 600}, "http_status"),
        # A 4xx is a refused call: Refund, which costs zero.
        ({"http_status": 403}, "http_status"),
        ({"http_status": 429, "outcome": Outcome.UNKNOWN}, "http_status"),
        # Any 4xx, both ends of the range included.
        ({"http_status": 400}, "http_status"),
        ({"http_status": 499, "outcome": Outcome.UNKNOWN}, "http_status"),
    ],
)
def test_settle_names_the_bad_field(changes: dict[str, object], field: str) -> None:
    assert field_refused(dataclasses.replace(SETTLE, **changes)) == field  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"http_status": -1}, "http_status"),
        ({"http_status": 500}, "http_status"),
        ({"http_status": 200}, "http_status"),
        ({"http_status": 0, "reason": ""}, "reason"),
        ({"http_status": 0, "reason": "   "}, "reason"),
        ({"reason": "line\nbreak"}, "reason"),
    ],
)
def test_refund_names_the_bad_field(changes: dict[str, object], field: str) -> None:
    assert field_refused(dataclasses.replace(REFUND, **changes)) == field  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"limit_nanos": 0}, "lane.limit_nanos"),
        ({"limit_nanos": -1}, "lane.limit_nanos"),
        ({"window_us": 0}, "lane.window"),
        ({"window_us": 999_999}, "lane.window"),
        ({"window_us": 366 * DAY_US + 1}, "lane.window"),
        ({"limit_nanos": MAX_AMOUNT_NANOS + 1}, "lane.limit_nanos"),
        ({"hold_ttl_us": 999}, "lane.hold_ttl"),
        ({"window_us": 60_000_000, "hold_ttl_us": 60_000_001}, "lane.hold_ttl"),
        ({"bytes_per_token_milli": 99}, "lane.bytes_per_token"),
        ({"bytes_per_token_milli": 64_001}, "lane.bytes_per_token"),
        ({"overhead_tokens": 10**7 + 1}, "lane.overhead_tokens"),
        ({"max_charge_multiple": 10**6 + 1}, "lane.max_charge_multiple"),
        ({"hold_ttl_us": 0}, "lane.hold_ttl"),
        ({"hold_ttl_us": 86_400_000_001}, "lane.hold_ttl"),
        ({"bytes_per_token_milli": 0}, "lane.bytes_per_token"),
        ({"overhead_tokens": -1}, "lane.overhead_tokens"),
        ({"prices": {}}, "lane.prices"),
        ({"prices": {"jev": ModelPrice(-1, 1)}}, "lane.prices[jev].input_nanos_per_million_tokens"),
        (
            {"prices": {"jev": ModelPrice(1, -1)}},
            "lane.prices[jev].output_nanos_per_million_tokens",
        ),
        ({"lane": ""}, "lane.lane"),
    ],
)
def test_lane_policy_names_the_bad_field(changes: dict[str, object], field: str) -> None:
    assert field_refused(dataclasses.replace(LANE, **changes)) == field  # type: ignore[arg-type]


def test_a_bad_model_name_is_named_among_the_lanes_models() -> None:
    """With up to 256 models a lane, "lane.prices: must start with a letter" left
    the operator to guess which one."""
    prices = {"jev": ModelPrice(1, 1), "-bad": ModelPrice(1, 1)}
    with pytest.raises(InvalidArgument) as caught:
        dataclasses.replace(LANE, prices=prices).validate()
    assert caught.value.field == "lane.prices"
    assert "'-bad'" in str(caught.value)
