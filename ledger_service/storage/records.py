"""Conversions between table rows and domain values."""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from json.encoder import encode_basestring_ascii
from typing import Any, ParamSpec, TypeVar

from ledger_service.domain.bookings import Booking, BookingState
from ledger_service.domain.chain import canonical_json
from ledger_service.domain.errors import DAMAGE_ADVICE, StoreDamaged
from ledger_service.domain.events import DenialReason, Event, EventKind, Outcome
from ledger_service.domain.policies import (
    ExpireCharge,
    LanePolicy,
    policy_from_dict,
    policy_to_dict,
)
from ledger_service.domain.pricing import ModelPrice
from ledger_service.domain.window import WindowState


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def event_values(event: Event) -> dict[str, Any]:
    return {
        "kind": event.kind.value,
        "lane": event.lane,
        "occurred_at_us": event.occurred_at_us,
        "reservation_id": event.reservation_id,
        "amount_nanos": event.amount_nanos,
        "previous_amount_nanos": event.previous_amount_nanos,
        "model": event.model,
        "request_bytes": event.request_bytes,
        "max_output_tokens": event.max_output_tokens,
        "estimate_nanos": event.estimate_nanos,
        "requested_ttl_us": event.requested_ttl_us,
        "hold_nanos": event.hold_nanos,
        "cap_nanos": event.cap_nanos,
        "reserved_at_us": event.reserved_at_us,
        "expires_at_us": event.expires_at_us,
        "retry_after_us": event.retry_after_us,
        "denial_reason": event.denial_reason.value if event.denial_reason else None,
        "input_nanos_per_million_tokens": event.input_nanos_per_million_tokens,
        "output_nanos_per_million_tokens": event.output_nanos_per_million_tokens,
        "cached_input_nanos_per_million_tokens": event.cached_input_nanos_per_million_tokens,
        "cache_write_nanos_per_million_tokens": event.cache_write_nanos_per_million_tokens,
        "expire_charge": event.expire_charge.value if event.expire_charge else None,
        "outcome": event.outcome.value if event.outcome else None,
        "input_tokens": event.input_tokens,
        "output_tokens": event.output_tokens,
        "billed_nanos": event.billed_nanos,
        "cached_input_tokens": event.cached_input_tokens,
        "cache_write_tokens": event.cache_write_tokens,
        "http_status": event.http_status,
        "reason": event.reason,
        "policy_json": _dumps(event.policy) if event.policy is not None else None,
        "trace_id": event.trace_id,
        "spent_after_nanos": event.spent_after_nanos,
        "held_after_nanos": event.held_after_nanos,
        "charged_after_nanos": event.charged_after_nanos,
        "limit_nanos": event.limit_nanos,
        "window_us": event.window_us,
        "open_bookings_after": event.open_bookings_after,
        "denied_by": event.denied_by,
        "correction_id": event.correction_id,
        "grant_id": event.grant_id,
        "hash": event.hash,
        "previous_hash": event.previous_hash,
    }


def window_values(state: WindowState) -> dict[str, Any]:
    return {
        "lane": state.lane,
        "window_us": state.window_us,
        "as_of_us": state.as_of_us,
        "amount_nanos": state.sums.amount_nanos,
        "open_amount_nanos": state.sums.open_amount_nanos,
        "open_bookings": state.sums.open_bookings,
    }


P = ParamSpec("P")
R = TypeVar("R")


