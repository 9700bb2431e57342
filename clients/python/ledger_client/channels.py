"""How a lane reaches the ledger: one channel, TLS when configured, the grant
sent as `authorization: Bearer <grant>` on every call."""

from __future__ import annotations

import dataclasses
import ipaddress
import pathlib
import re
import socket
import ssl
import tempfile
import time

import grpc

from ledger_client.settings import ClientSettings

# The longest grant the ledger takes (ledger_service/domain/grants.py): a longer
# one could only be refused, and past 8 KiB of headers gRPC refuses some calls at
# random with RESOURCE_EXHAUSTED, taken for an overloaded ledger.
MAX_GRANT_LENGTH = 4096
# A grant travels in an HTTP/2 header: visible ASCII, no spaces.
_GRANT = re.compile(r"[\x21-\x7e]+")
# A replica that froze (SIGSTOP, a paused VM, a host gone silent) keeps its
# connection open, and round robin kept sending it every other call. A ping
# every 5 s, unanswered for 5 s, closes that connection: within 10 s its calls
# go to the other replicas. The server admits a ping every 4 s at the most
# (client_ping_min_interval_seconds). The same figures as the Node client's
# RECONNECT_OPTIONS (clients/node/lib/client.js).
KEEPALIVE_INTERVAL_MS = 5000
KEEPALIVE_TIMEOUT_MS = 5000


@dataclasses.dataclass(frozen=True)
class TlsSettings:
    """PEM bytes. No root certificates: the system's roots. A certificate chain
    and private key together: mutual TLS."""

    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    # The name the server's certificate must carry, when it differs from the
    # address's host (tests, or a ledger reached through an IP address).
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("mutual TLS needs both certificate_chain and private_key")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )


