"""One model call, wrapped: reserve before, settle or refund after.

    with client.model_call("model-a", payload, max_output_tokens=512) as call:
        response = post(payload)
        call.answered(response.status_code, usage_of(response.json()))

Entering reserves with a fresh reservation_id, or raises `Denied` (fall back:
it carries the reason and, for a budget denial, `retry_after`). Leaving ends
the booking by the table in outcomes.py: what the caller reported, else what
the escaping exception says (UNKNOWN, because the call may have been sent,
unless it is CallNotSent), else UNKNOWN. An ending the ledger did not confirm
is sent again (`ClientSettings.end_attempts`, 3 by default). Ledger trouble
while ending never raises out of the block: the ending goes to the journal for
replay, or is logged and kept on the handle.

A Reserve that got no answer to a retryable error (UNAVAILABLE, a reset
connection, a replica gone) is sent again, the same request under the same id,
while its deadline (`ClientSettings.deadline_seconds`, from the first send)
has time left, up to `end_attempts` in all: the ledger answers a repeat with
its first answer, admitted or denied, and that is the call's answer.
A Reserve still without an answer (the ledger may have booked it) for a call
that will not be made is refunded: journaled in doubt and replayed when there is a
journal, else sent in the background (BackgroundRefunds), as the Node client
does.
"""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import datetime
import enum
import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Protocol

import grpc

from ledger_client.bookings import (
    DenialReason,
    Refunded,
    Reservation,
    ReserveArguments,
    Settled,
)
from ledger_client.errors import (
    BookingAlreadyEnded,
    BookingNotFound,
    BookingWasDenied,
    ClientClosed,
    LedgerError,
    LedgerUnavailable,
    ReservationConflict,
    is_retryable,
    may_have_applied,
    resends_reserve,
    settles_unknown_after_refusal,
)
from ledger_client.journal import (
    Journal,
    JournalEntry,
    JournalError,
    ReplayResult,
    Source,
    now_text,
)
from ledger_client.outage import Allowance
from ledger_client.outcomes import (
    CallFailure,
    CallNotSent,
    Ending,
    Settlement,
    Usage,
    ending_of,
    failure_of_exception,
    status_of_exception,
)
from ledger_client.replay import IN_DOUBT_REASON, Replayer
from ledger_client.settings import (
    DEFAULT_DEADLINE_SECONDS,
    DEFAULT_END_ATTEMPTS,
    END_RETRY_PAUSE_SECONDS,
)

log = logging.getLogger("ledger_client.calls")

# In-doubt Reserves journaled for a later refund, at most (beyond: refunded
# in the background, as without a journal).
MAX_IN_DOUBT_ENTRIES = 1000
# Refunds of unanswered Reserves sent in the background without a journal, at
# most this many at a time (beyond: the hold expires under expire_charge).
MAX_BACKGROUND_REFUNDS = 100
# More of them wait for a turn, at most this many (beyond: the hold expires):
# the flood that costs many Reserves their answers at once is when they come.
MAX_PENDING_REFUNDS = 1000
# A background refund that got no answer (its deadline passed, the ledger
# overloaded by the very flood that cost the Reserve its answer) is sent again
# under the same id (idempotent), each time with a fresh deadline, up to this
# many attempts in all, pausing UNANSWERED_REFUND_PAUSE_SECONDS times the
# attempt number between them, so the flood can pass; then the hold expires.
# The Node client's UNANSWERED_REFUND_ATTEMPTS and UNANSWERED_REFUND_PAUSE_MS.
UNANSWERED_REFUND_ATTEMPTS = 4
UNANSWERED_REFUND_PAUSE_SECONDS = 0.250
# Ids whose background refund ended (or may have ended) their booking, kept so
# that a Reserve under one is refused rather than admitted: the latest this many.
MAX_ENDED_IDS = 1000
# The reason those refunds carry (the Node client's UNANSWERED_REASON).
UNANSWERED_REASON = "not sent: the Reserve went unanswered"
SUPERSEDED_DETAIL = "reserved again under its id and admitted: the call that followed ends it"
NO_OUTCOME_REASON = "the block ended without reporting an outcome"
# A Reserve is sent again only with at least this much of its deadline left:
# less could not carry an answer back (the Node client's MIN_RESEND_MS).
MIN_RESEND_SECONDS = 0.005


