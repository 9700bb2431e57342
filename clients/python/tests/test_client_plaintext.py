"""A grant sent to another machine without TLS travels unencrypted: the client
warns once, naming the address (docs/security.md; the cases are
clients/cases/plaintext.json, shared with the Node client and the CLI)."""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Any

import pytest
from ledger_client import LaneClient, TlsSettings
from ledger_client.channels import is_local_address

CASES = pathlib.Path(__file__).resolve().parents[2] / "cases" / "plaintext.json"
ADDRESSES: list[dict[str, Any]] = json.loads(CASES.read_text())["addresses"]
GRANT = "lg1.key.payload.signature"


@pytest.mark.parametrize("case", ADDRESSES, ids=[case["address"] for case in ADDRESSES])
def test_which_addresses_are_this_machine(case: dict[str, Any]) -> None:
    assert is_local_address(case["address"]) is case["local"]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.levelno == logging.WARNING and "unencrypted" in record.getMessage()
    ]


def test_a_grant_to_another_machine_without_tls_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="ledger_client")
    client = LaneClient("10.0.0.5:50051", "recall", grant=GRANT)
    client.close(grace_seconds=0)
    [warning] = _warnings(caplog)
    assert "10.0.0.5:50051" in warning
    assert GRANT not in warning, "the warning never quotes the grant"


@pytest.mark.parametrize(
    ("address", "grant", "tls"),
    [
        ("127.0.0.1:50051", GRANT, None),
        ("unix:/run/ledger.sock", GRANT, None),
        ("10.0.0.5:50051", None, None),  # no grant: nothing secret goes out
        ("10.0.0.5:50051", GRANT, TlsSettings()),
    ],
)
def test_no_warning_on_this_machine_without_a_grant_or_with_tls(
    address: str, grant: str | None, tls: TlsSettings | None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ledger_client")
    LaneClient(address, "recall", grant=grant, tls=tls).close(grace_seconds=0)
    assert _warnings(caplog) == []


@pytest.mark.parametrize("address", [None, "", "   ", 50051])
def test_a_missing_address_is_refused_naming_it(address: object) -> None:
    # An unset environment variable (os.environ.get("LEDGER_ADDRESS")) failed with
    # "'NoneType' object has no attribute 'startswith'".
    with pytest.raises((TypeError, ValueError), match=r"^address: .*HOST:PORT"):
        LaneClient(address, "recall", grant=GRANT)  # type: ignore[arg-type]
