"""WatchEvents from a cursor past the end of the log, through a real server on
both databases: refused at once with INVALID_ARGUMENT naming `after_seq`,
where it used to wait, silent, for events this ledger will not have for ages
(a cursor from another ledger, or from before a restore)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest
import sqlalchemy as sa

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb

# A refusal comes at once; the deadline only ends the old silent wait, whose
# DEADLINE_EXCEEDED then fails the test's status check.
REFUSAL_DEADLINE_SECONDS = 5.0
# How long a stream may take for an event that must come.
WAIT_SECONDS = 30.0


def _first_event(harness: Any, request: pb.WatchEventsRequest, timeout: float) -> pb.Event:
    stream = harness.ledger.WatchEvents(request, timeout=timeout)
    try:
        event: pb.Event = next(stream)
        return event
    finally:
        stream.cancel()


def test_a_cursor_past_the_log_is_refused_naming_after_seq(harness: Any) -> None:
    harness.make_lane()
    harness.reserve("r1")
    last = harness.events()[-1].seq
    for after_seq in (last + 1, 2**62):
        request = pb.WatchEventsRequest(after_seq=after_seq)
        failure = harness.fails(
            grpc.StatusCode.INVALID_ARGUMENT,
            lambda request=request: _first_event(harness, request, REFUSAL_DEADLINE_SECONDS),
        )
        assert (failure.reason, failure.field) == ("INVALID_ARGUMENT", "after_seq")
        assert f"last seq is {last}" in failure.details
        assert "another ledger" in failure.details and "restore" in failure.details


def test_a_cursor_at_the_last_seq_waits_for_the_next_event(harness: Any) -> None:
    harness.make_lane()
    harness.reserve("r1")
    last = harness.events()[-1].seq
    harness.reserve("r2")
    event = _first_event(harness, pb.WatchEventsRequest(after_seq=last), WAIT_SECONDS)
    assert (event.seq, event.reservation_id) == (last + 1, "r2")


def test_from_now_ignores_a_cursor_past_the_log(harness: Any) -> None:
    harness.make_lane()
    stream = harness.ledger.WatchEvents(
        pb.WatchEventsRequest(after_seq=2**62, from_now=True), timeout=WAIT_SECONDS
    )
    try:
        stream.initial_metadata()  # accepted: the stream started at the log's end
        harness.reserve("r1")
        assert next(stream).reservation_id == "r1"
    finally:
        stream.cancel()


@pytest.mark.postgres
def test_a_seq_in_flight_elsewhere_is_inside_the_log(
    postgres_schema_url: str,
    start_ledger_server: Callable[..., Any],
    harness_for: Callable[[Any], Any],
) -> None:
    """PostgreSQL: the end is the sequence's value, not this server's commit
    horizon, which an append in flight (here, another replica's) holds back.
    A client of that replica may hold its seq as a cursor once it commits."""
    harness = harness_for(start_ledger_server(database_url=postgres_schema_url))
    harness.make_lane()
    harness.reserve("r1")
    engine = sa.create_engine(postgres_schema_url)
    try:
        with engine.connect() as elsewhere:
            taken = int(elsewhere.execute(sa.text("SELECT nextval('events_seq_seq')")).scalar_one())
            assert taken > harness.events()[-1].seq
            stream = harness.ledger.WatchEvents(
                pb.WatchEventsRequest(after_seq=taken), timeout=WAIT_SECONDS
            )
            stream.initial_metadata()  # the server accepted or refused it
            elsewhere.rollback()  # the append in flight leaves a hole
    finally:
        engine.dispose()
    try:
        harness.reserve("r2")
        event = next(stream)
        assert (event.seq, event.reservation_id) == (taken + 1, "r2")
    finally:
        stream.cancel()