class Denied(Exception):
    """Do not call the model; fall back. `retry_after` (UTC) is set when the
    ledger knows when enough of the window ages out for this call to fit;
    `denied_by` names the budget that said no ("" in an outage)."""

    def __init__(
        self,
        denial_reason: DenialReason,
        message: str,
        retry_after: datetime.datetime | None = None,
        reservation_id: str = "",
        denied_by: str = "",
    ) -> None:
        super().__init__(message)
        self.denial_reason = denial_reason
        self.message = message
        self.retry_after = retry_after
        self.reservation_id = reservation_id
        self.denied_by = denied_by


class CallLedger(Protocol):
    def reserve_arguments(
        self,
        arguments: ReserveArguments,
        *,
        deadline_seconds: float | None = None,
        trace_id: str = "",
    ) -> Reservation: ...

    def end(
        self,
        reservation_id: str,
        ending: Ending,
        *,
        deadline_seconds: float | None = None,
        trace_id: str = "",
    ) -> Settled | Refunded: ...


def refunded_after_unanswered(reservation_id: str) -> ReservationConflict:
    """A retry under the id of an unanswered Reserve whose refund has ended its booking."""
    return ReservationConflict(
        grpc.StatusCode.ALREADY_EXISTS,
        "RESERVATION_ID_REUSED",
        f"reservation {reservation_id} was refunded after its Reserve went unanswered; "
        "the ledger would answer a Reserve under it with its first answer for a booking "
        "that has ended: send the call under a new reservation_id",
    )


def used_by_model_call(reservation_id: str) -> ReservationConflict:
    """A model call under the id of one this client's model call was admitted
    under: the ledger would answer its Reserve with that first answer,
    admitted, and the model call made again could never be booked."""
    return ReservationConflict(
        grpc.StatusCode.ALREADY_EXISTS,
        "RESERVATION_ID_REUSED",
        f"reservation {reservation_id} was already admitted to a model call of this client; "
        "the ledger would answer a Reserve under it with its first answer, and this model "
        "call could never be booked: send the call under a new reservation_id",
    )


def reserved_by_another_call(reservation_id: str) -> ReservationConflict:
    """An admitted answer that an earlier Reserve under this id made, one this
    call did not send (another process, a lane restarted under the same id):
    that call may have made the model call, and one made again under its
    booking could never be booked, or would share its hold."""
    return ReservationConflict(
        grpc.StatusCode.ALREADY_EXISTS,
        "RESERVATION_ID_REUSED",
        f"reservation {reservation_id} was already reserved by a Reserve this call did not "
        "send; the ledger answered with that first answer, and this model call could never "
        "be booked: send the call under a new reservation_id",
    )


class RecentIds:
    """The latest `limit` reservation ids remembered, each with a value, the
    oldest forgotten first (the Node client's RecentIds): the model calls'
    ids, and the background refunds' ended ones."""

    def __init__(self, limit: int = MAX_ENDED_IDS) -> None:
        self._limit = limit
        self._ids: collections.OrderedDict[str, bool] = collections.OrderedDict()
        self._lock = threading.Lock()

    def add(self, reservation_id: str, value: bool = True) -> None:
        with self._lock:
            self._ids.pop(reservation_id, None)
            self._ids[reservation_id] = value
            while len(self._ids) > self._limit:
                self._ids.popitem(last=False)

    def forget(self, reservation_id: str) -> None:
        with self._lock:
            self._ids.pop(reservation_id, None)

    def get(self, reservation_id: str) -> bool | None:
        with self._lock:
            return self._ids.get(reservation_id)

    def __contains__(self, reservation_id: object) -> bool:
        with self._lock:
            return reservation_id in self._ids


