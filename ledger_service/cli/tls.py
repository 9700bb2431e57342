"""TLS for the commands: root certificates (`--tls-ca`) and a client certificate
(`--tls-cert` and `--tls-key`, for mutual TLS), from options or the environment.
Without either the channel is plaintext, and a grant sent on it to a server
that is not this machine draws a warning on stderr (connection.connect)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re

import grpc

from ledger_service.cli.exits import EXIT_BAD_VALUE, CliError
from ledger_service.cli.values import MAX_VALUE_LENGTH

MAX_PEM_BYTES = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Tls:
    """What a TLS channel trusts and shows, and where each setting came from."""

    # None: the system's root certificates.
    root_certificates: bytes | None
    ca_source: str
    # Both or neither: the client certificate for mutual TLS.
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    client_source: str = ""
    # The name the server's certificate must carry, when not the host of --server.
    server_name: str = ""

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def _setting(given: str | None, option: str, variable: str) -> tuple[str, str]:
    """A value and where it came from: the option, else the environment variable."""
    if given:
        return given, option
    if os.environ.get(variable):
        return os.environ[variable], variable
    return "", ""


def read_pem(path_text: str, source: str, label: str) -> bytes:
    """A bounded PEM file; `label` is what its BEGIN line must say (CERTIFICATE, PRIVATE KEY)."""
    path = pathlib.Path(path_text)
    try:
        with path.open("rb") as pem_file:
            content = pem_file.read(MAX_PEM_BYTES + 1)
    except FileNotFoundError:
        raise CliError(f"{source}: there is no file {path}", EXIT_BAD_VALUE) from None
    except OSError as error:
        reason = error.strerror or error.__class__.__name__
        raise CliError(f"{source}: cannot read {path} ({reason})", EXIT_BAD_VALUE) from None
    if len(content) > MAX_PEM_BYTES:
        raise CliError(f"{source}: {path} is larger than a PEM file should be", EXIT_BAD_VALUE)
    if b"-----BEGIN ENCRYPTED PRIVATE KEY-----" in content:
        raise CliError(
            f"{source}: {path} is encrypted; gRPC needs an unencrypted key", EXIT_BAD_VALUE
        )
    if not re.search(rb"-----BEGIN [A-Z ]*" + label.encode() + rb"-----", content):
        raise CliError(f"{source}: {path} holds no PEM {label}", EXIT_BAD_VALUE)
    return content


def resolve_tls(arguments: argparse.Namespace) -> Tls | None:
    """TLS when root certificates or a client certificate are given, else None (plaintext)."""
    ca, ca_source = _setting(getattr(arguments, "tls_ca", None), "--tls-ca", "LEDGER_TLS_CA")
    cert, cert_source = _setting(
        getattr(arguments, "tls_cert", None), "--tls-cert", "LEDGER_TLS_CLIENT_CERT"
    )
    key, key_source = _setting(
        getattr(arguments, "tls_key", None), "--tls-key", "LEDGER_TLS_CLIENT_KEY"
    )
    name, name_source = _setting(
        getattr(arguments, "tls_server_name", None), "--tls-server-name", "LEDGER_TLS_SERVER_NAME"
    )
    if bool(cert) != bool(key):
        given, missing = (cert_source, "--tls-key") if cert else (key_source, "--tls-cert")
        raise CliError(
            f"{given} needs {missing}: a client certificate and its key go together", EXIT_BAD_VALUE
        )
    if not ca and not cert:
        if name:
            raise CliError(
                f"{name_source} needs --tls-ca (or a client certificate): "
                "without them the channel is plaintext",
                EXIT_BAD_VALUE,
            )
        return None
    if name and not re.fullmatch(r"[A-Za-z0-9.:_\-]{1,253}", name):
        raise CliError(
            f"{name_source}: {name[:MAX_VALUE_LENGTH]!r} is not a host name", EXIT_BAD_VALUE
        )
    root_certificates = read_pem(ca, ca_source, "CERTIFICATE") if ca else None
    certificate_chain = read_pem(cert, cert_source, "CERTIFICATE") if cert else None
    private_key = read_pem(key, key_source, "PRIVATE KEY") if key else None
    if certificate_chain is not None and private_key is not None:
        _check_pair(certificate_chain, cert, cert_source, private_key, key, key_source)
    return Tls(
        root_certificates=root_certificates,
        ca_source=ca_source,
        certificate_chain=certificate_chain,
        private_key=private_key,
        client_source=cert_source,
        server_name=name,
    )


def _check_pair(chain: bytes, cert_path: str, cert_source: str,
                key: bytes, key_path: str, key_source: str) -> None:  # fmt: skip
    """A key of another certificate reached gRPC, which logged its own lines and
    failed the call with "Failed to create security handshaker", naming no option.
    Imported here: `cryptography` costs every other command its start-up time."""
    from ledger_service import tls_files

    names = tls_files.Sources(cert=cert_source, key=key_source)
    try:
        leaf = tls_files.certificates(chain, pathlib.Path(cert_path), cert_source)[0]
        tls_files.check_key_of(leaf, pathlib.Path(cert_path), key, pathlib.Path(key_path), names)
    except ValueError as error:
        raise CliError(str(error), EXIT_BAD_VALUE) from None
