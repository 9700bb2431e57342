"""Fixtures for the lane client's tests (helpers in client_ledger.py)."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
from client_ledger import (
    Admin,
    LedgerProcess,
    ledger_tls_arguments,
    make_certificates,
    new_lane_name,
    running,
)


@pytest.fixture(scope="session")
def ledger_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LedgerProcess]:
    server = LedgerProcess(tmp_path_factory.mktemp("ledger"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def lane_grant(ledger_server: LedgerProcess) -> str:
    """What a lane holds: charge on every lane, and nothing else (no read, no admin)."""
    return ledger_server.issue_grant("--lane", "*", "--scope", "charge")


@pytest.fixture(scope="session")
def admin(ledger_server: LedgerProcess) -> Iterator[Admin]:
    helper = Admin(ledger_server)
    try:
        yield helper
    finally:
        helper.close()


@pytest.fixture
def lane(admin: Admin) -> str:
    """A fresh lane with a limit of 1,000,000 nanos."""
    name = new_lane_name()
    admin.put_lane(name, 1_000_000)
    return name


@pytest.fixture
def certificates(tmp_path: pathlib.Path) -> dict[str, pathlib.Path]:
    return make_certificates(tmp_path / "certificates")


@pytest.fixture
def fresh_server(
    tmp_path: pathlib.Path, certificates: dict[str, pathlib.Path]
) -> Iterator[LedgerProcess]:
    """A server of its own, for tests that kill it; it serves mutual TLS, as a
    production ledger would."""
    with running(tmp_path / "ledger", ledger_tls_arguments(certificates)) as server:
        yield server
