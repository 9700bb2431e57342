"""The client's half of the one error table.

The server maps each domain error to a gRPC status code and a machine-readable
reason in trailing metadata (`ledger-reason`, plus `ledger-field` for bad
input). This module inverts that table: the reason picks the exception class,
and when there is no reason (a proxy, the transport, or a reason this client
does not know yet) the status code does. Messages are never parsed.
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

REASON_KEY = "ledger-reason"
FIELD_KEY = "ledger-field"
ERROR_ID_KEY = "ledger-error-id"
# gRPC's rich error model, which the server sends beside its own trailers.
DETAILS_KEY = "grpc-status-details-bin"
ERROR_DOMAIN = "ledger.v1"


class LedgerError(Exception):
    """Base of every error the ledger (or the way to it) reports."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message


class ClientClosed(RuntimeError):
    """The lane's own code used this client after `close()`: a programming
    error, not an outage, so no outage mode (allowance or journal) answers it
    and nothing is sent. Also for a call `close()` cut off once its grace was
    over (`may_have_applied`: the ledger may have booked it). Not a
    LedgerError: the ledger never sends it, so it has no row in the error table."""

    def __init__(self, message: str, *, may_have_applied: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.may_have_applied = may_have_applied


class LedgerUnavailable(LedgerError):
    """The ledger could not be reached or did not answer in time. Safe to retry
    with the same reservation_id; this is what switches a lane to its outage mode."""


class LedgerOverloaded(LedgerUnavailable):
    """The server refused the call for lack of capacity (no ledger reason)."""


class LedgerRecovering(LedgerUnavailable):
    """The ledger is rebuilding its projections from its log and takes no move
    until it is whole again (RECOVERY_REQUIRED)."""


class LedgerStoreDamaged(LedgerUnavailable):
    """The ledger's database reports damage (STORE_DAMAGED): it answers nothing
    until an operator restores it. An outage, and safe to retry once it is fixed."""


class InvalidArgument(LedgerError):
    """A request field broke a rule; `field` names it (a bug in the caller)."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str, field: str) -> None:
        super().__init__(code, reason, message)
        self.field = field


def invalid_argument(field: str, rule: str) -> InvalidArgument:
    """The InvalidArgument the server would send for this field and rule, raised
    by the client itself for an argument it can check before any call: the
    same class, reason (INVALID_ARGUMENT), `field` and message ("field: rule")."""
    return InvalidArgument(
        grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", f"{field}: {rule}", field
    )


class TtlExceedsHoldTtl(InvalidArgument):
    """The asked ttl is longer than the lane's hold_ttl."""


class UnknownModel(InvalidArgument):
    """The lane has no price for this model."""


class SettleWithoutUsage(InvalidArgument):
    """A SUCCEEDED settle with no input tokens and no billed amount: nothing a
    provider bills. Settle UNKNOWN when the usage is not known."""


class OutputExceedsMaxTokens(InvalidArgument):
    """More output tokens than the booking's max_output_tokens: impossible."""


class ChargeExceedsCapMultiple(InvalidArgument):
    """A SUCCEEDED charge above the lane's max_charge_multiple times the
    booking's cap: usage no request of that size could have produced."""


class SumOutOfRange(InvalidArgument):
    """The amount would take a window's sum past the largest the ledger keeps (2^62)."""


class LaneNotFound(LedgerError):
    pass


class BookingNotFound(LedgerError):
    """No such booking in this lane (also for another lane's booking)."""


class ReservationConflict(LedgerError):
    """The reservation_id was used before with different arguments."""


class BookingAlreadyEnded(LedgerError):
    """The move contradicts how the booking already ended."""


class BookingStillOpen(LedgerError):
    """A correction replaces the charge of an ended booking; this one is still open."""


class CorrectionConflict(LedgerError):
    """The correction_id was used before with different content."""


class BookingWasDenied(LedgerError):
    """The Reserve for this id was denied; there is nothing to settle or refund."""


class TooManyWatchers(LedgerError):
    pass


class TooManyReconciles(LedgerError):
    """Every Reconcile turn stayed taken while this one waited: nothing was
    read or written; send it again later. No outage."""


class TooManyCalls(LedgerError):
    """This grant already had its share of the ledger's calls running
    (the server's max_calls_per_grant), or the server's calls were nearly all
    taken and this grant ran more than a few: nothing was read or written;
    slow down and send it again later. No outage: the ledger answers, and
    other lanes are served."""


class TlsMismatch(LedgerError):
    """The client's `tls=` does not match the ledger: every retry fails the
    same way, so no outage mode; fix the `tls` setting or the address. TLS to
    a plaintext ledger is gRPC's handshake text (WRONG_VERSION_NUMBER), the one
    transport signal no outage produces; so is a ledger's certificate this
    client refuses (CERTIFICATE_VERIFY_FAILED against root_certificates, or
    not carrying the name checked), read where the client knows its settings
    (LaneClient._tls_refused). Plaintext to a TLS ledger ("Socket closed", as
    from a restarting server) is told apart by a handshake the client tries
    itself (LaneClient._mistaken_for_outage); so is a client certificate a
    mutual-TLS ledger refuses, or the lack of one, which gRPC also reports as
    "Socket closed"."""


class RequestTooLarge(InvalidArgument):
    """The ledger refused the request for its size (gRPC's own bare
    RESOURCE_EXHAUSTED, "Received message larger than max", not an overload):
    the server's max_message_bytes is below the client's. `field` is "request"."""


class Unauthenticated(LedgerError):
    """The grant is missing, malformed or expired."""


class PermissionDenied(LedgerError):
    """The grant is for another lane or scope."""


class LedgerInternal(LedgerError):
    """The server failed; `error_id` finds the matching line in its log."""

    error_id = ""


def may_have_applied(error: LedgerError) -> bool:
    """Whether the ledger may have applied a request that failed this way (its
    deadline passed, the connection dropped, the server failed after a commit).
    False only for a definite refusal, which books nothing: the Node client's
    `mayHaveApplied`."""
    if isinstance(error, LedgerOverloaded):
        return False  # refused for lack of capacity, before anything was done
    if isinstance(error, LedgerUnavailable):
        return True
    # An UNIMPLEMENTED method was never run; any other failure may have committed.
    return isinstance(error, LedgerInternal) and error.code is not grpc.StatusCode.UNIMPLEMENTED


def is_retryable(error: LedgerError) -> bool:
    """Whether the same request, sent again with the same ids, may succeed (and
    books nothing twice): UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED and
    RESOURCE_EXHAUSTED, as `retry` in clients/cases/errors.json says."""
    return isinstance(error, (LedgerUnavailable, TooManyWatchers, TooManyReconciles, TooManyCalls))


def resends_reserve(error: LedgerError) -> bool:
    """Whether a model call's Reserve that failed this way is sent again while
    the call's deadline has time left: a retry whose time is not spent (not
    DEADLINE_EXCEEDED), as `resend_reserve` in clients/cases/errors.json says."""
    return is_retryable(error) and error.code is not grpc.StatusCode.DEADLINE_EXCEEDED


def settles_unknown_after_refusal(error: LedgerError) -> bool:
    """Whether a model call's Settle SUCCEEDED refused this way is settled
    UNKNOWN at once: the ledger refused its usage (an InvalidArgument: more
    output than the max, no input tokens, ...), so the paid call's real cost
    cannot be booked from it, and left open the booking would expire at the
    lane's expire_charge, maybe zero. `settle_unknown_after_refusal` in
    clients/cases/errors.json."""
    return isinstance(error, InvalidArgument)


# The inverse of the server's table (ledger_service/api/errors.py and the grant
# interceptor in api/auth.py): one row per `ledger-reason`. Keep it in step with
# the server's domain errors.
REASONS: dict[str, type[LedgerError]] = {
    "INVALID_ARGUMENT": InvalidArgument,
    "UNDECODABLE_REQUEST": InvalidArgument,
    "TTL_EXCEEDS_HOLD_TTL": TtlExceedsHoldTtl,
    "UNKNOWN_MODEL": UnknownModel,
    "SETTLE_WITHOUT_USAGE": SettleWithoutUsage,
    "OUTPUT_EXCEEDS_MAX_TOKENS": OutputExceedsMaxTokens,
    "CHARGE_EXCEEDS_CAP_MULTIPLE": ChargeExceedsCapMultiple,
    "SUM_OUT_OF_RANGE": SumOutOfRange,
    "LANE_NOT_FOUND": LaneNotFound,
    "BOOKING_NOT_FOUND": BookingNotFound,
    "RESERVATION_ID_REUSED": ReservationConflict,
    "BOOKING_ALREADY_ENDED": BookingAlreadyEnded,
    "BOOKING_STILL_OPEN": BookingStillOpen,
    "CORRECTION_ID_REUSED": CorrectionConflict,
    "BOOKING_WAS_DENIED": BookingWasDenied,
    "TOO_MANY_WATCHERS": TooManyWatchers,
    "TOO_MANY_RECONCILES": TooManyReconciles,
    "TOO_MANY_CALLS": TooManyCalls,
    "STORE_UNAVAILABLE": LedgerUnavailable,
    "SHUTTING_DOWN": LedgerUnavailable,
    "STORE_DAMAGED": LedgerStoreDamaged,
    "RECOVERY_REQUIRED": LedgerRecovering,
    "UNAUTHENTICATED": Unauthenticated,
    "PERMISSION_DENIED": PermissionDenied,
    "INTERNAL": LedgerInternal,
}

# When no known reason came back, the status code decides.
STATUS_CODES: dict[grpc.StatusCode, type[LedgerError]] = {
    grpc.StatusCode.UNAVAILABLE: LedgerUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: LedgerUnavailable,
    # A call a server's shutdown cut off: the ledger went away, as for UNAVAILABLE.
    grpc.StatusCode.CANCELLED: LedgerUnavailable,
    # The ledger's own INTERNAL carries its reason; a bare one is the
    # transport's (a stream reset under the call), so the ledger went away too.
    grpc.StatusCode.INTERNAL: LedgerUnavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: LedgerOverloaded,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: BookingNotFound,
    grpc.StatusCode.ALREADY_EXISTS: ReservationConflict,
    grpc.StatusCode.FAILED_PRECONDITION: BookingAlreadyEnded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


def _trailing(error: grpc.Call) -> dict[str, str]:
    """The call's trailers; where our own are missing (a proxy dropped them),
    what the rich error model (grpc-status-details-bin) carries instead."""
    values: dict[str, str] = {}
    details = b""
    for key, value in error.trailing_metadata() or ():
        if isinstance(value, str):
            values[key] = value
        elif key == DETAILS_KEY:
            details = bytes(value)
    for key, value in _error_info(details).items():
        values.setdefault(key, value)
    return values


def _error_info(details: bytes) -> dict[str, str]:
    """The ledger's ErrorInfo in a google.rpc.Status, as trailer names:
    reason as `ledger-reason`, each metadata entry as `ledger-<name>`."""
    if not details:
        return {}
    status = status_pb2.Status()
    try:
        status.ParseFromString(details)
    except DecodeError:
        return {}
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Is(info.DESCRIPTOR) and detail.Unpack(info) and info.domain == ERROR_DOMAIN:
            found = {
                f"ledger-{name.replace('_', '-')}": value for name, value in info.metadata.items()
            }
            return {REASON_KEY: info.reason, **found}
    return {}


# gRPC's own texts for a client's mistake that every retry repeats. Messages
# are otherwise never read: these come from the transport, with no ledger
# reason, and are the only signal there is.
_NOT_TLS = "WRONG_VERSION_NUMBER"
_TOO_LARGE = "message larger than max"


def _transport_mistake(code: grpc.StatusCode, message: str) -> LedgerError | None:
    """The client error for a bare transport status that no outage produces."""
    if code is grpc.StatusCode.UNAVAILABLE and _NOT_TLS in message:
        return TlsMismatch(
            code,
            "",
            "the ledger does not speak TLS (the handshake got WRONG_VERSION_NUMBER): "
            "leave out tls= (TlsSettings), or give the address of a ledger serving TLS",
        )
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and _TOO_LARGE in message:
        return RequestTooLarge(
            code,
            "",
            f"request: too large for the ledger's max_message_bytes ({message})",
            "request",
        )
    return None


def from_rpc_error(error: grpc.RpcError) -> LedgerError:
    """The client exception for a failed RPC, chosen by reason, then by code."""
    if not isinstance(error, grpc.Call):
        # Raised before any call existed (e.g. a closed channel).
        return LedgerUnavailable(grpc.StatusCode.UNAVAILABLE, "", "the ledger call did not start")
    code = error.code()
    message = error.details() or ""
    metadata = _trailing(error)
    reason = metadata.get(REASON_KEY, "")
    if reason not in REASONS and (mistake := _transport_mistake(code, message)):
        return mistake
    error_class = REASONS.get(reason) or STATUS_CODES.get(code, LedgerInternal)
    if issubclass(error_class, InvalidArgument):
        return error_class(code, reason, message, metadata.get(FIELD_KEY, ""))
    result = error_class(code, reason, message)
    if isinstance(result, LedgerInternal):
        result.error_id = metadata.get(ERROR_ID_KEY, "")
    return result
