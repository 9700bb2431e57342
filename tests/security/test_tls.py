"""TLS and mutual TLS, with certificates the tests make (a CA, a server, clients)."""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Callable

import grpc
import pytest

from ledger_service.domain.clock import SystemClock
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.server import LedgerServer
from ledger_service.settings import Settings
from tests.security.certificates import Pki, ending_in
from tests.security.conftest import (
    CONNECT_TIMEOUT_SECONDS,
    HOME_LANE,
    balance,
    security_settings,
)


def _secure_channel(server: LedgerServer, pki: Pki, client: object = None) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki.ca.certificate_pem,
        private_key=None if client is None else client.key_pem,  # type: ignore[attr-defined]
        certificate_chain=None if client is None else client.certificate_pem,  # type: ignore[attr-defined]
    )
    return grpc.secure_channel(f"localhost:{server.port}", credentials)


def test_tls_serves_encrypted_and_refuses_plaintext(
    start_tls_server: Callable[..., LedgerServer], pki: Pki
) -> None:
    server = start_tls_server(**pki.server_files())
    assert balance(_secure_channel(server, pki), server) is grpc.StatusCode.OK
    plaintext = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    assert balance(plaintext, server) is grpc.StatusCode.UNAVAILABLE


def test_tls_still_needs_a_grant(start_tls_server: Callable[..., LedgerServer], pki: Pki) -> None:
    server = start_tls_server(**pki.server_files())
    channel = _secure_channel(server, pki)
    try:
        with pytest.raises(grpc.RpcError) as caught:
            pb_grpc.LedgerStub(channel).GetBalance(
                pb.GetBalanceRequest(lane=HOME_LANE), timeout=CONNECT_TIMEOUT_SECONDS
            )
        assert isinstance(caught.value, grpc.Call)
        assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
    finally:
        channel.close()


def test_mutual_tls_needs_a_client_certificate_from_the_trusted_ca(
    start_tls_server: Callable[..., LedgerServer], pki: Pki
) -> None:
    server = start_tls_server(**pki.server_files(), tls_client_ca_path=pki.client_ca_file())
    assert balance(_secure_channel(server, pki, pki.client), server) is grpc.StatusCode.OK
    assert balance(_secure_channel(server, pki), server) is grpc.StatusCode.UNAVAILABLE
    rogue = _secure_channel(server, pki, pki.rogue_client)
    assert balance(rogue, server) is grpc.StatusCode.UNAVAILABLE
    plaintext = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    assert balance(plaintext, server) is grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    "fields",
    [
        {"tls_cert_path": "server.pem"},
        {"tls_key_path": "server.key"},
        {"tls_client_ca_path": "client-ca.pem"},
    ],
    ids=["cert without key", "key without cert", "client CA without cert"],
)
def test_half_a_tls_configuration_is_refused(
    tmp_path: pathlib.Path, pki: Pki, fields: dict[str, str]
) -> None:
    pki.server_files()
    pki.client_ca_file()
    paths = {name: pki.directory / file for name, file in fields.items()}
    with pytest.raises(ValueError, match="--tls-"):
        LedgerServer(security_settings(tmp_path, **paths))


def test_tls_files_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.setenv("LEDGER_TLS_CERT", str(tmp_path / "c.pem"))
    monkeypatch.setenv("LEDGER_TLS_KEY", str(tmp_path / "k.pem"))
    monkeypatch.setenv("LEDGER_TLS_CLIENT_CA", str(tmp_path / "ca.pem"))
    settings = Settings.from_environment(data_dir=tmp_path)
    assert settings.tls_cert_path == tmp_path / "c.pem"
    assert settings.tls_key_path == tmp_path / "k.pem"
    assert settings.tls_client_ca_path == tmp_path / "ca.pem"
    flag = Settings.from_environment(data_dir=tmp_path, tls_cert_path=tmp_path / "flag.pem")
    assert flag.tls_cert_path == tmp_path / "flag.pem", "a flag wins over the environment"


@pytest.mark.parametrize(
    ("variable", "value"), [("LEDGER_AUTH_ENABLED", "0"), ("LEDGER_TEST_CLOCK", "1")]
)
def test_no_variable_turns_auth_off_or_the_clock_manual(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    """docs/security.md: the one way to turn auth off is --insecure-no-auth, and
    TestClock exists only with --test-clock."""
    monkeypatch.setenv(variable, value)
    settings = Settings.from_environment(data_dir=tmp_path)
    assert settings.auth_enabled and not settings.test_clock


def test_a_tls_file_that_cannot_be_read_is_one_line_naming_its_flag(
    tmp_path: pathlib.Path,
) -> None:
    from ledger_service import server

    missing = tmp_path / "nope.pem"
    settings = Settings(
        database_url="sqlite:///x.db",
        data_dir=tmp_path,
        tls_cert_path=missing,
        tls_key_path=missing,
    )
    with pytest.raises(ValueError, match=r"^--tls-key .*nope\.pem: No such file"):
        server.server_tls(settings, SystemClock())


def test_tls_beyond_loopback_is_not_warned_about_as_plaintext(
    start_tls_server: Callable[..., LedgerServer], pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        server = start_tls_server(listen="0.0.0.0:0", **pki.server_files())
    assert balance(_secure_channel(server, pki), server) is grpc.StatusCode.OK
    assert not any("PLAINTEXT" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize(
    ("cert", "key", "client_ca", "message"),
    [
        ("text", "text", None, r"^--tls-cert \S*text: holds no PEM certificate$"),
        ("server.pem", "text", None, r"^--tls-key \S*text: holds no PEM private key$"),
        ("server.pem", "server.pem", None, r"^--tls-key \S*server.pem: holds no PEM private key$"),
        (
            "server.pem",
            "other.key",
            None,
            r"^--tls-key \S*other.key is not the key of the "
            r"certificate in --tls-cert \S*server.pem$",
        ),
        (
            "expired.pem",
            "expired.key",
            None,
            r"^--tls-cert \S*expired.pem: the certificate "
            r"expired at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ",
        ),
        (
            "server.pem",
            "server.key",
            "text",
            r"^--tls-client-ca \S*text: holds no PEM certificate$",
        ),
    ],
)
def test_a_tls_file_gRPC_cannot_use_is_named_with_its_flag(
    tmp_path: pathlib.Path, pki: Pki, cert: str, key: str, client_ca: str | None, message: str
) -> None:
    # `ledger serve --tls-cert /etc/passwd --tls-key /etc/passwd` said "cannot
    # listen: the port is taken ... or its TLS certificate and key do not match",
    # exit 1: grpcio took the bytes and failed only when the port was added.
    from ledger_service import server

    expired = ending_in(pki.ca, -1)
    pki.server_files()
    pki.write("text", b"root:x:0:0:root:/root:/bin/bash\n")
    pki.write("other.key", pki.client.key_pem)
    pki.write("expired.pem", expired.certificate_pem)
    pki.write("expired.key", expired.key_pem)
    settings = Settings(
        database_url="sqlite:///x.db",
        data_dir=tmp_path,
        tls_cert_path=pki.directory / cert,
        tls_key_path=pki.directory / key,
        tls_client_ca_path=None if client_ca is None else pki.directory / client_ca,
    )
    with pytest.raises(ValueError, match=message):
        server.server_tls(settings, SystemClock())
