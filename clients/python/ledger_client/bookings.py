"""The values a lane sees: what it asks to reserve and what the ledger answers.

Frozen dataclasses with integer nanos and timezone-aware UTC datetimes; the
protobuf messages stop in `convert.py`.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import re
import uuid

import grpc

from ledger_client.errors import TtlExceedsHoldTtl, invalid_argument

MAX_REQUEST_BYTES = 2**40
MAX_TOKENS = 10**12
MAX_AMOUNT_NANOS = 2**62
MAX_RESERVATION_ID_LENGTH = 200
MAX_NAME_LENGTH = 200
MAX_TTL_US = 7 * 86_400 * 1_000_000
MAX_REASON_LENGTH = 1000
_RESERVATION_ID = re.compile(r"[\x21-\x7e]+")
# The ledger's rule for names (ledger_service/domain/policies.py): ASCII, a
# letter or digit first. The shared cases hold the two to the same answers.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")


class DenialReason(enum.Enum):
    """Why a lane must fall back instead of calling the model."""

    BUDGET_EXHAUSTED = "budget_exhausted"  # the ledger said no; retry_after says when
    HOLD_EXCEEDS_LIMIT = "hold_exceeds_limit"  # the ledger said no, for ever
    LEDGER_UNAVAILABLE = "ledger_unavailable"  # unreachable, and the outage mode is deny
    ALLOWANCE_EXHAUSTED = "allowance_exhausted"  # unreachable, and the allowance is spent


class BookingState(enum.Enum):
    UNSPECIFIED = "unspecified"
    OPEN = "open"
    SETTLED = "settled"
    SETTLED_UNKNOWN = "settled_unknown"
    REFUNDED = "refunded"
    EXPIRED = "expired"
    REJECTED = "rejected"
    RECONCILED = "reconciled"  # an estimate corrected by the provider's bill
    CORRECTED = "corrected"  # its charge replaced by an operator's correction


def new_reservation_id() -> str:
    """A fresh id: 32 hex digits, unique without coordination."""
    return uuid.uuid4().hex


def check_range(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_argument(name, f"must be an integer between {low} and {high}")
    if not low <= value <= high:
        raise invalid_argument(name, f"must be between {low} and {high}")


def check_name(field: str, name: object) -> None:
    """A lane's or a model's name by the ledger's rule for names (validate_name):
    InvalidArgument naming `field`, before any call, as the ledger would say it."""
    if not isinstance(name, str):
        raise invalid_argument(field, "must be a string")
    if not name:
        raise invalid_argument(field, "is required")
    if len(name) > MAX_NAME_LENGTH:
        raise invalid_argument(field, f"must be at most {MAX_NAME_LENGTH} characters")
    if not _NAME.fullmatch(name):
        raise invalid_argument(
            field, "must start with a letter or digit and use only letters, digits and ._:/@+-"
        )


def check_reservation_id(reservation_id: object) -> None:
    """The id a Reserve, Settle, Refund or GetBooking names, by the ledger's
    rule: InvalidArgument here, before any call, as the ledger would say it."""
    if not isinstance(reservation_id, str):
        raise invalid_argument("reservation_id", "must be a string")
    if not reservation_id:
        raise invalid_argument("reservation_id", "is required")
    if len(reservation_id) > MAX_RESERVATION_ID_LENGTH:
        raise invalid_argument(
            "reservation_id", f"must be at most {MAX_RESERVATION_ID_LENGTH} characters"
        )
    if not _RESERVATION_ID.fullmatch(reservation_id):
        raise invalid_argument("reservation_id", "must be printable ASCII without spaces")


def check_http_status(http_status: object, low: int, high: int) -> None:
    """A bare Settle's (100 to 599) or Refund's (400 to 499) HTTP status by the
    ledger's rule (SettleCommand, RefundCommand): 0, no answer, or in range.
    InvalidArgument here, before any call, as the ledger would say it, not the
    ValueError the Ending it goes into would raise."""
    if http_status != 0 or isinstance(http_status, bool):
        check_range("http_status", http_status, low, high)


def check_refund_reason(reason: str) -> None:
    """A bare Refund's reason by the ledger's rule (RefundCommand): sent as the
    lane wrote it, so refused here rather than cut or rewritten."""
    if len(reason) > MAX_REASON_LENGTH:
        raise invalid_argument("reason", f"must be at most {MAX_REASON_LENGTH} characters")
    if not reason.isprintable():
        raise invalid_argument("reason", "must be printable text")


@dataclasses.dataclass(frozen=True)
class ReserveArguments:
    """Everything a Reserve sends besides the lane. A replay sends exactly these
    again under the same reservation_id, which the ledger answers idempotently.

    An argument the ledger would refuse raises InvalidArgument here, before any
    call, with the field and reason the ledger would name (see errors.py)."""

    reservation_id: str
    model: str
    request_bytes: int
    max_output_tokens: int
    estimate_nanos: int | None = None
    ttl_us: int | None = None

    def __post_init__(self) -> None:
        # The server's rules and words (ledger_service/domain/moves.py, ReserveCommand).
        check_reservation_id(self.reservation_id)
        check_name("model", self.model)
        check_range("request_bytes", self.request_bytes, 0, MAX_REQUEST_BYTES)
        check_range("max_output_tokens", self.max_output_tokens, 0, MAX_TOKENS)
        if self.estimate_nanos is not None:
            check_range("estimate_nanos", self.estimate_nanos, 0, MAX_AMOUNT_NANOS)
        if self.ttl_us is not None:
            # The wire field is `ttl` (a Duration).
            if isinstance(self.ttl_us, bool) or not isinstance(self.ttl_us, int):
                raise invalid_argument("ttl", "must be a whole number of microseconds")
            if self.ttl_us <= 0:
                raise invalid_argument("ttl", "must be positive")
            if self.ttl_us > MAX_TTL_US:
                # No lane's hold_ttl is longer: the ledger refuses it as too long for the lane.
                raise TtlExceedsHoldTtl(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "TTL_EXCEEDS_HOLD_TTL",
                    "ttl: must not exceed the lane's hold_ttl, which is at most 7 days",
                    "ttl",
                )


@dataclasses.dataclass(frozen=True)
class Balance:
    lane: str
    limit_nanos: int
    spent_nanos: int
    held_nanos: int
    charged_nanos: int
    available_nanos: int
    overrun_nanos: int
    open_bookings: int
    window: datetime.timedelta
    as_of: datetime.datetime


@dataclasses.dataclass(frozen=True)
class Reservation:
    """The ledger's answer to a Reserve: admitted with a hold, or denied."""

    reservation_id: str
    admitted: bool
    hold_nanos: int
    cap_nanos: int
    reserved_at: datetime.datetime
    expires_at: datetime.datetime | None
    retry_after: datetime.datetime | None
    denial_reason: DenialReason | None
    reason: str
    balance: Balance
    # When denied: the budget that said no, this lane or one of its parents
    # (the lane's name); "" when admitted.
    denied_by: str = ""
    # An earlier Reserve under this id made the booking (or denial): this is
    # its first answer repeated, and this Reserve booked nothing.
    already_reserved: bool = False


@dataclasses.dataclass(frozen=True)
class Settled:
    charged_nanos: int
    state: BookingState
    balance: Balance


@dataclasses.dataclass(frozen=True)
class Refunded:
    balance: Balance
