"""The one table from a provider's result to a ledger move, and the error table."""

from __future__ import annotations

import grpc
import pytest
from ledger_client import errors
from ledger_client.outcomes import (
    RULES,
    CallFailure,
    CallNotSent,
    Ending,
    Settlement,
    Usage,
    classify,
    ending_of,
    failure_of_exception,
)

SUCCEEDED = Settlement.SETTLE_SUCCEEDED
UNKNOWN = Settlement.SETTLE_UNKNOWN
REFUND = Settlement.REFUND


@pytest.mark.parametrize(
    ("http_status", "usage_present", "failure", "expected"),
    [
        (200, True, CallFailure.NONE, SUCCEEDED),
        (200, False, CallFailure.NONE, UNKNOWN),
        (201, True, CallFailure.NONE, SUCCEEDED),
        (400, False, CallFailure.NONE, REFUND),
        (401, False, CallFailure.NONE, REFUND),
        (403, False, CallFailure.NONE, REFUND),
        (404, False, CallFailure.NONE, REFUND),
        (413, False, CallFailure.NONE, REFUND),
        (429, False, CallFailure.NONE, REFUND),
        (429, True, CallFailure.NONE, REFUND),  # a refusal is free even with usage
        (500, False, CallFailure.NONE, UNKNOWN),
        (502, False, CallFailure.NONE, UNKNOWN),
        (503, False, CallFailure.NONE, UNKNOWN),
        (500, True, CallFailure.NONE, SUCCEEDED),  # real data wins
        (0, False, CallFailure.TIMEOUT, UNKNOWN),
        (0, False, CallFailure.CONNECTION_LOST, UNKNOWN),
        (0, False, CallFailure.EXCEPTION, UNKNOWN),
        (0, False, CallFailure.NOT_SENT, REFUND),
        (0, True, CallFailure.TIMEOUT, SUCCEEDED),
        (302, False, CallFailure.NONE, UNKNOWN),
        (0, False, CallFailure.NONE, UNKNOWN),
    ],
)
def test_classify(
    http_status: int, usage_present: bool, failure: CallFailure, expected: Settlement
) -> None:
    assert classify(http_status, usage_present, failure) is expected


def test_every_combination_has_exactly_one_answer() -> None:
    statuses = [0, 100, 200, 204, 301, 400, 429, 499, 500, 599]
    for status in statuses:
        for usage_present in (False, True):
            for failure in CallFailure:
                assert classify(status, usage_present, failure) in Settlement
    assert RULES[-1].failure is None and RULES[-1].status is None
    assert RULES[-1].settlement is UNKNOWN, "the fallback never under-books"


@pytest.mark.parametrize("status", [-1, 1, 99, 600, 1000])
def test_impossible_status_is_refused(status: int) -> None:
    with pytest.raises(ValueError, match="http_status"):
        classify(status, False, CallFailure.NONE)


@pytest.mark.parametrize(
    ("error", "failure"),
    [
        (CallNotSent("queue full"), CallFailure.NOT_SENT),
        (TimeoutError(), CallFailure.TIMEOUT),
        (ConnectionResetError(), CallFailure.CONNECTION_LOST),
        # A refused connection is not proof: an HTTP client may have retried.
        (ConnectionRefusedError(), CallFailure.CONNECTION_LOST),
        (ValueError("bad json"), CallFailure.EXCEPTION),
        (KeyboardInterrupt(), CallFailure.EXCEPTION),
    ],
)
def test_failure_of_exception(error: BaseException, failure: CallFailure) -> None:
    assert failure_of_exception(error) is failure


def test_ending_of_a_refusal_keeps_the_status_and_names_a_reason() -> None:
    ending = ending_of(429, None, CallFailure.NONE)
    assert ending == Ending(REFUND, 429, None, "the provider refused the call")


def test_ending_of_a_call_never_sent_has_status_zero_and_the_reason() -> None:
    ending = ending_of(0, None, CallFailure.NOT_SENT, "circuit open")
    assert ending == Ending(REFUND, 0, None, "circuit open")


def test_ending_of_a_success_carries_the_usage() -> None:
    usage = Usage(input_tokens=10, output_tokens=5)
    assert ending_of(200, usage, CallFailure.NONE) == Ending(SUCCEEDED, 200, usage, "")


def test_an_ending_refuses_what_the_ledger_would_refuse() -> None:
    with pytest.raises(ValueError, match="usage"):
        Ending(SUCCEEDED, 200, None)
    # As the ledger refuses it: the same class, reason and field.
    with pytest.raises(errors.InvalidArgument) as refused:
        Ending(REFUND, 0, None, "")
    assert type(refused.value) is errors.InvalidArgument
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert (refused.value.reason, refused.value.field) == ("INVALID_ARGUMENT", "reason")
    assert refused.value.message == (
        "reason: is required when http_status is 0 (a call that was never sent)"
    )
    for blank in ("   ", "\t\n"):  # not only blanks, as the ledger says too
        with pytest.raises(errors.InvalidArgument):
            Ending(REFUND, 0, None, blank)


