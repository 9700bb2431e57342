"""One session with a running server: the channel, the grant, the options every
call carries, and the one line a failed call becomes (from its status code and
the `ledger-reason` / `ledger-field` trailers), with a failed TLS handshake
explained. `command` wraps each command in all of that."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import decimal
import math
import os
import pathlib
import re
import socket
import ssl
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import grpc

from ledger_service.api.errors import FIELD_KEY, REASON_KEY
from ledger_service.cli.exits import (
    EXIT_BAD_VALUE,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_UNREACHABLE,
    CliError,
)
from ledger_service.cli.render import money_in_text, usd
from ledger_service.cli.tls import Tls, resolve_tls
from ledger_service.cli.values import (
    DEFAULT_TIMEOUT_SECONDS,
    MAX_TIMEOUT_SECONDS,
    MAX_VALUE_LENGTH,
    parse_timeout_seconds,
)
from ledger_service.domain.grants import MAX_GRANT_LENGTH, GrantRejected, decode_unverified
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.settings import data_dir_from_environment, is_host, is_loopback
from ledger_service.storage import keyring

DEFAULT_SERVER = "127.0.0.1:50051"
# Keepalive pings, so that a call that waits (`history --follow`, a long
# reconcile) on a server that froze, or behind a network that silently drops
# packets, ends instead of hanging for ever. The server accepts a client's
# pings no more often than its `client_ping_min_interval_seconds` (4 by
# default) and sends GOAWAY too_many_pings past that: 30 s keeps a margin. A ping unanswered for
# the interval (at most KEEPALIVE_TIMEOUT_SECONDS) ends the call UNAVAILABLE.
KEEPALIVE_VARIABLE = "LEDGER_CLIENT_KEEPALIVE_SECONDS"
DEFAULT_KEEPALIVE_SECONDS = 30.0
KEEPALIVE_TIMEOUT_SECONDS = 20.0
MAX_KEEPALIVE_SECONDS = 3600.0
# A connection lost (a server restarting) is tried again after 0.1 s, then at
# most 1 s apart (gRPC's own backoff grows to 120 s): a follow waiting for its
# server looks every second (reading.FOLLOW_RESUME_TRY_SECONDS), and a look on
# a channel between tries waits for the next one. The connect timeout stays gRPC's.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
MAX_GRANT_BYTES = 16 * 1024
# Paging: every listing stops after MAX_PAGES pages of PAGE_SIZE, whatever the server says.
PAGE_SIZE = 1000
MAX_PAGES = 200
# Which command-line name to blame for a field the server names in `ledger-field`.
OPTION_OF_FIELD = {
    "lane": "LANE",
    "lane.lane": "LANE",
    "lane.limit_nanos": "--limit",
    "lane.window": "--window",
    "lane.hold_ttl": "--hold-ttl",
    "lane.bytes_per_token": "--bytes-per-token",
    "lane.overhead_tokens": "--overhead-tokens",
    "lane.prices": "--price",
    "lane.expire_charge": "--expire-charge",
    "lane.parent": "--parent",
    "lane.max_charge_multiple": "--max-charge-multiple",
    "reservation_id": "RESERVATION_ID",
    "model": "--model",
    "request_bytes": "--request-bytes",
    "max_output_tokens": "--max-output-tokens",
    "estimate_nanos": "--estimate",
    "ttl": "--ttl",
    "outcome": "--outcome",
    "input_tokens": "--input-tokens",
    "output_tokens": "--output-tokens",
    "cached_input_tokens": "--cached-input-tokens",
    "cache_write_tokens": "--cache-write-tokens",
    "billed_nanos": "--billed",
    "http_status": "--http-status",
    "reason": "--reason",
    "after_seq": "--after-seq",
    "content": "FILE",
    "format": "--format",
    "default_lane": "--lane",
    "charge_nanos": "--charge",
    "correction_id": "--correction-id",
}
# A server's sentence names other fields, methods and outcomes in the wire's words
# ("use Refund", "or billed_nanos", "the lane's hold_ttl"): each is shown as the
# CLI's own name, a field by the last part of its name ("lane.hold_ttl" as
# --hold-ttl). Only names with an underscore are fields here: "lane" or
# "reason" in a sentence are plain words.
CLI_WORD_OF_WIRE_WORD = {
    **{
        field.rpartition(".")[2]: option
        for field, option in OPTION_OF_FIELD.items()
        if "_" in field.rpartition(".")[2]
    },
    # The methods the CLI calls, as the command that calls them (a grant's refusal
    # names its method: "PutLane on lane 'x' needs the admin scope on every lane").
    "Reserve": "`ledger reserve`",
    "Settle": "`ledger settle`",
    "Refund": "`ledger refund`",
    "Correct": "`ledger correct`",
    "Reconcile": "`ledger reconcile`",
    "PutLane": "`ledger lane put`",
    "GetLane": "`ledger lane show`",
    "ListLanes": "`ledger lane list`",
    "GetBalance": "`ledger balance`",
    "ListEvents": "`ledger history`",
    "GetAudit": "`ledger audit`",
    "SUCCEEDED": "succeeded",
    "UNKNOWN": "unknown",
}
# Which of those are methods: the only words a refusal of an export file translates,
# since its fields are the columns of the user's own file.
_METHOD_WORDS = frozenset(word for word, said in CLI_WORD_OF_WIRE_WORD.items() if "`" in said)
# A quoted value (a lane, an id: Python's repr) is the user's, never translated;
# an apostrophe inside a word ("the lane's") starts none.
_QUOTED = re.compile(r"""((?<!\w)(?:'(?:\\.|[^'\\])*'|"(?:\\.|[^"\\])*")(?!\w))""")
_WIRE_WORD = re.compile(
    r"(?<![\w.`-])("
    + "|".join(sorted(map(re.escape, CLI_WORD_OF_WIRE_WORD), key=len, reverse=True))
    + r")(?![\w`-])"
)


