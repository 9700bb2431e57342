"""Commands that talk to a running server over gRPC: lanes, the moves, balance, history,
an operator's correction of a charge, reconciling with a provider's usage export.

Each command parses its own values (so a bad value gets one line naming the option),
makes a few bounded calls and prints a readable text, or JSON with `--json`. A
failed call becomes one line on stderr built from the status code and the
`ledger-reason` / `ledger-field` trailers, never a traceback. Money is integer
nanos throughout: "$0.50" and "0.50 USD" are parsed with Decimal, and anything
finer than a nano is refused rather than rounded.

Every command speaks plaintext gRPC unless it is given root certificates
(`--tls-ca`) or a client certificate (`--tls-cert` and `--tls-key`, for mutual
TLS); then it speaks TLS, and a failed handshake is explained in one line.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import decimal
import hashlib
import json
import os
import pathlib
import queue
import re
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
from google.protobuf import descriptor, duration_pb2, timestamp_pb2
from google.protobuf.message import Message

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc

NANOS_PER_USD = 10**9
MAX_INT64 = 2**63 - 1
MICROS_PER_UNIT = {"us": 1, "ms": 1000, "s": 10**6, "m": 60 * 10**6, "h": 3600 * 10**6}
MICROS_PER_UNIT["d"] = 24 * MICROS_PER_UNIT["h"]
MAX_DURATION_MICROS = 10 * 366 * MICROS_PER_UNIT["d"]
MAX_VALUE_LENGTH = 64
MAX_GRANT_BYTES = 16 * 1024
MAX_PEM_BYTES = 1024 * 1024
MAX_EXPORT_BYTES = 4 * 1024 * 1024
# A 10,000-row export takes seconds to check; the default --timeout of a reconcile.
RECONCILE_TIMEOUT_SECONDS = 120
MAX_LINES_NAMED = 10
EXPORT_FORMAT_OF_SUFFIX = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}
DEFAULT_SERVER = "127.0.0.1:50051"
DEFAULT_DATA_DIR = "data"
DEFAULT_TIMEOUT_SECONDS = decimal.Decimal(5)
MAX_TIMEOUT_SECONDS = decimal.Decimal(3600)
# Paging: every listing stops after MAX_PAGES pages of PAGE_SIZE, whatever the server says.
PAGE_SIZE = 1000
MAX_PAGES = 200
DEFAULT_HISTORY_EVENTS = 50
MAX_HISTORY_EVENTS = 10_000
# --follow: events received and not yet printed, and how often the printing
# thread looks up from waiting for them (so Ctrl-C is seen at once).
FOLLOW_QUEUE_EVENTS = 1000
FOLLOW_POLL_SECONDS = 0.1
TRACE_ID_SHOWN_CHARACTERS = 8
CORRECTION_REASON_SHOWN_CHARACTERS = 40
# A derived --correction-id: this prefix and this many hex digits of a SHA-256.
CORRECTION_ID_PREFIX = "c-"
CORRECTION_ID_HEX_DIGITS = 24
REASON_KEY = "ledger-reason"
FIELD_KEY = "ledger-field"

EXIT_FAILED = 1  # the server refused or failed the call
EXIT_BAD_VALUE = 2  # a value on the command line is wrong (as argparse does)
EXIT_UNREACHABLE = 3  # no answer from the server
EXIT_DENIED = 4  # `reserve` was answered with a denial
EXIT_INTERRUPTED = 130

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

_AMOUNT = re.compile(
    r"^(?P<sign>-?)\s*(?P<dollar>\$?)\s*(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[A-Za-z]*)$"
)
_DURATION = re.compile(r"^(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>us|ms|s|m|h|d|)$")
_COUNT = re.compile(r"^-?\d{1,19}$")
_DECIMAL = re.compile(r"^\d{1,6}(?:\.\d{1,6})?$")


class CliError(Exception):
    """A failure the user is told about in one line, with an exit code."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


# Values ----------------------------------------------------------------------


def parse_amount_nanos(option: str, text: str) -> int:
    """'$0.50', '0.50 USD', '0.50' (USD) or '500000000n' / '500000000 nanos' -> nanos."""
    match = _AMOUNT.match(text.strip()) if len(text) <= MAX_VALUE_LENGTH else None
    if match is None:
        raise CliError(
            f"{option}: {text[:MAX_VALUE_LENGTH]!r} is not an amount "
            "(write $0.50, 0.50 USD or 500000000n)",
            EXIT_BAD_VALUE,
        )
    unit = match["unit"].lower()
    number = decimal.Decimal(match["number"])
    if unit in {"n", "nanos"} and not match["dollar"]:
        if number != number.to_integral_value():
            raise CliError(f"{option}: nanos are whole numbers, not {text!r}", EXIT_BAD_VALUE)
        nanos = int(number)
    elif unit in {"", "usd"}:
        scaled = number * NANOS_PER_USD
        if scaled != scaled.to_integral_value():
            raise CliError(
                f"{option}: {text!r} is finer than one nano ($0.000000001)", EXIT_BAD_VALUE
            )
        nanos = int(scaled)
    else:
        raise CliError(f"{option}: unknown unit {match['unit']!r} (use USD or n)", EXIT_BAD_VALUE)
    if nanos > MAX_INT64:
        raise CliError(f"{option}: {text!r} is too large", EXIT_BAD_VALUE)
    return -nanos if match["sign"] else nanos


# The parts of a --price after MODEL=, in order; the last two may be left out.
PRICE_PARTS = ("input", "output", "cached input", "cache write")


def parse_price(text: str) -> tuple[str, pb.ModelPrice]:
    """'jev=0.10/0.40' (USD per million tokens, input / output), 'jev=100000000n/400000000n',
    or with the prompt cache's prices too: 'jev=0.10/0.40/0.01[/0.125]' (cached input,
    then cache write). A cache price left out is the input price, on the server."""
    model, equals, prices = text.partition("=")
    parts = prices.split("/")
    if not model or not equals or not 2 <= len(parts) <= len(PRICE_PARTS):
        raise CliError(
            f"--price: {text[:MAX_VALUE_LENGTH]!r} is not MODEL=IN/OUT[/CACHED_IN[/CACHE_WRITE]] "
            "(USD per million tokens, e.g. jev=0.10/0.40)",
            EXIT_BAD_VALUE,
        )
    nanos = [
        parse_amount_nanos(f"--price {model} {name}", part)
        for name, part in zip(PRICE_PARTS, parts, strict=False)
    ]
    price = pb.ModelPrice(
        input_nanos_per_million_tokens=nanos[0], output_nanos_per_million_tokens=nanos[1]
    )
    if len(nanos) > 2:
        price.cached_input_nanos_per_million_tokens = nanos[2]
    if len(nanos) > 3:
        price.cache_write_nanos_per_million_tokens = nanos[3]
    return model, price