@pytest.mark.parametrize(
    "fields",
    [{"input_tokens": -1}, {"output_tokens": 10**13}, {"billed_nanos": -5}],
)
def test_usage_is_bounded(fields: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        Usage(**fields)


@pytest.mark.parametrize(
    "fields",
    [
        {"input_tokens": 1000.5},
        {"input_tokens": True},
        {"output_tokens": "5"},
        {"input_tokens": 5, "billed_nanos": 1.5},
        {"input_tokens": 5, "cached_input_tokens": 2.0},
    ],
)
def test_usage_refuses_a_count_that_is_not_an_int(fields: dict[str, object]) -> None:
    # Accepted, a float or a bool would pass every bound and fail only when the
    # Settle is built, out of the model_call block, leaving the booking open.
    (name,) = [key for key, value in fields.items() if type(value) is not int]
    with pytest.raises(TypeError, match=name):
        Usage(**fields)  # type: ignore[arg-type]


def test_an_answer_refuses_a_usage_that_is_no_usage_and_a_status_that_is_no_int() -> None:
    # A provider's usage dict passed as it is (not through usage_of) was taken,
    # and the Settle failed to build after the block, leaving its booking open.
    with pytest.raises(TypeError, match="usage_of"):
        ending_of(200, {"input_tokens": 20, "output_tokens": 5}, CallFailure.NONE)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="http_status"):
        ending_of("200", Usage(20, 5), CallFailure.NONE)  # type: ignore[arg-type]


# The error table -------------------------------------------------------------


class FakeRpcError(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    def __init__(self, code: grpc.StatusCode, metadata: tuple[tuple[str, str], ...]) -> None:
        self._code = code
        self._metadata = metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "a message nobody parses"

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: object) -> bool:
        return False


@pytest.mark.parametrize(
    ("code", "reason", "expected"),
    [
        (grpc.StatusCode.NOT_FOUND, "LANE_NOT_FOUND", errors.LaneNotFound),
        (grpc.StatusCode.NOT_FOUND, "BOOKING_NOT_FOUND", errors.BookingNotFound),
        (grpc.StatusCode.ALREADY_EXISTS, "RESERVATION_ID_REUSED", errors.ReservationConflict),
        (grpc.StatusCode.FAILED_PRECONDITION, "BOOKING_ALREADY_ENDED", errors.BookingAlreadyEnded),
        (grpc.StatusCode.FAILED_PRECONDITION, "BOOKING_WAS_DENIED", errors.BookingWasDenied),
        (grpc.StatusCode.FAILED_PRECONDITION, "BOOKING_STILL_OPEN", errors.BookingStillOpen),
        (grpc.StatusCode.ALREADY_EXISTS, "CORRECTION_ID_REUSED", errors.CorrectionConflict),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_WATCHERS", errors.TooManyWatchers),
        (grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE", errors.LedgerUnavailable),
        (grpc.StatusCode.UNAVAILABLE, "RECOVERY_REQUIRED", errors.LedgerRecovering),
        (grpc.StatusCode.INTERNAL, "INTERNAL", errors.LedgerInternal),
        (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED", errors.Unauthenticated),
        (grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED", errors.PermissionDenied),
        # No reason (the transport, a proxy): the status code decides.
        (grpc.StatusCode.UNAVAILABLE, "", errors.LedgerUnavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "", errors.LedgerUnavailable),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "", errors.LedgerOverloaded),
        (grpc.StatusCode.UNAUTHENTICATED, "", errors.Unauthenticated),
        (grpc.StatusCode.UNKNOWN, "", errors.LedgerInternal),
        # A reason this client does not know yet: the code decides.
        (grpc.StatusCode.FAILED_PRECONDITION, "SOMETHING_NEW", errors.BookingAlreadyEnded),
    ],
)
def test_error_table(code: grpc.StatusCode, reason: str, expected: type) -> None:
    metadata = (("ledger-reason", reason),) if reason else ()
    error = errors.from_rpc_error(FakeRpcError(code, metadata))
    assert type(error) is expected
    assert error.code is code and error.reason == reason


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        ("INVALID_ARGUMENT", errors.InvalidArgument),
        ("TTL_EXCEEDS_HOLD_TTL", errors.TtlExceedsHoldTtl),
        ("UNKNOWN_MODEL", errors.UnknownModel),
        ("SETTLE_WITHOUT_USAGE", errors.SettleWithoutUsage),
        ("OUTPUT_EXCEEDS_MAX_TOKENS", errors.OutputExceedsMaxTokens),
        ("CHARGE_EXCEEDS_CAP_MULTIPLE", errors.ChargeExceedsCapMultiple),
        ("SUM_OUT_OF_RANGE", errors.SumOutOfRange),
    ],
)
def test_invalid_argument_names_its_field(reason: str, expected: type) -> None:
    metadata = (("ledger-reason", reason), ("ledger-field", "request_bytes"))
    error = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, metadata))
    assert type(error) is expected
    assert isinstance(error, errors.InvalidArgument) and error.field == "request_bytes"


