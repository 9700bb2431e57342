"""clients/cases/errors.json lists exactly the `ledger-reason`s the server can
send, each with the status the server sends it with.

The reasons are derived from the server's own code, not from a list kept
here: every LedgerError subclass the server defines (its `reason`, with the
status api/errors.py ERROR_TABLE gives it; a class the table does not name
goes out as INTERNAL), and every literal reason the api layer puts in the
trailing metadata (UNDECODABLE_REQUEST, INTERNAL, UNAUTHENTICATED,
PERMISSION_DENIED), with the status of the abort that follows it. A new server
reason without a row in the case file, which both clients' tests run, fails here.
"""

from __future__ import annotations

import ast
import importlib
import json
import pathlib
import pkgutil
from typing import Any

import grpc

import ledger_service
from ledger_service.api import errors as api_errors
from ledger_service.domain import errors as domain_errors

ROOT = pathlib.Path(__file__).resolve().parent.parent
CASES = ROOT / "clients" / "cases" / "errors.json"
PACKAGE_DIR = pathlib.Path(ledger_service.__file__).parent
# The statuses a caller may retry on, the same ids again: the condition passes
# (DEADLINE_EXCEEDED is the client's own, never with a reason).
RETRY_STATUSES = {"UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}


def _cases() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(CASES.read_text(encoding="utf-8"))
    return loaded


def _import_every_module() -> None:
    """So that every LedgerError subclass the server defines is loaded."""
    for module in pkgutil.walk_packages([str(PACKAGE_DIR)], prefix="ledger_service."):
        if ".generated" in module.name or ".bench" in module.name:
            continue
        importlib.import_module(module.name)


def _subclasses(
    base: type[domain_errors.LedgerError],
) -> set[type[domain_errors.LedgerError]]:
    found: set[type[domain_errors.LedgerError]] = set()
    for sub in base.__subclasses__():
        found |= {sub, *_subclasses(sub)}
    return found


def _table_status(error_class: type[domain_errors.LedgerError]) -> grpc.StatusCode:
    """api/errors.py status_of, for a class: the first row it is a subclass of."""
    for row_class, code in api_errors.ERROR_TABLE:
        if issubclass(error_class, row_class):
            return code
    return grpc.StatusCode.INTERNAL


def _class_reasons() -> dict[str, tuple[str, bool]]:
    """reason -> (status name, sends ledger-field) for every domain error class."""
    _import_every_module()
    reasons: dict[str, tuple[str, bool]] = {}
    for error_class in _subclasses(domain_errors.LedgerError):
        if not error_class.__module__.startswith("ledger_service."):
            continue
        code = _table_status(error_class)
        if code is grpc.StatusCode.INTERNAL:
            continue  # not in the table: the caller gets INTERNAL, not this reason
        entry = (code.name, issubclass(error_class, domain_errors.InvalidArgument))
        assert reasons.setdefault(error_class.reason, entry) == entry, error_class
    return reasons


def _string_constants(tree: ast.Module) -> dict[str, str]:
    constants: dict[str, str] = {}
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            constants[node.targets[0].id] = node.value.value
    return constants


def _status_name(code: ast.expr) -> str | None:
    """X of a `grpc.StatusCode.X` expression."""
    if (
        isinstance(code, ast.Attribute)
        and isinstance(code.value, ast.Attribute)
        and code.value.attr == "StatusCode"
    ):
        return code.attr
    return None


def _refusals(tree: ast.Module) -> list[ast.Call]:
    """Every `refuse(context, code, message, reason, ...)` call (api/errors.py,
    the one way a call is refused with a reason)."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Name) and node.func.id == "refuse")
            or (isinstance(node.func, ast.Attribute) and node.func.attr == "refuse")
        )
    ]


def _literal_reasons() -> dict[str, str]:
    """reason -> status name for every literal reason the server's code sends.

    A literal is a string (or a module constant naming one) given to `refuse`
    as its reason, with the status given beside it. The only other value
    allowed there is a domain error's `.reason` (covered by _class_reasons).
    No code sets a `ledger-reason` trailer any other way."""
    reasons: dict[str, str] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if "generated" in path.parts:
            continue
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
        constants = _string_constants(tree)
        for call in _refusals(tree):
            if len(call.args) < 4:
                continue  # the definition's own recursion, if any
            value, status = call.args[3], _status_name(call.args[1])
            if isinstance(value, ast.Attribute) and value.attr == "reason":
                continue
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                reason = value.value
            elif isinstance(value, ast.Name) and value.id in constants:
                reason = constants[value.id]
            else:
                raise AssertionError(f"{path}:{call.lineno}: a ledger-reason this test cannot read")
            assert status is not None, f"{path}:{call.lineno}: {reason} without a StatusCode"
            assert reasons.setdefault(reason, status) == status, reason
        if path.name != "errors.py":
            assert "set_trailing_metadata" not in source, f"{path}: trailers outside refuse()"
    return reasons


def server_reasons() -> dict[str, tuple[str, bool]]:
    reasons = _class_reasons()
    for reason, status in _literal_reasons().items():
        entry = (status, False)
        assert reasons.setdefault(reason, entry) == entry, reason
    return reasons


def test_the_derivation_finds_the_api_literals_and_the_domain_reasons() -> None:
    reasons = server_reasons()
    for literal in ("UNAUTHENTICATED", "PERMISSION_DENIED", "INTERNAL", "UNDECODABLE_REQUEST"):
        assert literal in reasons
    assert reasons["LANE_NOT_FOUND"] == ("NOT_FOUND", False)
    assert reasons["UNKNOWN_MODEL"] == ("INVALID_ARGUMENT", True)
    assert domain_errors.LedgerError.reason not in reasons  # not in the table: sent as INTERNAL


def test_the_case_file_lists_exactly_the_reasons_the_server_sends() -> None:
    listed = {row["reason"]: row for row in _cases()["reasons"]}
    assert len(listed) == len(_cases()["reasons"]), "a reason is listed twice"
    sent = server_reasons()
    assert set(listed) - set(sent) == set(), "the case file lists reasons the server never sends"
    assert set(sent) - set(listed) == set(), (
        "the server sends reasons clients/cases/errors.json does not list: add a row "
        "(and the clients' mapping) for each"
    )
    for reason, (status, field) in sent.items():
        assert listed[reason]["status"] == status, reason
        assert listed[reason]["field"] is field, reason


def _per_client(value: bool | dict[str, bool]) -> list[bool]:
    return list(value.values()) if isinstance(value, dict) else [value]


def test_retry_is_safe_exactly_on_a_passing_condition() -> None:
    cases = _cases()
    for row in cases["reasons"]:
        assert row["retry"] is (row["status"] in RETRY_STATUSES), row
        # The ledger could not answer now: only its UNAVAILABLE reasons.
        assert row["outage"] is (row["status"] == "UNAVAILABLE"), row
    for row in cases["by_status"]:
        assert grpc.StatusCode[row["status"]]  # a real status name
        # Made by the transport without a reason (a shutdown's CANCELLED, a
        # reset stream's INTERNAL): the ledger went away, so a retry is safe.
        if row["status"] not in ("CANCELLED", "INTERNAL"):
            assert _per_client(row["retry"]) == [row["status"] in RETRY_STATUSES], row
    for row in [*cases["reasons"], *cases["by_status"]]:
        # A model call's Reserve is sent again on a retry whose time is not spent.
        resend = [
            retry and row["status"] != "DEADLINE_EXCEEDED" for retry in _per_client(row["retry"])
        ]
        assert _per_client(row["resend_reserve"]) == resend, row
        for retry, outage in zip(
            _per_client(row["retry"]), _per_client(row["outage"]), strict=True
        ):
            assert retry or not outage, f"an outage is always safe to retry: {row}"