def parse_duration(option: str, text: str) -> duration_pb2.Duration:
    """'90s', '2m', '24h', '1d', '250ms' (a bare number is seconds)."""
    match = _DURATION.match(text.strip()) if len(text) <= MAX_VALUE_LENGTH else None
    if match is None:
        raise CliError(
            f"{option}: {text[:MAX_VALUE_LENGTH]!r} is not a duration (write 90s, 2m, 24h or 1d)",
            EXIT_BAD_VALUE,
        )
    micros = decimal.Decimal(match["number"]) * MICROS_PER_UNIT[match["unit"] or "s"]
    if micros != micros.to_integral_value() or micros > MAX_DURATION_MICROS:
        raise CliError(
            f"{option}: {text!r} is finer than a microsecond or longer than ten years",
            EXIT_BAD_VALUE,
        )
    seconds, remainder_micros = divmod(int(micros), 10**6)
    return duration_pb2.Duration(seconds=seconds, nanos=remainder_micros * 1000)


def parse_count(option: str, text: str) -> int:
    """A whole number. A negative one goes to the server, which refuses it naming the field."""
    if not _COUNT.match(text.strip()) or not -MAX_INT64 <= int(text) <= MAX_INT64:
        raise CliError(
            f"{option}: {text[:MAX_VALUE_LENGTH]!r} is not a whole number", EXIT_BAD_VALUE
        )
    return int(text)


def parse_bytes_per_token(text: str) -> float:
    """The wire carries a double; the server keeps thousandths, so more decimals are refused."""
    if not _DECIMAL.match(text.strip()):
        raise CliError(
            f"--bytes-per-token: {text[:MAX_VALUE_LENGTH]!r} is not a number like 3.5",
            EXIT_BAD_VALUE,
        )
    value = decimal.Decimal(text.strip())
    if value * 1000 != (value * 1000).to_integral_value():
        raise CliError("--bytes-per-token: at most three decimals", EXIT_BAD_VALUE)
    return float(value)


def parse_timeout_seconds(text: str | None) -> float:
    if text is None:
        return float(DEFAULT_TIMEOUT_SECONDS)
    try:
        value = decimal.Decimal(text)
    except decimal.InvalidOperation:
        value = decimal.Decimal(-1)
    if not decimal.Decimal(0) < value <= MAX_TIMEOUT_SECONDS:
        raise CliError(
            f"--timeout: {text[:MAX_VALUE_LENGTH]!r} is not a number of seconds "
            f"between 0 and {MAX_TIMEOUT_SECONDS}",
            EXIT_BAD_VALUE,
        )
    return float(value)


# Text ------------------------------------------------------------------------


def usd(nanos: int) -> str:
    """Nanos as USD with all nine decimals: 1400 -> '$0.000001400'."""
    whole, fraction = divmod(abs(nanos), NANOS_PER_USD)
    return f"{'-' if nanos < 0 else ''}${whole}.{fraction:09d}"


def duration_text(value: duration_pb2.Duration) -> str:
    """The largest unit that states the duration exactly: 86400 s -> '1d'."""
    micros = value.seconds * 10**6 + value.nanos // 1000
    for unit in ("d", "h", "m", "s", "ms"):
        if micros and micros % MICROS_PER_UNIT[unit] == 0:
            return f"{micros // MICROS_PER_UNIT[unit]}{unit}"
    return f"{micros}us"


def time_text(value: timestamp_pb2.Timestamp) -> str:
    """UTC ISO 8601 to the millisecond, or '-' when unset."""
    if value.seconds == 0 and value.nanos == 0:
        return "-"
    instant = datetime.datetime.fromtimestamp(value.seconds, tz=datetime.UTC)
    return f"{instant:%Y-%m-%dT%H:%M:%S}.{value.nanos // 1_000_000:03d}Z"


def _enum_name(enum: Any, number: int) -> str:
    return str(enum.Name(number)).lower().replace("_", " ")


def message_json(message: Message) -> dict[str, Any]:
    """A message as JSON with amounts as plain integers (protobuf's own JSON quotes int64)."""
    result: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            result[field.name] = {
                key: _json_value(value_field, item) for key, item in value.items()
            }
        elif field.is_repeated:
            result[field.name] = [_json_value(field, item) for item in value]
        elif not field.has_presence or message.HasField(field.name):
            result[field.name] = _json_value(field, value)
    return result


def _json_value(field: Any, value: Any) -> Any:
    # `field` is a FieldDescriptor; the stubs type it two ways (pure Python and upb).
    if field.type == descriptor.FieldDescriptor.TYPE_MESSAGE:
        if isinstance(value, timestamp_pb2.Timestamp | duration_pb2.Duration):
            return value.ToJsonString()
        return message_json(value)
    if field.type == descriptor.FieldDescriptor.TYPE_ENUM:
        known = field.enum_type.values_by_number.get(value) if field.enum_type else None
        return known.name if known is not None else value
    return value


def _pairs(rows: Sequence[tuple[str, str]]) -> list[str]:
    width = max(len(name) for name, _ in rows)
    return [f"{name:<{width}}  {value}".rstrip() for name, value in rows]


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header))]
    return [_row_text(row, widths) for row in [header, *rows]]


