"""The SQL copy of the expiry rule (storage/sql.py expired_at, held_at,
amount_at) agrees with the domain's (Booking.is_expired_at, is_open_at,
amount_at, contribution) over random bookings and instants, on both databases."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete, insert, select

from ledger_service.domain.bookings import Booking, BookingState
from ledger_service.domain.policies import ExpireCharge
from ledger_service.domain.pricing import ModelPrice
from ledger_service.storage import records
from ledger_service.storage.schema import bookings
from ledger_service.storage.sql import SqlStore, amount_at, expired_at, held_at
from tests.storage.conftest import RECALL

DEADLINE_US = 1_000_000_000

_BOOKING = st.fixed_dictionaries(
    {
        "state": st.sampled_from(list(BookingState)),
        # Deadlines around the instant, the edge included.
        "expires_at_us": st.integers(DEADLINE_US - 3, DEADLINE_US + 3),
        "hold_nanos": st.integers(0, 10**15),
        "amount_nanos": st.integers(0, 10**15),
        "expire_charge": st.sampled_from(list(ExpireCharge)),
    }
)


def _booking(index: int, fields: dict[str, object]) -> Booking:
    return dataclasses.replace(
        Booking(
            lane=RECALL.lane,
            reservation_id=f"r{index}",
            model="jev",
            request_bytes=1,
            max_output_tokens=1,
            estimate_nanos=None,
            requested_ttl_us=None,
            cap_nanos=1,
            hold_nanos=0,
            reserved_at_us=DEADLINE_US - 10,
            expires_at_us=DEADLINE_US,
            price=ModelPrice(1, 1),
            expire_charge=ExpireCharge.HOLD,
            state=BookingState.OPEN,
            amount_nanos=0,
            answer_seq=index + 1,
        ),
        **fields,
    )


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rows=st.lists(_BOOKING, min_size=1, max_size=8),
    now_us=st.integers(DEADLINE_US - 4, DEADLINE_US + 4),
)
def test_the_sql_expiry_rule_is_the_domain_rule(
    store: SqlStore, rows: list[dict[str, object]], now_us: int
) -> None:
    made = [_booking(index, fields) for index, fields in enumerate(rows)]
    with store.engine.begin() as connection:
        if not store.run(lambda tx: tx.get_lane(RECALL.lane), write=False):
            store.run(lambda tx: tx.save_lane(RECALL))
        connection.execute(delete(bookings).where(bookings.c.lane == RECALL.lane))
        connection.execute(insert(bookings), [records.booking_values(b) for b in made])
    with store.engine.connect() as connection:
        answers = connection.execute(
            select(
                bookings.c.reservation_id,
                expired_at(now_us),
                held_at(now_us),
                amount_at(now_us),
            ).where(bookings.c.lane == RECALL.lane)
        ).all()
    by_id = {booking.reservation_id: booking for booking in made}
    assert len(answers) == len(made)
    for reservation_id, expired, held, amount in answers:
        booking = by_id[reservation_id]
        assert bool(expired) is booking.is_expired_at(now_us), booking
        assert bool(held) is booking.is_open_at(now_us), booking
        assert int(amount) == booking.amount_at(now_us), booking
        contribution = (booking.amount_nanos, 0) if held else (0, int(amount))
        assert contribution == booking.contribution(now_us), booking
