"""The lane client against a real `ledger serve` (test clock, SQLite, grants)."""

from __future__ import annotations

import datetime
import pathlib
import socket
import time
from collections.abc import Iterator

import grpc
import pytest
from client_ledger import TEST_SETTINGS, Admin, LedgerProcess, lane_tls, new_lane_name
from ledger_client import (
    BookingAlreadyEnded,
    BookingNotFound,
    BookingState,
    BookingWasDenied,
    CallHandle,
    CallNotSent,
    ChargeExceedsCapMultiple,
    ClientSettings,
    DenialReason,
    Denied,
    InvalidArgument,
    LaneClient,
    LaneNotFound,
    LedgerUnavailable,
    ModelPrice,
    OutagePolicy,
    OutputExceedsMaxTokens,
    PermissionDenied,
    ReservationConflict,
    ReserveArguments,
    SettleWithoutUsage,
    TlsMismatch,
    TtlExceedsHoldTtl,
    Unauthenticated,
    UnknownModel,
    Usage,
)
from ledger_client.convert import duration_of_micros
from ledger_client.generated.ledger.v1 import ledger_pb2 as pb
from ledger_client.pricing import DEFAULT_BYTES_PER_TOKEN_MILLI, cap_nanos
from test_client_outcomes import FakeRpcError

# The lane's price in conftest: 1 nano per input token, 2 per output token.
PRICES = {"model-a": ModelPrice(1_000_000, 2_000_000)}
REQUEST = b"x" * 3_500  # 1,000 tokens at 3.5 bytes per token
HOLD_NANOS = 1_000 + 2 * 500  # with max_output_tokens=500


@pytest.fixture
def client(ledger_server: LedgerProcess, lane: str, lane_grant: str) -> Iterator[LaneClient]:
    with LaneClient(ledger_server.address, lane, grant=lane_grant, settings=TEST_SETTINGS) as made:
        yield made


@pytest.fixture
def reader(ledger_server: LedgerProcess, lane: str) -> Iterator[LaneClient]:
    """The same lane seen with the admin grant, for balances."""
    grant = ledger_server.admin_grant
    with LaneClient(ledger_server.address, lane, grant=grant, settings=TEST_SETTINGS) as made:
        yield made


def test_reserve_settle_refund_and_balance(client: LaneClient, reader: LaneClient) -> None:
    first = client.reserve("model-a", len(REQUEST), 500)
    assert first.admitted and first.hold_nanos == first.cap_nanos == HOLD_NANOS
    assert first.expires_at is not None and first.expires_at.tzinfo is not None
    settled = client.settle(first.reservation_id, Usage(input_tokens=900, output_tokens=100))
    assert settled.charged_nanos == 900 + 200 and settled.state is BookingState.SETTLED

    second = client.reserve("model-a", len(REQUEST), 500, estimate_nanos=300)
    assert second.hold_nanos == 300  # min(estimate, cap)
    refunded = client.refund(second.reservation_id, http_status=429)
    assert refunded.balance.held_nanos == 0

    third = client.reserve("model-a", len(REQUEST), 500)
    unknown = client.settle(third.reservation_id, http_status=503)
    assert unknown.charged_nanos == HOLD_NANOS and unknown.state is BookingState.SETTLED_UNKNOWN

    balance = reader.balance()
    assert balance.spent_nanos == 1_100 + 0 + HOLD_NANOS
    assert balance.available_nanos == 1_000_000 - balance.spent_nanos
    assert balance.window == datetime.timedelta(days=1)