def test_internal_keeps_the_error_id() -> None:
    metadata = (("ledger-reason", "INTERNAL"), ("ledger-error-id", "abc123"))
    error = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.INTERNAL, metadata))
    assert isinstance(error, errors.LedgerInternal) and error.error_id == "abc123"


def test_every_unavailable_kind_switches_to_the_outage_mode() -> None:
    assert issubclass(errors.LedgerOverloaded, errors.LedgerUnavailable)
    assert issubclass(errors.LedgerRecovering, errors.LedgerUnavailable)
    assert errors.REASONS["STORE_UNAVAILABLE"] is errors.LedgerUnavailable


# The server's newer reasons: bad input, an open booking, a reused correction id.
NEW_REASONS = {
    "SETTLE_WITHOUT_USAGE": errors.SettleWithoutUsage,
    "OUTPUT_EXCEEDS_MAX_TOKENS": errors.OutputExceedsMaxTokens,
    "CHARGE_EXCEEDS_CAP_MULTIPLE": errors.ChargeExceedsCapMultiple,
    "SUM_OUT_OF_RANGE": errors.SumOutOfRange,
    "BOOKING_STILL_OPEN": errors.BookingStillOpen,
    "CORRECTION_ID_REUSED": errors.CorrectionConflict,
}


def test_each_new_reason_has_its_row_and_never_suggests_a_retry() -> None:
    for reason, expected in NEW_REASONS.items():
        assert errors.REASONS[reason] is expected
        # Only LedgerUnavailable says "retry with the same id" (and drives the
        # outage mode): a refusal sent again is refused again.
        assert not issubclass(expected, errors.LedgerUnavailable), reason
    assert issubclass(errors.BookingStillOpen, errors.LedgerError)
    assert not issubclass(errors.BookingStillOpen, errors.InvalidArgument)
    assert not issubclass(errors.CorrectionConflict, errors.InvalidArgument)


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, "SETTLE_WITHOUT_USAGE"),
        (grpc.StatusCode.INVALID_ARGUMENT, "OUTPUT_EXCEEDS_MAX_TOKENS"),
        (grpc.StatusCode.INVALID_ARGUMENT, "CHARGE_EXCEEDS_CAP_MULTIPLE"),
        (grpc.StatusCode.INVALID_ARGUMENT, "SUM_OUT_OF_RANGE"),
        (grpc.StatusCode.FAILED_PRECONDITION, "BOOKING_STILL_OPEN"),
        (grpc.StatusCode.ALREADY_EXISTS, "CORRECTION_ID_REUSED"),
    ],
)
def test_each_new_reason_arrives_as_its_class(code: grpc.StatusCode, reason: str) -> None:
    metadata = (("ledger-reason", reason), ("ledger-field", "output_tokens"))
    error = errors.from_rpc_error(FakeRpcError(code, metadata))
    assert type(error) is NEW_REASONS[reason]
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        assert isinstance(error, errors.InvalidArgument) and error.field == "output_tokens"


def _rich(reason: str, domain: str = "ledger.v1", **metadata: str) -> tuple[tuple[str, bytes], ...]:
    from google.rpc import error_details_pb2, status_pb2

    status = status_pb2.Status(code=3, message="a message nobody parses")
    status.details.add().Pack(
        error_details_pb2.ErrorInfo(reason=reason, domain=domain, metadata=metadata)
    )
    return (("grpc-status-details-bin", status.SerializeToString()),)


def test_the_rich_error_model_stands_in_for_trailers_a_proxy_dropped() -> None:
    rich = _rich("UNKNOWN_MODEL", field="model")
    error = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, rich))  # type: ignore[arg-type]
    assert type(error) is errors.UnknownModel
    assert error.reason == "UNKNOWN_MODEL" and error.field == "model"
    # Our own trailer wins where both came; another domain's ErrorInfo is not ours.
    both = (("ledger-reason", "SUM_OUT_OF_RANGE"), *_rich("UNKNOWN_MODEL"))
    error = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, both))  # type: ignore[arg-type]
    assert type(error) is errors.SumOutOfRange
    foreign = _rich("UNKNOWN_MODEL", domain="googleapis.com")
    error = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, foreign))  # type: ignore[arg-type]
    assert type(error) is errors.InvalidArgument and error.reason == ""
    broken = (("grpc-status-details-bin", b"\xff\xff"),)
    error = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.NOT_FOUND, broken))  # type: ignore[arg-type]
    assert type(error) is errors.BookingNotFound and error.reason == ""