def in_cli_words(text: str, *, fields: bool = True) -> str:
    """A server's sentence with each wire word in it (outside quoted values) as
    CLI_WORD_OF_WIRE_WORD names it; with `fields` false, only the methods."""

    def word(found: re.Match[str]) -> str:
        wire = found[1]
        return CLI_WORD_OF_WIRE_WORD[wire] if fields or wire in _METHOD_WORDS else wire

    parts = _QUOTED.split(text)
    # split() with one group: the quoted values are the odd parts.
    return "".join(
        part if index % 2 else _WIRE_WORD.sub(word, part) for index, part in enumerate(parts)
    )


@dataclasses.dataclass(frozen=True)
class Session:
    """One channel to the server and the options every call carries."""

    server: str
    ledger: pb_grpc.LedgerStub
    admin: pb_grpc.LaneAdminStub
    timeout_seconds: float
    metadata: tuple[tuple[str, str], ...]
    # Where the grant came from, for error messages ("" when none was found).
    grant_source: str = ""
    # None: plaintext.
    tls: Tls | None = None
    # The grant sent, to say why the server refused it ("" when none).
    grant: str = ""
    # How often a call's silent connection is pinged (LEDGER_CLIENT_KEEPALIVE_SECONDS).
    keepalive_seconds: float = DEFAULT_KEEPALIVE_SECONDS
    # OPTION_OF_FIELD, with the command's own names where they differ (see option_of_field).
    option_of_field: Mapping[str, str] = dataclasses.field(
        default_factory=lambda: dict(OPTION_OF_FIELD)
    )

    def options(self) -> dict[str, Any]:
        return {"timeout": self.timeout_seconds, "metadata": self.metadata}


# Every character a grant (lg1.KEY.PAYLOAD.SIGNATURE, base64url) can hold.
_GRANT_CHARACTERS = re.compile(r"[A-Za-z0-9._=-]*")
# A range refusal's bounds ("must be between 1 and 4611686018427387904").
_BOUNDS = re.compile(r"\bbetween (\d+) and (\d+)\b")