class UnreadableRow(StoreDamaged, ValueError):
    """A row that breaks its table's shape: a NULL where the schema allows none,
    a value no enum has, JSON that does not parse. The database let it through,
    so its file is damaged. A ValueError too, as the decoders' own errors were:
    a snapshot chunk that does not decode is only an unreadable snapshot."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"a row of its tables breaks their schema ({detail})", DAMAGE_ADVICE)
        self.detail = detail

    def __reduce__(self) -> tuple[type[UnreadableRow], tuple[str]]:
        return UnreadableRow, (self.detail,)  # across the rebuild's helper processes


def _rows_read(decode: Callable[P, R]) -> Callable[P, R]:
    """`decode`, with what a broken row makes it raise turned into UnreadableRow."""

    @functools.wraps(decode)
    def read(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return decode(*args, **kwargs)
        except UnreadableRow:
            raise
        except (TypeError, ValueError, KeyError) as error:
            raise UnreadableRow(str(error)) from error

    return read


def event_from_row(row: Mapping[Any, Any]) -> Event:
    return events_from_rows([[row[column] for column in EVENT_COLUMNS]])[0]


def lane_values(policy: LanePolicy) -> dict[str, Any]:
    """The lanes row: the policy as its lane_configured event records it
    (`policy_to_dict`), its prices as JSON, and its version."""
    given = policy_to_dict(policy)
    given["prices_json"] = _dumps(given.pop("prices"))
    given.update(version=policy.version, updated_at_us=policy.updated_at_us)
    return {name: given[name] for name in LANE_COLUMNS}  # in the columns' order


@_rows_read
def lane_from_row(row: Mapping[Any, Any]) -> LanePolicy:
    data = {**row, "prices": json.loads(row["prices_json"])}
    return policy_from_dict(data, row["version"], row["updated_at_us"])


def booking_values(booking: Booking) -> dict[str, Any]:
    return dict(zip(BOOKING_COLUMNS, booking_rows([booking])[0], strict=True))


def booking_from_row(row: Mapping[Any, Any]) -> Booking:
    return bookings_from_rows([[row[column] for column in BOOKING_COLUMNS]])[0]


# Whole batches, for the rebuild ---------------------------------------------------
#
# A rebuild reads and writes millions of rows, so these work on plain row tuples
# in a fixed column order and skip the per-field work of the functions above,
# with the same results (tests/test_rebuild_speed_records.py compares them).
# Events and bookings are frozen dataclasses without __post_init__: their
# __init__ only stores each field, and through object.__setattr__ that costs
# more than the rest of the conversion. `_built` stores the same fields directly.

EVENT_COLUMNS: tuple[str, ...] = tuple(
    "policy_json" if field.name == "policy" else field.name for field in dataclasses.fields(Event)
)
_EVENT_FIELD_NAMES = tuple(field.name for field in dataclasses.fields(Event))
BOOKING_COLUMNS: tuple[str, ...] = (
    "lane",
    "reservation_id",
    "model",
    "request_bytes",
    "max_output_tokens",
    "estimate_nanos",
    "requested_ttl_us",
    "cap_nanos",
    "hold_nanos",
    "reserved_at_us",
    "expires_at_us",
    "input_nanos_per_million_tokens",
    "output_nanos_per_million_tokens",
    "cached_input_nanos_per_million_tokens",
    "cache_write_nanos_per_million_tokens",
    "expire_charge",
    "state",
    "amount_nanos",
    "answer_seq",
    "ended_seq",
    "outcome",
    "input_tokens",
    "output_tokens",
    "billed_nanos",
    "cached_input_tokens",
    "cache_write_tokens",
)
LANE_COLUMNS: tuple[str, ...] = (
    "lane",
    "limit_nanos",
    "window_us",
    "hold_ttl_us",
    "bytes_per_token_milli",
    "overhead_tokens",
    "expire_charge",
    "prices_json",
    "version",
    "updated_at_us",
    "parent",
    "max_charge_multiple",
)

E = TypeVar("E", bound=enum.Enum)
T = TypeVar("T")


def _members(kind: type[E]) -> dict[Any, E | None]:
    # Falsy stored values ("" or NULL) mean "none", as in event_from_row.
    return {None: None, "": None, **{member.value: member for member in kind}}


_KINDS = {member.value: member for member in EventKind}
_DENIAL_REASONS = _members(DenialReason)
_EXPIRE_CHARGES = _members(ExpireCharge)
_OUTCOMES = _members(Outcome)
_BOOKING_STATES = {member.value: member for member in BookingState}


def _optional_member(table: Mapping[Any, E | None], kind: type[E], value: Any) -> E | None:
    if value in table:
        return table[value]
    return kind(value) if value else None


def _built(kind: type[T], fields: dict[str, Any]) -> T:
    """kind(**fields), for the classes _check_buildable accepts; `fields` becomes
    the instance's own: the caller must not keep it."""
    instance: T = object.__new__(kind)
    object.__setattr__(instance, "__dict__", fields)
    return instance


def _check_buildable(kind: type[Any]) -> None:
    """`_built` holds only for plain frozen dataclasses: fail at import, not later."""
    assert dataclasses.is_dataclass(kind), kind
    assert not hasattr(kind, "__post_init__"), f"{kind.__name__} has a __post_init__"
    assert not hasattr(kind, "__slots__"), f"{kind.__name__} has __slots__"


_check_buildable(Event)
_check_buildable(Booking)
_check_buildable(ModelPrice)


