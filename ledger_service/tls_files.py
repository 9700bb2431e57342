"""The server's TLS files, checked before gRPC sees them. grpcio takes any
bytes and fails only when the port is added, with the same "cannot listen"
as a taken port; here a file that is no PEM certificate or key, a key that is
not the certificate's, or an expired certificate is named, with its flag."""

from __future__ import annotations

import datetime
import pathlib

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization


def read(path: pathlib.Path, flag: str) -> bytes:
    """A file's bytes; a file that cannot be read is the operator's to fix."""
    try:
        return path.read_bytes()
    except OSError as error:
        raise ValueError(f"{flag} {path}: {error.strerror or error}") from error


def certificates(content: bytes, path: pathlib.Path, flag: str) -> list[x509.Certificate]:
    """The PEM certificates of a file (at least one). Raises ValueError naming it."""
    try:
        return x509.load_pem_x509_certificates(content)
    except ValueError:
        raise ValueError(f"{flag} {path}: holds no PEM certificate") from None


def check_server_pair(cert: bytes, cert_path: pathlib.Path, key: bytes, key_path: pathlib.Path,
                      now: datetime.datetime) -> None:  # fmt: skip
    """The chain's first certificate is in force at `now` and `key` is its
    unencrypted private key. Raises ValueError naming the file at fault."""
    leaf = certificates(cert, cert_path, "--tls-cert")[0]
    if now >= leaf.not_valid_after_utc:
        raise ValueError(
            f"--tls-cert {cert_path}: the certificate expired at "
            f"{leaf.not_valid_after_utc:%Y-%m-%dT%H:%M:%SZ}; no client would complete a handshake"
        )
    try:
        private = serialization.load_pem_private_key(key, password=None)
    except TypeError:  # a password is needed
        raise ValueError(
            f"--tls-key {key_path}: is encrypted; gRPC needs an unencrypted key"
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        raise ValueError(f"--tls-key {key_path}: holds no PEM private key") from None
    if _public(private.public_key()) != _public(leaf.public_key()):
        raise ValueError(
            f"--tls-key {key_path} is not the key of the certificate in --tls-cert {cert_path}"
        )


def _public(key: object) -> bytes:
    return key.public_bytes(  # type: ignore[attr-defined,no-any-return]
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
