"""gRPC servicers: decode, call the application, encode. The rules live in the
domain; what is here checks the shape of read requests (a lane name, a page
token) before they reach it."""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TypeVar

import grpc
from google.protobuf import duration_pb2, empty_pb2, timestamp_pb2
from google.protobuf.message import Message
from opentelemetry import trace

from ledger_service.api import auth, convert, tracing
from ledger_service.application import deadlines
from ledger_service.application.audit import DEFAULT_BIGGEST, MAX_BIGGEST, Auditor
from ledger_service.application.feed import EventFeed
from ledger_service.application.ledger import Ledger
from ledger_service.application.ports import EventQuery
from ledger_service.application.reconciliation import reconcile_export
from ledger_service.domain.chain import GENESIS_HASH, event_hash
from ledger_service.domain.clock import ManualClock
from ledger_service.domain.errors import (
    ImplausibleUsage,
    InvalidArgument,
    TooManyReconciles,
)
from ledger_service.domain.moves import validate_reservation_id
from ledger_service.domain.policies import MAX_NAME_LENGTH, validate_name
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.settings import Settings

T = TypeVar("T", bound=Message)
log = logging.getLogger(__name__)


def trace_id_of(context: grpc.ServicerContext) -> str:
    """The W3C trace id (32 hex digits) of the request's server span, or empty.

    The tracing interceptor (api/tracing.py) starts that span as a child of the
    caller's `traceparent` when a valid one came in, so it is the caller's trace
    id then and a fresh one otherwise. Empty only without the interceptor.
    """
    span_context = trace.get_current_span().get_span_context()
    return format(span_context.trace_id, "032x") if span_context.is_valid else ""


def _page_size(value: int, settings: Settings) -> int:
    if value < 0:
        raise InvalidArgument("page_size", "must not be negative")
    return min(value or settings.default_page_size, settings.max_page_size)


def _cursor(after_seq: int) -> int:
    """A request's after_seq, as ListEvents and WatchEvents both read it."""
    if after_seq < 0:
        raise InvalidArgument("after_seq", "must not be negative")
    return after_seq


# A page's room for its items: the message limit less room for the rest of it.
_PAGE_HEADROOM_BYTES = 4096
_MAX_SEQ = 2**63 - 1


def _fitting(items: Sequence[T], message_bytes: int) -> Sequence[T]:
    """The longest prefix of `items` (protobuf messages) that fits in one answer
    of `message_bytes`: a page ends early rather than exceed the send limit.
    At least one item, which the request limit keeps below it."""
    room = message_bytes - _PAGE_HEADROOM_BYTES
    for index, item in enumerate(items):
        room -= item.ByteSize() + 6  # the field's tag and length
        if room < 0:
            return items[: max(index, 1)]
    return items


def _encode_token(position: str) -> str:
    return base64.urlsafe_b64encode(position.encode()).decode()


_NOT_OURS = "is not a token this ledger gave"
# A ledger is named by the first hex digits of its first event's hash (64 bits).
_LEDGER_TAG_LENGTH = 16
# A token is the base64 of "<ledger tag>.<list><position>": ListEvents' list
# is "" and its position a seq; ListLanes' is "lanes~" and its position a lane
# name (ASCII, at most MAX_NAME_LENGTH), so neither list takes the other's. No
# lane name holds "~": a server from before lists had names refuses the new
# lanes tokens rather than read them as a lane, and events tokens kept their form.
EVENTS_LIST = ""
LANES_LIST = "lanes~"
MAX_PAGE_TOKEN_LENGTH = len(
    _encode_token("x" * (_LEDGER_TAG_LENGTH + 1 + len(LANES_LIST) + MAX_NAME_LENGTH))
)