# gRPC's own target schemes, passed on as they are (`unix:/run/ledger.sock`).
_TARGET_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:")


def resolve_server(given: str | None) -> str:
    """--server, else LEDGER_SERVER, else the default; a HOST:PORT with a port gRPC
    can dial, so that a typo is named here rather than read as a server that is down."""
    source, server = ("--server", given) if given is not None else ("LEDGER_SERVER", None)
    if server is None:
        server = os.environ.get("LEDGER_SERVER") or DEFAULT_SERVER
    if server.startswith(_TARGET_SCHEMES):
        return server
    host, colon, port = server.rpartition(":")
    if "/" in host:  # a URL ('http://host:port'): gRPC would take 'http' for a host name
        raise CliError(
            f"{source}: {server[:MAX_VALUE_LENGTH]!r} is not HOST:PORT (a URL: leave out "
            f"the scheme, as in {DEFAULT_SERVER}; for TLS pass --tls-ca)",
            EXIT_BAD_VALUE,
        )
    if not (
        is_host(host) and colon and port.isascii() and port.isdigit() and 0 < int(port) < 65536
    ):
        raise CliError(
            f"{source}: {server[:MAX_VALUE_LENGTH]!r} is not HOST:PORT "
            f"(a port from 1 to 65535, as in {DEFAULT_SERVER})",
            EXIT_BAD_VALUE,
        )
    return server