def is_local_address(address: str) -> bool:
    """Whether a gRPC target is this machine: a unix socket, localhost,
    127.0.0.0/8 or ::1 (the cases are clients/cases/plaintext.json). A grant
    sent anywhere else without TLS travels unencrypted."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    target = address
    for scheme in ("dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme) :]
            if target.startswith("//"):  # dns://[authority]/host:port
                target = target[2:].partition("/")[2]
            break
    return all(_is_local_host(part) for part in target.split(","))


def _is_local_host(host_port: str) -> bool:
    if host_port.startswith("["):
        host = host_port[1:].partition("]")[0]
    elif host_port.count(":") == 1:
        host = host_port.partition(":")[0]
    else:
        host = host_port  # no port, or a bare IPv6 address
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_grant(grant: str) -> None:
    if not 0 < len(grant) <= MAX_GRANT_LENGTH or not _GRANT.fullmatch(grant):
        raise ValueError(
            f"a grant must be 1 to {MAX_GRANT_LENGTH} visible ASCII characters without spaces"
        )


def open_channel(address: str, tls: TlsSettings | None, settings: ClientSettings) -> grpc.Channel:
    options: list[tuple[str, str | int]] = [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", settings.initial_reconnect_backoff_ms),
        ("grpc.min_reconnect_backoff_ms", settings.initial_reconnect_backoff_ms),
        ("grpc.max_reconnect_backoff_ms", settings.max_reconnect_backoff_ms),
        # An address of several replicas (`ipv4:A,B`, a DNS name with one record
        # each): calls go to each ready one in turn. gRPC's default, pick_first,
        # sent every call to the first, and a drain there met all of them.
        ("grpc.lb_policy_name", "round_robin"),
        ("grpc.keepalive_time_ms", KEEPALIVE_INTERVAL_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # What this gRPC reads as the ping's timeout (default 1 minute): with
        # keepalive_timeout_ms alone, a frozen replica was not found in 30 s.
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # Pings on an idle connection too, and however long no data came.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.secure_channel(address, tls.credentials(), options=options)


def serves_tls(address: str, deadline: float) -> bool | None:
    """Whether the ledger at a plain `host:port` answers a TLS handshake: a
    plaintext channel to a TLS ledger gets only gRPC's "Socket closed", as
    from a restarting server, and this one handshake tells the two apart. No
    certificate is checked and nothing is sent after it; an alert from the
    server (a client certificate demanded) is TLS too. None: nobody answered
    (refused, timed out), so ask again another time. `deadline` (monotonic)
    bounds the connect and the handshake together."""
    target = _probe_target(address)
    if target is None:
        return False
    context = _probe_context()
    try:
        with socket.create_connection(target, _left(deadline)) as raw:
            raw.settimeout(_left(deadline))
            with context.wrap_socket(raw):
                return True
    except ssl.SSLEOFError:
        return False  # a listener that hung up on the handshake: not TLS
    except ssl.SSLError as error:
        return "ALERT" in (error.reason or "")
    except OSError:
        return None


def refuses_client_certificate(address: str, deadline: float, context: ssl.SSLContext) -> bool:
    """Whether the ledger at a plain `host:port` refuses a TLS client offering
    the client certificate of `context` (client_probe_context; none when the
    lane has none): gRPC reports either only as "Socket closed", as from a
    restarting server. gRPC's server completes the TLS 1.3 handshake and then
    hangs up without a byte (no alert), where a ledger that takes the client
    sends its HTTP/2 settings at once; a TLS alert refusing the certificate
    (another TLS stack in front) says it too. Only an answer in TLS counts: a
    listener or a plain TCP proxy that hangs up before the handshake is done is
    an outage. Nothing is sent. `deadline` (monotonic) bounds it all."""
    target = _probe_target(address)
    if target is None:
        return False
    try:
        with socket.create_connection(target, _left(deadline)) as raw:
            raw.settimeout(_left(deadline))
            with context.wrap_socket(raw) as tls_socket:
                tls_socket.settimeout(_left(deadline))
                try:
                    return tls_socket.recv(1) == b""
                except (ssl.SSLEOFError, ConnectionResetError):
                    return True
    except ssl.SSLError as error:
        reason = error.reason or ""
        return "ALERT" in reason and any(refusal in reason for refusal in _CERTIFICATE_REFUSALS)
    except OSError:
        return False  # refused, timed out, hung up in the handshake: not asked


def client_probe_context(tls: TlsSettings) -> ssl.SSLContext | None:
    """The handshake of refuses_client_certificate: TLS 1.3, ALPN h2, the
    lane's client certificate when it has one, no check of the ledger's
    certificate. A client builds it once: loading the certificate takes
    milliseconds (a file written and read), more than the probe itself. None
    when the certificate cannot be loaded (gRPC refuses it before any call)."""
    context = _probe_context()
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.set_alpn_protocols(["h2"])  # without it gRPC hangs up on anyone
    if tls.certificate_chain is None or tls.private_key is None:
        return context
    try:
        _load_client_certificate(context, tls.certificate_chain, tls.private_key)
    except (ssl.SSLError, OSError):
        return None
    return context


def roots_load(tls: TlsSettings) -> bool:
    """Whether root_certificates load as PEM certificates (no roots: the
    system's, which do). gRPC cannot use them otherwise, and says only "Failed
    to create security handshaker" on every call."""
    if tls.root_certificates is None:
        return True
    try:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.load_verify_locations(cadata=tls.root_certificates.decode("ascii"))
    except (ssl.SSLError, UnicodeDecodeError, ValueError):
        return False
    return True


# The TLS alerts that refuse a client's certificate: missing (TLS 1.3's
# certificate_required), signed by a CA the server does not know, or refused.
_CERTIFICATE_REFUSALS = ("CERTIFICATE_REQUIRED", "UNKNOWN_CA", "BAD_CERTIFICATE",
                         "CERTIFICATE_UNKNOWN")  # fmt: skip


def _load_client_certificate(context: ssl.SSLContext, chain: bytes, key: bytes) -> None:
    """The lane's certificate and key into a probe's context. Python's ssl
    loads them from a file only: one in a private temporary directory (mode
    0700, removed at once), written and read within this call."""
    with tempfile.TemporaryDirectory(prefix="ledger-probe-") as directory:
        path = pathlib.Path(directory) / "client.pem"
        path.write_bytes(chain + b"\n" + key)
        context.load_cert_chain(path)


def address_host(address: str) -> str | None:
    """The host of a plain `host:port` (the name gRPC checks in the ledger's
    certificate when no server_name is given); None for anything else."""
    target = _probe_target(address)
    return None if target is None else target[0]


def _probe_target(address: str) -> tuple[str, int] | None:
    """The host and port a probe connects to; None for a gRPC target scheme,
    a replica list or anything else that is not a plain `host:port`."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "," in host or host.startswith(("unix", "dns:", "ipv")):
        return None
    return host.strip("[]"), int(port)


def _probe_context() -> ssl.SSLContext:
    """A handshake that checks no certificate: a probe asks only whether TLS answers."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)
