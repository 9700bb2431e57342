"""The lane side of the lane ledger: reserve before a paid model call, settle
or refund after, fall back when denied, and stay bounded when the ledger is
unreachable. Imports nothing from the server."""

from ledger_client.bookings import (
    Balance,
    BookingState,
    DenialReason,
    Refunded,
    Reservation,
    ReserveArguments,
    Settled,
    new_reservation_id,
)
from ledger_client.calls import CallHandle, CallSource, Denied, ModelCall
from ledger_client.channels import TlsSettings
from ledger_client.client import LaneClient
from ledger_client.context import CONTEXT_OVERFLOW_REPLY, is_context_overflow
from ledger_client.errors import (
    BookingAlreadyEnded,
    BookingNotFound,
    BookingStillOpen,
    BookingWasDenied,
    ChargeExceedsCapMultiple,
    ClientClosed,
    CorrectionConflict,
    InvalidArgument,
    LaneNotFound,
    LedgerError,
    LedgerInternal,
    LedgerOverloaded,
    LedgerRecovering,
    LedgerStoreDamaged,
    LedgerUnavailable,
    OutputExceedsMaxTokens,
    PermissionDenied,
    RequestTooLarge,
    ReservationConflict,
    SettleWithoutUsage,
    SumOutOfRange,
    TlsMismatch,
    TooManyCalls,
    TooManyReconciles,
    TooManyWatchers,
    TtlExceedsHoldTtl,
    Unauthenticated,
    UnknownModel,
)
from ledger_client.events import EventPage, LedgerEvent
from ledger_client.journal import Journal, JournalEntry, JournalError, ReplayResult, Source
from ledger_client.outage import OutageMode, OutagePolicy
from ledger_client.outcomes import CallFailure, CallNotSent, Ending, Settlement, Usage, classify
from ledger_client.pricing import ModelPrice
from ledger_client.replay import ReplayReport
from ledger_client.settings import (
    CLOSE_JOURNAL_WAIT_SECONDS,
    DEFAULT_CLOSE_GRACE_SECONDS,
    DEFAULT_DEADLINE_SECONDS,
    ClientSettings,
)
from ledger_client.usage import usage_of

# The SDK integrations (the optional `openai` and `anthropic` extras) are in
# ledger_client.providers, which this package does not import.
__all__ = [
    "CLOSE_JOURNAL_WAIT_SECONDS",
    "CONTEXT_OVERFLOW_REPLY",
    "DEFAULT_CLOSE_GRACE_SECONDS",
    "DEFAULT_DEADLINE_SECONDS",
    "Balance",
    "BookingAlreadyEnded",
    "BookingNotFound",
    "BookingState",
    "BookingStillOpen",
    "BookingWasDenied",
    "CallFailure",
    "CallHandle",
    "CallNotSent",
    "CallSource",
    "ChargeExceedsCapMultiple",
    "ClientClosed",
    "ClientSettings",
    "CorrectionConflict",
    "DenialReason",
    "Denied",
    "Ending",
    "EventPage",
    "InvalidArgument",
    "Journal",
    "JournalEntry",
    "JournalError",
    "LaneClient",
    "LaneNotFound",
    "LedgerError",
    "LedgerEvent",
    "LedgerInternal",
    "LedgerOverloaded",
    "LedgerRecovering",
    "LedgerStoreDamaged",
    "LedgerUnavailable",
    "ModelCall",
    "ModelPrice",
    "OutageMode",
    "OutagePolicy",
    "OutputExceedsMaxTokens",
    "PermissionDenied",
    "Refunded",
    "ReplayReport",
    "ReplayResult",
    "RequestTooLarge",
    "Reservation",
    "ReservationConflict",
    "ReserveArguments",
    "SettleWithoutUsage",
    "Settled",
    "Settlement",
    "Source",
    "SumOutOfRange",
    "TlsMismatch",
    "TlsSettings",
    "TooManyCalls",
    "TooManyReconciles",
    "TooManyWatchers",
    "TtlExceedsHoldTtl",
    "Unauthenticated",
    "UnknownModel",
    "Usage",
    "classify",
    "is_context_overflow",
    "new_reservation_id",
    "usage_of",
]