@_rows_read
def events_from_rows(rows: Iterable[Sequence[Any]]) -> list[Event]:
    """Events from rows of EVENT_COLUMNS: what event_from_row gives for each."""
    built: list[Event] = []
    kinds, denials, charges, outcomes = _KINDS, _DENIAL_REASONS, _EXPIRE_CHARGES, _OUTCOMES
    for row in rows:
        fields = dict(zip(_EVENT_FIELD_NAMES, row, strict=True))
        # The usual values by one lookup each; anything else as event_from_row does.
        value = fields["kind"]
        member = kinds.get(value)
        fields["kind"] = member if member is not None else EventKind(value)
        value = fields["denial_reason"]
        if value is not None:
            fields["denial_reason"] = _optional_member(denials, DenialReason, value)
        value = fields["expire_charge"]
        if value is not None:
            fields["expire_charge"] = _optional_member(charges, ExpireCharge, value)
        value = fields["outcome"]
        if value is not None:
            fields["outcome"] = _optional_member(outcomes, Outcome, value)
        if fields["policy"] is not None:
            fields["policy"] = json.loads(fields["policy"]) if fields["policy"] else None
        built.append(_built(Event, fields))
    return built


@_rows_read
def bookings_from_rows(rows: Iterable[Sequence[Any]]) -> list[Booking]:
    """Bookings from rows of BOOKING_COLUMNS: what booking_from_row gives for each."""
    built: list[Booking] = []
    states, charges, outcomes = _BOOKING_STATES, _EXPIRE_CHARGES, _OUTCOMES
    for row in rows:
        (
            lane,
            reservation_id,
            model,
            request_bytes,
            max_output_tokens,
            estimate_nanos,
            requested_ttl_us,
            cap_nanos,
            hold_nanos,
            reserved_at_us,
            expires_at_us,
            input_price,
            output_price,
            cached_input_price,
            cache_write_price,
            expire_charge,
            state,
            amount_nanos,
            answer_seq,
            ended_seq,
            outcome,
            input_tokens,
            output_tokens,
            billed_nanos,
            cached_input_tokens,
            cache_write_tokens,
        ) = row
        charge = charges.get(expire_charge)
        built.append(
            _built(
                Booking,
                {
                    "lane": lane,
                    "reservation_id": reservation_id,
                    "model": model,
                    "request_bytes": request_bytes,
                    "max_output_tokens": max_output_tokens,
                    "estimate_nanos": estimate_nanos,
                    "requested_ttl_us": requested_ttl_us,
                    "cap_nanos": cap_nanos,
                    "hold_nanos": hold_nanos,
                    "reserved_at_us": reserved_at_us,
                    "expires_at_us": expires_at_us,
                    "price": _built(
                        ModelPrice,
                        {
                            "input_nanos_per_million_tokens": input_price,
                            "output_nanos_per_million_tokens": output_price,
                            "cached_input_nanos_per_million_tokens": cached_input_price,
                            "cache_write_nanos_per_million_tokens": cache_write_price,
                        },
                    ),
                    "expire_charge": charge if charge is not None else ExpireCharge(expire_charge),
                    "state": states[state] if state in states else BookingState(state),
                    "amount_nanos": amount_nanos,
                    "answer_seq": answer_seq,
                    "ended_seq": ended_seq,
                    "outcome": _optional_member(outcomes, Outcome, outcome),
                    "input_tokens": input_tokens,
                    "output_tokens": output_tokens,
                    "billed_nanos": billed_nanos,
                    "cached_input_tokens": cached_input_tokens,
                    "cache_write_tokens": cache_write_tokens,
                },
            )
        )
    return built


def booking_rows(bookings: Iterable[Booking]) -> list[tuple[Any, ...]]:
    """Rows of BOOKING_COLUMNS: booking_values of each booking, as tuples."""
    return [
        (
            booking.lane,
            booking.reservation_id,
            booking.model,
            booking.request_bytes,
            booking.max_output_tokens,
            booking.estimate_nanos,
            booking.requested_ttl_us,
            booking.cap_nanos,
            booking.hold_nanos,
            booking.reserved_at_us,
            booking.expires_at_us,
            booking.price.input_nanos_per_million_tokens,
            booking.price.output_nanos_per_million_tokens,
            booking.price.cached_input_nanos_per_million_tokens,
            booking.price.cache_write_nanos_per_million_tokens,
            # `_value_`: the same as `value`, without the property's cost.
            booking.expire_charge._value_,
            booking.state._value_,
            booking.amount_nanos,
            booking.answer_seq,
            booking.ended_seq,
            booking.outcome._value_ if booking.outcome else None,
            booking.input_tokens,
            booking.output_tokens,
            booking.billed_nanos,
            booking.cached_input_tokens,
            booking.cache_write_tokens,
        )
        for booking in bookings
    ]


def lane_rows(policies: Iterable[LanePolicy]) -> list[tuple[Any, ...]]:
    """Rows of LANE_COLUMNS: lane_values of each policy, as tuples."""
    return [tuple(lane_values(policy).values()) for policy in policies]


