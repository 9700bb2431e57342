"""The README's lane example runs against a real ledger, so it cannot rot."""

from __future__ import annotations

import builtins
import datetime
import inspect
import json
import pathlib
import re
import symtable
import tomllib
from typing import Any

import grpc
import pytest
from client_ledger import Admin, LedgerProcess
from ledger_client import (
    CLOSE_JOURNAL_WAIT_SECONDS,
    DEFAULT_CLOSE_GRACE_SECONDS,
    ClientSettings,
    DenialReason,
    LaneClient,
    errors,
)
from ledger_client.context import CONTEXT_OVERFLOW_REPLY
from ledger_client.settings import DEFAULT_END_ATTEMPTS, END_RETRY_PAUSE_SECONDS

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
EXAMPLE_ADDRESS = "ledger.internal:50051"


def lane_example() -> str:
    text = README.read_text()
    section = text.split("## One lane's whole call", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None
    return match.group(1)


class FakeResponse:
    def __init__(self, status_code: int, body: dict[str, Any]) -> None:
        self.status_code = status_code
        self._body = body

    def json(self) -> dict[str, Any]:
        return self._body

    def raise_for_status(self) -> None:
        if self.status_code >= 400:
            raise RuntimeError(f"HTTP {self.status_code}")


class FakeHttp:
    def __init__(self, *responses: FakeResponse) -> None:
        self._responses = list(responses)

    def post(self, url: str, *, content: bytes, timeout: float) -> FakeResponse:
        assert timeout <= 2.0
        return self._responses.pop(0)


ANSWER = {
    "choices": [{"message": {"content": "the memories that matter"}}],
    "usage": {"prompt_tokens": 900, "completion_tokens": 100},
}


def test_the_readme_example_runs(
    ledger_server: LedgerProcess, admin: Admin, lane_grant: str
) -> None:
    code = lane_example()
    assert len(code.strip().splitlines()) < 20
    assert EXAMPLE_ADDRESS in code
    admin.put_lane("recall", 3_000)  # room for one call of 1,024 bytes and 512 tokens
    fallbacks: list[tuple[DenialReason, datetime.datetime | None]] = []
    namespace: dict[str, Any] = {
        "GRANT": lane_grant,
        "PROVIDER_URL": "https://provider.invalid/v1/chat/completions",
        "http": FakeHttp(FakeResponse(200, ANSWER), FakeResponse(429, {"error": {}})),
        "fallback": lambda reason, retry_after: fallbacks.append((reason, retry_after)) or "",
    }
    exec(compile(code.replace(EXAMPLE_ADDRESS, ledger_server.address), "README", "exec"), namespace)
    try:
        recall = namespace["recall"]
        assert recall(b"x" * 1024) == "the memories that matter"
        with pytest.raises(RuntimeError, match="429"):
            recall(b"x" * 1024)
        assert recall(b"x" * 1024 * 1024) == ""  # a hold larger than the limit
    finally:
        namespace["ledger"].close()
    assert fallbacks == [(DenialReason.HOLD_EXCEEDS_LIMIT, None)]
    kinds = sorted(tuple(kinds) for kinds in admin.booking_events("recall").values())
    assert kinds == [("denied",), ("reserved", "refunded"), ("reserved", "settled")]


# What a lane supplies itself: its grant, keys, certificates and functions.
PLACEHOLDERS = {"GRANT", "PROVIDER_URL", "http", "fallback", "send", "OPENAI_KEY"}
PLACEHOLDERS |= {"ANTHROPIC_KEY", "ca_pem", "cert_pem", "key_pem"}


def free_names(table: symtable.SymbolTable, defined: set[str]) -> set[str]:
    """Names a block reads that neither it nor Python defines."""
    names = {s.get_name() for s in table.get_symbols() if s.is_global() or s.is_free()}
    names |= {s.get_name() for s in table.get_symbols() if s.is_referenced()}
    names -= defined | set(dir(builtins))
    for child in table.get_children():
        names |= free_names(child, defined | {s.get_name() for s in child.get_symbols()})
    return names


def test_every_readme_python_block_imports_what_it_uses() -> None:
    # A block copied alone into a lane's module must not fail with a NameError
    # on one of the client's own names (the outage and TLS blocks used
    # LaneClient without importing it, the SDK block an undefined `ledger`).
    for code in re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL):
        table = symtable.symtable(code, "README", "exec")
        top = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}
        assert free_names(table, top) <= PLACEHOLDERS, code.splitlines()[0]


