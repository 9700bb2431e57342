"""Text for people: money with all nine decimals, durations, UTC times,
aligned tables and pairs; and JSON with amounts as plain integers (`--json`)."""

from __future__ import annotations

import argparse
import datetime
import json
import re
from collections.abc import Sequence
from typing import Any

from google.protobuf import descriptor, duration_pb2, timestamp_pb2
from google.protobuf.message import Message

from ledger_service.cli.values import MICROS_PER_UNIT
from ledger_service.domain.pricing import NANOS_PER_USD

# "280000 nanos" in a sentence the server wrote (a denial's reason, say).
_NANOS_IN_TEXT = re.compile(r"(?<![\w.$])(-?\d+) nanos\b")


def usd(nanos: int) -> str:
    """Nanos as USD with all nine decimals: 1400 -> '$0.000001400'."""
    whole, fraction = divmod(abs(nanos), NANOS_PER_USD)
    return f"{'-' if nanos < 0 else ''}${whole}.{fraction:09d}"


def money_in_text(text: str) -> str:
    """A server's sentence with each 'N nanos' shown as usd(N), like the rest of the output."""
    return _NANOS_IN_TEXT.sub(lambda found: usd(int(found[1])), text)


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
    return _instant_text(value.seconds, value.nanos)


def _instant_text(seconds: int, nanos: int) -> str:
    instant = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    return f"{instant:%Y-%m-%dT%H:%M:%S}.{nanos // 1_000_000:03d}Z"


def not_before_text(value: timestamp_pb2.Timestamp) -> str:
    """As time_text, rounded up to the millisecond: an instant the reader may act
    at (a denial's retry_after), never shown before the server's own."""
    later = timestamp_pb2.Timestamp()
    later.FromNanoseconds(-(-value.ToNanoseconds() // 1_000_000) * 1_000_000)
    return time_text(later)


def micros_time_text(at_us: int) -> str:
    """An instant in microseconds since the epoch, as time_text shows it. It is
    always one (verify's --at-us takes 0), so 0 is 1970-01-01, never '-'."""
    seconds, rest_us = divmod(at_us, 10**6)
    return _instant_text(seconds, rest_us * 1000)


def enum_name(enum: Any, number: int) -> str:
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


def pairs(rows: Sequence[tuple[str, str]]) -> list[str]:
    width = max(len(name) for name, _ in rows)
    return [f"{name:<{width}}  {value}".rstrip() for name, value in rows]


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    shown = [[cell_text(cell) for cell in row] for row in [header, *rows]]
    widths = [max(len(row[column]) for row in shown) for column in range(len(header))]
    return [row_text(row, widths) for row in shown]


def cell_text(value: str) -> str:
    """A cell with its control characters escaped (ESC as \\x1b, a newline as
    \\n): a reconcile row echoes the export's own bytes, which must neither
    break the table nor reach the terminal as escape sequences."""
    if value.isprintable():
        return value
    return "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in value
    )


def row_text(row: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(f"{cell:<{width}}" for cell, width in zip(row, widths, strict=True)).rstrip()


def emit(arguments: argparse.Namespace, message: Message, lines: Sequence[str]) -> None:
    if arguments.json:
        print(json.dumps(message_json(message), sort_keys=True))
    else:
        print("\n".join(lines))
