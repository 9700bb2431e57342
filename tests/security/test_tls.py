"""TLS and mutual TLS, with certificates the tests make (a CA, a server, clients)."""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import logging
import pathlib
from collections.abc import Callable, Iterator

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.server import LedgerServer
from ledger_service.settings import Settings
from tests.security.conftest import HOME_LANE, bearer, security_settings

CONNECT_TIMEOUT_SECONDS = 5.0


@dataclasses.dataclass(frozen=True)
class Issued:
    certificate: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def certificate_pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return self.key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


CA_KEY_USAGE = x509.KeyUsage(
    digital_signature=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)


def make_ca(common_name: str) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(CA_KEY_USAGE, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(certificate, key)


def issue(ca: Issued, common_name: str, *, server: bool) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False
        )
    )
    if server:
        names: list[x509.GeneralName] = [
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return Issued(builder.sign(ca.key, hashes.SHA256()), key)


@dataclasses.dataclass(frozen=True)
class Pki:
    directory: pathlib.Path
    ca: Issued
    server: Issued
    client: Issued
    rogue_client: Issued  # signed by a CA the server does not trust

    def write(self, name: str, content: bytes) -> pathlib.Path:
        path = self.directory / name
        path.write_bytes(content)
        path.chmod(0o600)
        return path

    def server_files(self) -> dict[str, pathlib.Path]:
        return {
            "tls_cert_path": self.write("server.pem", self.server.certificate_pem),
            "tls_key_path": self.write("server.key", self.server.key_pem),
        }

    def client_ca_file(self) -> pathlib.Path:
        return self.write("client-ca.pem", self.ca.certificate_pem)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    ca = make_ca("ledger test CA")
    rogue_ca = make_ca("rogue CA")
    return Pki(
        directory=tmp_path_factory.mktemp("pki"),
        ca=ca,
        server=issue(ca, "localhost", server=True),
        client=issue(ca, "lane recall", server=False),
        rogue_client=issue(rogue_ca, "lane recall", server=False),
    )


@pytest.fixture
def start_tls_server(tmp_path: pathlib.Path) -> Iterator[Callable[..., LedgerServer]]:
    started: list[LedgerServer] = []

    def start(**overrides: object) -> LedgerServer:
        server = LedgerServer(security_settings(tmp_path / f"s{len(started)}", **overrides))
        started.append(server)
        server.start()
        return server

    yield start
    for server in started:
        server.stop(0)


def _balance(channel: grpc.Channel, server: LedgerServer) -> grpc.StatusCode:
    """Puts the home lane and reads its balance; the status of the first failing call."""
    try:
        admin = pb_grpc.LaneAdminStub(channel)
        lane = pb.Lane(lane=HOME_LANE, limit_nanos=1000, prices={"jev": pb.ModelPrice()})
        admin.PutLane(
            pb.PutLaneRequest(lane=lane),
            metadata=bearer(server.admin_grant),
            timeout=CONNECT_TIMEOUT_SECONDS,
        )
        pb_grpc.LedgerStub(channel).GetBalance(
            pb.GetBalanceRequest(lane=HOME_LANE),
            metadata=bearer(server.admin_grant),
            timeout=CONNECT_TIMEOUT_SECONDS,
        )
    except grpc.RpcError as error:
        assert isinstance(error, grpc.Call)
        return error.code()
    finally:
        channel.close()
    return grpc.StatusCode.OK


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
    assert _balance(_secure_channel(server, pki), server) is grpc.StatusCode.OK
    plaintext = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    assert _balance(plaintext, server) is grpc.StatusCode.UNAVAILABLE


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
    assert _balance(_secure_channel(server, pki, pki.client), server) is grpc.StatusCode.OK
    assert _balance(_secure_channel(server, pki), server) is grpc.StatusCode.UNAVAILABLE
    rogue = _secure_channel(server, pki, pki.rogue_client)
    assert _balance(rogue, server) is grpc.StatusCode.UNAVAILABLE
    plaintext = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    assert _balance(plaintext, server) is grpc.StatusCode.UNAVAILABLE


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
        server.server_credentials(settings)


def test_tls_beyond_loopback_is_not_warned_about_as_plaintext(
    start_tls_server: Callable[..., LedgerServer], pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        server = start_tls_server(listen="0.0.0.0:0", **pki.server_files())
    assert _balance(_secure_channel(server, pki), server) is grpc.StatusCode.OK
    assert not any("PLAINTEXT" in record.getMessage() for record in caplog.records)


def _expired(ca: Issued) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(_name("localhost"))
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=2))
        .not_valid_after(now - datetime.timedelta(days=1))
        .sign(ca.key, hashes.SHA256())
    )
    return Issued(certificate, key)


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

    expired = _expired(pki.ca)
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
        server.server_credentials(settings)