# The rest of the README, held to the code ------------------------------------------------

CASES = pathlib.Path(__file__).resolve().parents[2] / "cases" / "errors.json"
PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"


def section(title: str) -> str:
    return README.read_text().split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of each row of the table under `header` (its first line)."""
    table = text[text.index(header) :].split("\n\n", 1)[0].splitlines()
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in table[2:]]


def test_the_readme_names_every_dependency_pyproject_declares() -> None:
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    names = [re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0] for requirement in dependencies]
    assert "googleapis-common-protos" in names
    intro = README.read_text().split("\n\n    pip install", 1)[0]
    missing = [name for name in names if f"`{name}`" not in intro]
    assert not missing, f"the README's opening does not name {missing}"
    assert "only" not in intro.split("depends on", 1)[1].split(".", 1)[0]


def test_the_readme_error_table_is_errors_json() -> None:
    cases = json.loads(CASES.read_text())
    text = section("Errors: one table")
    yes_no = {True: "yes", False: "no"}
    by_reason = {row[0].strip("`"): row for row in table_rows(text, "| `ledger-reason` | status |")}
    assert set(by_reason) == {case["reason"] for case in cases["reasons"]}
    for case in cases["reasons"]:
        _, status, exception, retry, outage = by_reason[case["reason"]]
        assert status == case["status"], case["reason"]
        assert exception.split()[0] == f"`{case['python']}`", case["reason"]
        assert (retry, outage) == (yes_no[case["retry"]], yes_no[case["outage"]]), case["reason"]
        assert errors.REASONS[case["reason"]].__name__ == case["python"]
    by_status = {row[0]: row for row in table_rows(text, "| status, no known reason |")}
    for case in cases["by_status"]:
        key = "UNKNOWN, and any other" if case["status"] == "UNKNOWN" else case["status"]
        _, exception, retry, outage = by_status[key]
        assert exception.split()[0] == f"`{case['python']}`", case["status"]
        assert (retry, outage) == (yes_no[case["retry"]], yes_no[case["outage"]]), case["status"]


def test_the_readme_names_every_transport_mistake() -> None:
    cases = json.loads(CASES.read_text())
    text = section("Errors: one table")
    yes_no = {True: "yes", False: "no"}
    rows = {row[0].strip("`"): row for row in table_rows(text, "| transport failure | status |")}
    assert set(rows) == {case["case"] for case in cases["transport"]}
    for case in cases["transport"]:
        _, status, exception, retry, outage = rows[case["case"]]
        assert status == case["status"], case["case"]
        assert exception.startswith(f"`{case['python']}`"), case["case"]
        assert (retry, outage) == (yes_no[case["retry"]], yes_no[case["outage"]]), case["case"]


def test_the_readme_says_when_a_replayed_journal_is_moved_aside() -> None:
    text = " ".join(section("When the ledger cannot be reached").split())
    assert ClientSettings().rotate_journal_bytes == 1024 * 1024
    assert (
        "moved aside (renamed, never deleted) once it is fully replayed AND has reached "
        "`rotate_journal_bytes` (1 MiB by default)" in text
    )
    assert "Once fully replayed it is moved aside" not in text


def test_the_readme_describes_resent_endings_and_denied_by() -> None:
    text = " ".join(section("One lane's whole call").split())
    assert DEFAULT_END_ATTEMPTS == ClientSettings().end_attempts == 3
    assert END_RETRY_PAUSE_SECONDS == 0.020
    assert "3 attempts in all (`ClientSettings.end_attempts`), 20 ms after the first" in text
    assert "`denied_by`" in text and '`denied_by` is `""` when admitted' in text


def context_example() -> str:
    match = re.search(
        r"```python\n(.*?)```", section("Context budgeting, before the Reserve"), re.DOTALL
    )
    assert match is not None
    return match.group(1)


def test_the_readme_context_example_measures_message_dicts() -> None:
    sent: list[tuple[object, ...]] = []

    def send(*arguments: object) -> FakeContextResponse:
        sent.append(arguments)
        return FakeContextResponse()

    namespace: dict[str, Any] = {"send": send}
    exec(compile(context_example(), "README", "exec"), namespace)
    answer = namespace["answer"]
    schemas = [{"name": "search", "parameters": {"type": "object"}}]
    small = [{"role": "user", "content": "what is stuck?"}]
    assert answer(small, ["[]"], schemas) == "the memories that matter"
    assert sent == [(small, ("[]",), schemas)]
    # A 100,000-character message is about 28,572 tokens, not the 4 its two keys would be.
    huge = [{"role": "user", "content": "x" * 100_000}]
    assert answer(huge, ["[]"], schemas) == CONTEXT_OVERFLOW_REPLY
    assert len(sent) == 1, "a request that cannot fit is not sent"


class FakeContextResponse:
    status_code = 200
    content = b"{}"

    def json(self) -> dict[str, Any]:
        return ANSWER


def test_the_readme_allowance_copies_every_setting_the_cap_is_priced_by() -> None:
    # The ledger's byte cap is priced by the lane's prices AND its bytes_per_token and
    # overhead_tokens: an allowance left at their defaults under-prices a lane whose
    # own differ (1.0 bytes a token, or overhead for tool schemas), so the example
    # must copy them too.
    text = section("When the ledger cannot be reached")
    example = re.search(r"```python\n(.*?)```", text, re.DOTALL)
    assert example is not None
    assert "bytes_per_token_milli=" in example.group(1)
    assert "overhead_tokens=" in example.group(1)


SDK_EXAMPLE_PREAMBLE = """import datetime

