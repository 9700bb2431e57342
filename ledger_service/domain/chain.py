"""The tamper-evident log: each event's hash chains it to its lane's previous event.

    hash(event) = sha256(previous_hash + "\\n" + canonical(event))   (hex)

`previous_hash` is the hash of the lane's previous event, "" for its first.
`canonical(event)` is compact JSON with sorted keys of every field of the event
except `seq` (the store assigns it after the hash is computed), `hash` and
`previous_hash` (the latter is the prefix above). Fields at their default value
are left out, so that adding a field with a default to `Event` later keeps every
hash already in the log valid; a field with a value is always in.

Changing one stored field of an event changes its hash, and removing an event
leaves the next event of its lane pointing at a hash that is no longer its
predecessor's: `ChainWalker` finds both. Every field must round-trip through
the store unchanged, or a verification reports the event as altered.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import operator
from collections.abc import Callable, Mapping, Sequence
from itertools import compress
from json.encoder import encode_basestring_ascii
from typing import Any

from ledger_service.domain.events import Event

GENESIS_HASH = ""
_NOT_HASHED = frozenset({"seq", "hash", "previous_hash"})
_EVENT_FIELDS = tuple(field for field in dataclasses.fields(Event) if field.name not in _NOT_HASHED)
# Shapes (see `_Shape`) are few: one per kind and set of fields in use. Past
# this many, texts are still made the same way, only not kept.
MAX_SHAPES = 4096


def plain(value: Any) -> Any:
    """A JSON-ready form of domain values: enums by value, dataclasses and
    mappings as objects, tuples as lists."""
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            field.name: plain(getattr(value, field.name)) for field in dataclasses.fields(value)
        }
    if isinstance(value, Mapping):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple | frozenset | set):
        items = [plain(item) for item in value]
        return sorted(items) if isinstance(value, frozenset | set) else items
    return value


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _default_of(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


# The fast encoding --------------------------------------------------------------
#
# Every append and every rebuild hashes events: an event's text is `canonical_json`
# of its fields (tests/domain/test_chain_canonical.py compares) made without a
# dict, by a str.format template cached per the values' types and truths.


def canonical_json(value: Any) -> str:
    """Compact JSON with sorted keys: one text for one value, on every machine."""
    return _dumps(plain(value))


# How one field is written after its key: a constant text, the value as
# str.format writes it (an attribute of it), or the text of a converter.
@dataclasses.dataclass(frozen=True)
class _Piece:
    key: str = ""
    constant: str | None = None
    direct: str | None = None  # "" the value itself, or ".attribute"
    converter: Callable[[Any], str] | None = None
    quote: str = ""


_LEFT_OUT = _Piece()


def _braced(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


class _Shape:
    """A template for objects whose fields have these types (and, for events,
    whose values are falsy in these places)."""

    __slots__ = ("converted", "converters", "template")

    def __init__(self, pieces: Sequence[_Piece]) -> None:
        parts: list[str] = []
        converters: list[Callable[[Any], str]] = []
        converted: list[bool] = []
        # Converted values go in slots after the values themselves.
        slot = len(pieces)
        for index, piece in enumerate(pieces):
            converted.append(piece.converter is not None)
            if not piece.key:  # left out: at its default
                continue
            if piece.constant is not None:
                parts.append(_braced(piece.key + piece.constant))
                continue
            if piece.direct is not None:
                field = f"{{{index}{piece.direct}}}"
            else:
                assert piece.converter is not None
                converters.append(piece.converter)
                field = f"{{{slot}}}"
                slot += 1
            parts.append(_braced(piece.key + piece.quote) + field + _braced(piece.quote))
        self.template = "{{" + ",".join(parts) + "}}"
        self.converters = tuple(converters)
        self.converted = tuple(converted)

    def text(self, values: tuple[Any, ...]) -> str:
        if not self.converters:
            return self.template.format(*values)
        return self.template.format(
            *values, *map(operator.call, self.converters, compress(values, self.converted))
        )


_plain_enums: dict[type[Any], bool] = {}


def _piece(name: str, kind: type[Any], truthy: bool) -> _Piece:
    """How a value of exactly this type, true or not, is written after its key."""
    key = encode_basestring_ascii(name) + ":"
    if kind is type(None):
        return _Piece(key, constant="null")
    if kind is int:
        # str.format writes an int as repr does, as json does.
        return _Piece(key, direct="")
    if kind is str:
        return _Piece(key, converter=encode_basestring_ascii)
    if kind is bool:
        return _Piece(key, constant="true" if truthy else "false")
    if isinstance(kind, type) and issubclass(kind, enum.Enum) and plain_enum(kind):
        return _Piece(key, direct="._value_", quote='"')
    return _Piece(key, converter=canonical_json)


def plain_enum(kind: type[enum.Enum]) -> bool:
    """Whether every value is a str that JSON writes as it is, in quotes: then
    a member is written as its `_value_` (its `value` is a property)."""
    if kind not in _plain_enums:
        values = [member._value_ for member in kind]
        _plain_enums[kind] = all(type(v) is str and _dumps(v) == f'"{v}"' for v in values)
    return _plain_enums[kind]


# The names of the hashed fields, in the order canonical_values takes them.
HASHED_NAMES = tuple(sorted(field.name for field in _EVENT_FIELDS))
_hashed_values = operator.attrgetter(*HASHED_NAMES)
_HASHED_DEFAULTS = tuple(_default_of(f) for f in sorted(_EVENT_FIELDS, key=lambda f: f.name))
_event_shapes: dict[tuple[tuple[type[Any], ...], tuple[bool, ...]], _Shape] = {}
# canonical_event tells a value at its default by its type and truth, which
# holds for these defaults only (the one falsy value of their type).
assert all(
    default is dataclasses.MISSING
    or (type(default) in (int, str, bool, type(None)) and not default)
    for default in _HASHED_DEFAULTS
), "an Event field's default is not 0, '', False or None: extend canonical_event"


def _event_shape(types: tuple[type[Any], ...], truths: tuple[bool, ...]) -> _Shape:
    pieces: list[_Piece] = []
    for name, kind, truthy, default in zip(
        HASHED_NAMES, types, truths, _HASHED_DEFAULTS, strict=True
    ):
        # A field is left out only at its default, of the default's very type
        # (0 and None, 0 and False stay apart); a MISSING default never matches.
        # For the defaults' types (int 0, str "", None) falsy is at the default.
        at_default = kind is type(default) and not truthy
        pieces.append(_LEFT_OUT if at_default else _piece(name, kind, truthy))
    return _Shape(pieces)


def canonical_event(event: Event) -> str:
    """The hashed text of an event (see the module docstring)."""
    return canonical_values(_hashed_values(event))


def canonical_values(values: tuple[Any, ...]) -> str:
    """The hashed text of an event whose fields in HASHED_NAMES have these
    values. An enum field may be given as its member or as its member's value:
    both are written as the value (for the plain enums of Event, see
    plain_enum)."""
    key = (tuple(map(type, values)), tuple(map(bool, values)))
    shape = _event_shapes.get(key)
    if shape is None:
        shape = _event_shape(*key)
        if len(_event_shapes) < MAX_SHAPES:
            _event_shapes[key] = shape
    return shape.text(values)


def event_hash(previous_hash: str, event: Event) -> str:
    text = f"{previous_hash}\n{canonical_event(event)}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sealed(event: Event, previous_hash: str) -> Event:
    """The event with its place in the lane's chain: what the store appends."""
    return dataclasses.replace(
        event, previous_hash=previous_hash, hash=event_hash(previous_hash, event)
    )