def test_errors_come_back_as_exceptions_by_the_table(
    ledger_server: LedgerProcess, client: LaneClient, lane_grant: str
) -> None:
    nowhere = LaneClient(
        ledger_server.address, new_lane_name(), grant=lane_grant, settings=TEST_SETTINGS
    )
    with nowhere, pytest.raises(LaneNotFound):
        nowhere.reserve("model-a", 10, 10)
    with pytest.raises(TtlExceedsHoldTtl) as too_long:
        client.reserve("model-a", 10, 10, ttl=datetime.timedelta(hours=1))
    assert too_long.value.field == "ttl"
    with pytest.raises(UnknownModel) as unknown:
        client.reserve("model-z", 10, 10)
    assert isinstance(unknown.value, InvalidArgument) and unknown.value.field == "model"

    booked = client.reserve("model-a", 10, 10)
    with pytest.raises(ReservationConflict):
        client.reserve("model-a", 11, 10, reservation_id=booked.reservation_id)
    client.settle(booked.reservation_id, Usage(1, 1))
    with pytest.raises(BookingAlreadyEnded):
        client.refund(booked.reservation_id, http_status=400)
    with pytest.raises(BookingNotFound):
        client.settle("never-reserved", Usage(1, 1))

    # A lane's charge grant reads its own balance, to choose its fallback ...
    assert client.balance().lane == client.lane
    # ... but a grant for another lane moves nothing here.
    elsewhere = ledger_server.issue_grant("--lane", "elsewhere", "--scope", "charge")
    stranger = LaneClient(
        ledger_server.address, client.lane, grant=elsewhere, settings=TEST_SETTINGS
    )
    with stranger, pytest.raises(PermissionDenied) as refused:
        stranger.reserve("model-a", 10, 10)
    assert "needs the charge scope" in str(refused.value)
    forged = LaneClient(
        ledger_server.address, client.lane, grant="lg1.nope.nope.nope", settings=TEST_SETTINGS
    )
    with forged, pytest.raises(Unauthenticated):
        forged.reserve("model-a", 10, 10)


# $3 / $15 per million tokens, $0.30 to read the prompt cache, $3.75 to write it.
CACHED_PRICE = ModelPrice(3_000_000, 15_000_000, 300_000, 3_750_000)


def test_the_ledger_prices_cache_tokens_and_the_cap_as_the_client_does(
    ledger_server: LedgerProcess, admin: Admin, lane_grant: str
) -> None:
    lane = new_lane_name()
    wire_price = pb.ModelPrice(
        input_nanos_per_million_tokens=CACHED_PRICE.input_nanos_per_million_tokens,
        output_nanos_per_million_tokens=CACHED_PRICE.output_nanos_per_million_tokens,
        cached_input_nanos_per_million_tokens=CACHED_PRICE.cached_input_nanos_per_million_tokens,
        cache_write_nanos_per_million_tokens=CACHED_PRICE.cache_write_nanos_per_million_tokens,
    )
    admin.put_lane(lane, 1_000_000, prices={"model-c": wire_price})
    with LaneClient(ledger_server.address, lane, grant=lane_grant, settings=TEST_SETTINGS) as c:
        booked = c.reserve("model-c", 35_000, 500)  # 10,000 request tokens
        local_cap = cap_nanos(CACHED_PRICE, 35_000, 500, DEFAULT_BYTES_PER_TOKEN_MILLI, 0)
        # Every request token at the dearest input rate (the write's 3.75), plus the output.
        assert booked.cap_nanos == local_cap == 37_500 + 7_500
        usage = Usage(10_000, 500, None, cached_input_tokens=6_000, cache_write_tokens=2_000)
        settled = c.settle(booked.reservation_id, usage)
    local_charge = CACHED_PRICE.real_cost(10_000, 500, 6_000, 2_000)
    # 2,000 uncached * 3 + 6,000 cached * 0.3 + 2,000 written * 3.75 + 500 output * 15.
    assert settled.charged_nanos == local_charge == 6_000 + 1_800 + 7_500 + 7_500
    (event,) = [e for e in admin.events(lane) if e.kind == "settled"]
    assert (event.cached_input_tokens, event.cache_write_tokens) == (6_000, 2_000)