# Bookings' canonical texts straight from rows ------------------------------------
#
# A projection digest (recovery/snapshots.py) hashes chain.canonical_json of every
# booking: compact JSON with sorted keys of all its fields, the price as an
# object, enums by value, None as null. Made from the row, without the Booking,
# it costs a fifth: a template per combination of the row's value types, the
# three free strings escaped as json does. A row with a type or an enum value
# the template does not foresee takes the reference path (and fails as
# bookings_from_rows would). tests/recovery/test_parallel_rebuild.py compares.

# Type combinations a process keeps templates for (past them: made each time).
MAX_BOOKING_TEMPLATES = 256
_PRICE_COLUMNS = {
    name: BOOKING_COLUMNS.index(name)
    for name in (field.name for field in dataclasses.fields(ModelPrice))
}
_FREE_STRINGS = tuple(BOOKING_COLUMNS.index(name) for name in ("lane", "reservation_id", "model"))
_free_strings = operator.itemgetter(*_FREE_STRINGS)
_STATE, _CHARGE, _OUTCOME = (
    BOOKING_COLUMNS.index(name) for name in ("state", "expire_charge", "outcome")
)
_STATE_VALUES = frozenset(member.value for member in BookingState)
_CHARGE_VALUES = frozenset(member.value for member in ExpireCharge)
_OUTCOME_VALUES = frozenset(member.value for member in Outcome)
_NULLABLE = frozenset(
    BOOKING_COLUMNS.index(name)
    for name in (
        "estimate_nanos",
        "requested_ttl_us",
        "outcome",
        "billed_nanos",
        "cached_input_nanos_per_million_tokens",
        "cache_write_nanos_per_million_tokens",
    )
)
_ENUM_COLUMNS = frozenset((_STATE, _CHARGE, _OUTCOME))


def _booking_field(index: int, kind: type[Any], escaped_slot: dict[int, int]) -> str | None:
    """How column `index` holding a value of `kind` is written, as a str.format
    field (braces doubled elsewhere); None when no template foresees it."""
    if kind is type(None):
        return "null" if index in _NULLABLE else None
    if index in escaped_slot:
        return f"{{{escaped_slot[index]}}}" if kind is str else None
    if index in _ENUM_COLUMNS:
        return f'"{{{index}}}"' if kind is str else None
    return f"{{{index}}}" if kind is int else None


def _booking_template(types: tuple[type[Any], ...]) -> str | None:
    escaped_slot = {index: len(BOOKING_COLUMNS) + n for n, index in enumerate(_FREE_STRINGS)}
    parts: list[str] = []
    for field in sorted(dataclasses.fields(Booking), key=lambda field: field.name):
        if field.name == "price":
            inner = []
            for name, index in sorted(_PRICE_COLUMNS.items()):
                written = _booking_field(index, types[index], escaped_slot)
                if written is None:
                    return None
                inner.append(f'"{name}":{written}')
            parts.append('"price":{{' + ",".join(inner) + "}}")
            continue
        index = BOOKING_COLUMNS.index(field.name)
        written = _booking_field(index, types[index], escaped_slot)
        if written is None:
            return None
        parts.append(f'"{field.name}":{written}')
    return "{{" + ",".join(parts) + "}}"


_booking_templates: dict[tuple[type[Any], ...], str | None] = {}
assert {field.name for field in dataclasses.fields(Booking)} - {"price"} | set(
    _PRICE_COLUMNS
) == set(BOOKING_COLUMNS), "a Booking field has no column: extend booking_texts_from_rows"


def booking_texts_from_rows(rows: Iterable[Sequence[Any]]) -> list[str]:
    """chain.canonical_json of the booking of each row of BOOKING_COLUMNS."""
    texts: list[str] = []
    templates, escape = _booking_templates, encode_basestring_ascii
    states, charges, outcomes = _STATE_VALUES, _CHARGE_VALUES, _OUTCOME_VALUES
    for row in rows:
        types = tuple(map(type, row))
        template = templates.get(types, "")
        if template == "":
            template = _booking_template(types)
            if len(templates) < MAX_BOOKING_TEMPLATES:
                templates[types] = template
        outcome = row[_OUTCOME]
        if (
            template is None
            or row[_STATE] not in states
            or row[_CHARGE] not in charges
            or (outcome is not None and outcome not in outcomes)
        ):
            texts.append(canonical_json(bookings_from_rows([row])[0]))
            continue
        texts.append(template.format(*row, *map(escape, _free_strings(row))))
    return texts
