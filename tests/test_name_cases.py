"""The lane cases of clients/cases/arguments.json, which both clients check
before any call, are the ledger's own rule for names: each case the clients
refuse, the domain's validate_name refuses with the same field and message,
and each they accept, it accepts. A name rule changed on one side fails here."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from ledger_service.domain.errors import InvalidArgument
from ledger_service.domain.policies import validate_name

ROOT = pathlib.Path(__file__).resolve().parent.parent
CASES = ROOT / "clients" / "cases" / "arguments.json"


def _lane_cases() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = json.loads(CASES.read_text(encoding="utf-8"))["lane"]
    # A name that is no string never reaches the domain: the wire carries text.
    return [case for case in cases if isinstance(case["set"]["lane"], str)]


@pytest.mark.parametrize("case", _lane_cases(), ids=lambda case: case["why"])
def test_the_clients_lane_cases_are_the_ledgers_rule(case: dict[str, Any]) -> None:
    name = case["set"]["lane"]
    if case.get("accepted"):
        validate_name("lane", name)
        return
    with pytest.raises(InvalidArgument) as caught:
        validate_name("lane", name)
    assert (caught.value.field, str(caught.value)) == (case["field"], case["message"])
