"""The lane's history: its events, listed a page at a time or tailed as they
are committed (ListEvents and WatchEvents, docs/semantics.md "Audit").

A tail follows the server's sequence numbers: a stream that drops is opened
again after the last event it gave, so the caller never sees an event twice
and never misses one (the server's streams never skip a seq still committing).
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from typing import Any, Protocol, TypeVar

import grpc

from ledger_client.bookings import DenialReason, check_range
from ledger_client.errors import LedgerError, LedgerUnavailable, from_rpc_error, is_retryable
from ledger_client.pricing import ModelPrice
from ledger_client.settings import MAX_PAGE_SIZE

MAX_SEQ = 2**63 - 1
_Message = TypeVar("_Message")


@dataclasses.dataclass(frozen=True)
class LanePolicy:
    """A lane's policy as a `lane_configured` event carries it (the proto's
    Lane), with the defaults the ledger resolved. A setting the wire leaves
    out, which the ledger never does, is None (clients/cases/events.json)."""

    lane: str
    limit_nanos: int
    window: datetime.timedelta | None
    hold_ttl: datetime.timedelta | None
    # Bytes per token in thousandths (3.5 is 3500), as the ledger keeps it.
    bytes_per_token_milli: int | None
    overhead_tokens: int | None
    # Left out of the hash (a dict has none); compared all the same.
    prices: Mapping[str, ModelPrice] = dataclasses.field(hash=False)
    # HOLD or ZERO: what an expired booking is charged; "" when unset.
    expire_charge: str
    # The seq of the lane_configured event that set this policy.
    version: int
    updated_at: datetime.datetime | None
    # The parent budget (another lane), "" when none.
    parent: str
    # A SUCCEEDED charge above this multiple of the cap is refused; 0: no bound.
    max_charge_multiple: int | None


@dataclasses.dataclass(frozen=True)
class LedgerEvent:
    """One immutable fact of the lane's log (the proto's Event). Amounts in
    integer nanos; instants timezone-aware UTC, None where the event has none."""

    seq: int
    lane: str
    # reserved, denied, settled, refunded, expired, lane_configured, reconciled, corrected
    kind: str
    reservation_id: str
    # What the booking counts in its window after this event, and before it.
    amount_nanos: int
    previous_amount_nanos: int
    occurred_at: datetime.datetime
    # SUCCEEDED or UNKNOWN for a settlement; "" otherwise.
    outcome: str
    http_status: int
    model: str
    request_bytes: int
    max_output_tokens: int
    input_tokens: int
    output_tokens: int
    cached_input_tokens: int
    cache_write_tokens: int
    billed_nanos: int | None
    estimate_nanos: int | None
    hold_nanos: int
    cap_nanos: int
    reserved_at: datetime.datetime | None
    expires_at: datetime.datetime | None
    retry_after: datetime.datetime | None
    denial_reason: DenialReason | None
    # For a denial: the budget that said no (this lane or a parent).
    denied_by: str
    reason: str
    trace_id: str
    # The lane's spent and limit right after this event.
    spent_after_nanos: int
    limit_nanos: int
    correction_id: str
    grant_id: str
    # Tamper evidence: this event's hash, chained to the lane's previous one.
    hash: str
    previous_hash: str
    # For lane_configured: the lane's new policy; None for the other kinds.
    policy: LanePolicy | None = None


@dataclasses.dataclass(frozen=True)
class EventPage:
    """One page of the lane's events, oldest first. `next_after_seq` is the
    cursor for the next page (the `after_seq` to pass); None when the log has
    no more events right now."""

    events: tuple[LedgerEvent, ...]
    next_after_seq: int | None


def check_after_seq(after_seq: object) -> None:
    check_range("after_seq", after_seq, 0, MAX_SEQ)


def check_page_size(page_size: object) -> None:
    """The server serves at most MAX_PAGE_SIZE events a page and would cut a
    larger page short in silence: refused here, naming the field."""
    check_range("page_size", page_size, 1, MAX_PAGE_SIZE)


def all_pages(page: Callable[[int], EventPage], after_seq: int) -> Iterator[LedgerEvent]:
    """Every event after `after_seq`, page after page, until the log's end as
    it stands."""
    cursor: int | None = after_seq
    while cursor is not None:
        listed = page(cursor)
        yield from listed.events
        cursor = listed.next_after_seq


class _Stream(Protocol):
    def cancel(self) -> Any: ...


class Watches:
    """The event streams of one client that are open: close() cancels them all,
    and wakes a tail waiting to resume, so that each ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: set[_Stream] = set()
        self._closed = threading.Event()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def add(self, call: _Stream) -> bool:
        """Counts an open stream in; False (and cancelled) once closed."""
        with self._lock:
            if not self._closed.is_set():
                self._calls.add(call)
                return True
        call.cancel()
        return False

    def discard(self, call: _Stream) -> None:
        with self._lock:
            self._calls.discard(call)
        call.cancel()

    def close(self) -> None:
        with self._lock:
            self._closed.set()
            calls, self._calls = self._calls, set()
        for call in calls:
            call.cancel()

    def pause(self, seconds: float) -> bool:
        """Waits `seconds`; True when the client closed meanwhile."""
        return self._closed.wait(seconds)