def test_implausible_usage_is_refused_by_the_table(client: LaneClient) -> None:
    booked = client.reserve("model-a", len(REQUEST), 500)
    with pytest.raises(SettleWithoutUsage) as no_usage:
        client.settle(booked.reservation_id, Usage(0, 10))
    assert no_usage.value.field == "input_tokens"
    with pytest.raises(OutputExceedsMaxTokens) as too_long:
        client.settle(booked.reservation_id, Usage(900, 501))
    assert too_long.value.field == "output_tokens"
    # The lane's default max_charge_multiple is 100 times the cap.
    with pytest.raises(ChargeExceedsCapMultiple) as too_dear:
        client.settle(booked.reservation_id, Usage(900, 100, 100 * HOLD_NANOS + 1))
    assert too_dear.value.field == "billed_nanos"
    # Each refusal left the booking open: the real usage still settles it.
    settled = client.settle(booked.reservation_id, Usage(900, 100))
    assert settled.charged_nanos == 1_100


def test_a_denied_booking_cannot_be_ended(
    ledger_server: LedgerProcess, admin: Admin, lane_grant: str
) -> None:
    lane = new_lane_name()
    admin.put_lane(lane, 100)
    with LaneClient(ledger_server.address, lane, grant=lane_grant, settings=TEST_SETTINGS) as c:
        denied = c.reserve("model-a", 3_500, 500)
        assert not denied.admitted and denied.denial_reason is DenialReason.HOLD_EXCEEDS_LIMIT
        assert denied.retry_after is None
        with pytest.raises(BookingWasDenied):
            c.settle(denied.reservation_id, Usage(1, 1))


def test_model_calls_end_by_the_table(client: LaneClient, reader: LaneClient, admin: Admin) -> None:
    with client.model_call("model-a", REQUEST, 500) as ok:
        ok.succeeded(input_tokens=900, output_tokens=100)
    with client.model_call("model-a", REQUEST, 500) as limited:
        limited.answered(429)
    with client.model_call("model-a", REQUEST, 500) as broken:
        broken.answered(502)
    with pytest.raises(TimeoutError), client.model_call("model-a", REQUEST, 500) as timed_out:
        raise TimeoutError
    with pytest.raises(CallNotSent), client.model_call("model-a", REQUEST, 500) as unsent:
        raise CallNotSent("the lane's own rate limiter said no")

    for handle in (ok, limited, broken, timed_out, unsent):
        assert handle.result is not None and handle.end_error is None
    assert reader.balance().spent_nanos == 1_100 + 0 + HOLD_NANOS + HOLD_NANOS + 0
    events = {e.reservation_id: e for e in admin.events(client.lane) if e.kind != "reserved"}
    assert events[limited.reservation_id].http_status == 429
    assert events[unsent.reservation_id].reason == "the lane's own rate limiter said no"
    traced = [
        e.trace_id for e in admin.events(client.lane) if e.reservation_id == ok.reservation_id
    ]
    assert traced == [ok.trace_id, ok.trace_id], "one trace for the reserve and the settle"


def test_a_model_call_under_an_id_already_admitted_is_refused(
    client: LaneClient, reader: LaneClient
) -> None:
    # The ledger would answer its Reserve with the first answer, admitted, and
    # the model call made again could never be booked (as the Node client's call()).
    with client.model_call("model-a", REQUEST, 500, reservation_id="used-once") as first:
        first.succeeded(input_tokens=900, output_tokens=100)
    entered = False
    with (
        pytest.raises(ReservationConflict, match="used-once"),
        client.model_call("model-a", REQUEST, 500, reservation_id="used-once") as again,
    ):
        entered = True
        again.succeeded(input_tokens=900, output_tokens=100)
    assert not entered
    assert reader.balance().charged_nanos == 1_100


def test_a_denial_tells_the_lane_when_to_retry(
    ledger_server: LedgerProcess, admin: Admin, lane_grant: str
) -> None:
    lane = new_lane_name()
    admin.put_lane(lane, 3 * HOLD_NANOS)
    with LaneClient(ledger_server.address, lane, grant=lane_grant, settings=TEST_SETTINGS) as c:
        first = c.reserve("model-a", len(REQUEST), 500)
        for _ in range(2):
            c.reserve("model-a", len(REQUEST), 500)
        with pytest.raises(Denied) as denied, c.model_call("model-a", REQUEST, 500):
            raise AssertionError("the model must not be called")
    assert denied.value.denial_reason is DenialReason.BUDGET_EXHAUSTED
    assert denied.value.retry_after == first.reserved_at + datetime.timedelta(days=1)


