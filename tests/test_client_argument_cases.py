"""What both clients check before any call is the ledger's own rule. The lane
cases of clients/cases/arguments.json, and its reserve cases that set a model,
are the domain's rule for names: each case the clients refuse, validate_name
refuses with the same field and message, and each they accept, it accepts. The clients' page sizes
(clients/cases/settings.json) are the server's. A rule changed on one side
fails here."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from ledger_service.domain.errors import InvalidArgument
from ledger_service.domain.policies import validate_name
from ledger_service.settings import Settings

ROOT = pathlib.Path(__file__).resolve().parent.parent
CASES = ROOT / "clients" / "cases"


def _name_cases() -> list[tuple[str, dict[str, Any]]]:
    """(field, case) for each lane case and each reserve case that sets a model."""
    arguments = json.loads((CASES / "arguments.json").read_text(encoding="utf-8"))
    cases = [("lane", case) for case in arguments["lane"]]
    cases += [("model", case) for case in arguments["reserve"] if "model" in case["set"]]
    # A name that is no string never reaches the domain: the wire carries text.
    return [(field, case) for field, case in cases if isinstance(case["set"][field], str)]


@pytest.mark.parametrize(
    ("field", "case"),
    _name_cases(),
    ids=lambda value: value["why"] if isinstance(value, dict) else value,
)
def test_the_clients_name_cases_are_the_ledgers_rule(field: str, case: dict[str, Any]) -> None:
    name = case["set"][field]
    if case.get("accepted"):
        validate_name(field, name)
        return
    with pytest.raises(InvalidArgument) as caught:
        validate_name(field, name)
    assert (caught.value.field, str(caught.value)) == (case["field"], case["message"])


def test_the_clients_page_sizes_are_the_servers() -> None:
    constants = json.loads((CASES / "settings.json").read_text(encoding="utf-8"))["constants"]
    values = {constant["node"]: constant["value"] for constant in constants}
    settings = Settings(database_url="sqlite://")
    assert values["DEFAULT_PAGE_SIZE"] == settings.default_page_size
    assert values["MAX_PAGE_SIZE"] == settings.max_page_size
