"""The server's TLS files, checked before gRPC sees them. grpcio takes any
bytes and fails only when the port is added, with the same "cannot listen"
as a taken port; here a file that is no PEM certificate or key, a key that is
not the certificate's, or an expired certificate is named, with its flag.

A running server looks at the files again before every new connection's
handshake (`ServerTls.fetch`), so that replaced files take effect without a
restart, and says in its log, ahead of time, when its certificate runs out
(`ServerTls.check_expiry`)."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import pathlib
import threading

import grpc
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

from ledger_service.domain.clock import MICROS_PER_SECOND, Clock

log = logging.getLogger("ledger.tls")

DAY_US = 86_400 * MICROS_PER_SECOND
# A certificate that ends within this is warned about at start and once a day:
# time to have a new one issued before clients fail their handshakes.
EXPIRY_WARNING_US = 14 * DAY_US
EXPIRY_REMINDER_US = DAY_US


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


@dataclasses.dataclass(frozen=True)
class Sources:
    """What a message names each file by: its flag, or its variable when the
    value came from the environment (Settings.source)."""

    cert: str = "--tls-cert"
    key: str = "--tls-key"
    client_ca: str = "--tls-client-ca"


def check_server_pair(cert: bytes, cert_path: pathlib.Path, key: bytes, key_path: pathlib.Path,
                      now: datetime.datetime,
                      names: Sources = Sources()) -> x509.Certificate:  # fmt: skip
    """The chain's first certificate, checked: it is in force at `now` and
    `key` is its unencrypted private key. Raises ValueError naming the file at
    fault."""
    leaf = certificates(cert, cert_path, names.cert)[0]
    if now >= leaf.not_valid_after_utc:
        raise ValueError(
            f"{names.cert} {cert_path}: the certificate expired at "
            f"{leaf.not_valid_after_utc:%Y-%m-%dT%H:%M:%SZ}; no client would complete a handshake"
        )
    check_key_of(leaf, cert_path, key, key_path, names)
    return leaf


def check_key_of(leaf: x509.Certificate, cert_path: pathlib.Path, key: bytes,
                 key_path: pathlib.Path, names: Sources) -> None:  # fmt: skip
    """`key` is the unencrypted private key of `leaf`, a server's certificate
    or a command's client certificate. Raises ValueError naming the file at fault."""
    try:
        private = serialization.load_pem_private_key(key, password=None)
    except TypeError:  # a password is needed
        raise ValueError(
            f"{names.key} {key_path}: is encrypted; gRPC needs an unencrypted key"
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        raise ValueError(f"{names.key} {key_path}: holds no PEM private key") from None
    if _public(private.public_key()) != _public(leaf.public_key()):
        raise ValueError(
            f"{names.key} {key_path} is not the key of the certificate in {names.cert} {cert_path}"
        )


def _public(key: object) -> bytes:
    return key.public_bytes(  # type: ignore[attr-defined,no-any-return]
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


# A file's identity and state: inode, size, modification and change times (a
# chmod or chown changes only the last). None when it cannot be looked at.
_Stamp = tuple[int, int, int, int] | None


def _stamp(path: pathlib.Path | None) -> _Stamp:
    if path is None:
        return None
    try:
        status = os.stat(path)
    except OSError:
        return None
    return (status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)


def _instant(now_us: int) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(now_us / MICROS_PER_SECOND, datetime.UTC)


def _utc(moment: datetime.datetime) -> str:
    return f"{moment:%Y-%m-%dT%H:%M:%SZ}"


@dataclasses.dataclass(frozen=True)
class _Files:
    """The contents of the TLS files as one checked set."""

    cert: bytes
    key: bytes
    client_ca: bytes | None
    leaf: x509.Certificate

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(self.key, self.cert)], root_certificates=self.client_ca
        )