# Time: the ledger never eats the model call's time -------------------------------


@pytest.fixture
def silent_address() -> Iterator[str]:
    """A port that accepts TCP connections and never says a word."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield f"127.0.0.1:{listener.getsockname()[1]}"


@pytest.fixture
def closed_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


@pytest.mark.parametrize("kind", ["silent", "closed"])
def test_an_unreachable_ledger_costs_at_most_the_deadline(
    kind: str, silent_address: str, closed_address: str, tmp_path: pathlib.Path
) -> None:
    address = silent_address if kind == "silent" else closed_address
    settings = ClientSettings(replay_interval_seconds=None)  # the default 0.25 s deadline
    with LaneClient(address, "recall", grant="g", settings=settings) as c:
        started = time.monotonic()
        with pytest.raises(LedgerUnavailable):
            c.reserve("model-a", 3_500, 500)
        with pytest.raises(Denied) as denied, c.model_call("model-a", REQUEST, 500):
            raise AssertionError("fail closed")
        elapsed = time.monotonic() - started
    assert denied.value.denial_reason is DenialReason.LEDGER_UNAVAILABLE
    assert elapsed < 2 * 0.25 + 0.5, f"two ledger calls took {elapsed:.2f} s"


# Outage: the journal replayed to a real ledger -------------------------------------


def allowance(path: pathlib.Path, **limits: int) -> OutagePolicy:
    return OutagePolicy.allowance(
        max_nanos=limits.get("max_nanos", 10**6),
        max_calls=limits.get("max_calls", 10),
        journal_path=path,
        prices=PRICES,
    )


def test_a_journal_replayed_twice_books_once(
    ledger_server: LedgerProcess, admin: Admin, lane: str, lane_grant: str,
    closed_address: str, tmp_path: pathlib.Path,
) -> None:  # fmt: skip
    journal = tmp_path / "journal.jsonl"
    with LaneClient(
        closed_address, lane, outage=allowance(journal), settings=TEST_SETTINGS
    ) as down:
        handles = []
        for status in (200, 429, 503):
            with down.model_call("model-a", REQUEST, 500) as handle:
                handle.answered(status, Usage(900, 100) if status == 200 else None)
            handles.append(handle)
    before_replay = journal.read_bytes()

    def replay() -> None:
        with LaneClient(ledger_server.address, lane, grant=lane_grant,
                        outage=allowance(journal), settings=TEST_SETTINGS) as up:  # fmt: skip
            report = up.replay_journal()
            assert (report.landed, report.remaining) == (3, 0)

    replay()
    journal.write_bytes(before_replay)  # as if the lane died before journaling `replayed`
    replay()
    expected = {
        handles[0].reservation_id: ["reserved", "settled"],
        handles[1].reservation_id: ["reserved", "refunded"],
        handles[2].reservation_id: ["reserved", "settled"],
    }
    assert admin.booking_events(lane) == expected
    amounts = {
        e.reservation_id: e.amount_nanos
        for e in admin.events(lane)
        if e.kind in ("settled", "refunded")
    }
    assert amounts == {
        handles[0].reservation_id: 1_100,
        handles[1].reservation_id: 0,
        handles[2].reservation_id: HOLD_NANOS,
    }
    traces = {(e.reservation_id, e.trace_id) for e in admin.events(lane) if e.reservation_id}
    assert traces == {(h.reservation_id, h.trace_id) for h in handles}, "replays keep their trace"


def test_a_ledger_that_dies_mid_run_and_comes_back(
    fresh_server: LedgerProcess, certificates: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    """A production-like lane (mutual TLS, a charge-only grant, a bounded
    allowance) whose ledger is SIGKILLed mid-run and restarted on its port."""
    server = fresh_server
    tls = lane_tls(certificates)
    helper = Admin(server, tls)
    try:
        helper.put_lane("recall", 10**6)
    finally:
        helper.close()
    grant = server.issue_grant("--lane", "recall", "--scope", "charge")
    journal = tmp_path / "journal.jsonl"
    settings = ClientSettings(deadline_seconds=2.0, replay_interval_seconds=None)
    no_certificate = lane_tls(certificates, client_certificate=False)
    stranger = LaneClient(
        server.address, "recall", grant=grant, tls=no_certificate, settings=settings
    )
    with stranger, pytest.raises(TlsMismatch):
        stranger.reserve("model-a", 10, 10)  # mutual TLS: no certificate, no channel
    with LaneClient(server.address, "recall", grant=grant, tls=tls,
                    outage=allowance(journal, max_calls=3), settings=settings) as c:  # fmt: skip
        with c.model_call("model-a", REQUEST, 500) as before:
            before.succeeded(input_tokens=900, output_tokens=100)
        with c.model_call("model-a", REQUEST, 500) as interrupted:
            assert server.kill() == -9  # the ledger dies while the model answers
            interrupted.succeeded(input_tokens=800, output_tokens=50)
        assert interrupted.journaled, "its ending waits in the journal"
        during = []
        for status in (200, 429, 200):
            with c.model_call("model-a", REQUEST, 500) as handle:
                handle.answered(status, Usage(700, 70) if status == 200 else None)
            during.append(handle)
        with pytest.raises(Denied) as denied, c.model_call("model-a", REQUEST, 500):
            raise AssertionError("the allowance of 3 calls is spent")
        assert denied.value.denial_reason is DenialReason.ALLOWANCE_EXHAUSTED

        server.start()  # same port, same data directory
        deadline = time.monotonic() + 30
        while c.journal is not None and c.journal.pending() and time.monotonic() < deadline:
            c.replay_journal()
            time.sleep(0.05)
        assert c.journal is not None and c.journal.pending() == []
        with c.model_call("model-a", REQUEST, 500) as after:
            after.succeeded(input_tokens=1, output_tokens=1)

    helper = Admin(server, tls)
    try:
        kinds = helper.booking_events("recall")
    finally:
        helper.close()
    assert kinds == {
        before.reservation_id: ["reserved", "settled"],
        interrupted.reservation_id: ["reserved", "settled"],
        during[0].reservation_id: ["reserved", "settled"],
        during[1].reservation_id: ["reserved", "refunded"],
        during[2].reservation_id: ["reserved", "settled"],
        after.reservation_id: ["reserved", "settled"],
    }


# What the client checks itself, it refuses as the ledger would ---------------------

# Each: ReserveArguments' fields, and whether the ledger's message is the same
# (the ttl one names the lane's own hold_ttl, which the client does not know).
BAD_RESERVES = [
    ({"request_bytes": -1}, "request_bytes", True),
    ({"max_output_tokens": -1}, "max_output_tokens", True),
    ({"estimate_nanos": -1}, "estimate_nanos", True),
    ({"model": ""}, "model", True),
    ({"model": "m" * 201}, "model", True),
    ({"reservation_id": ""}, "reservation_id", True),
    ({"reservation_id": "r" * 201}, "reservation_id", True),
    ({"reservation_id": "two words"}, "reservation_id", True),
    ({"reservation_id": "trailing-newline\n"}, "reservation_id", True),
    ({"ttl_us": 0}, "ttl", True),
    ({"ttl_us": 8 * 86_400 * 1_000_000}, "ttl", False),
]


@pytest.mark.parametrize(("fields", "field", "same_message"), BAD_RESERVES)
def test_a_bad_reserve_argument_is_the_ledgers_invalid_argument(
    client: LaneClient, fields: dict[str, object], field: str, same_message: bool
) -> None:
    values: dict[str, object] = {
        "reservation_id": "bad-argument",
        "model": "model-a",
        "request_bytes": 10,
        "max_output_tokens": 10,
        **fields,
    }
    with pytest.raises(InvalidArgument) as local:
        ReserveArguments(**values)  # type: ignore[arg-type]
    # The same request, sent as it is: what the ledger answers.
    request = pb.ReserveRequest(
        lane=client.lane,
        reservation_id=values["reservation_id"],
        model=values["model"],
        request_bytes=values["request_bytes"],
        max_output_tokens=values["max_output_tokens"],
    )
    if "estimate_nanos" in values:
        request.estimate_nanos = values["estimate_nanos"]  # type: ignore[assignment]
    if "ttl_us" in values:
        request.ttl.CopyFrom(duration_of_micros(values["ttl_us"]))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument) as remote:
        client._invoke(client._stub.Reserve, request, None, "")
    assert type(local.value) is type(remote.value)
    assert local.value.code is remote.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert local.value.reason == remote.value.reason
    assert local.value.field == remote.value.field == field
    if same_message:
        assert local.value.message == remote.value.message


def test_a_refund_with_neither_status_nor_reason_is_the_ledgers_invalid_argument(
    client: LaneClient,
) -> None:
    booked = client.reserve("model-a", 10, 10)
    with pytest.raises(InvalidArgument) as local:
        client.refund(booked.reservation_id)
    request = pb.RefundRequest(lane=client.lane, reservation_id=booked.reservation_id)
    with pytest.raises(InvalidArgument) as remote:
        client._invoke(client._stub.Refund, request, None, "")
    assert type(local.value) is type(remote.value) is InvalidArgument
    assert (local.value.reason, local.value.field) == ("INVALID_ARGUMENT", "reason")
    assert (remote.value.reason, remote.value.field) == ("INVALID_ARGUMENT", "reason")
    assert local.value.message == remote.value.message
    with pytest.raises(InvalidArgument) as from_reserve:
        client.reserve("", 10, 10)
    assert from_reserve.value.field == "model"


def test_a_bare_refund_sends_its_reason_whole(client: LaneClient, admin: Admin) -> None:
    # Up to the 1,000 characters the ledger keeps, as the Node client's refund():
    # only a model call's own reason is cut (to 200) and made printable.
    reason = "r" * 1000
    booked = client.reserve("model-a", 10, 10)
    client.refund(booked.reservation_id, reason=reason)
    (refunded,) = [event for event in admin.events(client.lane) if event.kind == "refunded"
                   and event.reservation_id == booked.reservation_id]  # fmt: skip
    assert refunded.reason == reason


# Which budget said no ----------------------------------------------------------------


def test_a_denial_names_the_budget_that_said_no(
    ledger_server: LedgerProcess, admin: Admin, lane_grant: str
) -> None:
    parent, child = new_lane_name(), new_lane_name()
    admin.put_lane(parent, HOLD_NANOS + HOLD_NANOS // 2)  # room for one call
    admin.put_lane(child, 1_000_000, parent=parent)
    with LaneClient(ledger_server.address, child, grant=lane_grant, settings=TEST_SETTINGS) as c:
        admitted = c.reserve("model-a", len(REQUEST), 500)
        assert admitted.admitted and admitted.denied_by == ""
        by_parent = c.reserve("model-a", len(REQUEST), 500)
        assert not by_parent.admitted and by_parent.denied_by == parent
        assert by_parent.denial_reason is DenialReason.BUDGET_EXHAUSTED
        with pytest.raises(Denied) as denied, c.model_call("model-a", REQUEST, 500):
            raise AssertionError("the model must not be called")
        assert denied.value.denied_by == parent
    small = new_lane_name()
    admin.put_lane(small, 100)
    with LaneClient(ledger_server.address, small, grant=lane_grant, settings=TEST_SETTINGS) as c:
        by_itself = c.reserve("model-a", len(REQUEST), 500)
        assert not by_itself.admitted and by_itself.denied_by == small


class _LostAnswer:
    """A Reserve whose answer was lost on the way back (a replica restarted, a
    connection reset): the ledger booked it, the lane saw UNAVAILABLE."""

    def result(self) -> object:
        raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, ())


class _LosesTheFirstAnswer:
    """The channel's Reserve, whose first answer is lost after the ledger applied it."""

    def __init__(self, method: object) -> None:
        self.method = method
        self.sent = 0

    def future(self, request: object, **options: object) -> object:
        self.sent += 1
        call = self.method.future(request, **options)  # type: ignore[attr-defined]
        if self.sent > 1:
            return call
        call.result()  # booked on the ledger
        return _LostAnswer()


