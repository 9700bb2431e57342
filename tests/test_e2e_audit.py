"""The audit through real gRPC stubs: every event can be listed, paged and tailed,
with its time, amounts, outcome and the trace id of the request that caused it;
a change of policy is an event too."""

from __future__ import annotations

import base64
import queue
import re
import threading
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb

SECOND_US = 1_000_000
BIG_BYTES = 300_000
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = (("traceparent", f"00-{TRACE_ID}-00f067aa0ba902b7-01"),)
STREAM_WAIT_SECONDS = 5.0


@pytest.fixture
def harness(ledger_harness: Any) -> Any:
    ledger_harness.make_lane()
    return ledger_harness


def make_history(harness: Any) -> None:
    """A little of everything on two lanes: 22 events, 3 of them lane_configured."""
    harness.make_lane("filter")
    for number in range(4):
        harness.reserve(f"s{number}", estimate_nanos=300, request_bytes=BIG_BYTES)
        harness.settle(f"s{number}", input_tokens=1_000 + number)
        harness.advance_us(SECOND_US)
    for number in range(3):
        harness.reserve(f"u{number}", lane="filter", estimate_nanos=200, request_bytes=BIG_BYTES)
        harness.settle(f"u{number}", pb.UNKNOWN, lane="filter")
    harness.reserve("refused")
    harness.refund("refused", 403)
    harness.make_lane(limit_nanos=1_000)
    harness.reserve("denied", request_bytes=BIG_BYTES)
    harness.reserve("expiring", ttl_us=SECOND_US)
    harness.advance_us(2 * SECOND_US)
    harness.settle("expiring", pb.UNKNOWN)  # records the expiry first, charges nothing more


def test_lane_changes_are_lane_configured_events(harness: Any) -> None:
    first = harness.admin.GetLane(pb.GetLaneRequest(lane="recall"))
    harness.advance_us(5)
    changed = harness.make_lane(limit_nanos=123_456, expire_charge=pb.ZERO)
    assert changed.version > first.version
    assert harness.micros_of(changed.updated_at) == harness.START_US + 5
    configured = harness.events("recall", kinds=["lane_configured"])
    assert [event.seq for event in configured] == [first.version, changed.version]
    latest = configured[-1]
    assert latest.policy.limit_nanos == 123_456
    assert latest.policy.expire_charge == pb.ZERO
    assert latest.limit_nanos == 123_456
    assert harness.micros_of(latest.occurred_at) == harness.START_US + 5
    assert configured[0].policy.limit_nanos == harness.RECALL_LIMIT_NANOS


def test_events_carry_times_amounts_and_outcomes(harness: Any) -> None:
    start = harness.START_US
    harness.reserve("r1", estimate_nanos=300, request_bytes=BIG_BYTES, ttl_us=30 * SECOND_US)
    harness.advance_us(7)
    harness.settle("r1", input_tokens=2_000, output_tokens=5, http_status=200)
    reserved, settled = harness.events("recall", reservation_id="r1")
    assert (reserved.kind, reserved.model, reserved.request_bytes) == ("reserved", "jev", BIG_BYTES)
    assert (reserved.hold_nanos, reserved.amount_nanos, reserved.estimate_nanos) == (300, 300, 300)
    assert reserved.cap_nanos == 8_772
    assert harness.micros_of(reserved.reserved_at) == start
    assert harness.micros_of(reserved.expires_at) == start + 30 * SECOND_US
    assert (reserved.spent_after_nanos, reserved.limit_nanos) == (300, harness.RECALL_LIMIT_NANOS)
    assert settled.kind == "settled"
    assert (settled.outcome, settled.http_status) == (pb.SUCCEEDED, 200)
    assert (settled.input_tokens, settled.output_tokens) == (2_000, 5)
    assert (settled.previous_amount_nanos, settled.amount_nanos) == (300, 202)
    assert harness.micros_of(settled.occurred_at) == start + 7
    assert harness.micros_of(settled.reserved_at) == start
    assert settled.spent_after_nanos == 202
    assert settled.seq > reserved.seq