from ledger_client import DenialReason

GRANT = OPENAI_KEY = ANTHROPIC_KEY = "key"


def fallback(reason: DenialReason, retry_after: datetime.datetime | None) -> str:
    return ""
"""


@pytest.mark.slow  # mypy reads the openai and anthropic SDKs: a minute or two without a cache
def test_the_readme_sdk_example_type_checks_strictly(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lane copies it into code its own `mypy --strict` checks: its types must
    be the SDK's, and every name it uses exported and typed."""
    from mypy import api

    match = re.search(r"```python\n(.*?)```", section("The openai and anthropic SDKs"), re.DOTALL)
    assert match is not None
    example = tmp_path / "lane.py"
    example.write_text(SDK_EXAMPLE_PREAMBLE + match.group(1))
    monkeypatch.setenv("MYPYPATH", str(README.parent))
    cache = README.parents[2] / ".mypy_cache"
    out, err, status = api.run(
        ["--strict", "--follow-imports=silent", "--cache-dir", str(cache), str(example)]
    )
    assert status == 0, out + err


def test_the_readme_says_what_an_error_carries() -> None:
    """`.code` is a grpc.StatusCode, which the README did not say."""
    text = " ".join(section("Errors: one table").split())
    assert "`.code`: the call's gRPC status, a `grpc.StatusCode`" in text
    error = errors.invalid_argument("lane", "is required")
    assert isinstance(error.code, grpc.StatusCode)
    for name in ("code", "reason", "message", "field"):
        assert f"`.{name}`" in text and hasattr(error, name), name
    assert "`.error_id`" in text and hasattr(errors.LedgerInternal, "error_id")
    for function in ("is_retryable", "may_have_applied"):
        assert f"`{function}(error)`" in text and callable(getattr(errors, function))
    assert not issubclass(errors.ClientClosed, errors.LedgerError)


def test_the_readme_says_how_close_behaves() -> None:
    text = " ".join(section("Closing the client").split())
    grace = inspect.signature(LaneClient.close).parameters["grace_seconds"].default
    assert grace == DEFAULT_CLOSE_GRACE_SECONDS == 5.0
    assert "`close(grace_seconds=5.0)`" in text and "`ClientClosed`" in text
    assert CLOSE_JOURNAL_WAIT_SECONDS == 1.0
    assert "at most 1 s after the cut-off (`CLOSE_JOURNAL_WAIT_SECONDS`)" in text
