"""The rebuild's content checks judge every row as the reference does.

A rebuild's walk (recovery/walk.py) makes each event's canonical text
from the row's values, without building the Event; the reference is
chain.canonical_event of the Event the row holds. A change to any column is
found either way, and a value no enum has fails as the reference fails. A
rebuild's digest hashes the bookings' texts (records.booking_texts_from_rows).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import pathlib
import random
import typing
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from ledger_service.domain import chain
from ledger_service.domain.bookings import Booking
from ledger_service.domain.chain import ChainWalker
from ledger_service.domain.events import Event, EventKind, Outcome
from ledger_service.recovery import walk as chain_walk
from ledger_service.recovery.store import SqlRecoveryStore
from ledger_service.storage import database, migrate, records
from ledger_service.storage.schema import bookings, events
from tests.storage.conftest import altered_by_walk

PREVIOUS = records.EVENT_COLUMNS.index("previous_hash")
# Strings SQLite and Python quote alike, and strings they do not.
PLAIN = ["", "jev", 'say "hi"', "back\\slash", "tab\tand\nnewline", "ctl\x01\x1f", "{}[],:"]
ODD = ["café", "emoji \U0001f600", "del\x7f", "zero\x00width\u200b", "\ud7ff", "ü" * 3]


@pytest.fixture
def engine(tmp_path: pathlib.Path) -> Iterator[sa.Engine]:
    engine = database.create(f"sqlite:///{tmp_path / 'ledger.db'}", database.EngineLimits())
    migrate.upgrade(engine)
    try:
        yield engine
    finally:
        engine.dispose()


def _some_int(rng: random.Random) -> int:
    return rng.choice([0, 1, -1, 7, 2**62, -(2**62), rng.randrange(-(10**12), 10**12)])


def _random_instance(cls: Any, rng: random.Random, strings: list[str], /, **fixed: Any) -> Any:
    """An instance of the dataclass `cls` with random values of each field's
    type (None among them where it may be None), but for `fixed`: every field,
    one added later too."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if field.name in fixed:
            values[field.name] = fixed[field.name]
            continue
        hint = hints[field.name]
        arguments = [argument for argument in typing.get_args(hint) if argument is not type(None)]
        base = arguments[0] if arguments else hint
        value: Any
        if base is int:
            value = _some_int(rng)
        elif base is str:
            value = rng.choice(strings)
        elif isinstance(base, type) and issubclass(base, enum.Enum):
            value = rng.choice(list(base))
        elif dataclasses.is_dataclass(base):
            value = _random_instance(base, rng, strings)
        else:
            raise TypeError(f"{cls.__name__}.{field.name}: no random {hint}")
        optional = len(typing.get_args(hint)) > len(arguments)
        values[field.name] = rng.choice([None, value]) if optional else value
    return cls(**values)


def _random_event(rng: random.Random, strings: list[str], index: int) -> Event:
    kinds = [kind for kind in EventKind if kind is not EventKind.LANE_CONFIGURED]
    event: Event = _random_instance(
        Event,
        rng,
        strings,
        kind=rng.choice(kinds),
        # Unique: a lane's openings may not share one.
        reservation_id=f"{rng.choice(strings)}{index}",
        # Unique too: a lane's corrections may not share one.
        correction_id=f"{rng.choice(strings)}{index}",
        policy=None,  # a lane's policy: written in Python, tested apart
        previous_hash="",
        hash="",
        seq=0,
    )
    return event


def _append(engine: sa.Engine, log: list[Event]) -> list[Event]:
    """The events sealed in their lanes' chains and inserted as the store would."""
    heads: dict[str, str] = {}
    sealed: list[Event] = []
    with engine.begin() as connection:
        for event in log:
            event = chain.sealed(event, heads.get(event.lane, chain.GENESIS_HASH))
            heads[event.lane] = event.hash
            values = records.event_values(event)
            values["hash"], values["previous_hash"] = event.hash, event.previous_hash
            seq = connection.execute(sa.insert(events).values(values).returning(events.c.seq))
            sealed.append(dataclasses.replace(event, seq=int(seq.scalar_one())))
    return sealed


def _tamper(engine: sa.Engine, seq: int, column: str, value: Any) -> None:
    with engine.begin() as connection:
        connection.exec_driver_sql("DROP TRIGGER events_refuse_update")
        connection.execute(sa.update(events).where(events.c.seq == seq).values({column: value}))
        connection.exec_driver_sql(
            """CREATE TRIGGER events_refuse_update BEFORE UPDATE ON events
               BEGIN SELECT RAISE(ABORT, 'events are append-only'); END"""
        )


# A settled event whose amount is 5 and billed 7.
SETTLED = Event(
    kind=EventKind.SETTLED,
    lane="recall",
    occurred_at_us=5,
    reservation_id="r1",
    amount_nanos=5,
    billed_nanos=7,
    outcome=Outcome.SUCCEEDED,
)

ALTERATIONS: list[tuple[str, Any]] = [
    ("kind", "refunded"),
    ("kind", "bogus"),
    ("lane", "other"),
    ("occurred_at_us", 6),
    ("amount_nanos", 999),
    ("amount_nanos", "five"),
    ("estimate_nanos", None),
    ("estimate_nanos", 0),
    ("billed_nanos", 7),
    ("model", "café"),
    ("model", ""),
    ("reason", 'x","y'),
    ("denial_reason", "budget_exhausted"),
    ("outcome", None),
    ("outcome", "maybe"),
    ("policy_json", '{"lane":"x"}'),
]