@dataclasses.dataclass(frozen=True)
class Resumption:
    """How a dropped stream is opened again: pausing `first_pause_seconds`,
    doubling up to `most_pause_seconds`, until `for_seconds` have passed since
    the drop with no stream answering; then the last failure is raised."""

    for_seconds: float
    first_pause_seconds: float
    most_pause_seconds: float


# What stream_events yields once the server has accepted the stream.
ANSWERED = None


def tail(
    open_stream: Callable[[int], Generator[LedgerEvent | None, None, None]],
    watches: Watches,
    after_seq: int,
    resumption: Resumption,
) -> Generator[LedgerEvent, None, None]:
    """The events after `after_seq`, then each one as it is committed, for as
    long as the caller iterates. `open_stream(after)` opens one stream; a
    retryable failure (the error table's) opens another after the last event
    seen, any other is raised. Ends when the client closes."""
    last = after_seq
    pause = resumption.first_pause_seconds
    failing_since: float | None = None
    while not watches.closed:
        stream = open_stream(last)
        try:
            for event in stream:
                pause, failing_since = resumption.first_pause_seconds, None
                if event is not ANSWERED:
                    last = event.seq
                    yield event
        except LedgerError as failure:
            if watches.closed:
                return
            failing_since = time.monotonic() if failing_since is None else failing_since
            if (
                not is_retryable(failure)
                or time.monotonic() - failing_since >= resumption.for_seconds
            ):
                raise
        finally:
            stream.close()
        if watches.pause(pause):
            return
        pause = min(pause * 2, resumption.most_pause_seconds)


def stream_events(
    call: grpc.CallIterator[_Message],
    watches: Watches,
    deadline_seconds: float,
    convert: Callable[[_Message], LedgerEvent],
) -> Iterator[LedgerEvent | None]:
    """One open WatchEvents stream: ANSWERED once the server accepts it (it
    sends its headers at once), then its events. A stream not answered within
    the deadline is cancelled, taken for an outage. Cancelled too when the
    caller stops."""
    if not watches.add(call):
        return
    # Cancelled by this client, not the lane: said as the deadline it is.
    late = threading.Event()
    cancel: Callable[[], object] = call.cancel

    def give_up() -> None:
        late.set()
        cancel()

    timer = threading.Timer(deadline_seconds, give_up)
    timer.daemon = True
    timer.start()
    try:
        call.initial_metadata()
        timer.cancel()
        _raise_if_refused(call)
        yield ANSWERED
        for message in call:
            yield convert(message)
    except grpc.RpcError as error:
        if late.is_set():
            raise LedgerUnavailable(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "",
                "the ledger did not accept the event stream within its deadline "
                f"({deadline_seconds:g} s)",
            ) from error
        raise from_rpc_error(error) from error
    finally:
        timer.cancel()
        watches.discard(call)


def _raise_if_refused(call: Any) -> None:
    """Raises the error of a stream that ended before its headers (refused,
    unreachable, or cancelled): such a stream never answered. grpcio's
    streams are Futures, and RpcErrors themselves."""
    ended = isinstance(call, grpc.Future) and call.done()
    if ended and call.code() is not grpc.StatusCode.OK:
        raise call
