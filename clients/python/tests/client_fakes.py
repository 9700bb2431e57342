"""An in-memory stand-in for the ledger with the contract's idempotency, for
unit tests of the model call wrapper, the allowance and the replay."""

from __future__ import annotations

import dataclasses
import datetime

import grpc
from ledger_client import errors
from ledger_client.bookings import (
    Balance,
    BookingState,
    DenialReason,
    Refunded,
    Reservation,
    ReserveArguments,
    Settled,
)
from ledger_client.outcomes import Ending, Settlement

EPOCH = datetime.datetime(2026, 9, 24, tzinfo=datetime.UTC)
BALANCE = Balance("lane", 0, 0, 0, 0, 0, 0, 0, datetime.timedelta(days=1), EPOCH)


def unavailable() -> errors.LedgerUnavailable:
    return errors.LedgerUnavailable(grpc.StatusCode.UNAVAILABLE, "", "connection refused")


@dataclasses.dataclass
class FakeBooking:
    arguments: ReserveArguments
    admitted: bool
    hold_nanos: int
    ending: Ending | None = None


class FakeLedger:
    """Holds are request_bytes + max_output_tokens nanos; the limit is fixed."""

    def __init__(self, limit_nanos: int = 10**9) -> None:
        self.limit_nanos = limit_nanos
        self.reachable = True
        # After this many more RPCs the ledger goes away (None: never).
        self.calls_until_outage: int | None = None
        self.bookings: dict[str, FakeBooking] = {}
        self.events: list[tuple[str, str]] = []
        self.rpcs: list[tuple[str, str]] = []

    def _enter(self, method: str, reservation_id: str) -> None:
        if self.calls_until_outage is not None:
            if self.calls_until_outage == 0:
                self.reachable = False
            self.calls_until_outage -= 1
        if not self.reachable:
            raise unavailable()
        self.rpcs.append((method, reservation_id))

    def spent_nanos(self) -> int:
        total = 0
        for booking in self.bookings.values():
            if booking.admitted and (
                booking.ending is None or booking.ending.settlement is not Settlement.REFUND
            ):
                total += booking.hold_nanos
        return total

    def reserve_arguments(
        self,
        arguments: ReserveArguments,
        *,
        deadline_seconds: float | None = None,
        trace_id: str = "",
    ) -> Reservation:
        self._enter("reserve", arguments.reservation_id)
        booking = self.bookings.get(arguments.reservation_id)
        already_reserved = booking is not None
        if booking is None:
            hold = arguments.request_bytes + arguments.max_output_tokens
            admitted = self.spent_nanos() + hold <= self.limit_nanos
            booking = FakeBooking(arguments, admitted, hold)
            self.bookings[arguments.reservation_id] = booking
            self.events.append(("reserved" if admitted else "denied", arguments.reservation_id))
        elif booking.arguments != arguments:
            raise errors.ReservationConflict(grpc.StatusCode.ALREADY_EXISTS, "", "reused")
        return Reservation(
            reservation_id=arguments.reservation_id,
            admitted=booking.admitted,
            hold_nanos=booking.hold_nanos,
            cap_nanos=booking.hold_nanos,
            reserved_at=EPOCH,
            expires_at=EPOCH + datetime.timedelta(minutes=2) if booking.admitted else None,
            retry_after=None if booking.admitted else EPOCH + datetime.timedelta(hours=1),
            denial_reason=None if booking.admitted else DenialReason.BUDGET_EXHAUSTED,
            reason="" if booking.admitted else "does not fit",
            balance=BALANCE,
            already_reserved=already_reserved,
        )

    def end(
        self,
        reservation_id: str,
        ending: Ending,
        *,
        deadline_seconds: float | None = None,
        trace_id: str = "",
    ) -> Settled | Refunded:
        self._enter("end", reservation_id)
        booking = self.bookings.get(reservation_id)
        if booking is None:
            raise errors.BookingNotFound(grpc.StatusCode.NOT_FOUND, "BOOKING_NOT_FOUND", "none")
        if not booking.admitted:
            raise errors.BookingWasDenied(grpc.StatusCode.FAILED_PRECONDITION, "", "denied")
        if booking.ending is None:
            booking.ending = ending
            kind = "refunded" if ending.settlement is Settlement.REFUND else "settled"
            self.events.append((kind, reservation_id))
        elif booking.ending.settlement is not ending.settlement:
            raise errors.BookingAlreadyEnded(grpc.StatusCode.FAILED_PRECONDITION, "", "ended")
        if ending.settlement is Settlement.REFUND:
            return Refunded(BALANCE)
        return Settled(booking.hold_nanos, BookingState.SETTLED, BALANCE)

    def event_counts(self) -> dict[str, list[str]]:
        kinds: dict[str, list[str]] = {}
        for kind, reservation_id in self.events:
            kinds.setdefault(reservation_id, []).append(kind)
        return kinds


def client_on(fake: FakeLedger, outage: object, **settings: object) -> object:
    """A real LaneClient (journal, allowance, replayer and all) whose two moves
    go to the fake instead of the network."""
    from ledger_client import ClientSettings, LaneClient, OutagePolicy

    assert isinstance(outage, OutagePolicy)
    options: dict[str, object] = {"replay_interval_seconds": None, **settings}
    client = LaneClient(
        "127.0.0.1:9",  # never dialled: the moves below replace the RPCs
        "lane",
        outage=outage,
        settings=ClientSettings(**options),  # type: ignore[arg-type]
    )
    client.reserve_arguments = fake.reserve_arguments  # type: ignore[method-assign]
    client.end = fake.end  # type: ignore[method-assign]
    return client