def is_local_server(server: str) -> bool:
    """Whether a gRPC target is this machine: a unix socket, localhost,
    127.0.0.0/8 or ::1, as the clients decide it (clients/cases/plaintext.json).
    A grant sent anywhere else without TLS travels unencrypted."""
    if server.startswith(("unix:", "unix-abstract:")):
        return True
    target = server
    for scheme in ("dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme) :]
            if target.startswith("//"):  # dns://[authority]/host:port
                target = target[2:].partition("/")[2]
            break
    return all(is_loopback(part) for part in target.split(","))


def resolve_grant(given: str | None) -> tuple[str, str]:
    """The grant and where it came from: --grant, else LEDGER_GRANT, else the
    admin grant the server wrote to <LEDGER_DATA_DIR or ./data>/admin.grant."""
    if given is not None:
        if not given.strip():  # never taken as "no grant given": the admin grant would answer
            raise CliError(
                "--grant: is empty; give a grant, or leave the option out", EXIT_BAD_VALUE
            )
        return given.strip(), "--grant"
    if os.environ.get("LEDGER_GRANT"):
        return os.environ["LEDGER_GRANT"].strip(), "LEDGER_GRANT"
    path = admin_grant_path()
    try:
        with path.open("rb") as grant_file:
            return grant_file.read(MAX_GRANT_BYTES).decode("ascii").strip(), str(path)
    except FileNotFoundError:
        return "", ""
    except (OSError, UnicodeDecodeError) as error:
        raise CliError(f"cannot read the grant in {path}: {error.__class__.__name__}") from None


def resolve_keepalive_seconds() -> float:
    """LEDGER_CLIENT_KEEPALIVE_SECONDS, else 30: how long a call's connection may stay
    silent before the CLI pings the server (and how long it waits for the answer, at
    most 20 s). Below the server's `client_ping_min_interval_seconds` the server ends
    the connection."""
    text = os.environ.get(KEEPALIVE_VARIABLE, "").strip()
    if not text:
        return DEFAULT_KEEPALIVE_SECONDS
    try:
        seconds = float(text) if text.isascii() else math.nan
    except ValueError:
        seconds = math.nan
    if not 0.1 <= seconds <= MAX_KEEPALIVE_SECONDS:  # NaN included
        raise CliError(
            f"{KEEPALIVE_VARIABLE}: {text[:MAX_VALUE_LENGTH]!r} is not a number of seconds "
            f"between 0.1 and {MAX_KEEPALIVE_SECONDS:g}",
            EXIT_BAD_VALUE,
        )
    return seconds


def keepalive_options(seconds: float) -> list[tuple[str, int]]:
    """The channel options of a CLI channel that pings every `seconds` while a call runs."""
    interval_ms = round(seconds * 1000)
    timeout_ms = round(min(seconds, KEEPALIVE_TIMEOUT_SECONDS) * 1000)
    return [
        ("grpc.keepalive_time_ms", interval_ms),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # What this gRPC reads as the keepalive ping's timeout (default 1 minute).
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        # Only while a call runs: an idle channel has nothing to lose.
        ("grpc.keepalive_permit_without_calls", 0),
        # gRPC's default stops after two pings with no data sent, which a quiet
        # follow never sends: it would then hang again after a minute.
        ("grpc.http2.max_pings_without_data", 0),
    ]


def admin_grant_path() -> pathlib.Path:
    """The server's admin.grant, in the data directory read as the server reads it."""
    return keyring.admin_grant_path(data_dir_from_environment())


@contextlib.contextmanager
def connect(arguments: argparse.Namespace) -> Iterator[Session]:
    server = resolve_server(arguments.server)
    timeout_seconds = parse_timeout_seconds(arguments.timeout)
    grant, grant_source = resolve_grant(arguments.grant)
    if len(grant) > MAX_GRANT_LENGTH:
        # Longer than any grant: past 8 KiB of headers gRPC refuses some calls at
        # random with RESOURCE_EXHAUSTED, the others would be UNAUTHENTICATED.
        raise CliError(
            f"{grant_source}: not a grant (longer than {MAX_GRANT_LENGTH} characters)",
            EXIT_BAD_VALUE,
        )
    if not _GRANT_CHARACTERS.fullmatch(grant):
        # gRPC would refuse the header itself, with a C-core log line and "Invalid
        # metadata (INTERNAL)": a grant pasted with a line break, a space or a quote.
        raise CliError(
            f"{grant_source}: not a grant (it holds a space, a line break or a character "
            "other than ASCII letters, digits and . - _ =)",
            EXIT_BAD_VALUE,
        )
    metadata = (("authorization", f"Bearer {grant}"),) if grant else ()
    tls = resolve_tls(arguments)
    if grant and tls is None and not is_local_server(server):
        # A grant is a bearer credential: on the wire in plaintext anyone on the path can use it.
        print(
            f"ledger: warning: the grant from {grant_source} goes to {server} without TLS: "
            "it travels unencrypted (pass --tls-ca)",
            file=sys.stderr,
        )
    keepalive_seconds = resolve_keepalive_seconds()
    options = [*keepalive_options(keepalive_seconds), *RECONNECT_OPTIONS]
    channel = (
        grpc.insecure_channel(server, options=options)
        if tls is None
        else grpc.secure_channel(server, tls.credentials(), options=[*options, *tls.options()])
    )
    with channel:
        yield Session(
            server=server,
            ledger=pb_grpc.LedgerStub(channel),
            admin=pb_grpc.LaneAdminStub(channel),
            timeout_seconds=timeout_seconds,
            metadata=metadata,
            grant_source=grant_source if grant else "",
            tls=tls,
            grant=grant,
            keepalive_seconds=keepalive_seconds,
            option_of_field={**OPTION_OF_FIELD, **getattr(arguments, "option_of_field", {})},
        )


def explain(error: grpc.RpcError, session: Session) -> CliError:
    """One line for a failed call, from its status code and ledger trailers."""
    server = session.server
    if not isinstance(error, grpc.Call):
        return CliError(f"the call to the ledger at {server} failed")
    code = error.code()
    # A server sentence names amounts in nanos; the CLI shows money as dollars.
    details = money_in_text(error.details() or "")
    trailers = {
        key: value for key, value in error.trailing_metadata() or () if isinstance(value, str)
    }
    reason = trailers.get(REASON_KEY, "")
    if code is grpc.StatusCode.UNAVAILABLE and not reason:
        return _unreachable(session, details)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return CliError(
            f"the ledger at {server} did not answer within {session.timeout_seconds:g} s "
            "(see --timeout)",
            EXIT_UNREACHABLE,
        )
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        field = trailers.get(FIELD_KEY, "")
        names = session.option_of_field
        option = names.get(field) or names.get(field.split("[")[0]) or field
        message = details.removeprefix(f"{field}: ")
        if "nanos" in field:
            # An amount's field: its bounds are nanos, shown in dollars as the option takes them.
            message = _BOUNDS.sub(
                lambda found: f"between {usd(int(found[1]))} and {usd(int(found[2]))}", message
            )
        # A refusal of the export file speaks of its columns, which are wire names.
        message = in_cli_words(message, fields=field != "content")
        # The same mistake exits alike whether the CLI or the server found it:
        # a value to fix, which no retry mends.
        return CliError(f"bad value for {option} (field {field}): {message}", EXIT_BAD_VALUE)
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return CliError(_unauthenticated(session, reason or code.name))
    hint = _WHAT_TO_DO.get(reason, "")
    # UNAVAILABLE with a reason (its database, its stop) is errors.json's "retry",
    # not a refusal: the status a script reads as "try again", as for no answer.
    exit_code = EXIT_UNREACHABLE if code is grpc.StatusCode.UNAVAILABLE else EXIT_FAILED
    return CliError(f"{in_cli_words(details)} ({reason or code.name}){hint}", exit_code)


# What a person can do about a refusal whose usual cause is a typo.
_WHAT_TO_DO = {
    "LANE_NOT_FOUND": ": `ledger lane list` shows the lanes, `ledger lane put` creates one",
}


def _unreachable(session: Session, details: str) -> CliError:
    """Why no call got through: nobody listening (exit 3, try again), or a TLS
    handshake that failed and why (exit 2: a TLS setting to fix, which no retry mends)."""
    server, tls = session.server, session.tls
    if "ping timeout" in details or "keepalive" in details.lower():
        # The connection was up: the server (or the network to it) went silent.
        waited = min(session.keepalive_seconds, KEEPALIVE_TIMEOUT_SECONDS)
        return CliError(
            f"the ledger at {server} stopped answering: no reply to a keepalive ping "
            f"within {waited:g} s (is it frozen, or the network to it down?)",
            EXIT_UNREACHABLE,
        )
    if "too_many_pings" in details or "too many pings" in details.lower():
        # gRPC says "Too many pings": a setting to fix, which a retry meets again.
        return CliError(
            f"the ledger at {server} ended the connection: pinged too often (GOAWAY "
            f"too_many_pings); set {KEEPALIVE_VARIABLE} at or above the server's "
            "client_ping_min_interval_seconds (4 by default)",
            EXIT_BAD_VALUE,
        )
    down = f"cannot reach the ledger at {server}: is `ledger serve` running?"
    # gRPC says only "Socket closed" both for a TLS server refusing a plaintext
    # client or a client certificate, and for a peer that closes for any other
    # reason: a TLS hello sent to it tells which.
    closed = ("Socket closed" in details or "Connection reset" in details) and speaks_tls(
        server, min(session.timeout_seconds, TLS_PROBE_SECONDS)
    )
    if tls is None:
        if closed:
            return CliError(
                f"the ledger at {server} serves TLS and this command spoke plaintext: pass "
                "--tls-ca (and --tls-cert and --tls-key if it demands a client certificate)",
                EXIT_BAD_VALUE,
            )
        if "Socket closed" in details or "Connection reset" in details:
            return CliError(f"the ledger at {server} closed the connection", EXIT_UNREACHABLE)
        return CliError(down, EXIT_UNREACHABLE)
    if "CERTIFICATE_VERIFY_FAILED" in details:
        trusted = f"the CA in {tls.ca_source}" if tls.ca_source else "the system's root CAs"
        return CliError(
            f"TLS: the certificate of the ledger at {server} is not signed by {trusted} "
            "(CERTIFICATE_VERIFY_FAILED)",
            EXIT_BAD_VALUE,
        )
    if "Hostname Verification" in details:
        name = tls.server_name or server.rsplit(":", 1)[0]
        return CliError(
            f"TLS: the certificate of the ledger at {server} is not issued to {name} "
            "(see --tls-server-name)",
            EXIT_BAD_VALUE,
        )
    if "WRONG_VERSION_NUMBER" in details:
        return CliError(
            f"TLS: the ledger at {server} does not speak TLS (WRONG_VERSION_NUMBER); "
            "leave out --tls-ca, --tls-cert and --tls-key",
            EXIT_BAD_VALUE,
        )
    if closed:
        ask = (
            f"does it trust the CA of the client certificate in {tls.client_source}?"
            if tls.client_source
            else "does it demand a client certificate (--tls-cert and --tls-key)?"
        )
        return CliError(
            f"TLS: the ledger at {server} closed the connection during the handshake: {ask}",
            EXIT_BAD_VALUE,
        )
    if "handshake" in details.lower() or "ssl" in details.lower():
        last = " ".join(details.split())[-300:]
        return CliError(
            f"TLS: the handshake with the ledger at {server} failed: {last}", EXIT_BAD_VALUE
        )
    if "Socket closed" in details or "Connection reset" in details:
        return CliError(f"the ledger at {server} closed the connection", EXIT_UNREACHABLE)
    return CliError(down, EXIT_UNREACHABLE)


# How long the TLS hello of speaks_tls waits for an answer, at most.
TLS_PROBE_SECONDS = 2.0


def speaks_tls(server: str, timeout_seconds: float) -> bool:
    """Whether the HOST:PORT `server` answers a TLS ClientHello with a TLS record
    (a handshake or an alert): a server that does is up and speaks TLS, so a
    connection it closed was refused for its TLS settings. False for anything
    else, a gRPC target scheme included."""
    if server.startswith(_TARGET_SCHEMES):
        return False
    host, _, port = server.rpartition(":")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    hello = ssl.MemoryBIO()
    tls = context.wrap_bio(ssl.MemoryBIO(), hello)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout_seconds) as peer:
            peer.sendall(hello.read())
            first = peer.recv(1)
    except OSError:
        return False
    # TLS record types: 0x15 alert, 0x16 handshake.
    return first in (b"\x15", b"\x16")