@dataclasses.dataclass(frozen=True)
class ChainBreak:
    """The first thing wrong with one event's link."""

    seq: int
    lane: str
    reason: str

    def describe(self) -> str:
        return f"event {self.seq} (lane {self.lane!r}): {self.reason}"


class ChainWalker:
    """Checks events in seq order against each lane's chain, from genesis or
    given heads; after a break it follows the stored hash. Events appended
    before the chain existed pass as a lane's first only, counted in `unsealed`."""

    def __init__(self, heads: Mapping[str, str] | None = None) -> None:
        self.heads: dict[str, str] = dict(heads or {})
        self.unsealed = 0

    def check(self, event: Event) -> ChainBreak | None:
        found = self.check_link(event.seq, event.lane, event.previous_hash, event.hash)
        if found is None and event.hash and event_hash(event.previous_hash, event) != event.hash:
            return altered(event.seq, event.lane)
        return found

    def check_link(self, seq: int, lane: str, previous_hash: str, hash_: str) -> ChainBreak | None:
        """`check` without the content (the caller checks it: `content_matches`)."""
        expected = self.heads.get(lane, GENESIS_HASH)
        if not hash_:
            if expected or previous_hash:
                return ChainBreak(seq, lane, "has no hash, after sealed events")
            self.unsealed += 1
            return None
        self.heads[lane] = hash_
        if previous_hash != expected:
            return ChainBreak(
                seq,
                lane,
                f"previous_hash {previous_hash[:16] or '(empty)'} is not the hash of "
                f"the lane's previous event ({expected[:16] or 'none: the first event'}); "
                "an event before it was removed or altered",
            )
        return None


def altered(seq: int, lane: str) -> ChainBreak:
    return ChainBreak(seq, lane, "its content does not match its hash: altered after append")


def content_matches(previous_hash: str, hash_: str, text: str) -> bool:
    """Whether an event whose canonical text is `text` hashes to `hash_`."""
    return hashlib.sha256(f"{previous_hash}\n{text}".encode()).hexdigest() == hash_
