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
from ledger_client.errors import (
    BookingAlreadyEnded,
    BookingNotFound,
    BookingWasDenied,
    InvalidArgument,
    LaneNotFound,
    LedgerError,
    LedgerInternal,
    LedgerOverloaded,
    LedgerRecovering,
    LedgerUnavailable,
    PermissionDenied,
    ReservationConflict,
    TooManyWatchers,
    TtlExceedsHoldTtl,
    Unauthenticated,
    UnknownModel,
)
from ledger_client.journal import Journal, JournalEntry, ReplayResult, Source
from ledger_client.outage import OutageMode, OutagePolicy
from ledger_client.outcomes import CallFailure, CallNotSent, Ending, Settlement, Usage, classify
from ledger_client.pricing import ModelPrice
from ledger_client.replay import ReplayReport
from ledger_client.settings import DEFAULT_DEADLINE_SECONDS, ClientSettings

__all__ = [
    "DEFAULT_DEADLINE_SECONDS",
    "Balance",
    "BookingAlreadyEnded",
    "BookingNotFound",
    "BookingState",
    "BookingWasDenied",
    "CallFailure",
    "CallHandle",
    "CallNotSent",
    "CallSource",
    "ClientSettings",
    "DenialReason",
    "Denied",
    "Ending",
    "InvalidArgument",
    "Journal",
    "JournalEntry",
    "LaneClient",
    "LaneNotFound",
    "LedgerError",
    "LedgerInternal",
    "LedgerOverloaded",
    "LedgerRecovering",
    "LedgerUnavailable",
    "ModelCall",
    "ModelPrice",
    "OutageMode",
    "OutagePolicy",
    "PermissionDenied",
    "Refunded",
    "ReplayReport",
    "ReplayResult",
    "Reservation",
    "ReservationConflict",
    "ReserveArguments",
    "Settled",
    "Settlement",
    "Source",
    "TlsSettings",
    "TooManyWatchers",
    "TtlExceedsHoldTtl",
    "Unauthenticated",
    "UnknownModel",
    "Usage",
    "classify",
    "new_reservation_id",
]