def _unauthenticated(session: Session, reason: str) -> str:
    if not session.grant_source:
        return (
            f"the ledger at {session.server} needs a grant and none was found: pass --grant, "
            f"set LEDGER_GRANT, or point LEDGER_DATA_DIR at the server's data directory ({reason})"
        )
    expired_at = _expired_at(session.grant)
    if expired_at:
        renew = (
            "restart the server, which writes a fresh one, or issue one with `ledger grant issue`"
            if session.grant_source.endswith("admin.grant")
            else "issue a new one with `ledger grant issue`"
        )
        return (
            f"the grant from {session.grant_source} expired at {expired_at} "
            f"(the ledger at {session.server} refused it): {renew}"
        )
    key_id = _key_id(session.grant)
    if not key_id:
        return (
            f"the ledger at {session.server} refused the grant from {session.grant_source} "
            f"({reason}): it is not a grant; `ledger grant inspect` says why"
        )
    return (
        f"the ledger at {session.server} refused the grant from {session.grant_source}, "
        f"signed by key {key_id} ({reason}): `ledger grant inspect --data-dir DIR`, DIR "
        "that server's data directory, checks it with that server's keyring (a keyring "
        f"elsewhere, another replica's, may hold other keys); a retired {key_id} needs "
        "a new grant"
    )