class ServerTls:
    """The TLS files of a running server. Checked at start (ValueError naming
    the flag and the file); afterwards, before each new connection's handshake,
    the files are looked at (a stat of each) and read again only when one
    changed. A changed set that fails the start's checks is logged once, and
    the set in force serves on: half-copied files never take a replica down."""

    def __init__(self, cert_path: pathlib.Path, key_path: pathlib.Path,
                 client_ca_path: pathlib.Path | None, clock: Clock,
                 names: Sources = Sources()) -> None:  # fmt: skip
        self._cert_path, self._key_path, self._client_ca_path = cert_path, key_path, client_ca_path
        self._names = names
        # The real clock, as for grants: a test clock must not age a certificate.
        self._clock = clock
        # grpcio may ask from several threads at once.
        self._lock = threading.Lock()
        self._seen = self._stamps()
        self._in_force = self._read()
        # The stamps of a changed set that failed: logged once, not per handshake.
        self._refused: tuple[_Stamp, ...] | None = None
        # What check_expiry last said ("ending" or "expired") and when.
        self._said: tuple[str, int] | None = None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._in_force.configuration(),
            # grpcio documents None as "no change"; its type stub leaves None out.
            self.fetch,  # type: ignore[arg-type]
            require_client_authentication=self._client_ca_path is not None,
        )

    def _stamps(self) -> tuple[_Stamp, ...]:
        return (_stamp(self._cert_path), _stamp(self._key_path), _stamp(self._client_ca_path))

    def _read(self) -> _Files:
        key = read(self._key_path, self._names.key)
        cert = read(self._cert_path, self._names.cert)
        now = _instant(self._clock.now_us())
        leaf = check_server_pair(cert, self._cert_path, key, self._key_path, now, self._names)
        client_ca = None
        if self._client_ca_path is not None:
            client_ca = read(self._client_ca_path, self._names.client_ca)
            certificates(client_ca, self._client_ca_path, self._names.client_ca)
        return _Files(cert, key, client_ca, leaf)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """grpcio's fetcher: a new configuration when the files changed and
        pass the checks, else None (the one in force serves on). It must not
        raise: grpcio would fail the handshake."""
        try:
            with self._lock:
                return self._fetch()
        except Exception:
            log.exception("looking at the TLS files failed; the certificate in force serves on")
            return None

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        stamps = self._stamps()
        if stamps in (self._seen, self._refused):
            return None
        try:
            files = self._read()
        except ValueError as error:
            # The error names the flag, the file and what is wrong; never a key.
            self._refused = stamps
            log.error("the TLS files changed but are not taken: %s; the certificate "
                      "read before serves on (its subject %s, expires %s)", error,
                      self._in_force.leaf.subject.rfc4514_string(),
                      _utc(self._in_force.leaf.not_valid_after_utc))  # fmt: skip
            return None
        self._seen, self._refused = stamps, None
        if files == self._in_force:
            return None  # touched, not changed
        self._in_force, self._said = files, None
        log.info("took a new TLS certificate from %s for new connections: subject %s, "
                 "expires %s", self._cert_path, files.leaf.subject.rfc4514_string(),
                 _utc(files.leaf.not_valid_after_utc))  # fmt: skip
        return files.configuration()

    def check_expiry(self) -> None:
        """A WARNING while the certificate in force ends within 14 days, an
        ERROR once it has ended: at the first check, then once a day (at once
        when the one turns into the other)."""
        now_us = self._clock.now_us()
        with self._lock:
            ends = self._in_force.leaf.not_valid_after_utc
            left_us = int(ends.timestamp()) * MICROS_PER_SECOND - now_us
            if left_us > EXPIRY_WARNING_US:
                return
            kind = "expired" if left_us <= 0 else "ending"
            if self._said is not None:
                said, at_us = self._said
                if said == kind and now_us - at_us < EXPIRY_REMINDER_US:
                    return
            self._said = (kind, now_us)
        if kind == "expired":
            log.error("%s %s: the certificate expired at %s; clients fail their "
                      "handshakes: replace the certificate and key files (taken at the "
                      "next connection, no restart; docs/security.md)",
                      self._names.cert, self._cert_path, _utc(ends))  # fmt: skip
            return
        hours = left_us // (3600 * MICROS_PER_SECOND)
        log.warning("%s %s: the certificate expires at %s (in %d d %d h); "
                    "replace the certificate and key files before then (taken at the "
                    "next connection, no restart; docs/security.md)",
                    self._names.cert, self._cert_path, _utc(ends), hours // 24,
                    hours % 24)  # fmt: skip