class BackgroundRefunds:
    """Refunds of unanswered Reserves, sent in threads of their own, off the
    call's path, with the client's usual deadline: at most `limit` at a time,
    `pending_limit` more waiting their turn; one whose answer is lost is sent
    again, up to UNANSWERED_REFUND_ATTEMPTS (beyond that, the hold expires).
    Best effort: nothing they meet is raised. One per LaneClient.

    A Reserve sent again under such an id would get the ledger's first answer
    (admitted) even for a booking the refund has ended, and its paid call could
    then never be settled. So `clear` stands before every Reserve: it waits for
    the id's refund under way, and refuses the id (ReservationConflict) once
    the ledger has ended its booking; a refund whose answer was lost is sent
    again first. It remembers the `remember` latest ids whose refund did or may
    have ended a booking."""

    def __init__(
        self,
        limit: int = MAX_BACKGROUND_REFUNDS,
        remember: int = MAX_ENDED_IDS,
        pending_limit: int = MAX_PENDING_REFUNDS,
    ) -> None:
        self._limit = limit
        self._pending_limit = pending_limit
        # Refunds waiting for one of the `limit` threads, oldest first.
        self._pending: collections.deque[tuple[CallLedger, str, str]] = collections.deque()
        self._running = 0
        self._in_flight: set[str] = set()
        # Ids whose refund ended the booking (True) or may have (False: its answer was lost).
        self._ended = RecentIds(remember)
        self._changed = threading.Condition()

    def send(self, ledger: CallLedger, reservation_id: str, trace_id: str) -> bool:
        """Starts the refund, at once or once one of the `limit` under way ends;
        False when `limit` are under way and `pending_limit` wait."""
        with self._changed:
            if reservation_id in self._in_flight:
                return True
            if self._running >= self._limit:
                if len(self._pending) >= self._pending_limit:
                    return False
                self._pending.append((ledger, reservation_id, trace_id))
                self._in_flight.add(reservation_id)
                return True
            self._running += 1
            self._in_flight.add(reservation_id)
        thread = threading.Thread(
            target=self._work,
            args=(ledger, reservation_id, trace_id),
            name="ledger-unanswered-refund",
            daemon=True,
        )
        try:
            thread.start()
        except RuntimeError:  # no thread to be had (the interpreter is exiting)
            self._done(reservation_id)
            with self._changed:
                self._running -= 1
                self._changed.notify_all()
            return False
        return True

    def _work(self, ledger: CallLedger, reservation_id: str, trace_id: str) -> None:
        """Sends this refund, then those waiting, until none is left."""
        job: tuple[CallLedger, str, str] | None = (ledger, reservation_id, trace_id)
        while job is not None:
            self._refund(*job)
            with self._changed:
                job = self._pending.popleft() if self._pending else None
                if job is None:
                    self._running -= 1
                    self._changed.notify_all()

    def _refund(self, ledger: CallLedger, reservation_id: str, trace_id: str) -> None:
        try:
            for attempt in range(1, UNANSWERED_REFUND_ATTEMPTS + 1):
                error = self._attempt(ledger, reservation_id, trace_id)
                if error is None or not is_retryable(error):
                    break
                if attempt < UNANSWERED_REFUND_ATTEMPTS:
                    time.sleep(UNANSWERED_REFUND_PAUSE_SECONDS * attempt)
            if error is not None:  # best effort: at worst the hold expires
                log.debug("could not refund the unanswered reserve %s: %s", reservation_id, error)
        except Exception as error:  # ClientClosed among them: the channel is closed
            log.debug("could not refund the unanswered reserve %s: %s", reservation_id, error)
        finally:
            self._done(reservation_id)

    def _attempt(
        self, ledger: CallLedger, reservation_id: str, trace_id: str, deadline: float | None = None
    ) -> LedgerError | None:
        """Sends the refund once and remembers what its answer means for a later
        Reserve of the id; returns the error when the answer is not known."""
        ending = Ending(Settlement.REFUND, 0, None, UNANSWERED_REASON)
        try:
            ledger.end(reservation_id, ending, deadline_seconds=deadline, trace_id=trace_id)
        except (BookingNotFound, BookingWasDenied):
            self._remember_ended(reservation_id, None)  # nothing booked, or a denial a repeat gets
            return None
        except BookingAlreadyEnded:
            self._remember_ended(reservation_id, True)  # ended otherwise: the id is used up
            return None
        except LedgerError as error:
            self._remember_ended(reservation_id, False if may_have_applied(error) else None)
            return error
        self._remember_ended(reservation_id, True)
        return None

    def _remember_ended(self, reservation_id: str, ended: bool | None) -> None:
        if ended is None:
            self._ended.forget(reservation_id)
        else:
            self._ended.add(reservation_id, ended)

    def clear(
        self, ledger: CallLedger, reservation_id: str, trace_id: str, deadline: float
    ) -> None:
        """Before a Reserve of this id: returns when it may be sent. Raises
        ReservationConflict when a refund of it ended its booking, and
        LedgerUnavailable when that cannot be known now (a refund still under
        way after `deadline` seconds, or one asked again that got no answer)."""
        with self._changed:
            if not self._changed.wait_for(lambda: reservation_id not in self._in_flight, deadline):
                raise LedgerUnavailable(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "",
                    f"a refund of reservation {reservation_id} is still under way",
                )
            ended = self._ended.get(reservation_id)
        if ended is False:  # its answer was lost: ask again (a repeat gets the first answer)
            error = self._attempt(ledger, reservation_id, trace_id, deadline)
            if error is not None:
                raise error
            with self._changed:
                ended = self._ended.get(reservation_id)
        if ended:
            raise refunded_after_unanswered(reservation_id)

    def _done(self, reservation_id: str) -> None:
        with self._changed:
            self._in_flight.discard(reservation_id)
            self._changed.notify_all()

    @property
    def running(self) -> int:
        with self._changed:
            return self._running

    def wait(self, timeout_seconds: float) -> bool:
        """Waits until none is under way, at most this long; True if none is."""
        with self._changed:
            return self._changed.wait_for(lambda: self._running == 0, timeout_seconds)


