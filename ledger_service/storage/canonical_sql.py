"""Canonical texts written by SQLite itself: an event's (domain/chain.py),
for the rebuild's hash checks, and a booking's, for its digest (below).

Checking an event's hash needs its canonical text: compact JSON with sorted
keys of its hashed fields, those at their default left out. Made in Python
from the row (content_check), reading the 38-column row and writing the text
cost about 11 us an event, most of a rebuild's work. SQLite writes the same
text from the row in C, so that a checking process reads five short columns
and the text, and is left the SHA-256.

The expression is made from Event's fields, their types and defaults, as
chain.canonical_event reads them, so a field added to Event is written here
too (or refused at import, for a type this module does not know):

- a field at its default is left out: an int 0 where the default is 0, a
  text '' where it is '', a NULL where it is None;
- an int is written as SQLite writes an integer as text, which is the
  decimal Python and json write;
- a text through json_quote; an enum's value in quotes (their values are
  plain, see chain.plain_enum);
- a lane's policy (lane_configured) is not written here.

It is a fast path, never the judge. Wherever the row is not what the Python
text expects (a value of another type, a value no enum member has, a
policy), the expression is NULL and the caller makes the text in Python, as
before. Where the texts could differ (json_quote writes non-ASCII characters
as they are and DEL unescaped, where Python escapes them), a text that does
not give the stored hash is made again in Python before the event is called
altered. A text from here that does give the stored hash is sound: it is a
JSON text of the row's values, and it is the text that was hashed when the
event was appended; decoded, the two are the same values.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
import weakref
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError

from ledger_service.domain import chain
from ledger_service.domain.bookings import Booking
from ledger_service.domain.events import Event

_FIELDS = {field.name: field for field in dataclasses.fields(Event)}


def _quoted_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _piece(name: str) -> str:
    """The SQL text of one hashed field: ',"name":value', '' at its default,
    NULL where the row is not as expected."""
    field = _FIELDS[name]
    kind: Any = typing.get_type_hints(Event)[name]
    column = "policy_json" if name == "policy" else name
    lead = _quoted_literal("," + chain.field_key(name))
    arguments = typing.get_args(kind)
    optional = isinstance(kind, types.UnionType) and type(None) in arguments
    if optional:
        others = [argument for argument in arguments if argument is not type(None)]
        assert len(others) == 1, f"Event.{name}: one type besides None expected"
        kind = others[0]
    if name == "policy":
        return f"CASE WHEN {column} IS NULL THEN '' END"
    default = field.default
    if default is None and not optional:
        raise TypeError(f"Event.{name}: a None default on a field that is not optional")
    at_null = f"WHEN {column} IS NULL THEN '' " if optional else ""
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        values = [member._value_ for member in kind]
        assert chain.plain_enum(kind), f"Event.{name}: an enum not written as its value"
        listed = ", ".join(_quoted_literal(value) for value in values)
        return (
            f"CASE {at_null}WHEN {column} IN ({listed}) THEN {lead} || '\"' || {column} || '\"' END"
        )
    if kind is int:
        at_zero = f"CASE {column} WHEN 0 THEN '' ELSE {lead} || {column} END"
        written = at_zero if default == 0 else f"{lead} || {column}"
        nothing = "WHEN 'null' THEN '' " if optional else ""
        return f"CASE typeof({column}) {nothing}WHEN 'integer' THEN {written} END"
    if kind is str:
        quoted = f"{lead} || json_quote({column})"
        written = f"CASE {column} WHEN '' THEN '' ELSE {quoted} END" if default == "" else quoted
        nothing = "WHEN 'null' THEN '' " if optional else ""
        return f"CASE typeof({column}) {nothing}WHEN 'text' THEN {written} END"
    raise TypeError(f"Event.{name}: no SQL text for a field of type {kind!r}")


def _check_defaults() -> None:
    for name in chain.HASHED_NAMES:
        default = _FIELDS[name].default
        if default not in (dataclasses.MISSING, None, 0, "") or isinstance(default, bool):
            raise TypeError(f"Event.{name}: a default the SQL text cannot leave out")


_check_defaults()

# The hashed fields' pieces in sorted-key order, the first one's comma cut off.
# Every piece is NULL where the row is not as expected, and so is the whole.
EVENT_TEXT = (
    "'{' || substr(" + " || ".join(_piece(name) for name in chain.HASHED_NAMES) + ", 2) || '}'"
)


# A booking's canonical text ------------------------------------------------------
#
# chain.canonical_json of the Booking a row of the bookings table holds (the
# digest's lines, domain/snapshots.py): every field, sorted keys, the price an
# object of its own. Unlike an event's text, nothing checks it afterwards, so
# it is written only where it is the Python text by construction, and is NULL
# elsewhere (the caller makes that row's text in Python):
#
# - every integer column holds an integer (or NULL, where the field may be None);
# - every enum column holds one of its enum's values (or NULL, where it may);
# - every free text holds ASCII without DEL, which json_object and Python's
#   json escape alike (control characters included; see the tests).


def _booking_value(name: str, kind: Any) -> tuple[str, str]:
    """The json_object argument of one Booking field, and its guard."""
    arguments = typing.get_args(kind)
    optional = isinstance(kind, types.UnionType) and type(None) in arguments
    if optional:
        kind = next(argument for argument in arguments if argument is not type(None))
    if dataclasses.is_dataclass(kind):
        inner = [(field, *_booking_value(field, hint)) for field, hint in _sorted_hints(kind)]
        members = ", ".join(f"{_quoted_literal(field)}, {value}" for field, value, _ in inner)
        return f"json_object({members})", " AND ".join(guard for _, _, guard in inner)
    nullable = f"{name} IS NULL OR " if optional else ""
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        assert chain.plain_enum(kind), f"Booking.{name}: an enum not written as its value"
        listed = ", ".join(_quoted_literal(member._value_) for member in kind)
        return name, f"({nullable}{name} IN ({listed}))"
    if kind is int:
        return name, f"({nullable}typeof({name}) = 'integer')"
    if kind is str:
        # ASCII: as many bytes as characters. Then no DEL.
        ascii_only = f"length(CAST({name} AS BLOB)) = length({name})"
        return name, (
            f"({nullable}(typeof({name}) = 'text' AND {ascii_only} "
            f"AND instr({name}, char(127)) = 0))"
        )
    raise TypeError(f"Booking.{name}: no SQL text for a field of type {kind!r}")


def _sorted_hints(kind: Any) -> list[tuple[str, Any]]:
    hints = typing.get_type_hints(kind)
    return sorted((field.name, hints[field.name]) for field in dataclasses.fields(kind))


def _booking_text() -> str:
    written = [(name, *_booking_value(name, hint)) for name, hint in _sorted_hints(Booking)]
    members = ", ".join(f"{_quoted_literal(name)}, {value}" for name, value, _ in written)
    guards = " AND ".join(guard for _, _, guard in written)
    return f"CASE WHEN {guards} THEN json_object({members}) END"


# A row's chain.canonical_json(Booking), or NULL (see above). Made from the
# dataclass: each field is a column of the same name (the price's fields too).
BOOKING_TEXT = _booking_text()


# Per engine, asked once: every range of a rebuild asks again.
_available: weakref.WeakKeyDictionary[Engine, bool] = weakref.WeakKeyDictionary()


def available(connection: Connection) -> bool:
    """Whether this database writes the texts: SQLite with its JSON functions
    (built in since 3.38, unless left out of the build)."""
    if connection.dialect.name != "sqlite":
        return False
    known = _available.get(connection.engine)
    if known is None:
        try:
            connection.exec_driver_sql("SELECT json_quote('x')").scalar_one()
            known = True
        except DBAPIError:
            known = False
        _available[connection.engine] = known
    return known