def test_paging_covers_every_event_exactly_once(harness: Any) -> None:
    make_history(harness)
    everything = harness.ledger.ListEvents(pb.ListEventsRequest(page_size=1000)).events
    assert len(everything) == 3 + 8 + 6 + 2 + 1 + 2
    seqs = [event.seq for event in everything]
    assert seqs == sorted(set(seqs))

    paged: list[int] = []
    token = ""
    for _ in range(100):
        page = harness.ledger.ListEvents(pb.ListEventsRequest(page_size=4, page_token=token))
        assert len(page.events) <= 4
        paged.extend(event.seq for event in page.events)
        token = page.next_page_token
        if not token:
            break
    assert paged == seqs

    recall = harness.events("recall", page_size=3)
    assert {event.lane for event in recall} == {"recall"}
    assert [event.seq for event in recall] == [e.seq for e in everything if e.lane == "recall"]
    kinds = harness.events("", kinds=["refunded", "denied"])
    assert [(event.kind, event.reservation_id) for event in kinds] == [
        ("refunded", "refused"),
        ("denied", "denied"),
    ]
    expiring = harness.events("recall", reservation_id="expiring")
    assert [event.kind for event in expiring] == ["reserved", "expired"]
    after = harness.ledger.ListEvents(pb.ListEventsRequest(after_seq=seqs[-3])).events
    assert [event.seq for event in after] == seqs[-2:]


def test_a_bad_page_token_is_invalid_argument(harness: Any) -> None:
    failure = harness.fails(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: harness.ledger.ListEvents(pb.ListEventsRequest(page_token="not a token!")),
    )
    assert failure.field == "page_token"


def start_reader(stream: Any) -> tuple[threading.Thread, queue.Queue[Any]]:
    """Drains a server stream into a queue on a thread, so every wait is bounded."""
    received: queue.Queue[Any] = queue.Queue()

    def drain() -> None:
        try:
            for event in stream:
                received.put(event)
        except grpc.RpcError as error:
            received.put(error)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    return reader, received


def test_watch_streams_existing_then_new_events(harness: Any) -> None:
    harness.reserve("before")
    existing = harness.events("recall")
    stream = harness.ledger.WatchEvents(pb.WatchEventsRequest(lane="recall"))
    reader, received = start_reader(stream)
    try:
        got = [received.get(timeout=STREAM_WAIT_SECONDS) for _ in existing]
        assert [event.seq for event in got] == [event.seq for event in existing]
        harness.settle("before", input_tokens=10)
        harness.reserve("after")
        new = [received.get(timeout=STREAM_WAIT_SECONDS) for _ in range(2)]
        assert [(event.kind, event.reservation_id) for event in new] == [
            ("settled", "before"),
            ("reserved", "after"),
        ]
        assert received.empty()
    finally:
        stream.cancel()
        reader.join(timeout=STREAM_WAIT_SECONDS)
    assert not reader.is_alive()
    assert stream.code() is grpc.StatusCode.CANCELLED


def _first_new_event(harness: Any, received: Any) -> Any:
    """Reserves new-0, new-1, ... until the stream shows one (when a stream's
    server side starts is not observable); the first it showed, or None."""
    for attempt in range(50):
        harness.reserve(f"new-{attempt}")
        try:
            return received.get(timeout=0.2)
        except queue.Empty:
            continue
    return None


def test_watch_from_now_skips_the_past(harness: Any) -> None:
    harness.reserve("old")
    stream = harness.ledger.WatchEvents(pb.WatchEventsRequest(lane="recall", from_now=True))
    reader, received = start_reader(stream)
    try:
        first = _first_new_event(harness, received)
        assert first is not None
        assert first.reservation_id.startswith("new-")
    finally:
        stream.cancel()
        reader.join(timeout=STREAM_WAIT_SECONDS)


def test_watch_from_now_ignores_after_seq_as_the_proto_says(harness: Any) -> None:
    """WatchEventsRequest.from_now: "after_seq ignored". A client that leaves a
    sentinel there (-1: "none") still gets its stream, not INVALID_ARGUMENT."""
    stream = harness.ledger.WatchEvents(
        pb.WatchEventsRequest(lane="recall", from_now=True, after_seq=-1)
    )
    reader, received = start_reader(stream)
    try:
        first = _first_new_event(harness, received)
        assert isinstance(first, pb.Event), first
        assert first.reservation_id.startswith("new-")
    finally:
        stream.cancel()
        reader.join(timeout=STREAM_WAIT_SECONDS)


def test_a_page_token_takes_the_place_of_after_seq(harness: Any) -> None:
    """ListEventsRequest.page_token: "given, it takes the place of after_seq":
    whatever after_seq holds then is not read, as with from_now."""
    for number in range(3):
        harness.reserve(f"p{number}")
    first = harness.ledger.ListEvents(pb.ListEventsRequest(lane="recall", page_size=2))
    assert first.next_page_token
    rest = harness.ledger.ListEvents(
        pb.ListEventsRequest(lane="recall", page_token=first.next_page_token, after_seq=-1)
    )
    assert [event.seq for event in rest.events]
    assert rest.events[0].seq > first.events[-1].seq


