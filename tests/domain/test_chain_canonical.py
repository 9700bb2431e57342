"""The fast canonical text (domain/chain.py) against the reference it replaced.

Every hash already in a log was made from the reference text, so the fast one
must give the very same characters for every event and every projection value,
including values of unexpected types (0 against None, False against 0), policy
mappings, and strings that JSON must escape.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ledger_service.domain import chain
from ledger_service.domain.bookings import Booking, BookingState
from ledger_service.domain.events import DenialReason, Event, EventKind, Outcome
from ledger_service.domain.policies import ExpireCharge, LanePolicy
from ledger_service.domain.pricing import ModelPrice

# The reference implementation, as chain.py had it before the fast encoding. ------

_NOT_HASHED = frozenset({"seq", "hash", "previous_hash"})
_EVENT_FIELDS = tuple(f for f in dataclasses.fields(Event) if f.name not in _NOT_HASHED)


def reference_plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            field.name: reference_plain(getattr(value, field.name))
            for field in dataclasses.fields(value)
        }
    if isinstance(value, Mapping):
        return {str(key): reference_plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple | frozenset | set):
        items = [reference_plain(item) for item in value]
        return sorted(items) if isinstance(value, frozenset | set) else items
    return value


def reference_canonical_json(value: Any) -> str:
    return json.dumps(
        reference_plain(value), sort_keys=True, separators=(",", ":"), ensure_ascii=True
    )


def _reference_default_of(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def reference_canonical_event(event: Event) -> str:
    data: dict[str, Any] = {}
    for field in _EVENT_FIELDS:
        value = getattr(event, field.name)
        default = _reference_default_of(field)
        if default is not dataclasses.MISSING and type(value) is type(default) and value == default:
            continue
        data[field.name] = value
    return reference_canonical_json(data)


def reference_event_hash(previous_hash: str, event: Event) -> str:
    text = f"{previous_hash}\n{reference_canonical_event(event)}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# Strategies ------------------------------------------------------------------------

# Quotes, backslashes, control characters, non-ASCII, astral (surrogate pairs), '%'.
_tricky_text = st.text(
    alphabet=st.sampled_from(
        ['"', "\\", "\n", "\t", "\x00", "\x1f", "\x7f", "é", "€", "😀", "%", "a", "/"]
    )
    | st.characters(),
    max_size=12,
)
_text = st.one_of(st.just(""), _tricky_text)
_int = st.one_of(st.just(0), st.integers(-(2**70), 2**70), st.sampled_from([1, -1, 10**15]))
# Values of the wrong type: the default's own value in another type must stay apart.
_odd = st.sampled_from([None, 0, False, True, 0.0, 1.5, "", "0", (), (1, "a")])
_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), _text, st.sampled_from([0.5, -0.0]))
_json = st.recursive(
    _json_leaf,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(_text, children, max_size=3)
        | st.tuples(children, children)
    ),
    max_leaves=10,
)
_policy = st.one_of(
    st.none(),
    st.dictionaries(_text, _json, max_size=6),
    st.dictionaries(
        st.one_of(st.integers(-3, 3), _text), st.sampled_from([ExpireCharge.HOLD, 1, "x"])
    ),
)


def _field_strategy(field: dataclasses.Field[Any]) -> st.SearchStrategy[Any]:
    annotation = str(field.type)
    if field.name == "policy":
        strategy: st.SearchStrategy[Any] = _policy
    elif field.name == "kind":
        strategy = st.sampled_from(EventKind)
    elif "DenialReason" in annotation:
        strategy = st.one_of(st.none(), st.sampled_from(DenialReason))
    elif "ExpireCharge" in annotation:
        strategy = st.one_of(st.none(), st.sampled_from(ExpireCharge))
    elif "Outcome" in annotation:
        strategy = st.one_of(st.none(), st.sampled_from(Outcome))
    elif annotation.startswith("int | None"):
        strategy = st.one_of(st.none(), _int)
    elif annotation.startswith("int"):
        strategy = _int
    else:
        strategy = _text
    # Mostly the field's own kind of value, sometimes one of another type.
    return st.one_of(strategy, strategy, strategy, _odd)


events = st.builds(
    Event, **{field.name: _field_strategy(field) for field in dataclasses.fields(Event)}
)
# Events near real ones: most fields at their default, the rest set.
sparse_events = st.builds(
    Event,
    kind=st.sampled_from(EventKind),
    lane=_text,
    occurred_at_us=_int,
    **{
        field.name: st.one_of(st.just(chain._default_of(field)), _field_strategy(field))
        for field in dataclasses.fields(Event)
        if field.name not in {"kind", "lane", "occurred_at_us"}
    },
)
bookings = st.builds(
    Booking,
    lane=_text,
    reservation_id=_text,
    model=_text,
    request_bytes=_int,
    max_output_tokens=_int,
    estimate_nanos=st.one_of(st.none(), _int, _odd),
    requested_ttl_us=st.one_of(st.none(), _int),
    cap_nanos=_int,
    hold_nanos=_int,
    reserved_at_us=_int,
    expires_at_us=_int,
    price=st.builds(ModelPrice, _int, st.one_of(_int, _odd)),
    expire_charge=st.sampled_from(ExpireCharge),
    state=st.sampled_from(BookingState),
    amount_nanos=_int,
    answer_seq=_int,
    ended_seq=_int,
    outcome=st.one_of(st.none(), st.sampled_from(Outcome)),
    input_tokens=_int,
    output_tokens=st.one_of(_int, _odd),
    billed_nanos=st.one_of(st.none(), _int),
)
lane_policies = st.builds(
    LanePolicy,
    lane=_text,
    limit_nanos=_int,
    prices=st.dictionaries(_text, st.builds(ModelPrice, _int, _int), max_size=3),
    window_us=_int,
    hold_ttl_us=_int,
    bytes_per_token_milli=_int,
    overhead_tokens=_int,
    expire_charge=st.sampled_from(ExpireCharge),
    parent=st.one_of(st.none(), _text),
    version=_int,
    updated_at_us=_int,
)


# The comparisons -------------------------------------------------------------------


# A previous hash is hex; any text without lone surrogates (UTF-8 refuses those).
_previous_hashes = st.text(st.characters(blacklist_categories=("Cs",)), max_size=70)


@settings(max_examples=1500, deadline=None)
@given(events, _previous_hashes)
def test_every_event_has_the_reference_text_and_hash(event: Event, previous: str) -> None:
    assert chain.canonical_event(event) == reference_canonical_event(event)
    assert chain.event_hash(previous, event) == reference_event_hash(previous, event)


@settings(max_examples=1500, deadline=None)
@given(sparse_events)
def test_events_mostly_at_their_defaults_have_the_reference_text(event: Event) -> None:
    assert chain.canonical_event(event) == reference_canonical_event(event)


@settings(max_examples=500, deadline=None)
@given(bookings, lane_policies)
def test_projection_values_have_the_reference_text(booking: Booking, policy: LanePolicy) -> None:
    assert chain.canonical_json(booking) == reference_canonical_json(booking)
    assert chain.canonical_json(policy) == reference_canonical_json(policy)


@settings(max_examples=300, deadline=None)
@given(st.one_of(_json, st.dictionaries(_text, _text), st.sampled_from(list(BookingState))))
def test_other_values_have_the_reference_text(value: Any) -> None:
    assert chain.canonical_json(value) == reference_canonical_json(value)


def test_a_real_event_keeps_its_hash() -> None:
    """A fixed event and the hash the reference gave it: the text did not move."""
    event = Event(
        kind=EventKind.SETTLED,
        lane="recall",
        occurred_at_us=1_800_000_000_123_456,
        reservation_id='r-"1"\\é',
        amount_nanos=12_345,
        previous_amount_nanos=50_000,
        estimate_nanos=0,
        outcome=Outcome.SUCCEEDED,
        input_tokens=1100,
        output_tokens=300,
        http_status=200,
        policy={"b": [1, 2], "a": {"z": None, "é": True}},
        hash="ignored",
        seq=7,
    )
    assert chain.canonical_event(event) == reference_canonical_event(event)
    assert chain.event_hash("abc", event) == reference_event_hash("abc", event)
    # The same text every time, whichever shape came first.
    assert chain.canonical_event(event) == chain.canonical_event(dataclasses.replace(event))
