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
        self.detail = message  # the message without its field


class TtlExceedsLaneHoldTtl(InvalidArgument):
    reason = "TTL_EXCEEDS_HOLD_TTL"


class UnknownModel(InvalidArgument):
    reason = "UNKNOWN_MODEL"


class ImplausibleUsage(InvalidArgument):
    """A Settle's usage that no call of its booking could have produced: refused
    before anything is written (the subclasses say which rule)."""


class UsageNotEvidence(ImplausibleUsage):
    """A SUCCEEDED Settle says nothing a provider bills: no input tokens, no bill."""

    reason = "SETTLE_WITHOUT_USAGE"


class OutputExceedsMaxTokens(ImplausibleUsage):
    """More output tokens than the booking asked the provider for: impossible."""

    reason = "OUTPUT_EXCEEDS_MAX_TOKENS"


class ChargeExceedsCapMultiple(ImplausibleUsage):
    """A SUCCEEDED charge above the lane's max_charge_multiple of the booking's cap."""

    reason = "CHARGE_EXCEEDS_CAP_MULTIPLE"


class SumOutOfRange(InvalidArgument):
    """The amount would take a budget's window past the largest sum the ledger keeps."""

    reason = "SUM_OUT_OF_RANGE"


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


class BookingStillOpen(LedgerError):
    """A correction replaces the charge of an ended booking; this one is still open."""

    reason = "BOOKING_STILL_OPEN"

    def __init__(self, reservation_id: str) -> None:
        super().__init__(
            f"booking {reservation_id!r} is still open: settle or refund it, or let it expire"
        )


class CorrectionConflict(LedgerError):
    """The correction_id was used before with different content."""

    reason = "CORRECTION_ID_REUSED"

    def __init__(self, correction_id: str) -> None:
        super().__init__(f"correction_id {correction_id!r} was already used with other content")


class BookingWasDenied(LedgerError):
    """The Reserve for this id was denied; there is nothing to settle or refund."""

    reason = "BOOKING_WAS_DENIED"

    def __init__(self, reservation_id: str) -> None:
        super().__init__(f"reservation {reservation_id!r} was denied; nothing was booked to end")


class TooManyWatchers(LedgerError):
    reason = "TOO_MANY_WATCHERS"

    def __init__(self, why: str = "too many event streams are open") -> None:
        super().__init__(f"{why}; try again later")


class TooManyReconciles(LedgerError):
    """Every reconcile turn stayed taken for as long as this one could wait:
    nothing was read or written. No outage: the ledger answers moves."""

    reason = "TOO_MANY_RECONCILES"

    def __init__(self, turns: int) -> None:
        super().__init__(
            f"{turns} reconciles are running, as many as the server runs at once "
            "(max_concurrent_reconciles), and none ended in time; send it again later"
        )


class TooManyCalls(LedgerError):
    """The caller's grant already has its share of the server's calls running,
    or the server's calls are nearly all taken and the grant runs more than
    a calm grant's few: nothing was read or written. No outage: the ledger
    answers other grants; the caller is to slow down and send it again later."""

    reason = "TOO_MANY_CALLS"

    def __init__(self, running: int, *, calm: int = 0) -> None:
        """`running`: the grant's calls running; `calm`: when refused for the
        server's last places, the calls a grant runs below which it gets one."""
        why = (
            "its share of the server (max_calls_per_grant)"
            if not calm
            else "and the server's calls are nearly all taken: its last places are for "
            f"grants running fewer than {calm}"
        )
        super().__init__(
            f"this grant has {running} calls running, {why}; "
            "send it again once one of them has its answer"
        )


class ShuttingDown(LedgerError):
    """The server is draining for a stop: the call is safe to send again, to
    another replica or once this one is back."""

    reason = "SHUTTING_DOWN"

    def __init__(self) -> None:
        super().__init__("the server is shutting down; try again")


class StoreUnavailable(LedgerError):
    """The database did not answer in time, or went away. Safe to retry."""

    reason = "STORE_UNAVAILABLE"

    def __init__(self) -> None:
        super().__init__("the ledger's database is unavailable; retry later")


# What an operator does about a damaged database.
DAMAGE_ADVICE = (
    "stop the ledger and restore the database from a backup; "
    "if `ledger verify` finds the log whole, `ledger rebuild` remakes the projections "
    "(docs/recovery.md)"
)


class StoreDamaged(StoreUnavailable):
    """The database says its own content is broken (a corrupt page, a file that
    is no longer a database, PostgreSQL's data-corruption class). Not safe to
    serve from and not healed by retrying: an operator restores a backup, or
    rebuilds the projections when the log is whole (docs/recovery.md).
    A kind of StoreUnavailable (the database cannot answer, nothing was done),
    so that code which handles an outage handles it; its reason and message
    say what is damaged and what to do."""

    reason = "STORE_DAMAGED"

    def __init__(self, what: str, advice: str) -> None:
        LedgerError.__init__(self, f"the ledger's database is damaged: {what}; {advice}")
        self.what = what
        self.advice = advice


class RecoveryRequired(LedgerError):
    """The projections are missing, behind or inconsistent with the log, or being
    rebuilt: no move is taken until a recovery makes them whole (docs/recovery.md)."""

    reason = "RECOVERY_REQUIRED"

    def __init__(self, operator_steps: str = "") -> None:
        """`operator_steps`: what an operator must do, when no recovery runs by
        itself (the planner refused); a caller told "retry later" then would
        retry for ever."""
        if operator_steps:
            super().__init__(
                f"the ledger's projections need an operator: {operator_steps}; moves are "
                "refused until they are whole (docs/recovery.md)"
            )
        else:
            super().__init__("the ledger is recovering its projections from the log; retry later")