class PageTokens:
    """Page tokens that name their ledger. A position means something in one log
    only: a token from another ledger (another database) is refused naming
    page_token, rather than answered with a page of this log from a position
    it never gave. A ledger's name is the start of its first event's hash
    (computed, so that a log older than the hash chain has one too), which
    never changes (events are append-only): read once, then kept. A ledger
    with no event yet has handed out no token and takes none. A token names
    its list too: a lane named "2" is no seq 2."""

    def __init__(self, ledger: Ledger, list_name: str) -> None:
        self._ledger = ledger
        self._list = list_name
        self._tag = ""

    def _ledger_tag(self) -> str:
        if not self._tag:
            first = self._ledger.read_events(EventQuery(limit=1))
            if first:
                self._tag = event_hash(GENESIS_HASH, first[0])[:_LEDGER_TAG_LENGTH]
        return self._tag

    def encode(self, position: str) -> str:
        return _encode_token(f"{self._ledger_tag()}.{self._list}{position}")

    def decode(self, token: str) -> str:
        """The position a token holds; INVALID_ARGUMENT unless this ledger gave it."""
        if len(token) > MAX_PAGE_TOKEN_LENGTH:
            raise InvalidArgument("page_token", _NOT_OURS)
        try:
            text = base64.urlsafe_b64decode(token.encode("ascii")).decode()
        except (binascii.Error, UnicodeError, ValueError) as error:
            raise InvalidArgument("page_token", _NOT_OURS) from error
        # Only what _encode_token wrote decodes: lenient base64 would accept junk.
        if _encode_token(text) != token or not text.isprintable():
            raise InvalidArgument("page_token", _NOT_OURS)
        tag, dot, listed = text.partition(".")
        if not dot or tag != self._ledger_tag() or not listed.startswith(self._list):
            raise InvalidArgument("page_token", _NOT_OURS)
        position = listed[len(self._list) :]
        if not position:
            raise InvalidArgument("page_token", _NOT_OURS)
        return position


