"""The CLI sends its grant in plaintext without --tls-ca: to a server that is
not this machine it says so, once, on stderr (docs/security.md). Which
addresses are this machine: clients/cases/plaintext.json, shared with both
clients."""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

import pytest

from ledger_service.cli.connection import connect, is_local_server

CASES = pathlib.Path(__file__).resolve().parents[1] / "clients" / "cases" / "plaintext.json"
ADDRESSES: list[dict[str, Any]] = json.loads(CASES.read_text())["addresses"]
GRANT = "lg1.key.payload.signature"


@pytest.mark.parametrize("case", ADDRESSES, ids=[case["address"] for case in ADDRESSES])
def test_which_servers_are_this_machine(case: dict[str, Any]) -> None:
    assert is_local_server(case["address"]) is case["local"]


def _stderr_of(
    server: str, grant: str, capsys: pytest.CaptureFixture[str], **tls: str | None
) -> str:
    arguments = argparse.Namespace(server=server, grant=grant, timeout=None, **tls)
    with connect(arguments):
        pass
    return capsys.readouterr().err


@pytest.fixture(autouse=True)
def _no_tls_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("LEDGER_TLS_CA", "LEDGER_TLS_CLIENT_CERT", "LEDGER_TLS_CLIENT_KEY"):
        monkeypatch.delenv(variable, raising=False)


def test_a_grant_to_another_machine_without_tls_is_one_line_on_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = _stderr_of("10.0.0.5:50051", GRANT, capsys)
    assert err.count("\n") == 1
    assert "10.0.0.5:50051" in err and "unencrypted" in err and "--tls-ca" in err
    assert GRANT not in err, "the warning never quotes the grant"


def test_no_warning_on_this_machine_or_with_tls(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    assert _stderr_of("127.0.0.1:50051", GRANT, capsys) == ""
    assert _stderr_of("unix:/run/ledger.sock", GRANT, capsys) == ""
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n")
    assert _stderr_of("10.0.0.5:50051", GRANT, capsys, tls_ca=str(ca)) == ""