def test_the_trace_id_of_the_request_is_stored_on_its_events(harness: Any) -> None:
    harness.reserve("traced", metadata=TRACEPARENT)
    harness.settle("traced", input_tokens=1, metadata=TRACEPARENT)
    harness.reserve("untraced")
    harness.reserve("badly-traced", metadata=(("traceparent", "not-a-traceparent"),))
    by_id = {
        (event.reservation_id, event.kind): event.trace_id for event in harness.events("recall")
    }
    assert by_id[("traced", "reserved")] == TRACE_ID
    assert by_id[("traced", "settled")] == TRACE_ID
    # Without a valid traceparent the server's own span gives a fresh trace id (or none).
    for untraced in (by_id[("untraced", "reserved")], by_id[("badly-traced", "reserved")]):
        assert untraced != TRACE_ID
        assert untraced == "" or re.fullmatch(r"[0-9a-f]{32}", untraced)


def test_an_expiry_recorded_by_a_move_carries_that_moves_trace_id(
    start_ledger_server: Any, harness_for: Any
) -> None:
    """With no sweep, whichever move finds an overdue booking first records its
    expiry, in that request's trace: Settle and Refund, and an operator's
    Correct or Reconcile too (docs/observability.md, "Which trace")."""
    unswept = harness_for(start_ledger_server(sweep_interval_seconds=3600))
    unswept.make_lane()
    for name in ("settled", "refunded", "corrected", "reconciled"):
        unswept.reserve(name, ttl_us=SECOND_US)
    unswept.advance_us(2 * SECOND_US)
    traces = {name: f"{number:032x}" for number, name in enumerate(
        ("settled", "refunded", "corrected", "reconciled"), start=1
    )}  # fmt: skip

    def traced(name: str) -> tuple[tuple[str, str], ...]:
        return (("traceparent", f"00-{traces[name]}-00f067aa0ba902b7-01"),)

    unswept.settle("settled", input_tokens=1, metadata=traced("settled"))
    unswept.ledger.Refund(
        pb.RefundRequest(lane="recall", reservation_id="refunded", http_status=403),
        metadata=traced("refunded"),
    )
    unswept.ledger.Correct(
        pb.CorrectRequest(
            lane="recall", reservation_id="corrected", charge_nanos=1, reason="bill",
            correction_id="c-1",
        ),
        metadata=traced("corrected"),
    )  # fmt: skip
    unswept.ledger.Reconcile(
        pb.ReconcileRequest(
            format=pb.ReconcileRequest.CSV,
            content=b"reservation_id,lane,billed_nanos\nreconciled,recall,1\n",
        ),
        metadata=traced("reconciled"),
    )
    expired = unswept.events("recall", kinds=["expired"])
    assert {event.reservation_id: event.trace_id for event in expired} == traces


@pytest.mark.parametrize(
    "position", ["9223372036854775808", "99999999999999999999999", "\u0663", "-5"]
)
def test_a_page_token_that_is_no_seq_is_invalid_argument(harness: Any, position: str) -> None:
    token = base64.urlsafe_b64encode(position.encode()).decode()
    failure = harness.fails(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: harness.ledger.ListEvents(pb.ListEventsRequest(page_token=token)),
    )
    assert failure.field == "page_token"


SMALL_MESSAGE_BYTES = 64 * 1024


def test_pages_end_early_to_fit_the_message_limit(
    start_ledger_server: Callable[..., Any], harness_for: Callable[[Any], Any]
) -> None:
    """Events and lanes large but accepted: a full page would pass the server's
    send limit, so each page stops short of it and the next one goes on."""
    harness = harness_for(start_ledger_server(max_message_bytes=SMALL_MESSAGE_BYTES))
    models = {f"model-{number:03d}-" + "m" * 150: (1_000, 2_000) for number in range(40)}
    lanes = [f"wide-{number}" for number in range(12)]
    for lane in lanes:
        harness.make_lane(lane, prices=models)
    harness.make_lane()
    for number in range(60):
        harness.reserve(f"r{number}")
        harness.refund(f"r{number}", 403, reason="r" * 1000)

    sizes: list[int] = []
    seqs: list[int] = []
    token = ""
    for _ in range(100):
        request = pb.ListEventsRequest(page_size=1000, page_token=token)
        page = harness.ledger.ListEvents(request)
        sizes.append(page.ByteSize())
        seqs.extend(event.seq for event in page.events)
        token = page.next_page_token
        if not token:
            break
    assert len(sizes) > 2 and max(sizes) <= SMALL_MESSAGE_BYTES
    assert seqs == list(range(1, len(lanes) + 1 + 120 + 1))

    names: list[str] = []
    token = ""
    for _ in range(100):
        listed = harness.admin.ListLanes(pb.ListLanesRequest(page_size=1000, page_token=token))
        assert listed.ByteSize() <= SMALL_MESSAGE_BYTES
        names.extend(lane.lane for lane in listed.lanes)
        token = listed.next_page_token
        if not token:
            break
    assert names == sorted([*lanes, "recall"])


