"""The README's lane example runs against a real ledger, so it cannot rot."""

from __future__ import annotations

import datetime
import pathlib
import re
from typing import Any

import pytest
from client_ledger import Admin, LedgerProcess
from ledger_client import DenialReason

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