def _key_id(grant: str) -> str:
    """The key id `grant` names (unverified), or "" if it is not a grant."""
    try:
        return decode_unverified(grant).key_id
    except GrantRejected:
        return ""


def _expired_at(grant: str) -> str:
    """When `grant` expired, by this machine's clock, or "" if it has not or is
    not a grant. The server says only UNAUTHENTICATED, the same for every bad
    grant; the CLI holds the grant, so it can read its expiry (unverified)."""
    try:
        claims = decode_unverified(grant)
    except GrantRejected:
        return ""
    if claims.expires_at_us > time.time_ns() // 1000:
        return ""
    instant = datetime.datetime.fromtimestamp(claims.expires_at_us // 1_000_000, datetime.UTC)
    return instant.strftime("%Y-%m-%dT%H:%M:%SZ")


def command(behaviour: Callable[[argparse.Namespace, Session], int]) -> Callable[..., int]:
    """Wraps a command: connects, runs, and turns every expected failure into one line."""

    def run(arguments: argparse.Namespace) -> int:
        server = "the server"
        try:
            with connect(arguments) as session:
                server = session.server
                try:
                    return behaviour(arguments, session)
                except grpc.RpcError as error:
                    raise explain(error, session) from None
        except CliError as error:
            print(f"ledger: {error.message}", file=sys.stderr)
            return error.exit_code
        except KeyboardInterrupt:
            print(f"ledger: interrupted while talking to {server}", file=sys.stderr)
            return EXIT_INTERRUPTED

    return run


def common_options(
    timeout_seconds: decimal.Decimal | int = DEFAULT_TIMEOUT_SECONDS,
) -> argparse.ArgumentParser:
    """The options of every command that talks to a server. A command with another
    default --timeout takes a parser of its own: argparse's parents share their
    actions, so a child's set_defaults(timeout=...) would change every command's."""
    common = argparse.ArgumentParser(add_help=False)
    talk = common.add_argument_group("talking to the server")
    talk.add_argument(
        "--server", metavar="HOST:PORT", help=f"default LEDGER_SERVER or {DEFAULT_SERVER}"
    )
    talk.add_argument(
        "--grant",
        metavar="TOKEN",
        help="default LEDGER_GRANT, else the contents of <LEDGER_DATA_DIR or ./data>/admin.grant",
    )
    talk.add_argument(
        "--timeout",
        metavar="SECONDS",
        default=str(timeout_seconds),
        help=f"per call (default {timeout_seconds}, at most {MAX_TIMEOUT_SECONDS})",
    )
    talk.add_argument(
        "--json", action="store_true", help="machine-readable output: amounts in raw nanos"
    )
    tls = common.add_argument_group("TLS (plaintext unless --tls-ca or --tls-cert is given)")
    tls.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="PEM root certificates to check the server with; speaks TLS (default LEDGER_TLS_CA)",
    )
    tls.add_argument(
        "--tls-cert",
        metavar="FILE",
        help="PEM client certificate for mutual TLS (default LEDGER_TLS_CLIENT_CERT); "
        "without --tls-ca the system's root certificates check the server",
    )
    tls.add_argument(
        "--tls-key", metavar="FILE", help="its PEM private key (default LEDGER_TLS_CLIENT_KEY)"
    )
    tls.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="the name the server's certificate must carry, when it is not the host of "
        "--server (default LEDGER_TLS_SERVER_NAME)",
    )
    return common


_Found = TypeVar("_Found")


def last_holding(low: int, at_low: _Found, probe: Callable[[int], _Found | None]) -> _Found:
    """What `probe` finds at the largest seq at or after `low` where it still
    finds something (it does at `low`: `at_low`; once it finds nothing it
    never does again). ListEvents reads forward only, so the newest
    events are found by doubling, then halving, a seq: some 2 x log2 probes."""
    found, step = at_low, 1
    while (probe_found := probe(low + step)) is not None:  # doubling
        low, found, step = low + step, probe_found, step * 2
    high = low + step
    while high - low > 1:  # halving: found at low, nothing at high
        middle = (low + high) // 2
        probe_found = probe(middle)
        if probe_found is not None:
            low, found = middle, probe_found
        else:
            high = middle
    return found
