"""The rebuild's fast paths give what the plain ones give (issue 8).

The rebuild reads events and bookings as plain rows, converts them in bulk,
and ends bookings without dataclasses.replace. Each is compared here with the
path it replaces, on SQLite and PostgreSQL. (The database's fold of bookings
is compared with the domain's in tests/storage/test_sql_fold.py.)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import sqlalchemy as sa

from ledger_service.domain import bookings as booking_fold
from ledger_service.domain.bookings import Booking, BookingState
from ledger_service.domain.events import DenialReason, Event, EventKind, Outcome
from ledger_service.domain.policies import ExpireCharge
from ledger_service.domain.pricing import ModelPrice
from ledger_service.recovery.rebuild import (
    FULL_LOG_SOURCE,
    Route,
)
from ledger_service.recovery.store import SqlRecoveryStore
from ledger_service.storage import records
from ledger_service.storage.schema import bookings, events, lanes
from tests.recovery.conftest import History, open_history
from tests.storage import conftest as storage_fixtures

database_url = storage_fixtures.database_url
postgres_schema_url = storage_fixtures.postgres_schema_url


# The per-row conversions as they were written field by field, kept as the
# reference: records' per-row functions now derive from its batch ones.


def _event_from_row(row: Mapping[Any, Any]) -> Event:
    return Event(
        seq=row["seq"],
        kind=EventKind(row["kind"]),
        lane=row["lane"],
        occurred_at_us=row["occurred_at_us"],
        reservation_id=row["reservation_id"],
        amount_nanos=row["amount_nanos"],
        previous_amount_nanos=row["previous_amount_nanos"],
        model=row["model"],
        request_bytes=row["request_bytes"],
        max_output_tokens=row["max_output_tokens"],
        estimate_nanos=row["estimate_nanos"],
        requested_ttl_us=row["requested_ttl_us"],
        hold_nanos=row["hold_nanos"],
        cap_nanos=row["cap_nanos"],
        reserved_at_us=row["reserved_at_us"],
        expires_at_us=row["expires_at_us"],
        retry_after_us=row["retry_after_us"],
        denial_reason=DenialReason(row["denial_reason"]) if row["denial_reason"] else None,
        input_nanos_per_million_tokens=row["input_nanos_per_million_tokens"],
        output_nanos_per_million_tokens=row["output_nanos_per_million_tokens"],
        cached_input_nanos_per_million_tokens=row["cached_input_nanos_per_million_tokens"],
        cache_write_nanos_per_million_tokens=row["cache_write_nanos_per_million_tokens"],
        expire_charge=ExpireCharge(row["expire_charge"]) if row["expire_charge"] else None,
        outcome=Outcome(row["outcome"]) if row["outcome"] else None,
        input_tokens=row["input_tokens"],
        output_tokens=row["output_tokens"],
        billed_nanos=row["billed_nanos"],
        cached_input_tokens=row["cached_input_tokens"],
        cache_write_tokens=row["cache_write_tokens"],
        http_status=row["http_status"],
        reason=row["reason"],
        policy=json.loads(row["policy_json"]) if row["policy_json"] else None,
        trace_id=row["trace_id"],
        spent_after_nanos=row["spent_after_nanos"],
        held_after_nanos=row["held_after_nanos"],
        charged_after_nanos=row["charged_after_nanos"],
        limit_nanos=row["limit_nanos"],
        window_us=row["window_us"],
        open_bookings_after=row["open_bookings_after"],
        denied_by=row["denied_by"],
        correction_id=row["correction_id"],
        grant_id=row["grant_id"],
        hash=row["hash"],
        previous_hash=row["previous_hash"],
    )


def _booking_from_row(row: Mapping[Any, Any]) -> Booking:
    return Booking(
        lane=row["lane"],
        reservation_id=row["reservation_id"],
        model=row["model"],
        request_bytes=row["request_bytes"],
        max_output_tokens=row["max_output_tokens"],
        estimate_nanos=row["estimate_nanos"],
        requested_ttl_us=row["requested_ttl_us"],
        cap_nanos=row["cap_nanos"],
        hold_nanos=row["hold_nanos"],
        reserved_at_us=row["reserved_at_us"],
        expires_at_us=row["expires_at_us"],
        price=ModelPrice(
            row["input_nanos_per_million_tokens"],
            row["output_nanos_per_million_tokens"],
            row["cached_input_nanos_per_million_tokens"],
            row["cache_write_nanos_per_million_tokens"],
        ),
        expire_charge=ExpireCharge(row["expire_charge"]),
        state=BookingState(row["state"]),
        amount_nanos=row["amount_nanos"],
        answer_seq=row["answer_seq"],
        ended_seq=row["ended_seq"],
        outcome=Outcome(row["outcome"]) if row["outcome"] else None,
        input_tokens=row["input_tokens"],
        output_tokens=row["output_tokens"],
        billed_nanos=row["billed_nanos"],
        cached_input_tokens=row["cached_input_tokens"],
        cache_write_tokens=row["cache_write_tokens"],
    )


def _booking_values(booking: Booking) -> dict[str, Any]:
    return {
        "lane": booking.lane,
        "reservation_id": booking.reservation_id,
        "model": booking.model,
        "request_bytes": booking.request_bytes,
        "max_output_tokens": booking.max_output_tokens,
        "estimate_nanos": booking.estimate_nanos,
        "requested_ttl_us": booking.requested_ttl_us,
        "cap_nanos": booking.cap_nanos,
        "hold_nanos": booking.hold_nanos,
        "reserved_at_us": booking.reserved_at_us,
        "expires_at_us": booking.expires_at_us,
        "input_nanos_per_million_tokens": booking.price.input_nanos_per_million_tokens,
        "output_nanos_per_million_tokens": booking.price.output_nanos_per_million_tokens,
        "cached_input_nanos_per_million_tokens": (
            booking.price.cached_input_nanos_per_million_tokens
        ),
        "cache_write_nanos_per_million_tokens": booking.price.cache_write_nanos_per_million_tokens,
        "expire_charge": booking.expire_charge.value,
        "state": booking.state.value,
        "amount_nanos": booking.amount_nanos,
        "answer_seq": booking.answer_seq,
        "ended_seq": booking.ended_seq,
        "outcome": booking.outcome.value if booking.outcome else None,
        "input_tokens": booking.input_tokens,
        "output_tokens": booking.output_tokens,
        "billed_nanos": booking.billed_nanos,
        "cached_input_tokens": booking.cached_input_tokens,
        "cache_write_tokens": booking.cache_write_tokens,
    }


@pytest.fixture
def history(database_url: str) -> Iterator[History]:
    yield from open_history(database_url, bookings=20)


def test_rows_convert_as_the_row_functions_do(history: History) -> None:
    with history.engine.connect() as connection:
        event_rows = list(connection.execute(sa.select(events).order_by(events.c.seq)).mappings())
        expected_events = [_event_from_row(row) for row in event_rows]
        booking_rows = list(
            connection.execute(
                sa.select(bookings).order_by(bookings.c.lane, bookings.c.reservation_id)
            ).mappings()
        )
        expected_bookings = [_booking_from_row(row) for row in booking_rows]
        policies = [
            records.lane_from_row(row)
            for row in connection.execute(sa.select(lanes).order_by(lanes.c.lane)).mappings()
        ]
    assert {event.kind for event in expected_events} >= {
        EventKind.LANE_CONFIGURED,
        EventKind.RESERVED,
        EventKind.SETTLED,
        EventKind.REFUNDED,
        EventKind.EXPIRED,
        EventKind.CORRECTED,
    }
    store = SqlRecoveryStore(history.engine, batch_rows=7)
    assert store.events_after(0, 10_000) == expected_events
    assert store.events_after(5, 3) == expected_events[5:8]
    with store.view() as view:
        assert list(view.bookings()) == expected_bookings
    # The column tuples and the value dicts name the same columns, in the same order.
    assert [records.event_from_row(row) for row in event_rows] == expected_events
    assert [records.booking_from_row(row) for row in booking_rows] == expected_bookings
    assert [records.booking_values(booking) for booking in expected_bookings] == [
        _booking_values(booking) for booking in expected_bookings
    ]
    assert records.booking_rows(expected_bookings) == [
        tuple(_booking_values(booking).values()) for booking in expected_bookings
    ]
    assert tuple(_booking_values(expected_bookings[0])) == records.BOOKING_COLUMNS
    assert records.lane_rows(policies) == [
        tuple(records.lane_values(policy).values()) for policy in policies
    ]
    assert tuple(records.lane_values(policies[0])) == records.LANE_COLUMNS


@pytest.mark.parametrize("batch_events", [1, 3, 1000])
def test_a_rebuild_gives_the_projections_the_live_path_kept(
    history: History, batch_events: int
) -> None:
    """Batches of one event end, in the database's fold, bookings opened in
    earlier batches; the projection digest must be the live path's every time."""
    recovery = history.recovery(batch_events=batch_events)
    kept = recovery.projection_digest()
    assert recovery.rebuild(Route(FULL_LOG_SOURCE, None)) == kept
    assert recovery.assess().consistent