def _row_text(row: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(f"{cell:<{width}}" for cell, width in zip(row, widths, strict=True)).rstrip()


def lane_lines(lane: pb.Lane) -> list[str]:
    rows = [("lane", lane.lane)]
    if lane.parent:
        rows.append(("parent", f"{lane.parent} (a Reserve must fit its budget too)"))
    rows += [
        ("limit", f"{usd(lane.limit_nanos)} per {duration_text(lane.window)} (rolling)"),
        ("hold ttl", duration_text(lane.hold_ttl)),
        ("bytes per token", f"{lane.bytes_per_token:g}"),
        ("overhead tokens", str(lane.overhead_tokens)),
        ("expire charge", _enum_name(pb.ExpireCharge, lane.expire_charge)),
        ("max charge", max_charge_text(lane)),
        ("version", str(lane.version)),
        ("updated at", time_text(lane.updated_at)),
    ]
    rows += [(f"price {model}", price_text(lane.prices[model])) for model in sorted(lane.prices)]
    return _pairs(rows)


def max_charge_text(lane: pb.Lane) -> str:
    """The bound on a SUCCEEDED charge, as the server states it."""
    if not lane.HasField("max_charge_multiple"):
        return "the server's default"
    multiple = lane.max_charge_multiple
    return f"{multiple}x the cap" if multiple else "no bound"


def price_text(price: pb.ModelPrice) -> str:
    """'in $X / out $Y per million tokens', and the cache prices when the lane sets them."""
    parts = [
        f"in {usd(price.input_nanos_per_million_tokens)}",
        f"out {usd(price.output_nanos_per_million_tokens)}",
    ]
    if price.HasField("cached_input_nanos_per_million_tokens"):
        parts.append(f"cached in {usd(price.cached_input_nanos_per_million_tokens)}")
    if price.HasField("cache_write_nanos_per_million_tokens"):
        parts.append(f"cache write {usd(price.cache_write_nanos_per_million_tokens)}")
    return " / ".join(parts) + " per million tokens"


def balance_lines(balance: pb.Balance) -> list[str]:
    return _pairs(
        [
            ("lane", balance.lane),
            ("as of", time_text(balance.as_of)),
            ("window", duration_text(balance.window)),
            ("limit", usd(balance.limit_nanos)),
            ("spent", usd(balance.spent_nanos)),
            ("  held", usd(balance.held_nanos)),
            ("  charged", usd(balance.charged_nanos)),
            ("available", usd(balance.available_nanos)),
            ("overrun", usd(balance.overrun_nanos)),
            ("open bookings", str(balance.open_bookings)),
        ]
    )


def balance_summary(balance: pb.Balance) -> str:
    return (
        f"lane {balance.lane}: spent {usd(balance.spent_nanos)} of {usd(balance.limit_nanos)} "
        f"(held {usd(balance.held_nanos)}, charged {usd(balance.charged_nanos)}), "
        f"available {usd(balance.available_nanos)}"
    )


def reserve_lines(reservation_id: str, response: pb.ReserveResponse) -> list[str]:
    if response.decision == pb.ADMITTED:
        first = (
            f"admitted {reservation_id}: hold {usd(response.hold_nanos)} "
            f"(cap {usd(response.cap_nanos)}), expires {time_text(response.expires_at)}"
        )
    else:
        retry = (
            f"; retry after {time_text(response.retry_after)} with a new reservation id"
            if response.HasField("retry_after")
            else ""
        )
        by = (
            f" by the budget of {response.denied_by}"
            if response.denied_by and response.denied_by != response.balance.lane
            else ""
        )
        first = (
            f"denied {reservation_id}{by}: "
            f"{_enum_name(pb.DenialReason, response.denial_reason)}: {response.reason}{retry}"
        )
    return [first, balance_summary(response.balance)]


HISTORY_HEADER = (
    "SEQ",
    "TIME (UTC)",
    "LANE",
    "KIND",
    "RESERVATION",
    "AMOUNT",
    "SPENT AFTER",
    "OUTCOME",
    "TRACE",
)
# Minimum widths, so that rows printed later by --follow stay in their columns.
HISTORY_WIDTHS = (5, 24, 8, 15, 12, 12, 12, 14, 8)


def event_outcome(event: pb.Event) -> str:
    """What ended the booking, in a few words: the 'outcome/http status' column."""
    if event.kind == "settled":
        status = f" http {event.http_status}" if event.http_status else ""
        return f"{_enum_name(pb.Outcome, event.outcome)}{status}"
    if event.kind == "refunded":
        return f"http {event.http_status}" if event.http_status else event.reason[:40]
    if event.kind == "denied":
        return _enum_name(pb.DenialReason, event.denial_reason)
    if event.kind == "lane_configured":
        return f"limit {usd(event.limit_nanos)}"
    if event.kind == "corrected":
        return correction_outcome(event)
    return "-"


def correction_outcome(event: pb.Event) -> str:
    """'was $X: why', the reason on one line and cut short: the table stays one row a line."""
    reason = " ".join(event.reason.split())
    if len(reason) > CORRECTION_REASON_SHOWN_CHARACTERS:
        reason = reason[: CORRECTION_REASON_SHOWN_CHARACTERS - 3] + "..."
    return f"was {usd(event.previous_amount_nanos)}: {reason or event.correction_id}"


def event_row(event: pb.Event) -> tuple[str, ...]:
    return (
        str(event.seq),
        time_text(event.occurred_at),
        event.lane,
        event.kind,
        event.reservation_id or "-",
        usd(event.amount_nanos),
        usd(event.spent_after_nanos),
        event_outcome(event),
        event.trace_id[:TRACE_ID_SHOWN_CHARACTERS] or "-",
    )


# Talking to the server -------------------------------------------------------


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

    def options(self) -> dict[str, Any]:
        return {"timeout": self.timeout_seconds, "metadata": self.metadata}


def resolve_grant(given: str | None) -> tuple[str, str]:
    """The grant and where it came from: --grant, else LEDGER_GRANT, else the
    admin grant the server wrote to <LEDGER_DATA_DIR or ./data>/admin.grant."""
    if given:
        return given.strip(), "--grant"
    if os.environ.get("LEDGER_GRANT"):
        return os.environ["LEDGER_GRANT"].strip(), "LEDGER_GRANT"
    path = pathlib.Path(os.environ.get("LEDGER_DATA_DIR") or DEFAULT_DATA_DIR) / "admin.grant"
    try:
        with path.open("rb") as grant_file:
            return grant_file.read(MAX_GRANT_BYTES).decode("ascii").strip(), str(path)
    except FileNotFoundError:
        return "", ""
    except (OSError, UnicodeDecodeError) as error:
        raise CliError(f"cannot read the grant in {path}: {error.__class__.__name__}") from None


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
    return Tls(
        root_certificates=read_pem(ca, ca_source, "CERTIFICATE") if ca else None,
        ca_source=ca_source,
        certificate_chain=read_pem(cert, cert_source, "CERTIFICATE") if cert else None,
        private_key=read_pem(key, key_source, "PRIVATE KEY") if key else None,
        client_source=cert_source,
        server_name=name,
    )


@contextlib.contextmanager
def connect(arguments: argparse.Namespace) -> Iterator[Session]:
    server = arguments.server or os.environ.get("LEDGER_SERVER") or DEFAULT_SERVER
    timeout_seconds = parse_timeout_seconds(arguments.timeout)
    grant, grant_source = resolve_grant(arguments.grant)
    metadata = (("authorization", f"Bearer {grant}"),) if grant else ()
    tls = resolve_tls(arguments)
    channel = (
        grpc.insecure_channel(server)
        if tls is None
        else grpc.secure_channel(server, tls.credentials(), options=tls.options())
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
        )


def explain(error: grpc.RpcError, session: Session) -> CliError:
    """One line for a failed call, from its status code and ledger trailers."""
    server = session.server
    if not isinstance(error, grpc.Call):
        return CliError(f"the call to the ledger at {server} failed")
    code = error.code()
    details = error.details() or ""
    trailers = {
        key: value for key, value in error.trailing_metadata() or () if isinstance(value, str)
    }
    reason = trailers.get(REASON_KEY, "")
    if code is grpc.StatusCode.UNAVAILABLE and not reason:
        return CliError(_unreachable(session, details), EXIT_UNREACHABLE)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return CliError(
            f"the ledger at {server} did not answer within {session.timeout_seconds:g} s "
            "(see --timeout)",
            EXIT_UNREACHABLE,
        )
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        field = trailers.get(FIELD_KEY, "")
        option = OPTION_OF_FIELD.get(field) or OPTION_OF_FIELD.get(field.split("[")[0]) or field
        message = details.removeprefix(f"{field}: ")
        return CliError(f"bad value for {option} (field {field}): {message}")
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return CliError(_unauthenticated(session, reason or code.name))
    return CliError(f"{details} ({reason or code.name})")


def _unreachable(session: Session, details: str) -> str:
    """Why no call got through: nobody listening, or a TLS handshake that failed, and why."""
    server, tls = session.server, session.tls
    closed = "Socket closed" in details or "Connection reset" in details
    if tls is None:
        if closed:
            return (
                f"the ledger at {server} closed the connection: if it serves TLS, pass --tls-ca "
                "(and --tls-cert and --tls-key if it demands a client certificate)"
            )
        return f"cannot reach the ledger at {server}: is `ledger serve` running?"
    if "CERTIFICATE_VERIFY_FAILED" in details:
        trusted = f"the CA in {tls.ca_source}" if tls.ca_source else "the system's root CAs"
        return (
            f"TLS: the certificate of the ledger at {server} is not signed by {trusted} "
            "(CERTIFICATE_VERIFY_FAILED)"
        )
    if "Hostname Verification" in details:
        name = tls.server_name or server.rsplit(":", 1)[0]
        return (
            f"TLS: the certificate of the ledger at {server} is not issued to {name} "
            "(see --tls-server-name)"
        )
    if "WRONG_VERSION_NUMBER" in details:
        return (
            f"TLS: the ledger at {server} does not speak TLS (WRONG_VERSION_NUMBER); "
            "leave out --tls-ca, --tls-cert and --tls-key"
        )
    if closed:
        ask = (
            f"does it trust the CA of the client certificate in {tls.client_source}?"
            if tls.client_source
            else "does it demand a client certificate (--tls-cert and --tls-key)?"
        )
        return f"TLS: the ledger at {server} closed the connection during the handshake: {ask}"
    if "handshake" in details.lower() or "ssl" in details.lower():
        last = " ".join(details.split())[-300:]
        return f"TLS: the handshake with the ledger at {server} failed: {last}"
    return f"cannot reach the ledger at {server}: is `ledger serve` running?"


def _unauthenticated(session: Session, reason: str) -> str:
    if not session.grant_source:
        return (
            f"the ledger at {session.server} needs a grant and none was found: pass --grant, "
            f"set LEDGER_GRANT, or point LEDGER_DATA_DIR at the server's data directory ({reason})"
        )
    return (
        f"the ledger at {session.server} refused the grant from {session.grant_source} ({reason})"
    )


def _command(behaviour: Callable[[argparse.Namespace, Session], int]) -> Callable[..., int]:
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


def _emit(arguments: argparse.Namespace, message: Message, lines: Sequence[str]) -> None:
    if arguments.json:
        print(json.dumps(message_json(message), sort_keys=True))
    else:
        print("\n".join(lines))


# Commands --------------------------------------------------------------------


def lane_put(arguments: argparse.Namespace, session: Session) -> int:
    prices: dict[str, pb.ModelPrice] = {}
    for text in arguments.price:
        model, price = parse_price(text)
        if model in prices:
            raise CliError(f"--price: model {model!r} is priced twice", EXIT_BAD_VALUE)
        prices[model] = price
    lane = pb.Lane(
        lane=arguments.lane,
        limit_nanos=parse_amount_nanos("--limit", arguments.limit),
        prices=prices,
        expire_charge=pb.ZERO if arguments.expire_charge == "zero" else pb.HOLD,
    )
    if arguments.window is not None:
        lane.window.CopyFrom(parse_duration("--window", arguments.window))
    if arguments.hold_ttl is not None:
        lane.hold_ttl.CopyFrom(parse_duration("--hold-ttl", arguments.hold_ttl))
    if arguments.bytes_per_token is not None:
        lane.bytes_per_token = parse_bytes_per_token(arguments.bytes_per_token)
    if arguments.overhead_tokens is not None:
        lane.overhead_tokens = parse_count("--overhead-tokens", arguments.overhead_tokens)
    if arguments.parent is not None:
        lane.parent = arguments.parent
    if arguments.max_charge_multiple is not None:
        lane.max_charge_multiple = parse_count(
            "--max-charge-multiple", arguments.max_charge_multiple
        )
    saved = session.admin.PutLane(pb.PutLaneRequest(lane=lane), **session.options())
    _emit(arguments, saved, lane_lines(saved))
    return 0


def lane_show(arguments: argparse.Namespace, session: Session) -> int:
    lane = session.admin.GetLane(pb.GetLaneRequest(lane=arguments.lane), **session.options())
    _emit(arguments, lane, lane_lines(lane))
    return 0


def lane_list(arguments: argparse.Namespace, session: Session) -> int:
    lanes: list[pb.Lane] = []
    token = ""
    for _ in range(MAX_PAGES):
        request = pb.ListLanesRequest(page_size=PAGE_SIZE, page_token=token)
        page = session.admin.ListLanes(request, **session.options())
        lanes.extend(page.lanes)
        token = page.next_page_token
        if not token:
            break
    else:
        print(f"ledger: showing the first {len(lanes)} lanes only", file=sys.stderr)
    if arguments.json:
        print(json.dumps({"lanes": [message_json(lane) for lane in lanes]}, sort_keys=True))
        return 0
    header = ("LANE", "PARENT", "LIMIT", "WINDOW", "HOLD TTL", "MODELS", "VERSION", "UPDATED (UTC)")
    rows = [
        (
            lane.lane,
            lane.parent or "-",
            usd(lane.limit_nanos),
            duration_text(lane.window),
            duration_text(lane.hold_ttl),
            ",".join(sorted(lane.prices)),
            str(lane.version),
            time_text(lane.updated_at),
        )
        for lane in lanes
    ]
    print(
        "\n".join(_table(header, rows))
        if rows
        else "no lanes yet: create one with `ledger lane put`"
    )
    return 0


def reserve(arguments: argparse.Namespace, session: Session) -> int:
    request = pb.ReserveRequest(
        lane=arguments.lane,
        reservation_id=arguments.reservation_id,
        model=arguments.model,
        request_bytes=parse_count("--request-bytes", arguments.request_bytes),
        max_output_tokens=parse_count("--max-output-tokens", arguments.max_output_tokens),
    )
    if arguments.estimate is not None:
        request.estimate_nanos = parse_amount_nanos("--estimate", arguments.estimate)
    if arguments.ttl is not None:
        request.ttl.CopyFrom(parse_duration("--ttl", arguments.ttl))
    response = session.ledger.Reserve(request, **session.options())
    _emit(arguments, response, reserve_lines(arguments.reservation_id, response))
    return 0 if response.decision == pb.ADMITTED else EXIT_DENIED


def settle(arguments: argparse.Namespace, session: Session) -> int:
    request = pb.SettleRequest(
        lane=arguments.lane,
        reservation_id=arguments.reservation_id,
        outcome=pb.SUCCEEDED if arguments.outcome == "succeeded" else pb.UNKNOWN,
        input_tokens=parse_count("--input-tokens", arguments.input_tokens),
        output_tokens=parse_count("--output-tokens", arguments.output_tokens),
        http_status=parse_count("--http-status", arguments.http_status),
        cached_input_tokens=parse_count("--cached-input-tokens", arguments.cached_input_tokens),
        cache_write_tokens=parse_count("--cache-write-tokens", arguments.cache_write_tokens),
    )
    if arguments.billed is not None:
        request.billed_nanos = parse_amount_nanos("--billed", arguments.billed)
    response = session.ledger.Settle(request, **session.options())
    state = _enum_name(pb.BookingState, response.state)
    lines = [
        f"{state} {arguments.reservation_id}: charged {usd(response.charged_nanos)}",
        balance_summary(response.balance),
    ]
    _emit(arguments, response, lines)
    return 0


def refund(arguments: argparse.Namespace, session: Session) -> int:
    request = pb.RefundRequest(
        lane=arguments.lane,
        reservation_id=arguments.reservation_id,
        http_status=parse_count("--http-status", arguments.http_status),
        reason=arguments.reason,
    )
    response = session.ledger.Refund(request, **session.options())
    lines = [
        f"refunded {arguments.reservation_id}: charged {usd(0)}",
        balance_summary(response.balance),
    ]
    _emit(arguments, response, lines)
    return 0


def correction_id(lane: str, reservation_id: str, charge_nanos: int, reason: str) -> str:
    """The id of a correction given no --correction-id: derived from what it says, so
    that running the same command again is the same correction (answered, not redone)."""
    content = json.dumps([lane, reservation_id, charge_nanos, reason], ensure_ascii=False)
    digest = hashlib.sha256(content.encode("utf-8")).hexdigest()
    return CORRECTION_ID_PREFIX + digest[:CORRECTION_ID_HEX_DIGITS]


def correct(arguments: argparse.Namespace, session: Session) -> int:
    charge_nanos = parse_amount_nanos("--charge", arguments.charge)
    chosen_id = arguments.correction_id or correction_id(
        arguments.lane, arguments.reservation_id, charge_nanos, arguments.reason
    )
    request = pb.CorrectRequest(
        lane=arguments.lane,
        reservation_id=arguments.reservation_id,
        charge_nanos=charge_nanos,
        reason=arguments.reason,
        correction_id=chosen_id,
    )
    response = session.ledger.Correct(request, **session.options())
    lines = [
        f"corrected {arguments.reservation_id}: charge {usd(response.previous_charge_nanos)} "
        f"-> {usd(response.charged_nanos)}",
        balance_summary(response.balance),
    ]
    _emit(arguments, response, lines)
    return 0


def balance(arguments: argparse.Namespace, session: Session) -> int:
    value = session.ledger.GetBalance(
        pb.GetBalanceRequest(lane=arguments.lane), **session.options()
    )
    _emit(arguments, value, balance_lines(value))
    return 0


def history(arguments: argparse.Namespace, session: Session) -> int:
    limit = parse_count("--limit", arguments.limit)
    if not 1 <= limit <= MAX_HISTORY_EVENTS:
        raise CliError(f"--limit: must be between 1 and {MAX_HISTORY_EVENTS}", EXIT_BAD_VALUE)
    after_seq = parse_count("--after-seq", arguments.after_seq)
    if arguments.lane:
        # Fails with a clear "does not exist" instead of an empty table.
        session.admin.GetLane(pb.GetLaneRequest(lane=arguments.lane), **session.options())
    events, last_seq = recent_events(arguments, session, after_seq, limit)
    widths = _history_widths(events)
    columns = _history_columns(arguments)
    if not arguments.json:
        print(_row_text([HISTORY_HEADER[i] for i in columns], [widths[i] for i in columns]))
    for event in events:
        _print_event(arguments, event, widths, columns)
    if arguments.follow:
        return follow(arguments, session, last_seq, widths, columns)
    return 0


def recent_events(
    arguments: argparse.Namespace, session: Session, after_seq: int, limit: int
) -> tuple[list[pb.Event], int]:
    """The newest `limit` events after `after_seq`, and the last seq read."""
    kept: collections.deque[pb.Event] = collections.deque(maxlen=limit)
    last_seq = after_seq
    token = ""
    for _ in range(MAX_PAGES):
        request = pb.ListEventsRequest(
            lane=arguments.lane or "",
            reservation_id=arguments.reservation_id or "",
            page_size=PAGE_SIZE,
            page_token=token,
            after_seq=after_seq,
        )
        page = session.ledger.ListEvents(request, **session.options())
        kept.extend(page.events)
        last_seq = page.events[-1].seq if page.events else last_seq
        token = page.next_page_token
        if not token:
            return list(kept), last_seq
    print(
        f"ledger: read {MAX_PAGES * PAGE_SIZE} events and stopped; "
        f"use --after-seq {last_seq} to read on",
        file=sys.stderr,
    )
    return list(kept), last_seq


def follow(
    arguments: argparse.Namespace,
    session: Session,
    after_seq: int,
    widths: Sequence[int],
    columns: Sequence[int],
) -> int:
    """Tails the log until Ctrl-C; the only loop that the user, not a limit, ends.

    The stream is read in a thread of its own and printed here, so that the
    KeyboardInterrupt of a Ctrl-C is raised in this loop, never inside
    grpc's own code halfway through a step of the stream (with its locks
    held, where it once left the command hanging after Ctrl-C)."""
    request = pb.WatchEventsRequest(lane=arguments.lane or "", after_seq=after_seq)
    stream = session.ledger.WatchEvents(request, metadata=session.metadata)
    received: queue.Queue[pb.Event | grpc.RpcError | None] = queue.Queue(FOLLOW_QUEUE_EVENTS)

    def receive() -> None:
        try:
            for event in stream:
                received.put(event)
            received.put(None)
        except grpc.RpcError as error:
            received.put(error)

    threading.Thread(target=receive, name="ledger-follow", daemon=True).start()
    try:
        while True:
            try:
                item = received.get(timeout=FOLLOW_POLL_SECONDS)
            except queue.Empty:
                continue
            if item is None:
                break
            if isinstance(item, grpc.RpcError):
                raise item
            if arguments.reservation_id and item.reservation_id != arguments.reservation_id:
                continue
            _print_event(arguments, item, widths, columns)
    except KeyboardInterrupt:
        return 0
    finally:
        stream.cancel()  # type: ignore[no-untyped-call]  # grpc-stubs leaves it untyped
    raise CliError(f"the ledger at {session.server} ended the stream")


def _history_columns(arguments: argparse.Namespace) -> list[int]:
    """Every column, less LANE when one lane is asked for."""
    return [i for i, name in enumerate(HISTORY_HEADER) if name != "LANE" or not arguments.lane]


def _history_widths(events: Sequence[pb.Event]) -> list[int]:
    rows = [HISTORY_HEADER, *(event_row(event) for event in events)]
    return [
        max(minimum, *(len(row[i]) for row in rows)) for i, minimum in enumerate(HISTORY_WIDTHS)
    ]


def _print_event(
    arguments: argparse.Namespace, event: pb.Event, widths: Sequence[int], columns: Sequence[int]
) -> None:
    if arguments.json:
        print(json.dumps(message_json(event), sort_keys=True), flush=True)
        return
    row = event_row(event)
    print(_row_text([row[i] for i in columns], [widths[i] for i in columns]), flush=True)


# Reconciling -----------------------------------------------------------------

RECONCILE_HEADER = ("LINE", "LANE", "RESERVATION", "STATUS", "BEFORE -> AFTER", "MESSAGE")
# Rows whose before and after are charges of a booking the ledger found.
STATUSES_WITH_AMOUNTS = frozenset(
    {"corrected", "matched", "disagrees", "replaced", "open", "refunded"}
)


def read_export(
    path_text: str, chosen_format: str | None
) -> tuple[bytes, pb.ReconcileRequest.Format.ValueType]:
    """The export's bytes (at most MAX_EXPORT_BYTES) and its wire format."""
    path = pathlib.Path(path_text)
    export_format = chosen_format or EXPORT_FORMAT_OF_SUFFIX.get(path.suffix.lower())
    if export_format is None:
        raise CliError(
            f"FILE: cannot tell the format of {path} from its extension: "
            "pass --format csv or --format jsonl",
            EXIT_BAD_VALUE,
        )
    try:
        with path.open("rb") as export:
            content = export.read(MAX_EXPORT_BYTES + 1)
    except FileNotFoundError:
        raise CliError(f"FILE: there is no file {path}", EXIT_BAD_VALUE) from None
    except OSError as error:
        reason = error.strerror or error.__class__.__name__
        raise CliError(f"FILE: cannot read {path} ({reason})", EXIT_BAD_VALUE) from None
    if len(content) > MAX_EXPORT_BYTES:
        raise CliError(
            f"FILE: {path} is larger than {MAX_EXPORT_BYTES // (1024 * 1024)} MiB: "
            "split the export into smaller files",
            EXIT_BAD_VALUE,
        )
    wire = pb.ReconcileRequest.CSV if export_format == "csv" else pb.ReconcileRequest.JSONL
    return content, wire


def reconcile_row(row: pb.ReconcileRow) -> tuple[str, ...]:
    amounts = (
        f"{usd(row.before_nanos)} -> {usd(row.after_nanos)}"
        if row.status in STATUSES_WITH_AMOUNTS
        else "-"
    )
    # The server's message may already start with its field.
    message = row.message.removeprefix(f"{row.field}: ")
    message = f"{row.field}: {message}" if row.field else message
    return (
        str(row.line),
        row.lane or "-",
        row.reservation_id or "-",
        row.status,
        amounts,
        " ".join(message.split()),
    )


def reconcile_lines(
    response: pb.ReconcileResponse, dry_run: bool, bill_wins: bool = False
) -> list[str]:
    if response.bad_count:
        verdict = "not applied: the file has bad rows, so nothing changed"
    elif response.applied:
        verdict = "applied"
    elif dry_run:
        verdict = "dry run: nothing changed; without --dry-run this file would apply"
    else:
        verdict = "not applied"
    rows = [reconcile_row(row) for row in response.rows]
    table = _table(RECONCILE_HEADER, rows) if rows else ["the file holds no rows"]
    counts = (
        # The good rows of a refused file are listed as not_applied: they were never checked.
        f"{response.bad_count} bad, {len(rows) - response.bad_count} not checked"
        if response.bad_count
        else f"{response.corrected_count} corrected, {response.matched_count} matched, "
        f"{response.unmatched_count} unmatched, {response.disagreement_count} disagreeing"
        # Only a --bill-wins run replaces charges, so only it counts them.
        + (f", {response.replaced_count} replaced" if bill_wins or response.replaced_count else "")
    )
    totals = _pairs(
        [
            ("estimated before", usd(response.estimated_before_nanos)),
            ("real after", usd(response.real_after_nanos)),
            ("difference", usd(response.difference_nanos)),
        ]
    )
    return [*table, "", f"{verdict}: {counts}", *totals]


def _reconcile_failure(
    error: grpc.RpcError, arguments: argparse.Namespace, session: Session
) -> CliError:
    """A failed Reconcile, saying whether the file may have applied all the same."""
    if not isinstance(error, grpc.Call):
        return explain(error, session)
    code, details = error.code(), " ".join((error.details() or "").split())
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and "Received message" in details:
        return CliError(
            f"the ledger at {session.server} takes no message as large as {arguments.file} "
            f"({details}): split the export into smaller files"
        )
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        failure = f"could not send its answer, larger than its message limit ({details})"
    elif code is grpc.StatusCode.DEADLINE_EXCEEDED:
        failure = f"did not answer within {session.timeout_seconds:g} s (see --timeout)"
    else:
        return explain(error, session)
    outcome = (
        "nothing changed (a dry run)"
        if arguments.dry_run
        else "the file may have applied: send it again with --dry-run to see "
        "(rows already corrected show as matched)"
    )
    return CliError(
        f"the ledger at {session.server} {failure}; {outcome}; split the export into smaller files",
        EXIT_UNREACHABLE if code is grpc.StatusCode.DEADLINE_EXCEEDED else EXIT_FAILED,
    )


def reconcile(arguments: argparse.Namespace, session: Session) -> int:
    content, wire_format = read_export(arguments.file, arguments.format)
    request = pb.ReconcileRequest(
        format=wire_format,
        content=content,
        default_lane=arguments.lane or "",
        dry_run=arguments.dry_run,
        bill_wins=arguments.bill_wins,
    )
    try:
        response = session.ledger.Reconcile(request, **session.options())
    except grpc.RpcError as error:
        raise _reconcile_failure(error, arguments, session) from None
    lines = reconcile_lines(response, arguments.dry_run, arguments.bill_wins)
    _emit(arguments, response, lines)
    if response.bad_count:
        bad = [str(row.line) for row in response.rows if row.status == "bad"]
        shown = ", ".join(bad[:MAX_LINES_NAMED]) + (", ..." if len(bad) > MAX_LINES_NAMED else "")
        print(
            f"ledger: not applied: {response.bad_count} bad "
            f"{'row (line' if len(bad) == 1 else 'rows (lines'} {shown}); nothing changed",
            file=sys.stderr,
        )
        return EXIT_FAILED
    return 0 if response.applied or arguments.dry_run else EXIT_FAILED


# Wiring ----------------------------------------------------------------------


def _common_options() -> argparse.ArgumentParser:
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
        "--timeout", metavar="SECONDS", help=f"per call (default {DEFAULT_TIMEOUT_SECONDS})"
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


def register(commands: Any) -> None:
    common = _common_options()
    _register_lane(commands, common)
    _register_moves(commands, common)
    _register_reading(commands, common)
    _register_reconcile(commands, common)


def _register_lane(commands: Any, common: argparse.ArgumentParser) -> None:
    lane = commands.add_parser("lane", help="create, show and list lanes")
    actions = lane.add_subparsers(dest="lane_command", required=True, metavar="ACTION")
    put = actions.add_parser("put", parents=[common], help="create or replace a lane's policy")
    put.add_argument("lane", metavar="LANE")
    put.add_argument(
        "--limit",
        required=True,
        metavar="AMOUNT",
        help="most booked inside one window: $0.50, 0.50 USD or 500000000n",
    )
    put.add_argument(
        "--price",
        action="append",
        required=True,
        metavar="MODEL=IN/OUT[/CACHED_IN[/CACHE_WRITE]]",
        help="USD per million tokens, e.g. jev=0.10/0.40 (or nanos: "
        "jev=100000000n/400000000n); CACHED_IN and CACHE_WRITE price the input tokens "
        "read from and written to the prompt cache (default: IN); repeat for each model",
    )
    put.add_argument("--window", metavar="DURATION", help="rolling window (default 24h)")
    put.add_argument("--hold-ttl", metavar="DURATION", help="hold lifetime (default 120s)")
    put.add_argument("--bytes-per-token", metavar="NUMBER", help="default 3.5")
    put.add_argument("--overhead-tokens", metavar="N", help="default 0")
    put.add_argument(
        "--expire-charge",
        choices=("hold", "zero"),
        default="hold",
        help="what an expired booking costs (default hold)",
    )
    put.add_argument(
        "--parent",
        metavar="LANE",
        help="a parent budget (another lane) that every Reserve must fit too; "
        "a put replaces the whole policy, so leave it out to have none",
    )
    put.add_argument(
        "--max-charge-multiple",
        metavar="N",
        help="refuse a SUCCEEDED charge above N times the booking's cap (default 100; 0: no bound)",
    )
    put.set_defaults(run=_command(lane_put))
    show = actions.add_parser("show", parents=[common], help="show a lane's policy")
    show.add_argument("lane", metavar="LANE")
    show.set_defaults(run=_command(lane_show))
    listing = actions.add_parser("list", parents=[common], help="list every lane")
    listing.set_defaults(run=_command(lane_list))


def _register_moves(commands: Any, common: argparse.ArgumentParser) -> None:
    book = commands.add_parser(
        "reserve",
        parents=[common],
        help="book a hold for one planned model call (exits 4 if denied)",
    )
    book.add_argument("lane", metavar="LANE")
    book.add_argument("reservation_id", metavar="RESERVATION_ID")
    book.add_argument("--model", required=True)
    book.add_argument("--request-bytes", required=True, metavar="N")
    book.add_argument("--max-output-tokens", required=True, metavar="N")
    book.add_argument("--estimate", metavar="AMOUNT", help="hold min(estimate, cap)")
    book.add_argument("--ttl", metavar="DURATION", help="at most the lane's hold ttl")
    book.set_defaults(run=_command(reserve))

    end = commands.add_parser("settle", parents=[common], help="end a booking with its outcome")
    end.add_argument("lane", metavar="LANE")
    end.add_argument("reservation_id", metavar="RESERVATION_ID")
    end.add_argument("--outcome", required=True, choices=("succeeded", "unknown"))
    end.add_argument("--input-tokens", default="0", metavar="N")
    end.add_argument("--output-tokens", default="0", metavar="N")
    end.add_argument("--billed", metavar="AMOUNT", help="the provider's billed amount")
    end.add_argument("--http-status", default="0", metavar="N")
    end.add_argument(
        "--cached-input-tokens",
        default="0",
        metavar="N",
        help="the part of --input-tokens read from the prompt cache",
    )
    end.add_argument(
        "--cache-write-tokens",
        default="0",
        metavar="N",
        help="the part of --input-tokens written to the prompt cache",
    )
    end.set_defaults(run=_command(settle))

    back = commands.add_parser(
        "refund", parents=[common], help="end a refused (4xx) or never-sent call: charge zero"
    )
    back.add_argument("lane", metavar="LANE")
    back.add_argument("reservation_id", metavar="RESERVATION_ID")
    back.add_argument(
        "--http-status",
        default="0",
        metavar="N",
        help="the provider's 4xx; leave out for a call never sent",
    )
    back.add_argument(
        "--reason", default="", metavar="TEXT", help="required when there is no --http-status"
    )
    back.set_defaults(run=_command(refund))

    fix = commands.add_parser(
        "correct",
        parents=[common],
        help="replace the charge of an ended booking (admin grant only)",
        description="Replaces the charge of an ended booking, recorded as a `corrected` "
        "event with the reason. Without --correction-id the id is derived from the lane, "
        "reservation id, charge and reason, so running the same command again changes "
        "nothing; pass --correction-id to make the same correction anew.",
    )
    fix.add_argument("lane", metavar="LANE")
    fix.add_argument("reservation_id", metavar="RESERVATION_ID")
    fix.add_argument(
        "--charge",
        required=True,
        metavar="AMOUNT",
        help="the new charge: $0.50, 0.50 USD or 500000000n",
    )
    fix.add_argument("--reason", required=True, metavar="TEXT", help="why, kept in the event")
    fix.add_argument(
        "--correction-id",
        metavar="ID",
        help="unique within the lane; a retry reuses it (default: derived from the content)",
    )
    fix.set_defaults(run=_command(correct))


def _register_reading(commands: Any, common: argparse.ArgumentParser) -> None:
    money = commands.add_parser("balance", parents=[common], help="a lane's window right now")
    money.add_argument("lane", metavar="LANE")
    money.set_defaults(run=_command(balance))

    log = commands.add_parser("history", parents=[common], help="the event log as a table")
    log.add_argument("lane", metavar="LANE", nargs="?", help="default: every lane")
    log.add_argument("--reservation-id", metavar="ID", help="only this booking's events")
    log.add_argument(
        "--limit",
        default=str(DEFAULT_HISTORY_EVENTS),
        metavar="N",
        help=f"the newest N events (default {DEFAULT_HISTORY_EVENTS})",
    )
    log.add_argument("--after-seq", default="0", metavar="SEQ", help="only events after SEQ")
    log.add_argument("--follow", action="store_true", help="then print new events until Ctrl-C")
    log.set_defaults(run=_command(history))


def _register_reconcile(commands: Any, common: argparse.ArgumentParser) -> None:
    fix = commands.add_parser(
        "reconcile",
        parents=[common],
        help="correct UNKNOWN and expired charges from the provider's usage export",
        description="Sends a provider's usage export (CSV with a header row, or JSON lines; "
        "keys reservation_id, lane, billed_nanos or billed_usd, input_tokens, output_tokens, "
        "model) to the ledger. The file applies in full or not at all. A real charge that "
        "disagrees with the bill is flagged, not changed, unless --bill-wins: then the bill "
        "replaces it (status replaced, a `corrected` event). Exits 0 when it "
        "applied (or a --dry-run found no bad row), 1 when bad rows kept it from applying. "
        f"--timeout is {RECONCILE_TIMEOUT_SECONDS} s here unless given.",
    )
    fix.add_argument(
        "file", metavar="FILE", help=f"the export, at most {MAX_EXPORT_BYTES // 2**20} MiB"
    )
    fix.add_argument(
        "--format",
        choices=("csv", "jsonl"),
        help="default from the extension: .csv, or .jsonl / .ndjson",
    )
    fix.add_argument("--lane", metavar="LANE", help="the lane of rows that name none")
    fix.add_argument(
        "--dry-run", action="store_true", help="show what would change; change nothing"
    )
    fix.add_argument(
        "--bill-wins",
        action="store_true",
        help="replace real charges that disagree with the bill (default: flag them, "
        "change nothing)",
    )
    fix.set_defaults(run=_command(reconcile), timeout=str(RECONCILE_TIMEOUT_SECONDS))