@pytest.mark.parametrize(("column", "value"), ALTERATIONS)
def test_every_alteration_is_found_as_the_reference_finds_it(
    engine: sa.Engine, column: str, value: Any
) -> None:
    original = dataclasses.replace(
        SETTLED,
        billed_nanos=7 if column != "billed_nanos" else None,
        estimate_nanos=12,
        model="jev",
        reason="ok",
    )
    (event,) = _append(engine, [original])
    _tamper(engine, event.seq, column, value)
    with engine.connect() as connection:
        row = connection.execute(
            sa.select(*(events.c[name] for name in records.EVENT_COLUMNS))
        ).one()
    try:
        expected: list[int] | type[Exception] = _altered_rows([row])
    except ValueError:
        expected = ValueError  # a value no enum member has: the reference fails
    assert expected == [event.seq] or expected is ValueError, (column, value)
    if expected is ValueError:
        with pytest.raises(ValueError):
            altered_by_walk(_walk_range(engine, 0, event.seq))
        return
    assert altered_by_walk(_walk_range(engine, 0, event.seq)) == expected


def test_a_text_in_an_integer_column_cannot_spell_the_original_text(engine: sa.Engine) -> None:
    """amount_nanos '5,"billed_nanos":7' and billed_nanos NULL: written into
    the text as it is, the row would read as the original's text and hash."""
    (event,) = _append(engine, [SETTLED])
    _tamper(engine, event.seq, "amount_nanos", '5,"billed_nanos":7')
    _tamper(engine, event.seq, "billed_nanos", None)
    assert altered_by_walk(_walk_range(engine, 0, event.seq)) == [event.seq]


def test_a_batch_longer_than_one_fetch_reads_whole_rows_between_fetches(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(10)
    log = _append(engine, [_random_event(rng, PLAIN + ODD, n) for n in range(50)])
    tampered = log[20].seq
    _tamper(engine, tampered, "http_status", 500)
    assert altered_by_walk(_walk_range(engine, 0, log[-1].seq)) == [tampered]


def test_a_kind_no_enum_has_fails_even_when_its_hash_was_made_over_it(
    engine: sa.Engine,
) -> None:
    """A row sealed over a kind that does not exist (no ledger writes one):
    the reference cannot build its event and fails; so must the SQL path,
    rather than take the text it would write as proof."""
    (event,) = _append(engine, [Event(kind=EventKind.SETTLED, lane="recall", occurred_at_us=5)])
    _tamper(engine, event.seq, "kind", "bogus")
    row = _row(engine)
    column = {name: name for name in chain.HASHED_NAMES} | {"policy": "policy_json"}
    hashed = [row[records.EVENT_COLUMNS.index(column[name])] for name in chain.HASHED_NAMES]
    text = chain.canonical_values(tuple(hashed))
    assert '"kind":"bogus"' in text
    _tamper(engine, event.seq, "hash", hashlib.sha256(f"\n{text}".encode()).hexdigest())
    with pytest.raises(ValueError, match="bogus"):
        _altered_rows([_row(engine)])
    with pytest.raises(ValueError, match="bogus"):
        altered_by_walk(_walk_range(engine, 0, event.seq))


def _row(engine: sa.Engine) -> sa.Row[Any]:
    with engine.connect() as connection:
        columns = (events.c[name] for name in records.EVENT_COLUMNS)
        return connection.execute(sa.select(*columns)).one()


# Bookings' texts (the digest's lines) -----------------------------------------------


def _random_booking(rng: random.Random, strings: list[str], index: int) -> Booking:
    booking: Booking = _random_instance(
        Booking, rng, strings, reservation_id=f"{rng.choice(strings)}{index}"
    )
    return booking


def _insert_bookings(engine: sa.Engine, rows: list[Booking]) -> None:
    with engine.begin() as connection:
        connection.execute(sa.insert(bookings), [records.booking_values(b) for b in rows])


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("amount_nanos", 1e20),
        ("estimate_nanos", 2.5),
        ("reservation_id", "café"),
        ("lane", "del\x7f"),
    ],
)
def _altered_rows(rows: list[Any]) -> list[int]:
    """The seqs among `rows` (of EVENT_COLUMNS) whose content no longer gives
    their hash, as a range's walk judges them."""
    heads: dict[str, str] = {}
    for row in rows:
        heads.setdefault(row[records.EVENT_COLUMNS.index("lane")], row[PREVIOUS])
    content = chain.altered(0, "").reason
    found = chain_walk.walk_rows(ChainWalker(heads), rows)
    return [broken.seq for broken in found if broken.reason == content]


def _walk_range(engine: sa.Engine, after_seq: int, through_seq: int) -> chain_walk.WalkedRange:
    """The walk of (after_seq, through_seq], read in one transaction."""
    with chain_walk.Helpers(SqlRecoveryStore(engine), 0) as helpers:
        (walked,) = helpers.walk({}, after_seq, [through_seq])
    return walked
