"""Bad input is refused with InvalidArgument naming the field, before any I/O."""

from __future__ import annotations

import dataclasses

import pytest

from ledger_service.domain import moves
from ledger_service.domain.errors import InvalidArgument
from ledger_service.domain.events import Outcome
from ledger_service.domain.policies import LanePolicy
from ledger_service.domain.pricing import ModelPrice

RESERVE = moves.ReserveCommand("recall", "r1", "jev", 10_000, 500)
SETTLE = moves.SettleCommand("recall", "r1", Outcome.SUCCEEDED, 10, 10)
REFUND = moves.RefundCommand("recall", "r1", 403)
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
        # A 4xx is a refused call: Refund, which costs zero.
        ({"http_status": 403}, "http_status"),
        ({"http_status": 429, "outcome": Outcome.UNKNOWN}, "http_status"),
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
