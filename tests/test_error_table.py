"""Every LedgerError the server defines has a row in the one error table
(api/errors.py ERROR_TABLE): a status other than INTERNAL and a reason of its
own kind; the auth refusals are rows there too."""

from __future__ import annotations

import json
import pathlib
import re

import grpc
import pytest

from ledger_service.api import errors as api_errors
from ledger_service.domain import errors as domain_errors
from tests.test_error_cases import _import_every_module, _subclasses


def test_every_ledger_error_maps_to_a_status_and_a_reason() -> None:
    _import_every_module()
    classes = {
        error_class
        for error_class in _subclasses(domain_errors.LedgerError)
        if error_class.__module__.startswith("ledger_service.")
    }
    assert domain_errors.StoreDamaged in classes
    for error_class in classes:
        status = next(
            (code for row, code in api_errors.ERROR_TABLE if issubclass(error_class, row)),
            grpc.StatusCode.INTERNAL,
        )
        assert status is not grpc.StatusCode.INTERNAL, f"{error_class} is not in ERROR_TABLE"
        assert error_class.reason.isupper() and error_class.reason != "LEDGER_ERROR", error_class


def test_a_damaged_store_is_its_own_reason() -> None:
    error = domain_errors.StoreDamaged("the file is corrupt", "restore a backup")
    assert api_errors.status_of(error) is grpc.StatusCode.UNAVAILABLE
    assert error.reason == "STORE_DAMAGED" != domain_errors.StoreUnavailable.reason


def test_the_auth_refusals_are_in_the_table() -> None:
    assert api_errors.UNAUTHENTICATED_REASON == "UNAUTHENTICATED"
    assert api_errors.PERMISSION_DENIED_REASON == "PERMISSION_DENIED"


def test_the_readme_lists_every_reason_the_clients_know() -> None:
    root = pathlib.Path(__file__).resolve().parent.parent
    cases = json.loads((root / "clients" / "cases" / "errors.json").read_text())
    readme = (root / "README.md").read_text()
    table = readme[readme.index("| status | `ledger-reason` | when |") :].split("\n\n")[0]
    missing = [case["reason"] for case in cases["reasons"] if f"`{case['reason']}`" not in table]
    assert not missing, f"README's error table lacks {missing}"


class _Context:
    def __init__(self) -> None:
        self.trailers: tuple[tuple[str, str | bytes], ...] = ()
        self.message = ""

    def set_trailing_metadata(self, trailers: tuple[tuple[str, str | bytes], ...]) -> None:
        self.trailers = trailers

    def abort(self, _code: grpc.StatusCode, message: str) -> None:
        self.message = message
        raise Exception()  # as grpcio's abort does


@pytest.mark.parametrize("unit", ["x", "\u00e9", "\U0001f600"])
def test_a_long_message_is_cut_to_fit_the_trailers(unit: str) -> None:
    """Caller text echoed in full could pass gRPC's metadata limit, and the
    caller would get RESOURCE_EXHAUSTED with no reason instead."""
    context = _Context()
    with pytest.raises(Exception):  # noqa: B017 - grpcio's abort raises a bare Exception
        api_errors.refuse(
            context,  # type: ignore[arg-type]
            grpc.StatusCode.INVALID_ARGUMENT,
            "content: " + unit * 20_000,
            "INVALID_ARGUMENT",
            field="content",
        )
    assert context.message.startswith("content: " + unit)
    assert context.message.endswith("...")
    assert len(context.message.encode()) <= api_errors.MAX_MESSAGE_BYTES
    details = dict(context.trailers)[api_errors.DETAILS_KEY]
    assert isinstance(details, bytes) and len(details) < 2 * api_errors.MAX_MESSAGE_BYTES
    short = _Context()
    with pytest.raises(Exception):  # noqa: B017
        api_errors.refuse(short, grpc.StatusCode.NOT_FOUND, "lane x not found", "LANE_NOT_FOUND")  # type: ignore[arg-type]
    assert short.message == "lane x not found"


def test_the_readme_has_a_row_for_every_status_the_server_sends() -> None:
    """A team writing its own client reads README's error table: every status
    the ledger's code answers with, a reason or none, has a row there."""
    root = pathlib.Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    table = readme[readme.index("| status | `ledger-reason` | when |") :].split("\n\n")[0]
    sent = {code.name for _, code in api_errors.ERROR_TABLE}
    sent |= {"UNAUTHENTICATED", "PERMISSION_DENIED", "INTERNAL"}
    for path in (root / "ledger_service" / "api").glob("*.py"):
        sent |= set(re.findall(r"abort\(\s*grpc\.StatusCode\.([A-Z_]+)", path.read_text()))
    assert "UNIMPLEMENTED" in sent  # a TestClock method of a server without --test-clock
    missing = sorted(code for code in sent if f"\n| `{code}` |" not in table)
    assert not missing, f"README's error table has no row for {missing}"