def test_a_reconcile_report_leaves_out_the_rows_past_the_message_limit(
    start_ledger_server: Callable[..., Any], harness_for: Callable[[Any], Any]
) -> None:
    harness = harness_for(start_ledger_server(max_message_bytes=SMALL_MESSAGE_BYTES))
    lane = "l" * 150
    harness.make_lane(lane)
    export = b"reservation_id,billed_nanos\n" + b"".join(b"r%d,7\n" % n for n in range(800))
    response = harness.ledger.Reconcile(
        pb.ReconcileRequest(format=pb.ReconcileRequest.CSV, content=export, default_lane=lane)
    )
    assert response.unmatched_count == 800
    assert response.ByteSize() <= SMALL_MESSAGE_BYTES
    assert 0 < len(response.rows) < 800
    assert len(response.rows) + response.rows_omitted == 800


def test_lanes_with_the_longest_names_page_through_their_own_tokens(harness: Any) -> None:
    """A page that ends on a 200-character lane name hands out a token the
    server must take back."""
    longest = [letter * 200 for letter in "ab"]
    for name in longest:
        harness.make_lane(name)
    names, token = [], ""
    for _ in range(10):
        listed = harness.admin.ListLanes(pb.ListLanesRequest(page_size=1, page_token=token))
        names.extend(lane.lane for lane in listed.lanes)
        token = listed.next_page_token
        if not token:
            break
    assert names == sorted([*longest, "recall"])


def test_a_page_token_names_its_ledger(
    start_ledger_server: Callable[..., Any], harness_for: Callable[[Any], Any]
) -> None:
    """A token is a position in one ledger's log: another ledger (another
    database) refuses it naming page_token, rather than answer a page of its
    own log from a position that means nothing there; a second server on the
    same database takes it."""
    first_server = start_ledger_server()
    first = harness_for(first_server)
    first.make_lane()
    for number in range(3):
        first.reserve(f"p{number}")
    token = first.ledger.ListEvents(pb.ListEventsRequest(page_size=2)).next_page_token
    first.make_lane("filter")
    lanes_token = first.admin.ListLanes(pb.ListLanesRequest(page_size=1)).next_page_token
    assert token and lanes_token

    empty = harness_for(start_ledger_server())
    other = harness_for(start_ledger_server())
    other.make_lane()
    for number in range(3):
        other.reserve(f"p{number}")
    for foreign in (empty, other):
        failure = foreign.fails(
            grpc.StatusCode.INVALID_ARGUMENT,
            lambda ledger=foreign.ledger: ledger.ListEvents(pb.ListEventsRequest(page_token=token)),
        )
        assert (failure.reason, failure.field) == ("INVALID_ARGUMENT", "page_token")
        lanes_failure = foreign.fails(
            grpc.StatusCode.INVALID_ARGUMENT,
            lambda admin=foreign.admin: admin.ListLanes(
                pb.ListLanesRequest(page_token=lanes_token)
            ),
        )
        assert lanes_failure.field == "page_token"

    same = harness_for(start_ledger_server(database_url=first_server.settings.database_url))
    rest = same.ledger.ListEvents(pb.ListEventsRequest(page_token=token))
    assert [event.seq for event in rest.events] == [3, 4, 5]
    lanes = same.admin.ListLanes(pb.ListLanesRequest(page_token=lanes_token))
    assert [lane.lane for lane in lanes.lanes] == ["recall"]


def test_a_page_token_names_its_list(harness: Any) -> None:
    """A token is a position in one list: ListEvents' (a seq) and ListLanes'
    (a lane name) refuse each other's, naming page_token, rather than answer
    a page from a position the list never gave. Lane names may be digits, so
    a lane token could read as a seq."""
    for lane in ("2", "3", "4"):
        harness.make_lane(lane)
    for number in range(3):
        harness.reserve(f"p{number}")
    events_token = harness.ledger.ListEvents(pb.ListEventsRequest(page_size=2)).next_page_token
    lanes_token = harness.admin.ListLanes(pb.ListLanesRequest(page_size=1)).next_page_token
    assert events_token and lanes_token

    lanes_failure = harness.fails(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: harness.admin.ListLanes(pb.ListLanesRequest(page_token=events_token)),
    )
    events_failure = harness.fails(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: harness.ledger.ListEvents(pb.ListEventsRequest(page_token=lanes_token)),
    )
    assert (lanes_failure.field, events_failure.field) == ("page_token", "page_token")
