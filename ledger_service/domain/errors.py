"""Domain errors. Each names the rule it enforces.

`api/errors.py` maps each class to one gRPC status code and a machine-readable
reason; anything not in that table becomes a constant INTERNAL.
"""

from __future__ import annotations


class LedgerError(Exception):
    """Base of every error a caller can cause and be told about."""

    reason = "LEDGER_ERROR"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(LedgerError):
    """A request field breaks a rule; names the field."""

    reason = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class TtlExceedsLaneHoldTtl(InvalidArgument):
    reason = "TTL_EXCEEDS_HOLD_TTL"


class UnknownModel(InvalidArgument):
    reason = "UNKNOWN_MODEL"


class LaneNotFound(LedgerError):
    reason = "LANE_NOT_FOUND"

    def __init__(self, lane: str) -> None:
        super().__init__(f"lane {lane!r} does not exist")


class BookingNotFound(LedgerError):
    """Also raised for another lane's booking: no cross-lane probing."""

    reason = "BOOKING_NOT_FOUND"

    def __init__(self, lane: str, reservation_id: str) -> None:
        super().__init__(f"lane {lane!r} has no booking {reservation_id!r}")


class ReservationConflict(LedgerError):
    """The reservation_id was used before with different arguments."""

    reason = "RESERVATION_ID_REUSED"

    def __init__(self, reservation_id: str) -> None:
        super().__init__(
            f"reservation_id {reservation_id!r} was already used with different arguments"
        )


class BookingAlreadyEnded(LedgerError):
    """A move contradicts how the booking already ended."""

    reason = "BOOKING_ALREADY_ENDED"


class BookingWasDenied(LedgerError):
    """The Reserve for this id was denied; there is nothing to settle or refund."""

    reason = "BOOKING_WAS_DENIED"

    def __init__(self, reservation_id: str) -> None:
        super().__init__(f"reservation {reservation_id!r} was denied; nothing was booked to end")


class TooManyWatchers(LedgerError):
    reason = "TOO_MANY_WATCHERS"

    def __init__(self) -> None:
        super().__init__("too many event streams are open; try again later")


class StoreUnavailable(LedgerError):
    """The database did not answer in time, or went away. Safe to retry."""

    reason = "STORE_UNAVAILABLE"

    def __init__(self) -> None:
        super().__init__("the ledger's database is unavailable; retry later")


class RecoveryRequired(LedgerError):
    """The projections are missing, behind or inconsistent with the log, or being
    rebuilt: no move is taken until a recovery makes them whole (docs/recovery.md)."""

    reason = "RECOVERY_REQUIRED"

    def __init__(self) -> None:
        super().__init__("the ledger is recovering its projections from the log; retry later")
