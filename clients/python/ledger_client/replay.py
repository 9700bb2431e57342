"""Replays the journal to the ledger, with the original reservation_ids.

The ledger answers a repeated Reserve, Settle or Refund with its first answer,
so replaying an entry twice (a crash between the ledger's answer and the
journal's `replayed` line) books nothing twice. Each attempt is bounded in
entries and time and stops at the first sign that the ledger is unreachable;
the next attempt resumes from the journal, which records every acknowledged
entry.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Protocol

from ledger_client.bookings import Refunded, Reservation, ReserveArguments, Settled
from ledger_client.errors import (
    BookingAlreadyEnded,
    BookingNotFound,
    BookingWasDenied,
    LedgerError,
    LedgerInternal,
    LedgerUnavailable,
    PermissionDenied,
    Unauthenticated,
)
from ledger_client.journal import Journal, JournalEntry, ReplayResult, Source
from ledger_client.outcomes import Ending, Settlement
from ledger_client.settings import ClientSettings

log = logging.getLogger("ledger_client.replay")

ORPHAN_REASON = "the lane stopped before the call's outcome was known"
IN_DOUBT_REASON = "the ledger did not answer the reserve; the call was not made"
# Errors that say "not now" rather than "never": the attempt stops and a later
# one tries again.
_STOP_ATTEMPT = (LedgerUnavailable, Unauthenticated, PermissionDenied)


class LedgerMoves(Protocol):
    """The moves a replay needs; LaneClient provides them."""

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


@dataclasses.dataclass(frozen=True)
class ReplayReport:
    landed: int = 0
    denied: int = 0  # made on the allowance, then denied by the ledger: spent unbooked
    absent: int = 0  # in-doubt Reserves the ledger never recorded
    rejected: int = 0  # refused for good; an operator must look at them
    failed: int = 0  # the ledger failed on them this time; left for the next attempt
    remaining: int = 0  # still in the journal after this attempt
    stopped_early: bool = False  # the ledger went away, or a limit of the attempt was hit


class Replayer:
    def __init__(self, ledger: LedgerMoves, journal: Journal, settings: ClientSettings) -> None:
        self._ledger = ledger
        self._journal = journal
        self._settings = settings
        self._in_flight: set[str] = set()
        self._replaying = ""  # the id whose entry is being sent now
        self._in_flight_changed = threading.Condition()
        self._attempt_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # Calls in progress in this process are not orphans ----------------------

    def hold(self, reservation_id: str) -> None:
        """Marks a call's id as in flight: no entry of that id is replayed until
        it is released (a retry under an id the journal holds in doubt owns its
        booking). Waits while an entry of that id is being sent."""
        with self._in_flight_changed:
            while self._replaying == reservation_id:
                self._in_flight_changed.wait()
            self._in_flight.add(reservation_id)

    def release(self, reservation_id: str) -> None:
        with self._in_flight_changed:
            self._in_flight.discard(reservation_id)

    def _claim(self, reservation_id: str) -> bool:
        with self._in_flight_changed:
            if reservation_id in self._in_flight:
                return False
            self._replaying = reservation_id
            return True

    def _unclaim(self) -> None:
        with self._in_flight_changed:
            self._replaying = ""
            self._in_flight_changed.notify_all()

    # One attempt -------------------------------------------------------------

    def replay_once(self, max_entries: int | None = None) -> ReplayReport:
        limit = self._settings.max_replay_entries_per_attempt
        if max_entries is not None:
            limit = max(1, min(max_entries, limit))
        with self._attempt_lock:
            return self._attempt(limit)

    def _attempt(self, limit: int) -> ReplayReport:
        deadline = time.monotonic() + self._settings.max_replay_seconds_per_attempt
        counts = {result: 0 for result in ReplayResult}
        failed = handled = 0
        stopped = False
        for pending in self._journal.pending():
            if handled + failed >= limit or time.monotonic() >= deadline or self._stop.is_set():
                stopped = True
                break
            if not self._claim(pending.reservation_id):
                continue  # a call of this id is in progress: it owns the booking
            try:
                # Read afresh: the list is as old as the attempt, and a call of
                # this id may since have ended it, superseded it or journaled it
                # anew (an in-doubt refund replaced by the retry's settle).
                current = self._journal.entry(pending.reservation_id)
                if current is None or current.replay is not None:
                    continue
                entry = self._closed(current)
                result, detail = self._replay(entry)
                self._journal.record_replay(entry.reservation_id, result, detail)
            except _STOP_ATTEMPT:
                stopped = True
                break
            except LedgerInternal as error:
                log.warning("replay of %s failed (%s); will retry", pending.reservation_id, error)
                failed += 1
                continue
            finally:
                self._unclaim()
            _log_result(entry, result, detail)
            counts[result] += 1
            handled += 1
        remaining = len(self._journal.pending())
        if remaining == 0:
            self._journal.rotate_if_replayed()
        return ReplayReport(
            landed=counts[ReplayResult.LANDED],
            denied=counts[ReplayResult.DENIED],
            absent=counts[ReplayResult.ABSENT],
            rejected=counts[ReplayResult.REJECTED],
            failed=failed,
            remaining=remaining,
            stopped_early=stopped,
        )

    def _closed(self, entry: JournalEntry) -> JournalEntry:
        """An entry with its ending; an orphan (its lane process died during the
        call) ends UNKNOWN, since the call may have been sent."""
        if entry.ending is not None:
            return entry
        if entry.source is Source.IN_DOUBT:
            ending = Ending(Settlement.REFUND, 0, None, IN_DOUBT_REASON)
            charge = 0
        else:
            ending = Ending(Settlement.SETTLE_UNKNOWN, 0, None, ORPHAN_REASON)
            charge = entry.local_hold_nanos if entry.source is Source.ALLOWANCE else 0
        self._journal.record_end(entry.reservation_id, ending, charge)
        return dataclasses.replace(entry, ending=ending, local_charge_nanos=charge)

    def _replay(self, entry: JournalEntry) -> tuple[ReplayResult, str]:
        """Sends one entry; raises for errors that should stop or skip the attempt."""
        assert entry.ending is not None
        deadline = self._settings.replay_deadline_seconds
        trace_id = entry.trace_id
        try:
            if entry.source is Source.ALLOWANCE:
                reservation = self._ledger.reserve_arguments(
                    entry.arguments, deadline_seconds=deadline, trace_id=trace_id
                )
                if not reservation.admitted:
                    reason = reservation.denial_reason
                    return ReplayResult.DENIED, reason.value if reason else ""
            elif entry.source is Source.IN_DOUBT:
                # Only a refund, which needs no more than the lane's charge scope:
                # the ledger says whether there was anything to refund.
                try:
                    self._ledger.end(
                        entry.reservation_id,
                        entry.ending,
                        deadline_seconds=deadline,
                        trace_id=trace_id,
                    )
                except (BookingNotFound, BookingWasDenied):
                    return ReplayResult.ABSENT, "the ledger holds nothing for it"
                return ReplayResult.LANDED, ""
            try:
                self._ledger.end(
                    entry.reservation_id, entry.ending, deadline_seconds=deadline, trace_id=trace_id
                )
            except BookingAlreadyEnded:
                if not _is_orphan(entry):
                    raise
                # The lane's own ending reached the ledger before the process
                # died, unjournaled: the booking has ended as the lane reported.
                return ReplayResult.LANDED, "the ledger holds the lane's own ending"
        except (*_STOP_ATTEMPT, LedgerInternal):
            raise
        except LedgerError as error:
            return ReplayResult.REJECTED, error.reason or error.code.name
        return ReplayResult.LANDED, ""

    # In the background -------------------------------------------------------

    def start(self, interval_seconds: float) -> None:
        assert self._thread is None, "the replayer runs once per client"
        self._thread = threading.Thread(
            target=self._run, args=(interval_seconds,), name="ledger-replay", daemon=True
        )
        self._thread.start()

    def wake(self) -> None:
        """Asks the background replayer to look now (cheap; never blocks)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self._settings.replay_deadline_seconds + 1.0)
            self._thread = None

    def _run(self, interval_seconds: float) -> None:
        while not self._stop.is_set():
            self._wake.wait(interval_seconds)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                if self._journal.pending():
                    self.replay_once()
            except Exception:
                # The replayer must outlive any one bad attempt; the journal keeps
                # everything for the next one.
                log.exception("journal replay attempt failed")


def _is_orphan(entry: JournalEntry) -> bool:
    """A call the ledger admitted whose lane process died before it journaled an
    ending: the replay's own UNKNOWN ending, not the lane's report."""
    ending = entry.ending
    return (
        entry.source is Source.LEDGER
        and ending is not None
        and ending.settlement is Settlement.SETTLE_UNKNOWN
        and ending.reason == ORPHAN_REASON
    )


def _log_result(entry: JournalEntry, result: ReplayResult, detail: str) -> None:
    if result is ReplayResult.DENIED:
        log.warning(
            "call %s was made on the outage allowance (about %d nanos) but the ledger "
            "denied its replayed reserve (%s): it is spent without a booking",
            entry.reservation_id,
            entry.local_charge_nanos,
            detail,
        )
    elif result is ReplayResult.REJECTED:
        log.error("the ledger refused the replay of %s for good: %s", entry.reservation_id, detail)