CLOSED_MESSAGE = (
    "the lane client is closed: nothing was sent (a client is used until close(), "
    "not after; make a new one)"
)


# The model_call blocks the running code is inside: (gate, block) pairs.
_ENCLOSING: contextvars.ContextVar[tuple[tuple[CallGate, object], ...]] = contextvars.ContextVar(
    "ledger_enclosing_blocks", default=()
)


class CallGate:
    """What close() waits for: the calls under way, each RPC and each
    model_call block from its Reserve to its ending. Once closing, a new call
    is refused (ClientClosed) while those already admitted, and the RPCs they
    make, go on. One per LaneClient.

    close() called inside a model_call block cannot wait for that block, which
    ends only after it: the blocks the caller is inside (`enclosing`, by the
    context, which a thread or asyncio.to_thread keeps apart) are left out of
    its wait, and the rest of the close is left to their ending (`defer`)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._under_way = 0
        self._closing = False
        # The blocks close() was called inside, and what to run once they end.
        self._awaited: set[object] = set()
        self._deferred: Callable[[], None] | None = None
        # The blocks under way (a context may keep one left on another thread).
        self._blocks: set[object] = set()

    def admit(self) -> None:
        """Counts a new call in; ClientClosed once the client is closing."""
        with self._changed:
            if self._closing:
                raise ClientClosed(CLOSED_MESSAGE)
            self._under_way += 1

    def join(self) -> None:
        """Counts in a call made for one already admitted: never refused."""
        with self._changed:
            self._under_way += 1

    def done(self) -> None:
        with self._changed:
            self._under_way -= 1
            self._changed.notify_all()

    def enter_block(self, block: object) -> None:
        """Counts a model_call block in, as the caller's context's."""
        self.admit()
        with self._changed:
            self._blocks.add(block)
        _ENCLOSING.set((*_ENCLOSING.get(), (self, block)))

    def leave_block(self, block: object) -> None:
        _ENCLOSING.set(tuple(entry for entry in _ENCLOSING.get() if entry[1] is not block))
        self.done()
        with self._changed:
            self._blocks.discard(block)
            self._awaited.discard(block)
            self._changed.notify_all()
            action = self._deferred if not self._awaited else None
            if action is not None:
                self._deferred = None
        if action is not None:
            action()

    def enclosing(self) -> list[object]:
        """The blocks of this gate the caller's code runs inside."""
        with self._changed:
            return [
                block for gate, block in _ENCLOSING.get() if gate is self and block in self._blocks
            ]

    def defer(self, blocks: list[object], action: Callable[[], None]) -> None:
        """Runs `action` once `blocks` have ended."""
        with self._changed:
            self._awaited.update(blocks)
            self._deferred = action

    def wait_blocks(self, timeout_seconds: float) -> bool:
        """Waits until no model_call block is under way, at most this long;
        True if none is."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._blocks, timeout_seconds)

    def check(self) -> None:
        """ClientClosed once the client is closing."""
        with self._changed:
            if self._closing:
                raise ClientClosed(CLOSED_MESSAGE)

    def close(self) -> None:
        with self._changed:
            self._closing = True

    def wait(self, timeout_seconds: float, keep: int = 0) -> bool:
        """Waits until no more than `keep` are under way, at most this long;
        True if so."""
        with self._changed:
            return self._changed.wait_for(lambda: self._under_way <= keep, timeout_seconds)


@dataclasses.dataclass(frozen=True)
class CallSupport:
    ledger: CallLedger
    lane: str
    journal: Journal | None
    allowance: Allowance | None
    replayer: Replayer | None
    refunds: BackgroundRefunds | None = None
    # Attempts at a Settle or Refund in all (see ClientSettings.end_attempts).
    end_attempts: int = DEFAULT_END_ATTEMPTS
    # The client's deadline, also the longest a Reserve waits for a refund of its id.
    deadline_seconds: float = DEFAULT_DEADLINE_SECONDS
    # Refuses a block once the client is closing; counts it while under way.
    gate: CallGate | None = None
    # The ids of this client's model calls: True once the ledger admitted one
    # (a block under it again is refused), False while its Reserve went
    # unanswered and no model call was made (a block under it again may take
    # over what that Reserve booked).
    model_call_ids: RecentIds | None = None


class CallSource(enum.Enum):
    LEDGER = "ledger"  # the ledger admitted it
    ALLOWANCE = "allowance"  # the ledger was unreachable; the outage allowance admitted it


class CallHandle:
    """What the block reports through. Report once."""

    def __init__(
        self,
        arguments: ReserveArguments,
        source: CallSource,
        hold_nanos: int,
        expires_at: datetime.datetime | None,
        trace_id: str,
    ) -> None:
        self.arguments = arguments
        self.reservation_id = arguments.reservation_id
        self.source = source
        self.hold_nanos = hold_nanos
        self.expires_at = expires_at
        self.trace_id = trace_id
        self.ending: Ending | None = None
        # After the block: the ledger's answer, or why it is not there.
        self.result: Settled | Refunded | None = None
        self.end_error: LedgerError | ClientClosed | None = None
        self.journaled = False

    def _report(self, ending: Ending) -> Settlement:
        if self.ending is not None:
            raise RuntimeError("this model call already reported its outcome")
        self.ending = ending
        return ending.settlement

    def answered(self, http_status: int, usage: Usage | None = None) -> Settlement:
        """The provider answered with this status, with or without usage."""
        return self._report(ending_of(http_status, usage, CallFailure.NONE))

    def succeeded(
        self,
        input_tokens: int = 0,
        output_tokens: int = 0,
        *,
        billed_nanos: int | None = None,
        http_status: int = 200,
        cached_input_tokens: int = 0,
        cache_write_tokens: int = 0,
    ) -> Settlement:
        """The provider answered with usage. `input_tokens` counts every input
        token; the cached and cache-write ones are parts of it."""
        usage = Usage(
            input_tokens, output_tokens, billed_nanos, cached_input_tokens, cache_write_tokens
        )
        return self.answered(http_status, usage)

    def failed(self, failure: CallFailure, http_status: int = 0) -> Settlement:
        """The call failed without usage: timed out, lost its connection, ..."""
        return self._report(ending_of(http_status, None, failure))

    def not_sent(self, reason: str) -> Settlement:
        """The request never left the lane: refunded with this reason."""
        return self._report(ending_of(0, None, CallFailure.NOT_SENT, reason))


class ModelCall:
    def __init__(self, support: CallSupport, arguments: ReserveArguments, trace_id: str) -> None:
        self._support = support
        self._arguments = arguments
        self._trace_id = trace_id
        self._handle: CallHandle | None = None
        # Whether one of the Reserve's attempts may have booked it (its answer lost).
        self._reserve_in_doubt = False

    def __enter__(self) -> CallHandle:
        if self._handle is not None:
            raise RuntimeError("a ModelCall is entered once; make a new one per call")
        gate = self._support.gate
        if gate is not None:
            gate.enter_block(self)  # ClientClosed after close(): not an outage, nothing booked
        try:
            return self._enter()
        except BaseException:
            if gate is not None:
                gate.leave_block(self)
            raise

    def _enter(self) -> CallHandle:
        replayer = self._support.replayer
        if replayer is not None:
            # Before anything is journaled, so the replayer never takes this
            # call for the orphan of a dead process.
            replayer.hold(self._arguments.reservation_id)
        try:
            self._handle = self._reserve()
        except BaseException:
            if replayer is not None:
                replayer.release(self._arguments.reservation_id)
            raise
        return self._handle

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        handle = self._handle
        assert handle is not None
        ending = handle.ending or _ending_for(exc)
        handle.ending = ending
        try:
            if handle.source is CallSource.LEDGER:
                self._end_with_ledger(handle, ending)
            else:
                self._end_on_allowance(handle, ending)
        finally:
            if self._support.replayer is not None:
                self._support.replayer.release(handle.reservation_id)
            if self._support.gate is not None:
                self._support.gate.leave_block(self)

    # Entering --------------------------------------------------------------------

    def _reserve(self) -> CallHandle:
        arguments = self._arguments
        support = self._support
        model_call_ids = support.model_call_ids
        if model_call_ids is not None and model_call_ids.get(arguments.reservation_id):
            raise used_by_model_call(arguments.reservation_id)
        self._clear_refund(support.deadline_seconds)
        try:
            reservation = self._send_reserve()
        except LedgerUnavailable as error:
            return self._reserve_in_outage(error)
        except ClientClosed as error:
            # close() cut the Reserve off: the ledger may have booked it, and
            # the call will not be made. Its refund is journaled in doubt (the
            # channel is closed, so nothing can be sent now) for the next start.
            if error.may_have_applied or self._reserve_in_doubt:
                self._journal_in_doubt()
            raise
        except LedgerError as error:
            # Not an outage, but the ledger may have booked it (INTERNAL) and
            # the call will not be made.
            self._forget_unanswered(error)
            raise
        if not reservation.admitted:
            raise Denied(
                reservation.denial_reason or DenialReason.BUDGET_EXHAUSTED,
                reservation.reason,
                reservation.retry_after,
                arguments.reservation_id,
                reservation.denied_by,
            )
        if reservation.already_reserved and not self._takes_over_earlier_reserve():
            # The booking is another call's, left to it (nothing is ended here).
            raise reserved_by_another_call(arguments.reservation_id)
        if model_call_ids is not None:
            model_call_ids.add(arguments.reservation_id)
        self._supersede_in_doubt()
        self._wake_replayer()
        return CallHandle(
            arguments,
            CallSource.LEDGER,
            reservation.hold_nanos,
            reservation.expires_at,
            self._trace_id,
        )

    def _send_reserve(self) -> Reservation:
        """The Reserve, sent again (the same request: the ledger answers a repeat
        with its first answer) after a retryable error, as an ending is, but all
        within one deadline_seconds from the first send, so a lost answer costs
        no refund when the ledger answers in time. DEADLINE_EXCEEDED means that
        time is spent. Before each resend the id is cleared again: a refund of
        it (another call's, under the same id) may have ended its booking since."""
        support = self._support
        deadline = time.monotonic() + support.deadline_seconds
        attempt = 1
        while True:
            try:
                return support.ledger.reserve_arguments(
                    self._arguments,
                    deadline_seconds=max(deadline - time.monotonic(), MIN_RESEND_SECONDS),
                    trace_id=self._trace_id,
                )
            except LedgerError as error:
                # Any attempt may have booked it: one later refusal does not undo that.
                self._reserve_in_doubt = self._reserve_in_doubt or may_have_applied(error)
                pause = END_RETRY_PAUSE_SECONDS * attempt
                if (
                    not resends_reserve(error)
                    or attempt >= support.end_attempts
                    or deadline - time.monotonic() - pause < MIN_RESEND_SECONDS
                ):
                    raise
            time.sleep(pause)
            attempt += 1
            try:
                self._clear_refund(max(deadline - time.monotonic(), MIN_RESEND_SECONDS))
            except BaseException:
                # That refund (under way, or done) ends what the Reserves booked.
                self._reserve_in_doubt = False
                raise

    def _clear_refund(self, deadline_seconds: float) -> None:
        """A refund of an unanswered Reserve of this id may have ended the booking
        a Reserve would now be admitted to (BackgroundRefunds.clear). When that
        cannot be known, the lane falls back, whatever its outage mode: a call
        on the allowance under this id could not be settled either."""
        support = self._support
        reservation_id = self._arguments.reservation_id
        entry = support.journal.entry(reservation_id) if support.journal is not None else None
        if (
            entry is not None
            and entry.source is Source.IN_DOUBT
            and entry.replay is ReplayResult.LANDED
        ):
            # The journal's in-doubt refund reached the ledger: the booking has
            # ended, and a Reserve under this id would get its first answer,
            # admitted, for a call nobody could then settle.
            raise refunded_after_unanswered(reservation_id)
        if support.refunds is None:
            return
        try:
            support.refunds.clear(support.ledger, reservation_id, self._trace_id, deadline_seconds)
        except LedgerUnavailable as error:
            raise Denied(
                DenialReason.LEDGER_UNAVAILABLE,
                f"a refund of reservation {reservation_id} has no answer yet ({error.message}): "
                "send the call again later, or under a new reservation_id",
                None,
                reservation_id,
            ) from error

    def _reserve_in_outage(self, error: LedgerUnavailable) -> CallHandle:
        support = self._support
        arguments = self._arguments
        if support.allowance is not None:
            verdict = support.allowance.take(support.lane, arguments, self._trace_id)
            if verdict.admitted:
                return CallHandle(
                    arguments, CallSource.ALLOWANCE, verdict.hold_nanos, None, self._trace_id
                )
            reason = verdict.denial_reason or DenialReason.ALLOWANCE_EXHAUSTED
            message = verdict.message
        else:
            reason = DenialReason.LEDGER_UNAVAILABLE
            message = "the ledger is unreachable and this lane fails closed"
        # The Reserve may have reached the ledger without its answer reaching us.
        self._forget_unanswered(error)
        raise Denied(reason, message, None, arguments.reservation_id) from error

    def _forget_unanswered(self, error: LedgerError) -> None:
        """The Reserve got no answer and the call will not be made, but the
        ledger may hold a booking for it: refund it, so that it costs nothing
        instead of expiring at its hold. With a journal the refund is journaled
        (in doubt) and replayed; without one (or with the journal full of them,
        or failing) it is sent in the background, off the call's path."""
        if not (may_have_applied(error) or self._reserve_in_doubt):
            return
        if self._support.model_call_ids is not None:
            self._support.model_call_ids.add(self._arguments.reservation_id, False)
        if self._journal_in_doubt():
            return
        support = self._support
        if support.refunds is None or not support.refunds.send(
            support.ledger, self._arguments.reservation_id, self._trace_id
        ):
            log.debug(
                "unanswered reserve %s not refunded: %d refunds already under way",
                self._arguments.reservation_id,
                MAX_BACKGROUND_REFUNDS,
            )

    def _journal_in_doubt(self) -> bool:
        journal = self._support.journal
        if journal is None:
            return False
        entry = JournalEntry(
            self._support.lane,
            self._arguments,
            Source.IN_DOUBT,
            0,
            now_text(),
            trace_id=self._trace_id,
        )
        refund = Ending(Settlement.REFUND, 0, None, IN_DOUBT_REASON)
        try:
            return journal.record_in_doubt(entry, refund, MAX_IN_DOUBT_ENTRIES)
        except (JournalError, OSError) as failure:
            log.warning("could not journal an unanswered reserve: %s", failure)
            return False

    def _takes_over_earlier_reserve(self) -> bool:
        """Whether the earlier Reserve a repeated answer comes from is one this
        client sent for no model call: this call's own attempt whose answer was
        lost, or an earlier call's that went unanswered (remembered, or
        journaled in doubt by this process or one before it)."""
        model_call_ids = self._support.model_call_ids
        unanswered = model_call_ids is not None and (
            model_call_ids.get(self._arguments.reservation_id) is False
        )
        return self._reserve_in_doubt or unanswered or self._in_doubt_entry()

    def _in_doubt_entry(self) -> bool:
        """Whether an earlier Reserve of this id went unanswered, for a call
        never made, and was journaled in doubt, its refund not yet sent."""
        journal = self._support.journal
        entry = journal.entry(self._arguments.reservation_id) if journal is not None else None
        return entry is not None and entry.source is Source.IN_DOUBT and entry.replay is None

    def _supersede_in_doubt(self) -> None:
        """An earlier Reserve of this id went unanswered and was journaled in
        doubt, to be refunded. Admitted now, the booking is this call's to end:
        the refund would end it behind the call's back."""
        journal = self._support.journal
        reservation_id = self._arguments.reservation_id
        if journal is not None and self._in_doubt_entry():
            try:
                journal.record_replay(reservation_id, ReplayResult.SUPERSEDED, SUPERSEDED_DETAIL)
            except (JournalError, OSError) as failure:
                log.warning("could not mark %s superseded: %s", reservation_id, failure)

    def _wake_replayer(self) -> None:
        support = self._support
        if (
            support.replayer is not None
            and support.journal is not None
            and support.journal.pending()
        ):
            support.replayer.wake()

    # Leaving ---------------------------------------------------------------------

    def _end_with_ledger(self, handle: CallHandle, ending: Ending) -> None:
        try:
            handle.result = self._end(handle.reservation_id, ending)
        except ClientClosed as error:
            # close() cut the ending off once its grace was over: journaled if
            # the journal is still open, else the hold expires.
            handle.end_error = error
            log.warning("the client closed before booking %s was ended", handle.reservation_id)
            self._journal_ending(handle, ending)
        except LedgerError as error:
            handle.end_error = error
            if is_retryable(error):
                # Unanswered after the last attempt: the ledger unreachable, or
                # too busy (TOO_MANY_CALLS). Kept for the replay.
                self._journal_ending(handle, ending)
                return
            if ending.settlement is Settlement.SETTLE_SUCCEEDED and settles_unknown_after_refusal(
                error
            ):
                self._settle_refused_usage(handle, ending, error)
                return
            log.error(
                "the ledger refused to end booking %s (%s)", handle.reservation_id, error.reason
            )

    def _settle_refused_usage(
        self, handle: CallHandle, ending: Ending, refusal: LedgerError
    ) -> None:
        """The paid call happened, but the ledger refused its usage (more output
        than the max, no input tokens, ...), so its real cost cannot be booked
        from it: settled UNKNOWN at once, at most the cap, rather than left open
        to expire (at the lane's expire_charge, which may be zero). Both
        model_call and the SDK transports end here. The refusal stays on
        `end_error`; an UNKNOWN that gets no answer is journaled as any ending."""
        log.warning(
            "the ledger refused the usage of booking %s (%s): settled UNKNOWN, at most its cap",
            handle.reservation_id,
            refusal.reason,
        )
        unknown = Ending(Settlement.SETTLE_UNKNOWN, ending.http_status, None, ending.reason)
        handle.ending = unknown
        self._end_with_ledger(handle, unknown)
        handle.end_error = refusal

    def _end(self, reservation_id: str, ending: Ending) -> Settled | Refunded:
        """The Settle or Refund, sent again (same content: the ledger answers a
        repeat with its first answer) while unconfirmed, up to end_attempts."""
        attempt = 1
        while True:
            try:
                return self._support.ledger.end(reservation_id, ending, trace_id=self._trace_id)
            except LedgerError as error:
                if not is_retryable(error) or attempt >= self._support.end_attempts:
                    raise
            time.sleep(END_RETRY_PAUSE_SECONDS * attempt)
            attempt += 1

    def _journal_ending(self, handle: CallHandle, ending: Ending) -> None:
        journal = self._support.journal
        if journal is None:
            log.warning(
                "could not end booking %s and there is no journal: it will expire",
                handle.reservation_id,
            )
            return
        entry = JournalEntry(
            self._support.lane,
            handle.arguments,
            Source.LEDGER,
            handle.hold_nanos,
            now_text(),
            trace_id=self._trace_id,
        )
        try:
            journal.record_reserve(entry)
            journal.record_end(handle.reservation_id, ending, 0)
            handle.journaled = True
        except (JournalError, OSError) as failure:
            log.error("could not journal the ending of %s: %s", handle.reservation_id, failure)

    def _end_on_allowance(self, handle: CallHandle, ending: Ending) -> None:
        allowance = self._support.allowance
        assert allowance is not None
        try:
            allowance.record_end(handle.reservation_id, ending)
            handle.journaled = True
        except (JournalError, OSError) as failure:
            # The replay ends it UNKNOWN (an orphan), which never under-books.
            log.error("could not journal the ending of %s: %s", handle.reservation_id, failure)


def _ending_for(error: BaseException | None) -> Ending:
    if error is None:
        log.warning("a model call block ended without reporting an outcome: settled UNKNOWN")
        return ending_of(0, None, CallFailure.EXCEPTION, NO_OUTCOME_REASON)
    failure = failure_of_exception(error)
    reason = error.reason if isinstance(error, CallNotSent) else type(error).__name__
    return ending_of(status_of_exception(error), None, failure, reason)