class LedgerServicer(pb_grpc.LedgerServicer):
    def __init__(
        self,
        ledger: Ledger,
        settings: Settings,
        feed: EventFeed,
        auditor: Auditor | None = None,
    ) -> None:
        self._ledger = ledger
        self._settings = settings
        self._feed = feed
        self._auditor = auditor
        # Each refused Settle is counted (ledger.settle.refused) but logged at most
        # auth.MAX_REFUSALS_LOGGED_PER_SECOND a second, as refused grants are.
        self._refused_settles = auth.RefusalLog(
            logger=log, level=logging.WARNING, what="refused Settles"
        )
        self._reconciles = threading.BoundedSemaphore(settings.max_concurrent_reconciles)
        self._tokens = PageTokens(ledger, EVENTS_LIST)

    def Reserve(
        self, request: pb.ReserveRequest, context: grpc.ServicerContext
    ) -> pb.ReserveResponse:
        result = self._ledger.reserve(convert.reserve_command(request), trace_id_of(context))
        return convert.reserve_response(result.event, result.balance, result.already_reserved)

    def Settle(self, request: pb.SettleRequest, context: grpc.ServicerContext) -> pb.SettleResponse:
        try:
            result = self._ledger.settle(convert.settle_command(request), trace_id_of(context))
        except ImplausibleUsage as refusal:
            self._refused_settles.write(
                "refused a Settle of booking %r of lane %r (%s): %s",
                request.reservation_id[:200],
                request.lane[:200],
                refusal.reason,
                refusal.message,
            )
            tracing.note_refused_settle(refusal.reason)
            raise
        return convert.settle_response(result)

    def Refund(self, request: pb.RefundRequest, context: grpc.ServicerContext) -> pb.RefundResponse:
        result = self._ledger.refund(convert.refund_command(request), trace_id_of(context))
        return convert.refund_response(result)

    def GetBalance(
        self, request: pb.GetBalanceRequest, context: grpc.ServicerContext
    ) -> pb.Balance:
        validate_name("lane", request.lane)
        return convert.balance(self._ledger.balance(request.lane))

    def GetBooking(
        self, request: pb.GetBookingRequest, context: grpc.ServicerContext
    ) -> pb.Booking:
        validate_name("lane", request.lane)
        validate_reservation_id(request.reservation_id)
        booking, now_us, window_us = self._ledger.booking(request.lane, request.reservation_id)
        return convert.booking(booking, now_us, window_us)

    def ListEvents(
        self, request: pb.ListEventsRequest, context: grpc.ServicerContext
    ) -> pb.ListEventsResponse:
        if request.lane:
            validate_name("lane", request.lane)
        if request.reservation_id:
            validate_reservation_id(request.reservation_id)
        # A page token takes the place of after_seq (the proto): only one is read.
        if request.page_token:
            position = self._tokens.decode(request.page_token)
            if not (position.isascii() and position.isdigit() and int(position) <= _MAX_SEQ):
                raise InvalidArgument("page_token", _NOT_OURS)
            after_seq = int(position)
        else:
            after_seq = _cursor(request.after_seq)
        size = _page_size(request.page_size, self._settings)
        # One more than the page, to know whether another page follows.
        events = self._ledger.list_events(convert.event_query(request, size + 1, after_seq))
        converted = [convert.event(event) for event in events[:size]]
        page = _fitting(converted, self._settings.max_message_bytes)
        response = pb.ListEventsResponse(events=page)
        if len(events) > len(page):
            response.next_page_token = self._tokens.encode(str(page[-1].seq))
        return response

    def Correct(
        self, request: pb.CorrectRequest, context: grpc.ServicerContext
    ) -> pb.CorrectResponse:
        command = convert.correct_command(request)
        result = self._ledger.correct(command, auth.current_grant_id(), trace_id_of(context))
        return convert.correct_response(result)

    def Reconcile(
        self, request: pb.ReconcileRequest, context: grpc.ServicerContext
    ) -> pb.ReconcileResponse:
        export_format = convert.export_format(request.format)
        if request.default_lane:
            validate_name("default_lane", request.default_lane)
        with self._reconcile_turn():
            report = reconcile_export(
                self._ledger,
                request.content,
                export_format,
                request.default_lane,
                dry_run=request.dry_run,
                trace_id=trace_id_of(context),
                bill_wins=request.bill_wins,
                grant_id=auth.current_grant_id(),
            )
            lanes = {row.lane for row in report.rows if row.lane}
            if len(lanes) == 1:
                tracing.note_lane(lanes.pop())
            response = convert.reconcile_response(report)
            shown = len(_fitting(response.rows, self._settings.max_message_bytes))
            response.rows_omitted += len(response.rows) - shown
            del response.rows[shown:]
            return response

    @contextlib.contextmanager
    def _reconcile_turn(self) -> Iterator[None]:
        """One of max_concurrent_reconciles turns, waited for at most the
        request deadline (or the caller's, when sooner): a file's parsed rows
        and report stay off the heap, and its parsing off the GIL, until it may
        run. Without a turn in time it is TOO_MANY_RECONCILES (not an outage:
        the database answers); nothing was read or written."""
        wait = deadlines.work_deadline(self._settings.request_deadline_seconds) - time.monotonic()
        if not self._reconciles.acquire(timeout=max(0.0, wait)):
            raise TooManyReconciles(self._settings.max_concurrent_reconciles)
        try:
            yield
        finally:
            self._reconciles.release()

    def GetAudit(self, request: pb.GetAuditRequest, context: grpc.ServicerContext) -> pb.Audit:
        validate_name("lane", request.lane)
        if not 0 <= request.biggest <= MAX_BIGGEST:
            raise InvalidArgument("biggest", f"must be between 0 and {MAX_BIGGEST}")
        if self._auditor is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server has no audit")
        assert self._auditor is not None  # abort raises
        found = self._auditor.audit(request.lane, request.biggest or DEFAULT_BIGGEST)
        return convert.audit(found)

    def WatchEvents(
        self, request: pb.WatchEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.Event]:
        if request.lane:
            validate_name("lane", request.lane)
            self._ledger.check_lane(request.lane)
        # from_now: "after_seq ignored" (the proto), whatever it holds.
        if request.from_now:
            after_seq = self._ledger.last_seq()
        else:
            after_seq = self._ledger.watch_after(_cursor(request.after_seq))
        query = EventQuery(
            lane=request.lane, after_seq=after_seq, limit=self._settings.watch_batch_size
        )
        # Not a generator itself: the call's grant is known only while this runs.
        owner = auth.current_grant_id()
        # The headers go out once the feed admits the stream, not with its first event.
        accepted = functools.partial(context.send_initial_metadata, ())
        streamed = self._feed.events(query, context.is_active, context.cancel, owner, accepted)
        return (convert.event(event) for event in streamed)


