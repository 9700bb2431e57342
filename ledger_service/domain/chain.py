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
from collections.abc import Mapping
from typing import Any

from ledger_service.domain.events import Event

GENESIS_HASH = ""
_NOT_HASHED = frozenset({"seq", "hash", "previous_hash"})
_EVENT_FIELDS = tuple(field for field in dataclasses.fields(Event) if field.name not in _NOT_HASHED)


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


def canonical_json(value: Any) -> str:
    """Compact JSON with sorted keys: one text for one value, on every machine."""
    return json.dumps(plain(value), sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _default_of(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def canonical_event(event: Event) -> str:
    """The hashed text of an event (see the module docstring)."""
    data: dict[str, Any] = {}
    for field in _EVENT_FIELDS:
        value = getattr(event, field.name)
        default = _default_of(field)
        # `type(...) is` keeps 0 and None (and 0 and False) apart.
        if default is not dataclasses.MISSING and type(value) is type(default) and value == default:
            continue
        data[field.name] = value
    return canonical_json(data)


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
    """Checks events in seq order against each lane's chain.

    Start it from genesis (no heads) or from the heads a snapshot recorded.
    After a break the walker follows the stored hash, so each altered event is
    reported on its own and the links after it are still checked.

    Events appended before the chain existed (schema 0002 and older) have no
    hash. They are tolerated as a lane's first events only and counted in
    `unsealed`: nothing proves they were not changed.
    """

    def __init__(self, heads: Mapping[str, str] | None = None) -> None:
        self.heads: dict[str, str] = dict(heads or {})
        self.checked = 0
        self.unsealed = 0
        self.last_seq = 0

    def check(self, event: Event) -> ChainBreak | None:
        self.checked += 1
        self.last_seq = event.seq
        expected = self.heads.get(event.lane, GENESIS_HASH)
        if not event.hash:
            if expected or event.previous_hash:
                return ChainBreak(event.seq, event.lane, "has no hash, after sealed events")
            self.unsealed += 1
            return None
        self.heads[event.lane] = event.hash
        if event.previous_hash != expected:
            return ChainBreak(
                event.seq,
                event.lane,
                f"previous_hash {event.previous_hash[:16] or '(empty)'} is not the hash of "
                f"the lane's previous event ({expected[:16] or 'none: the first event'}); "
                "an event before it was removed or altered",
            )
        if event_hash(event.previous_hash, event) != event.hash:
            return ChainBreak(
                event.seq, event.lane, "its content does not match its hash: altered after append"
            )
        return None