def test_a_reserve_whose_answer_was_lost_is_sent_again_and_booked_once(
    client: LaneClient, reader: LaneClient, admin: Admin
) -> None:
    reserve = _LosesTheFirstAnswer(client._stub.Reserve)
    client._stub.Reserve = reserve  # type: ignore[method-assign]
    with client.model_call("model-a", REQUEST, 500) as handle:
        handle.succeeded(input_tokens=900, output_tokens=100)
    assert reserve.sent == 2 and handle.result is not None
    assert client._refunds.wait(5.0)
    booked = admin.booking_events(client.lane)
    assert booked == {handle.reservation_id: ["reserved", "settled"]}, "one booking, no refund"
    assert reader.balance().spent_nanos == 1_100


@pytest.mark.parametrize("earlier_ended", [True, False], ids=["ended", "still-open"])
def test_a_model_call_under_an_id_another_process_reserved_never_calls_the_model(
    client: LaneClient, ledger_server: LedgerProcess, lane_grant: str, admin: Admin,
    earlier_ended: bool,
) -> None:  # fmt: skip
    """A lane restarted, or a caller reusing its own id: the ledger answers the
    Reserve with the earlier process's first answer (admitted). The model call
    must not run again under that booking: its cost could never be booked (the
    booking ended), or two calls would share one hold (still open)."""
    rid = "call-7"
    model_calls: list[str] = []

    def call_model(handle: CallHandle) -> None:
        model_calls.append(handle.reservation_id)
        handle.succeeded(input_tokens=900, output_tokens=100)

    address, settings = ledger_server.address, TEST_SETTINGS
    with LaneClient(address, client.lane, grant=lane_grant, settings=settings) as earlier:
        if earlier_ended:
            with earlier.model_call("model-a", REQUEST, 500, reservation_id=rid) as handle:
                call_model(handle)
        else:  # reserved, then the process died
            assert earlier.reserve("model-a", len(REQUEST), 500, reservation_id=rid).admitted
    before = admin.booking_events(client.lane)
    with (
        pytest.raises(ReservationConflict) as refused,
        client.model_call("model-a", REQUEST, 500, reservation_id=rid) as handle,
    ):
        call_model(handle)
    assert model_calls == ([rid] if earlier_ended else [])
    assert refused.value.reason == "RESERVATION_ID_REUSED" and rid in refused.value.message
    assert admin.booking_events(client.lane) == before, "nothing sent after the Reserve"


def test_a_usage_the_ledger_refuses_is_settled_unknown_at_once(
    client: LaneClient, admin: Admin
) -> None:
    # The paid call happened, but its usage cannot be booked: settled UNKNOWN
    # at once (at most the cap), not left open to expire at expire_charge,
    # and the refusal is reported on the handle (as the SDK transport does).
    with client.model_call("model-a", REQUEST, 500) as too_long:
        too_long.succeeded(input_tokens=900, output_tokens=501)
    with client.model_call("model-a", REQUEST, 500) as no_input:
        no_input.succeeded(input_tokens=0, output_tokens=10)
    assert isinstance(too_long.end_error, OutputExceedsMaxTokens)
    assert isinstance(no_input.end_error, SettleWithoutUsage)
    for handle in (too_long, no_input):
        assert client.booking_state(handle.reservation_id) is BookingState.SETTLED_UNKNOWN
        assert handle.result is not None and handle.result.charged_nanos == HOLD_NANOS
    events = {e.reservation_id: e for e in admin.events(client.lane) if e.kind != "reserved"}
    assert events[too_long.reservation_id].http_status == 200