class LaneAdminServicer(pb_grpc.LaneAdminServicer):
    def __init__(self, ledger: Ledger, settings: Settings) -> None:
        self._ledger = ledger
        self._settings = settings
        self._tokens = PageTokens(ledger, LANES_LIST)

    def PutLane(self, request: pb.PutLaneRequest, context: grpc.ServicerContext) -> pb.Lane:
        if not request.HasField("lane"):
            raise InvalidArgument("lane", "is required")
        policy = convert.lane_policy(request.lane)
        return convert.lane(self._ledger.put_lane(policy, trace_id_of(context)))

    def GetLane(self, request: pb.GetLaneRequest, context: grpc.ServicerContext) -> pb.Lane:
        validate_name("lane", request.lane)
        return convert.lane(self._ledger.get_lane(request.lane))

    def ListLanes(
        self, request: pb.ListLanesRequest, context: grpc.ServicerContext
    ) -> pb.ListLanesResponse:
        size = _page_size(request.page_size, self._settings)
        after_lane = self._tokens.decode(request.page_token) if request.page_token else ""
        if after_lane:
            try:
                validate_name("page_token", after_lane)
            except InvalidArgument as error:
                raise InvalidArgument("page_token", _NOT_OURS) from error
        lanes = self._ledger.list_lanes(after_lane, size + 1)
        converted = [convert.lane(policy) for policy in lanes[:size]]
        page = _fitting(converted, self._settings.max_message_bytes)
        response = pb.ListLanesResponse(lanes=page)
        if len(lanes) > len(page):
            response.next_page_token = self._tokens.encode(page[-1].lane)
        return response


def _whole_micros(nanos: int) -> None:
    """The test clock counts whole microseconds, as the ledger does: a finer
    instant would be silently cut. Its requests carry no negative part."""
    if not 0 <= nanos <= 999_999_999:
        raise InvalidArgument("nanos", "is not a valid part of a second: 0 to 999,999,999")
    if nanos % 1000:
        raise InvalidArgument("nanos", "the ledger's clock counts whole microseconds")


class TestClockServicer(pb_grpc.TestClockServicer):
    """Registered by a server started with --test-clock (else AbsentTestClockServicer)."""

    def __init__(self, clock: ManualClock, ledger: Ledger) -> None:
        self._clock = clock
        self._ledger = ledger

    def SetTime(
        self, request: timestamp_pb2.Timestamp, context: grpc.ServicerContext
    ) -> timestamp_pb2.Timestamp:
        _whole_micros(request.nanos)
        instant_us = convert.micros_of_timestamp("seconds", request)
        floor_us = self._ledger.last_event_at_us()
        return convert.timestamp(self._clock.set_us(instant_us, not_before_us=floor_us))

    def Advance(
        self, request: duration_pb2.Duration, context: grpc.ServicerContext
    ) -> timestamp_pb2.Timestamp:
        _whole_micros(request.nanos)
        length_us = convert.micros_of_duration("seconds", request)
        if length_us < 0:
            raise InvalidArgument("seconds", "a test clock only moves forward by Advance")
        return convert.timestamp(self._clock.advance_us(length_us))

    def GetTime(
        self, request: empty_pb2.Empty, context: grpc.ServicerContext
    ) -> timestamp_pb2.Timestamp:
        return convert.timestamp(self._clock.now_us())


NO_TEST_CLOCK_MESSAGE = "this server has no test clock (start it with --test-clock)"


class AbsentTestClockServicer(pb_grpc.TestClockServicer):
    """The TestClock of a server started without --test-clock: every method
    answers UNIMPLEMENTED. It is registered rather than left out so that its
    calls pass the grant check and the tracing as every RPC does: unregistered,
    grpcio would answer before any interceptor ran."""

    def _absent(self, request: object, context: grpc.ServicerContext) -> timestamp_pb2.Timestamp:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, NO_TEST_CLOCK_MESSAGE)
        raise AssertionError("abort raises")

    SetTime = Advance = GetTime = _absent
