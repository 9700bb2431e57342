"""Certificates the TLS tests make with `cryptography` (a CA, a server,
clients) and the files a server reads them from. The fixtures that start
servers on them are in conftest.py."""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import pathlib

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


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


def subject_named(common_name: str) -> x509.Name:
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
        .subject_name(subject_named(common_name))
        .issuer_name(subject_named(common_name))
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
        .subject_name(subject_named(common_name))
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


def ending_in(ca: Issued, days: float) -> Issued:
    """A server certificate for localhost that ends `days` from now."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject_named("localhost"))
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=30))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(ca.key, hashes.SHA256())
    )
    return Issued(certificate, key)
