"""Fixtures for the core tests: a real ledger server on 127.0.0.1:0, in process.

Every fixture here is requested by name and none is autouse, so suites in
sub-folders with their own conftest (tests/storage/) are unaffected. The names
say what they give: `server` is a LedgerServer with the test clock and a fast
sweeper, `channel` a gRPC channel to it, `ledger_stub` / `admin_stub` /
`clock_stub` the three services, `make_lane` puts a lane's policy, and
`ledger_harness` bundles them with the small helpers the end-to-end tests share.
"""

from __future__ import annotations

import os

# Every server a test starts checks each incremental window read against a
# full sum of the window (the pair assertion; see application/budgets.py).
os.environ.setdefault("LEDGER_VERIFY_WINDOWS", "1")

import collections
import dataclasses
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2, empty_pb2, timestamp_pb2

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.server import LedgerServer
from ledger_service.settings import Settings

MICROS_PER_SECOND = 1_000_000
# A fixed instant with a sub-second part, so that off-by-one-microsecond edges show.
START_US = 1_800_000_000 * MICROS_PER_SECOND + 123_456
# The recall lane of the incident: $0.50 a day, JEV priced at $0.10 / $0.40 per
# million input / output tokens.
RECALL_LIMIT_NANOS = 500_000_000
JEV_INPUT_NANOS_PER_MILLION = 100_000
JEV_OUTPUT_NANOS_PER_MILLION = 400_000
CHANNEL_READY_SECONDS = 10.0
RPC_TIMEOUT_SECONDS = 30.0


def ledger_settings(data_dir: pathlib.Path, **overrides: Any) -> Settings:
    """Settings for a test server on SQLite in `data_dir`, on port 0."""
    values: dict[str, Any] = {
        "database_url": f"sqlite:///{data_dir}/ledger.db",
        "data_dir": data_dir,
        "listen": "127.0.0.1:0",
        "test_clock": True,
        "sweep_interval_seconds": 0.05,
    }
    values.update(overrides)
    return Settings(**values)


@pytest.fixture
def start_ledger_server(tmp_path: pathlib.Path) -> Iterator[Callable[..., LedgerServer]]:
    """A factory of started servers, each on its own SQLite file; all stopped at teardown.

    `start_ledger_server(test_clock=False)` or `(sweep_interval_seconds=3600)`
    give the variants; the first server uses tmp_path itself.
    """
    started: list[LedgerServer] = []

    def start(**overrides: Any) -> LedgerServer:
        data_dir = tmp_path if not started else tmp_path / f"server-{len(started)}"
        server = LedgerServer(ledger_settings(data_dir, **overrides))
        started.append(server)
        server.start()
        return server

    yield start
    for server in reversed(started):
        server.stop(0)


@pytest.fixture
def server(start_ledger_server: Callable[..., LedgerServer]) -> LedgerServer:
    """A server with the test clock and a sweeper that looks every 50 ms."""
    return start_ledger_server()


