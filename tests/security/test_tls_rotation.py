"""TLS files replaced under a running server, and a certificate near its end.

Real servers and handshakes: a client that trusts only a new CA is refused
until the new files are on disk, then served, with no restart between.
"""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Callable

import grpc
import pytest

from ledger_service import tls_files
from ledger_service.domain.clock import MICROS_PER_SECOND, ManualClock
from ledger_service.server import LedgerServer
from tests.security.certificates import Issued, Pki, ending_in, issue, make_ca
from tests.security.conftest import balance

DAY_US = 86_400 * MICROS_PER_SECOND


def _channel(server: LedgerServer, ca: Issued) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(root_certificates=ca.certificate_pem)
    return grpc.secure_channel(f"localhost:{server.port}", credentials)


def _replace(path: pathlib.Path, content: bytes) -> None:
    """As an operator should: a whole new file renamed into place."""
    temporary = path.with_name(path.name + ".new")
    temporary.write_bytes(content)
    temporary.chmod(0o600)
    os.replace(temporary, path)


def test_new_certificate_files_serve_new_connections_without_a_restart(
    start_tls_server: Callable[..., LedgerServer], pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    files = pki.server_files()
    server = start_tls_server(**files)
    new_ca = make_ca("next CA")
    new = issue(new_ca, "localhost", server=True)
    assert balance(_channel(server, new_ca), server) is grpc.StatusCode.UNAVAILABLE
    assert balance(_channel(server, pki.ca), server) is grpc.StatusCode.OK

    with caplog.at_level(logging.INFO):
        _replace(files["tls_key_path"], new.key_pem)
        _replace(files["tls_cert_path"], new.certificate_pem)
        assert balance(_channel(server, new_ca), server) is grpc.StatusCode.OK
    assert balance(_channel(server, pki.ca), server) is grpc.StatusCode.UNAVAILABLE
    taken = [r.getMessage() for r in caplog.records if "new TLS certificate" in r.getMessage()]
    expires = f"{new.certificate.not_valid_after_utc:%Y-%m-%dT%H:%M:%SZ}"
    assert any("CN=localhost" in m and expires in m for m in taken), taken


@pytest.mark.parametrize("fault", ["key of another certificate", "expired", "not PEM"])
def test_a_bad_replacement_keeps_the_old_certificate_serving(
    start_tls_server: Callable[..., LedgerServer],
    pki: Pki,
    caplog: pytest.LogCaptureFixture,
    fault: str,
) -> None:
    files = pki.server_files()
    server = start_tls_server(**files)
    new_ca = make_ca("next CA")
    new = issue(new_ca, "localhost", server=True)
    if fault == "key of another certificate":
        bad_path, bad, wrong = files["tls_key_path"], pki.client.key_pem, "is not the key of"
    elif fault == "expired":
        bad_path, wrong = files["tls_cert_path"], "expired at"
        bad = ending_in(pki.ca, -1).certificate_pem
    else:
        bad_path, bad, wrong = files["tls_key_path"], b"not a key\n", "holds no PEM private key"

    with caplog.at_level(logging.INFO):
        _replace(bad_path, bad)
        for _ in range(2):
            assert balance(_channel(server, pki.ca), server) is grpc.StatusCode.OK
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, "once per change, not per handshake"
    assert str(bad_path) in errors[0].getMessage() and wrong in errors[0].getMessage()
    assert "PRIVATE KEY" not in caplog.text

    # Mended: the next handshake takes the good pair.
    _replace(files["tls_key_path"], new.key_pem)
    _replace(files["tls_cert_path"], new.certificate_pem)
    assert balance(_channel(server, new_ca), server) is grpc.StatusCode.OK


def test_a_certificate_ending_within_14_days_is_warned_about_at_start(
    start_tls_server: Callable[..., LedgerServer], pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    ending = ending_in(pki.ca, 10)
    cert = pki.write("ending.pem", ending.certificate_pem)
    key = pki.write("ending.key", ending.key_pem)
    with caplog.at_level(logging.WARNING):
        start_tls_server(tls_cert_path=cert, tls_key_path=key)
    date = f"{ending.certificate.not_valid_after_utc:%Y-%m-%d}"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(cert) in m and date in m for m in warnings), warnings


def test_the_expiry_warning_comes_once_a_day_then_an_error_once_expired(
    pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    ending = ending_in(pki.ca, 20)
    cert = pki.write("twenty.pem", ending.certificate_pem)
    key = pki.write("twenty.key", ending.key_pem)
    clock = ManualClock()
    files = tls_files.ServerTls(cert, key, None, clock)
    date = f"{ending.certificate.not_valid_after_utc:%Y-%m-%d}"

    def logged() -> list[tuple[int, str]]:
        found = [(r.levelno, r.getMessage()) for r in caplog.records]
        caplog.clear()
        return found

    with caplog.at_level(logging.WARNING):
        files.check_expiry()
        assert logged() == [], "20 days left: nothing to say"
        clock.advance_us(7 * DAY_US)
        files.check_expiry()
        (first,) = logged()
        assert first[0] == logging.WARNING and str(cert) in first[1] and date in first[1]
        clock.advance_us(DAY_US - 1)
        files.check_expiry()
        assert logged() == [], "once a day"
        clock.advance_us(1)
        files.check_expiry()
        assert [level for level, _ in logged()] == [logging.WARNING]
        clock.advance_us(14 * DAY_US)
        files.check_expiry()
        (expired,) = logged()
        assert expired[0] == logging.ERROR and str(cert) in expired[1] and date in expired[1]
        assert "expired" in expired[1]


def test_a_new_client_ca_admits_its_clients_without_a_restart(
    start_tls_server: Callable[..., LedgerServer], pki: Pki
) -> None:
    client_ca = pki.client_ca_file()
    server = start_tls_server(**pki.server_files(), tls_client_ca_path=client_ca)
    new_ca = make_ca("next client CA")
    new_client = issue(new_ca, "lane recall", server=False)

    def with_client(client: Issued) -> grpc.StatusCode:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=pki.ca.certificate_pem,
            private_key=client.key_pem,
            certificate_chain=client.certificate_pem,
        )
        return balance(grpc.secure_channel(f"localhost:{server.port}", credentials), server)

    assert with_client(new_client) is grpc.StatusCode.UNAVAILABLE
    _replace(client_ca, new_ca.certificate_pem + pki.ca.certificate_pem)
    assert with_client(new_client) is grpc.StatusCode.OK
    assert with_client(pki.client) is grpc.StatusCode.OK, "both CAs while clients move"