def test_an_ending_builds_what_replace_built() -> None:
    opened = booking_fold.apply(
        Event(
            kind=EventKind.RESERVED,
            lane="recall",
            occurred_at_us=1,
            reservation_id="r1",
            amount_nanos=500,
            model="jev",
            hold_nanos=500,
            cap_nanos=600,
            expire_charge=ExpireCharge.HOLD,
            input_nanos_per_million_tokens=7,
            output_nanos_per_million_tokens=8,
            seq=3,
        ),
        None,
    )
    # Every field set, as the constructor would have set it.
    assert [name for name in vars(opened)] == [field.name for field in dataclasses.fields(Booking)]
    assert vars(opened.price) == vars(ModelPrice(7, 8))
    assert opened == Booking(
        "recall", "r1", "jev", 0, 0, None, None, 600, 500, 0, 0, ModelPrice(7, 8),
        ExpireCharge.HOLD, BookingState.OPEN, 500, 3,
    )  # fmt: skip
    ending = Event(
        kind=EventKind.SETTLED,
        lane="recall",
        occurred_at_us=2,
        reservation_id="r1",
        amount_nanos=123,
        outcome=Outcome.SUCCEEDED,
        input_tokens=10,
        output_tokens=20,
        billed_nanos=None,
        seq=9,
    )
    ended = booking_fold.apply(ending, opened)
    assert ended == dataclasses.replace(
        opened,
        state=BookingState.SETTLED,
        amount_nanos=123,
        ended_seq=9,
        outcome=Outcome.SUCCEEDED,
        input_tokens=10,
        output_tokens=20,
        billed_nanos=None,
    )
    assert type(ended) is Booking and hash(ended) == hash(dataclasses.replace(ended))
    assert list(vars(ended)) == list(vars(opened))
    assert opened.state is BookingState.OPEN  # the booking it ended is unchanged