@pytest.fixture
def server_without_test_clock(start_ledger_server: Callable[..., LedgerServer]) -> LedgerServer:
    return start_ledger_server(test_clock=False)


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class GrantInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """Sends `authorization: Bearer <grant>` with every call, beside the call's own metadata."""

    def __init__(self, grant: str) -> None:
        self._grant_metadata = (("authorization", f"Bearer {grant}"),)

    def _with_grant(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            (*(details.metadata or ()), *self._grant_metadata),
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_grant(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_grant(details), request)


@pytest.fixture
def open_ledger_channel() -> Iterator[Callable[[LedgerServer], grpc.Channel]]:
    """Opens ready channels to servers, carrying each server's admin grant; closes
    them all at teardown."""
    channels: list[grpc.Channel] = []

    def open_channel(target: LedgerServer) -> grpc.Channel:
        raw = grpc.insecure_channel(f"127.0.0.1:{target.port}")
        channels.append(raw)
        grpc.channel_ready_future(raw).result(timeout=CHANNEL_READY_SECONDS)
        return grpc.intercept_channel(raw, GrantInterceptor(target.admin_grant))

    yield open_channel
    for opened in channels:
        opened.close()


@pytest.fixture
def channel(
    server: LedgerServer, open_ledger_channel: Callable[[LedgerServer], grpc.Channel]
) -> grpc.Channel:
    return open_ledger_channel(server)


@pytest.fixture
def ledger_stub(channel: grpc.Channel) -> pb_grpc.LedgerStub:
    return pb_grpc.LedgerStub(channel)


@pytest.fixture
def admin_stub(channel: grpc.Channel) -> pb_grpc.LaneAdminStub:
    return pb_grpc.LaneAdminStub(channel)


@pytest.fixture
def clock_stub(channel: grpc.Channel) -> pb_grpc.TestClockStub:
    return pb_grpc.TestClockStub(channel)


# Values on the wire ---------------------------------------------------------


def timestamp_of(instant_us: int) -> timestamp_pb2.Timestamp:
    seconds, micros = divmod(instant_us, MICROS_PER_SECOND)
    return timestamp_pb2.Timestamp(seconds=seconds, nanos=micros * 1000)


def duration_of(length_us: int) -> duration_pb2.Duration:
    seconds, micros = divmod(length_us, MICROS_PER_SECOND)
    return duration_pb2.Duration(seconds=seconds, nanos=micros * 1000)


def micros_of(value: timestamp_pb2.Timestamp | duration_pb2.Duration) -> int:
    assert value.nanos % 1000 == 0, "the ledger keeps microseconds"
    return value.seconds * MICROS_PER_SECOND + value.nanos // 1000


def lane_message(
    lane: str = "recall",
    *,
    limit_nanos: int = RECALL_LIMIT_NANOS,
    prices: dict[str, tuple[int, ...]] | None = None,
    window_seconds: int | None = None,
    hold_ttl_seconds: int | None = None,
    bytes_per_token: float | None = None,
    overhead_tokens: int | None = None,
    expire_charge: int = pb.EXPIRE_CHARGE_UNSPECIFIED,
    max_charge_multiple: int | None = None,
    parent: str = "",
) -> pb.Lane:
    """A lane policy; fields left None keep the contract's defaults. A price is
    (input, output) or (input, output, cached input, cache write)."""
    chosen = prices or {"jev": (JEV_INPUT_NANOS_PER_MILLION, JEV_OUTPUT_NANOS_PER_MILLION)}
    message = pb.Lane(
        lane=lane,
        limit_nanos=limit_nanos,
        prices={model: _price_message(*price) for model, price in chosen.items()},
        expire_charge=expire_charge,
        parent=parent,
    )
    if max_charge_multiple is not None:
        message.max_charge_multiple = max_charge_multiple
    if window_seconds is not None:
        message.window.CopyFrom(duration_pb2.Duration(seconds=window_seconds))
    if hold_ttl_seconds is not None:
        message.hold_ttl.CopyFrom(duration_pb2.Duration(seconds=hold_ttl_seconds))
    if bytes_per_token is not None:
        message.bytes_per_token = bytes_per_token
    if overhead_tokens is not None:
        message.overhead_tokens = overhead_tokens
    return message


def _price_message(
    price_in: int, price_out: int, cached_in: int | None = None, cache_write: int | None = None
) -> pb.ModelPrice:
    message = pb.ModelPrice(
        input_nanos_per_million_tokens=price_in, output_nanos_per_million_tokens=price_out
    )
    if cached_in is not None:
        message.cached_input_nanos_per_million_tokens = cached_in
    if cache_write is not None:
        message.cache_write_nanos_per_million_tokens = cache_write
    return message


@pytest.fixture
def make_lane(admin_stub: pb_grpc.LaneAdminStub) -> Callable[..., pb.Lane]:
    """Puts a lane (default: recall, $0.50, JEV prices) and returns the stored policy."""

    def put(lane: str = "recall", **fields: Any) -> pb.Lane:
        stored: pb.Lane = admin_stub.PutLane(
            pb.PutLaneRequest(lane=lane_message(lane, **fields)), timeout=RPC_TIMEOUT_SECONDS
        )
        return stored

    return put


@dataclasses.dataclass(frozen=True)
class RpcFailure:
    code: grpc.StatusCode
    details: str
    reason: str
    field: str


def failure_of(error: BaseException, code: grpc.StatusCode) -> RpcFailure:
    assert isinstance(error, grpc.Call), error
    assert error.code() is code, f"expected {code}, got {error.code()}: {error.details()}"
    trailing = dict(error.trailing_metadata() or ())
    return RpcFailure(
        code=error.code(),
        details=error.details() or "",
        reason=str(trailing.get("ledger-reason", "")),
        field=str(trailing.get("ledger-field", "")),
    )


@dataclasses.dataclass
class LedgerHarness:
    """The stubs plus the helpers the end-to-end tests share."""

    ledger: pb_grpc.LedgerStub
    admin: pb_grpc.LaneAdminStub
    clock: pb_grpc.TestClockStub
    make_lane: Callable[..., pb.Lane]

    # Test modules reach the shared constants and helpers through the fixture:
    # importing from a conftest is fragile once sub-folders have their own.
    START_US = START_US
    MICROS_PER_SECOND = MICROS_PER_SECOND
    RECALL_LIMIT_NANOS = RECALL_LIMIT_NANOS
    JEV_INPUT_NANOS_PER_MILLION = JEV_INPUT_NANOS_PER_MILLION
    JEV_OUTPUT_NANOS_PER_MILLION = JEV_OUTPUT_NANOS_PER_MILLION
    timestamp_of = staticmethod(timestamp_of)
    duration_of = staticmethod(duration_of)
    micros_of = staticmethod(micros_of)
    lane_message = staticmethod(lane_message)
    failure_of = staticmethod(failure_of)

    # Time.

    def set_time_us(self, instant_us: int) -> int:
        return micros_of(self.clock.SetTime(timestamp_of(instant_us), timeout=RPC_TIMEOUT_SECONDS))

    def advance_us(self, length_us: int) -> int:
        return micros_of(self.clock.Advance(duration_of(length_us), timeout=RPC_TIMEOUT_SECONDS))

    def now_us(self) -> int:
        return micros_of(self.clock.GetTime(empty_pb2.Empty(), timeout=RPC_TIMEOUT_SECONDS))

    # Moves.

    def reserve(
        self,
        reservation_id: str,
        *,
        lane: str = "recall",
        model: str = "jev",
        request_bytes: int = 10_000,
        max_output_tokens: int = 500,
        estimate_nanos: int | None = None,
        ttl_us: int | None = None,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> pb.ReserveResponse:
        request = pb.ReserveRequest(
            lane=lane,
            reservation_id=reservation_id,
            model=model,
            request_bytes=request_bytes,
            max_output_tokens=max_output_tokens,
        )
        if estimate_nanos is not None:
            request.estimate_nanos = estimate_nanos
        if ttl_us is not None:
            request.ttl.CopyFrom(duration_of(ttl_us))
        response: pb.ReserveResponse = self.ledger.Reserve(
            request, metadata=metadata, timeout=RPC_TIMEOUT_SECONDS
        )
        return response

    def settle(
        self,
        reservation_id: str,
        outcome: int = pb.SUCCEEDED,
        *,
        lane: str = "recall",
        input_tokens: int = 0,
        output_tokens: int = 0,
        billed_nanos: int | None = None,
        http_status: int = 0,
        metadata: tuple[tuple[str, str], ...] | None = None,
        cached_input_tokens: int = 0,
        cache_write_tokens: int = 0,
    ) -> pb.SettleResponse:
        request = pb.SettleRequest(
            lane=lane,
            reservation_id=reservation_id,
            outcome=outcome,  # type: ignore[arg-type]
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            http_status=http_status,
            cached_input_tokens=cached_input_tokens,
            cache_write_tokens=cache_write_tokens,
        )
        if billed_nanos is not None:
            request.billed_nanos = billed_nanos
        response: pb.SettleResponse = self.ledger.Settle(
            request, metadata=metadata, timeout=RPC_TIMEOUT_SECONDS
        )
        return response

    def refund(
        self, reservation_id: str, http_status: int = 403, *, lane: str = "recall", reason: str = ""
    ) -> pb.RefundResponse:
        response: pb.RefundResponse = self.ledger.Refund(
            pb.RefundRequest(
                lane=lane, reservation_id=reservation_id, http_status=http_status, reason=reason
            ),
            timeout=RPC_TIMEOUT_SECONDS,
        )
        return response

    def correct(
        self,
        reservation_id: str,
        charge_nanos: int,
        *,
        lane: str = "recall",
        reason: str = "the provider's bill",
        correction_id: str = "c-1",
    ) -> pb.CorrectResponse:
        response: pb.CorrectResponse = self.ledger.Correct(
            pb.CorrectRequest(
                lane=lane,
                reservation_id=reservation_id,
                charge_nanos=charge_nanos,
                reason=reason,
                correction_id=correction_id,
            ),
            timeout=RPC_TIMEOUT_SECONDS,
        )
        return response

    # Reads.

    def balance(self, lane: str = "recall") -> pb.Balance:
        found: pb.Balance = self.ledger.GetBalance(
            pb.GetBalanceRequest(lane=lane), timeout=RPC_TIMEOUT_SECONDS
        )
        return found

    def booking(self, reservation_id: str, lane: str = "recall") -> pb.Booking:
        found: pb.Booking = self.ledger.GetBooking(
            pb.GetBookingRequest(lane=lane, reservation_id=reservation_id),
            timeout=RPC_TIMEOUT_SECONDS,
        )
        return found

    def events(self, lane: str = "", *, page_size: int = 1000, **filters: Any) -> list[pb.Event]:
        """Every event that matches, following page tokens (bounded)."""
        found: list[pb.Event] = []
        token = ""
        for _ in range(10_000):
            page = self.ledger.ListEvents(
                pb.ListEventsRequest(lane=lane, page_size=page_size, page_token=token, **filters),
                timeout=RPC_TIMEOUT_SECONDS,
            )
            found.extend(page.events)
            token = page.next_page_token
            if not token:
                return found
        raise AssertionError("ListEvents kept giving page tokens")

    # Errors.

    @staticmethod
    def fails(code: grpc.StatusCode, call: Callable[[], object]) -> RpcFailure:
        """Runs `call`, which must fail with `code`; returns the failure's details."""
        with pytest.raises(grpc.RpcError) as caught:
            call()
        return failure_of(caught.value, code)


@pytest.fixture
def harness_for(
    open_ledger_channel: Callable[[LedgerServer], grpc.Channel],
) -> Callable[[LedgerServer], LedgerHarness]:
    """Builds a harness on any started server (its clock, if it has one, set to START_US)."""

    def build(target: LedgerServer) -> LedgerHarness:
        opened = open_ledger_channel(target)
        admin = pb_grpc.LaneAdminStub(opened)

        def put(lane: str = "recall", **fields: Any) -> pb.Lane:
            stored: pb.Lane = admin.PutLane(
                pb.PutLaneRequest(lane=lane_message(lane, **fields)), timeout=RPC_TIMEOUT_SECONDS
            )
            return stored

        harness = LedgerHarness(
            pb_grpc.LedgerStub(opened), admin, pb_grpc.TestClockStub(opened), put
        )
        if target.settings.test_clock:
            harness.set_time_us(START_US)
        return harness

    return build


@pytest.fixture
def ledger_harness(
    ledger_stub: pb_grpc.LedgerStub,
    admin_stub: pb_grpc.LaneAdminStub,
    clock_stub: pb_grpc.TestClockStub,
    make_lane: Callable[..., pb.Lane],
) -> LedgerHarness:
    """The harness on `server`, its clock set to START_US."""
    harness = LedgerHarness(ledger_stub, admin_stub, clock_stub, make_lane)
    harness.set_time_us(START_US)
    return harness
