"""The model call wrapper and the outage modes, against an in-memory ledger."""

from __future__ import annotations

import json
import pathlib
import threading
from collections.abc import Callable, Iterator

import grpc
import pytest
from client_fakes import FakeLedger, client_on
from ledger_client import (
    CallNotSent,
    CallSource,
    ClientSettings,
    DenialReason,
    Denied,
    Ending,
    LaneClient,
    ModelPrice,
    OutagePolicy,
    ReplayResult,
    Settlement,
    Source,
    Usage,
    calls,
    errors,
)
from ledger_client.bookings import ReserveArguments
from ledger_client.outcomes import CallFailure
from test_client_outcomes import FakeRpcError

# 1 nano per input token, 2 per output token (per million: 10**6 and 2 * 10**6).
PRICES = {"model-a": ModelPrice(1_000_000, 2_000_000)}
# A call of 3,500 request bytes (1,000 tokens) and 500 output tokens holds 2,000 nanos.
REQUEST_BYTES = 3_500
MAX_OUTPUT_TOKENS = 500
HOLD_NANOS = 2_000


def allowance(path: pathlib.Path, *, max_nanos: int = 10**9, max_calls: int = 100) -> OutagePolicy:
    return OutagePolicy.allowance(
        max_nanos=max_nanos, max_calls=max_calls, journal_path=path / "journal.jsonl", prices=PRICES
    )


@pytest.fixture
def fake() -> FakeLedger:
    return FakeLedger()


@pytest.fixture
def make_client(fake: FakeLedger) -> Iterator[object]:
    made: list[LaneClient] = []

    def make(outage: OutagePolicy) -> LaneClient:
        client = client_on(fake, outage)
        assert isinstance(client, LaneClient)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def call(client: LaneClient, request_bytes: int = REQUEST_BYTES, model: str = "model-a") -> object:
    return client.model_call(model, request_bytes, MAX_OUTPUT_TOKENS)


def succeed(client: LaneClient, **kwargs: int) -> object:
    with client.model_call(
        "model-a", kwargs.get("request_bytes", REQUEST_BYTES), MAX_OUTPUT_TOKENS
    ) as handle:
        handle.succeeded(input_tokens=900, output_tokens=100)
    return handle


# Through the ledger -------------------------------------------------------------


def test_a_successful_call_is_reserved_then_settled(
    fake: FakeLedger, make_client, tmp_path
) -> None:
    client = make_client(OutagePolicy.deny())
    with client.model_call("model-a", b"x" * 3_500, 500) as handle:
        assert handle.source is CallSource.LEDGER
        assert handle.arguments.request_bytes == 3_500
        handle.succeeded(input_tokens=900, output_tokens=100)
    assert fake.event_counts() == {handle.reservation_id: ["reserved", "settled"]}
    ending = fake.bookings[handle.reservation_id].ending
    assert ending is not None and ending.settlement is Settlement.SETTLE_SUCCEEDED
    assert ending.usage == Usage(900, 100)


def test_each_call_gets_a_fresh_reservation_id(fake: FakeLedger, make_client) -> None:
    client = make_client(OutagePolicy.deny())
    ids = {succeed(client).reservation_id for _ in range(5)}
    assert len(ids) == 5


@pytest.mark.parametrize(
    ("report", "settlement", "status"),
    [
        (lambda h: h.answered(429), Settlement.REFUND, 429),
        (lambda h: h.answered(403), Settlement.REFUND, 403),
        (lambda h: h.answered(503), Settlement.SETTLE_UNKNOWN, 503),
        (lambda h: h.answered(500, Usage(10, 10)), Settlement.SETTLE_SUCCEEDED, 500),
        (lambda h: h.failed(CallFailure.TIMEOUT), Settlement.SETTLE_UNKNOWN, 0),
        (lambda h: h.failed(CallFailure.CONNECTION_LOST), Settlement.SETTLE_UNKNOWN, 0),
        (lambda h: h.not_sent("circuit open"), Settlement.REFUND, 0),
    ],
)
def test_reported_results_end_by_the_table(fake, make_client, report, settlement, status) -> None:
    client = make_client(OutagePolicy.deny())
    with call(client) as handle:
        report(handle)
    ending = fake.bookings[handle.reservation_id].ending
    assert ending is not None
    assert ending.settlement is settlement and ending.http_status == status


@pytest.mark.parametrize(
    ("error", "settlement", "reason"),
    [
        (RuntimeError("boom"), Settlement.SETTLE_UNKNOWN, "RuntimeError"),
        (TimeoutError(), Settlement.SETTLE_UNKNOWN, "TimeoutError"),
        (CallNotSent("rate limiter said no"), Settlement.REFUND, "rate limiter said no"),
    ],
)
def test_an_escaping_exception_ends_the_booking_and_propagates(
    fake, make_client, error, settlement, reason
) -> None:
    client = make_client(OutagePolicy.deny())
    with pytest.raises(type(error)), call(client) as handle:
        raise error
    ending = fake.bookings[handle.reservation_id].ending
    assert ending is not None and ending.settlement is settlement and ending.reason == reason


class _StatusError(Exception):
    """As provider SDKs raise: openai and anthropic set status_code."""

    def __init__(self, status_code: int) -> None:
        super().__init__(f"HTTP {status_code}")
        self.status_code = status_code


class _Response:
    def __init__(self, status_code: int) -> None:
        self.status_code = status_code


class _ResponseError(Exception):
    """As httpx's HTTPStatusError and requests' HTTPError do: on its response."""

    def __init__(self, status_code: int) -> None:
        super().__init__(f"HTTP {status_code}")
        self.response = _Response(status_code)


@pytest.mark.parametrize(
    ("error", "settlement", "status"),
    [
        (_StatusError(429), Settlement.REFUND, 429),
        (_ResponseError(403), Settlement.REFUND, 403),
        (_StatusError(503), Settlement.SETTLE_UNKNOWN, 503),
        (_ResponseError(200), Settlement.SETTLE_UNKNOWN, 200),
    ],
)
def test_an_escaping_exception_is_read_by_the_http_status_it_carries(
    fake, make_client, error, settlement, status
) -> None:
    """A provider's refusal raised as an exception still costs nothing, as in
    the Node client (an error's `status`)."""
    client = make_client(OutagePolicy.deny())
    with pytest.raises(type(error)), call(client) as handle:
        raise error
    ending = fake.bookings[handle.reservation_id].ending
    assert ending is not None
    assert ending.settlement is settlement and ending.http_status == status


@pytest.mark.parametrize(
    "payload",
    [
        {"model": "model-a", "messages": [{"role": "user", "content": "é" * 50_000}]},
        [{"role": "user", "content": "x" * 100_000}],
    ],
)
def test_a_json_payload_is_booked_by_its_bytes_not_its_len(
    fake, make_client, payload: object
) -> None:
    client = make_client(OutagePolicy.deny())
    with client.model_call("model-a", payload, MAX_OUTPUT_TOKENS) as handle:
        handle.succeeded(input_tokens=900, output_tokens=100)
    sent = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    assert handle.arguments.request_bytes == len(sent)


def test_a_bool_is_no_request_size(make_client) -> None:
    client = make_client(OutagePolicy.deny())
    with pytest.raises(TypeError, match="request"):
        client.model_call("model-a", True, MAX_OUTPUT_TOKENS)


@pytest.mark.parametrize("request_", [7000.0, 3.5, None])
def test_a_float_or_none_is_no_request_size(make_client, request_: object) -> None:
    # 7000.0 was measured as the JSON text "7000": a hold for 4 bytes, not
    # 7,000, and a real charge past its cap multiple then settles UNKNOWN at it.
    client = make_client(OutagePolicy.deny())
    with pytest.raises(TypeError, match=r"^request must be a payload .* not a "):
        client.model_call("model-a", request_, MAX_OUTPUT_TOKENS)


@pytest.mark.parametrize(
    ("request_", "error"),
    [(object(), TypeError), ("a\ud800", ValueError), ({"x": b"y"}, TypeError)],
)
def test_a_payload_that_cannot_be_measured_names_the_request(
    make_client, request_: object, error: type[Exception]
) -> None:
    client = make_client(OutagePolicy.deny())
    with pytest.raises(error, match=r"^request: "):
        client.model_call("model-a", request_, MAX_OUTPUT_TOKENS)


def test_a_report_wins_over_a_later_exception(fake, make_client) -> None:
    client = make_client(OutagePolicy.deny())
    with pytest.raises(KeyError), call(client) as handle:
        handle.succeeded(input_tokens=1, output_tokens=1)
        raise KeyError("parsing the answer failed")
    ending = fake.bookings[handle.reservation_id].ending
    assert ending is not None and ending.settlement is Settlement.SETTLE_SUCCEEDED


def test_no_report_settles_unknown(fake, make_client) -> None:
    client = make_client(OutagePolicy.deny())
    with call(client) as handle:
        pass
    ending = fake.bookings[handle.reservation_id].ending
    assert ending is not None and ending.settlement is Settlement.SETTLE_UNKNOWN


def test_reporting_twice_is_a_bug(fake, make_client) -> None:
    client = make_client(OutagePolicy.deny())
    with pytest.raises(RuntimeError), call(client) as handle:
        handle.answered(200, Usage(1, 1))
        handle.answered(500)


def test_a_denial_says_fall_back_with_the_reason_and_retry_after(make_client) -> None:
    fake = FakeLedger(limit_nanos=100)
    client = client_on(fake, OutagePolicy.deny())
    try:
        with pytest.raises(Denied) as denied, call(client):
            raise AssertionError("the model must not be called")
    finally:
        client.close()
    assert denied.value.denial_reason is DenialReason.BUDGET_EXHAUSTED
    assert denied.value.retry_after is not None and denied.value.retry_after.tzinfo is not None
    assert fake.event_counts() == {denied.value.reservation_id: ["denied"]}


# Outage: deny -------------------------------------------------------------------


def test_deny_mode_falls_back_while_the_ledger_is_unreachable(fake, make_client) -> None:
    client = make_client(OutagePolicy.deny())
    fake.reachable = False
    with pytest.raises(Denied) as denied, call(client):
        raise AssertionError("the model must not be called")
    assert denied.value.denial_reason is DenialReason.LEDGER_UNAVAILABLE
    assert denied.value.retry_after is None


def test_deny_mode_with_a_journal_refunds_unanswered_reserves_later(
    fake, make_client, tmp_path
) -> None:
    client = make_client(OutagePolicy.deny(tmp_path / "journal.jsonl"))
    fake.reachable = False
    with pytest.raises(Denied), call(client):
        pass
    (entry,) = client.journal.pending()
    assert entry.source is Source.IN_DOUBT and entry.ending.settlement is Settlement.REFUND
    fake.reachable = True
    report = client.replay_journal()
    assert report.absent == 1 and report.remaining == 0
    assert fake.events == [], "a Reserve that never arrived leaves no trace"


def test_an_ending_that_cannot_reach_the_ledger_is_journaled_and_replayed(
    fake, make_client, tmp_path
) -> None:
    client = make_client(OutagePolicy.deny(tmp_path / "journal.jsonl"))
    with call(client) as handle:
        fake.reachable = False  # the ledger goes away during the model call
        handle.succeeded(input_tokens=900, output_tokens=100)
    assert handle.journaled and handle.result is None
    assert [entry.source for entry in client.journal.pending()] == [Source.LEDGER]
    fake.reachable = True
    assert client.replay_journal().landed == 1
    assert fake.event_counts() == {handle.reservation_id: ["reserved", "settled"]}


# Outage: a bounded allowance ----------------------------------------------------------


def test_the_allowance_limits_the_number_of_calls(fake, make_client, tmp_path) -> None:
    client = make_client(allowance(tmp_path, max_calls=3))
    fake.reachable = False
    for _ in range(3):
        handle = succeed(client)
        assert handle.source is CallSource.ALLOWANCE and handle.journaled
    with pytest.raises(Denied) as denied, call(client):
        raise AssertionError("the model must not be called")
    assert denied.value.denial_reason is DenialReason.ALLOWANCE_EXHAUSTED
    assert client._allowance.used().calls == 3


def test_the_allowance_limits_the_nanos_at_the_local_cap(fake, make_client, tmp_path) -> None:
    client = make_client(allowance(tmp_path, max_nanos=5_000))
    fake.reachable = False
    with call(client) as first:
        assert first.hold_nanos == HOLD_NANOS  # priced like the ledger: the byte cap
        with call(client) as second:
            assert second.hold_nanos == HOLD_NANOS
            with pytest.raises(Denied) as denied, call(client):
                raise AssertionError("a third hold of 2,000 does not fit 1,000 left")
            assert denied.value.denial_reason is DenialReason.ALLOWANCE_EXHAUSTED
            with call(client, request_bytes=0) as small:  # 1,000 nanos still fits
                assert small.hold_nanos == 1_000
            second.answered(429)  # refused: costs nothing
        first.failed(CallFailure.TIMEOUT)  # unknown: charged at the hold
    used = client._allowance.used()
    assert used.calls == 3
    assert used.nanos == HOLD_NANOS + 0 + 1_000


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("max_nanos", 1.5),
        ("max_nanos", "5"),
        ("max_calls", True),
        ("max_calls", 2.5),
        ("bytes_per_token_milli", 3500.0),
        ("overhead_tokens", None),
    ],
)
def test_an_allowance_setting_that_is_not_an_integer_is_refused_by_name(
    tmp_path, setting, value
) -> None:
    # As the Node client does: a count is an integer, not something that compares like one.
    settings = {"max_nanos": 10**6, "max_calls": 10, setting: value}
    with pytest.raises(TypeError, match=f"^{setting} must be an integer"):
        OutagePolicy.allowance(journal_path=tmp_path / "j.jsonl", prices=PRICES, **settings)


def test_a_price_that_is_not_a_model_price_is_refused(tmp_path) -> None:
    with pytest.raises(TypeError, match="prices"):
        OutagePolicy.allowance(
            max_nanos=1, max_calls=1, journal_path=tmp_path / "j", prices={"m": (1, 2)}
        )
    with pytest.raises(TypeError, match="price"):
        ModelPrice(1.5, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("setting", "value"),
    [("end_attempts", 1.5), ("deadline_seconds", "1"), ("max_journal_bytes", True)],
)
def test_a_client_setting_of_the_wrong_type_is_refused_by_name(setting, value) -> None:
    with pytest.raises(TypeError, match=f"^{setting} must be"):
        ClientSettings(**{setting: value})


def test_an_estimate_does_not_stretch_the_allowance(fake, make_client, tmp_path) -> None:
    # The estimate lowers what the ledger will hold, not what the call may cost:
    # the allowance admits on the byte cap, or calls that cost more than their
    # estimate spend past max_nanos while the ledger is away.
    client = make_client(allowance(tmp_path, max_nanos=5_000))
    fake.reachable = False
    spent = 0
    for _ in range(10):
        try:
            with client.model_call(
                "model-a", REQUEST_BYTES, MAX_OUTPUT_TOKENS, estimate_nanos=10
            ) as handle:
                assert handle.hold_nanos == 10  # the ledger's hold is still the estimate
                handle.succeeded(input_tokens=1_000, output_tokens=500)  # costs its cap
        except Denied as denied:
            assert denied.denial_reason is DenialReason.ALLOWANCE_EXHAUSTED
            assert "-" not in denied.message
            break
        spent += HOLD_NANOS
    assert spent == 2 * HOLD_NANOS <= 5_000
    assert client._allowance.used().nanos == spent


def test_an_unknown_ending_does_not_stretch_the_allowance(fake, make_client, tmp_path) -> None:
    # A call that timed out may have cost its cap as much as an open one: the
    # ledger will charge its estimate, but the allowance bounds what the lane
    # may have spent unbooked. Counted at the estimate, ten calls capped at
    # 2,000 nanos went through an allowance of 5,000.
    client = make_client(allowance(tmp_path, max_nanos=5_000))
    fake.reachable = False
    admitted = 0
    for _ in range(10):
        try:
            with client.model_call(
                "model-a", REQUEST_BYTES, MAX_OUTPUT_TOKENS, estimate_nanos=10
            ) as handle:
                handle.failed(CallFailure.TIMEOUT)
        except Denied as denied:
            assert denied.denial_reason is DenialReason.ALLOWANCE_EXHAUSTED
            break
        admitted += 1
    assert admitted == 2
    assert client._allowance.used().nanos == 2 * HOLD_NANOS
    # The journal still says what the ledger will charge: the hold.
    charges = [
        e.local_charge_nanos for e in client.journal.pending() if e.source is Source.ALLOWANCE
    ]
    assert charges == [10, 10]


def test_an_open_call_counts_at_its_cap_not_its_estimate(fake, make_client, tmp_path) -> None:
    client = make_client(allowance(tmp_path, max_nanos=3_000))
    fake.reachable = False
    with client.model_call("model-a", REQUEST_BYTES, MAX_OUTPUT_TOKENS, estimate_nanos=10):
        assert client._allowance.used().nanos == HOLD_NANOS
        with pytest.raises(Denied), call(client):  # 2,000 more do not fit the 1,000 left
            raise AssertionError("the model must not be called")


def test_a_model_without_a_local_price_fails_closed(fake, make_client, tmp_path) -> None:
    client = make_client(allowance(tmp_path))
    fake.reachable = False
    with pytest.raises(Denied) as denied, call(client, model="model-unpriced"):
        pass
    assert denied.value.denial_reason is DenialReason.LEDGER_UNAVAILABLE


def test_the_allowance_resets_only_after_replay(fake, make_client, tmp_path) -> None:
    client = make_client(allowance(tmp_path, max_calls=2))
    fake.reachable = False
    succeed(client)
    succeed(client)
    with pytest.raises(Denied), call(client):
        pass
    # Still unreachable: a replay attempt frees nothing.
    report = client.replay_journal()
    assert report.stopped_early and report.landed == 0
    with pytest.raises(Denied), call(client):
        pass
    fake.reachable = True
    report = client.replay_journal()
    assert report.landed == 2
    assert client._allowance.used().calls == 0
    fake.reachable = False
    assert succeed(client).source is CallSource.ALLOWANCE


def test_the_allowance_survives_a_restart_of_the_lane(fake, make_client, tmp_path) -> None:
    first = make_client(allowance(tmp_path, max_calls=2))
    fake.reachable = False
    succeed(first)
    succeed(first)
    first.close()
    second = make_client(allowance(tmp_path, max_calls=2))
    with pytest.raises(Denied) as denied, call(second):
        pass
    assert denied.value.denial_reason is DenialReason.ALLOWANCE_EXHAUSTED


def test_the_journal_line_is_written_before_the_model_call(fake, make_client, tmp_path) -> None:
    client = make_client(allowance(tmp_path))
    fake.reachable = False
    with call(client) as handle:
        text = (tmp_path / "journal.jsonl").read_text()
        assert handle.reservation_id in text and '"kind":"reserve"' in text
        assert '"kind":"end"' not in text
        handle.succeeded(input_tokens=5, output_tokens=5)
    assert '"kind":"end"' in (tmp_path / "journal.jsonl").read_text()


def test_an_allowance_is_never_unbounded(tmp_path) -> None:
    for limits in ({"max_nanos": 0, "max_calls": 1}, {"max_nanos": 1, "max_calls": 0},
                   {"max_nanos": 1, "max_calls": 10**9}):  # fmt: skip
        with pytest.raises(ValueError):
            OutagePolicy.allowance(journal_path=tmp_path / "j", prices=PRICES, **limits)
    with pytest.raises(ValueError):
        OutagePolicy.allowance(max_nanos=1, max_calls=1, journal_path=tmp_path / "j", prices={})


# A Reserve whose answer was lost --------------------------------------------------------


def lost(code: grpc.StatusCode) -> Callable[[], errors.LedgerError]:
    def make() -> errors.LedgerError:
        return errors.from_rpc_error(FakeRpcError(code, ()))

    return make


class LostAnswers(FakeLedger):
    """Books each Reserve, then its answer is lost on the way back."""

    def __init__(self, error: Callable[[], errors.LedgerError]) -> None:
        super().__init__()
        self.error = error

    def reserve_arguments(self, arguments, **options):  # type: ignore[no-untyped-def]
        super().reserve_arguments(arguments, **options)
        raise self.error()


def refunds_of(client: LaneClient) -> calls.BackgroundRefunds:
    refunds = client._refunds
    assert refunds.wait(5.0), "the background refunds did not finish"
    return refunds


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED],
)
def test_without_a_journal_an_unanswered_reserve_is_refunded_in_the_background(
    code: grpc.StatusCode,
) -> None:
    fake = LostAnswers(lost(code))
    client = client_on(fake, OutagePolicy.deny())
    assert isinstance(client, LaneClient)
    with client:
        with pytest.raises(Denied) as denied, call(client):
            raise AssertionError("the model must not be called")
        assert denied.value.denial_reason is DenialReason.LEDGER_UNAVAILABLE
        refunds_of(client)
    booking = fake.bookings[denied.value.reservation_id]
    assert fake.event_counts() == {denied.value.reservation_id: ["reserved", "refunded"]}
    assert booking.ending == Ending(Settlement.REFUND, 0, None, calls.UNANSWERED_REASON)
    assert calls.UNANSWERED_REASON == "not sent: the Reserve went unanswered"  # Node's words
    assert fake.spent_nanos() == 0


def test_a_reserve_that_failed_inside_the_ledger_is_refunded_too() -> None:
    # Not an outage (the error is raised as it is), but it may have been booked.
    # The ledger's own INTERNAL carries its reason (a bare one is the transport's).
    fake = LostAnswers(
        lambda: errors.from_rpc_error(
            FakeRpcError(grpc.StatusCode.INTERNAL, (("ledger-reason", "INTERNAL"),))
        )
    )
    client = client_on(fake, OutagePolicy.deny())
    assert isinstance(client, LaneClient)
    with client:
        with pytest.raises(errors.LedgerInternal), call(client):
            raise AssertionError("the model must not be called")
        refunds_of(client)
    assert [kinds for kinds in fake.event_counts().values()] == [["reserved", "refunded"]]


@pytest.mark.parametrize(
    "error",
    [
        lost(grpc.StatusCode.RESOURCE_EXHAUSTED),  # LedgerOverloaded: refused, booked nothing
        lost(grpc.StatusCode.UNIMPLEMENTED),
        lambda: errors.ReservationConflict(grpc.StatusCode.ALREADY_EXISTS, "", "reused"),
    ],
)
def test_a_definite_refusal_is_not_refunded(error: Callable[[], errors.LedgerError]) -> None:
    fake = LostAnswers(error)
    client = client_on(fake, OutagePolicy.deny())
    assert isinstance(client, LaneClient)
    with client:
        with pytest.raises((Denied, errors.LedgerError)), call(client):
            raise AssertionError("the model must not be called")
        refunds_of(client)
    # RESOURCE_EXHAUSTED is retryable: its Reserve is sent again, never refunded.
    assert {method for method, _ in fake.rpcs} == {"reserve"}


def test_with_a_journal_full_of_doubts_the_refund_goes_in_the_background(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(calls, "MAX_IN_DOUBT_ENTRIES", 0)
    fake = LostAnswers(lost(grpc.StatusCode.UNAVAILABLE))
    client = client_on(fake, OutagePolicy.deny(tmp_path / "journal.jsonl"))
    assert isinstance(client, LaneClient)
    with client:
        with pytest.raises(Denied), call(client):
            pass
        refunds_of(client)
        assert client.journal is not None and client.journal.pending() == []
    assert [kinds for kinds in fake.event_counts().values()] == [["reserved", "refunded"]]


class LostTogether(LostAnswers):
    """Loses the answers of `parties` Reserves that arrive at once, all at once."""

    def __init__(self, parties: int) -> None:
        super().__init__(lost(grpc.StatusCode.UNAVAILABLE))
        self.together = threading.Barrier(parties)

    def reserve_arguments(self, arguments, **options):  # type: ignore[no-untyped-def]
        self.together.wait(5.0)
        return super().reserve_arguments(arguments, **options)


def test_calls_at_once_journal_no_more_doubts_than_the_limit(tmp_path, monkeypatch) -> None:
    limit, parties = 3, 12
    monkeypatch.setattr(calls, "MAX_IN_DOUBT_ENTRIES", limit)
    fake = LostTogether(parties)
    client = client_on(fake, OutagePolicy.deny(tmp_path / "journal.jsonl"))
    assert isinstance(client, LaneClient)

    def one() -> None:
        with pytest.raises(Denied), call(client):
            raise AssertionError("the model must not be called")

    with client:
        threads = [threading.Thread(target=one) for _ in range(parties)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10.0)
        refunds_of(client)
        assert client.journal is not None
        in_doubt = [e for e in client.journal.pending() if e.source is Source.IN_DOUBT]
        assert len(in_doubt) == limit
    # The rest were refunded in the background: every booking is refunded or journaled.
    refunded = [kinds for kinds in fake.event_counts().values() if kinds[-1] == "refunded"]
    assert len(refunded) == parties - limit


class BlockedEnds:
    """A ledger whose Refunds wait until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.refunded: list[str] = []

    def reserve_arguments(self, arguments, **options):  # type: ignore[no-untyped-def]
        raise AssertionError("not called")

    def end(self, reservation_id, ending, **options):  # type: ignore[no-untyped-def]
        assert self.release.wait(5.0)
        self.refunded.append(reservation_id)
        raise errors.BookingNotFound(grpc.StatusCode.NOT_FOUND, "BOOKING_NOT_FOUND", "none")


def test_background_refunds_are_bounded_and_never_raise() -> None:
    """Past `limit` under way, a refund waits its turn (it was dropped, and
    under a flood of unanswered Reserves its hold expired); past
    `pending_limit` waiting, it is dropped."""
    assert calls.MAX_BACKGROUND_REFUNDS == 100  # as the Node client
    assert calls.MAX_PENDING_REFUNDS == 1000
    ledger = BlockedEnds()
    refunds = calls.BackgroundRefunds(limit=2, pending_limit=1)
    sent = [refunds.send(ledger, f"id-{n}", "") for n in range(4)]
    assert sent == [True, True, True, False] and refunds.running == 2
    assert not refunds.wait(0.05)
    ledger.release.set()
    assert refunds.wait(5.0) and refunds.running == 0
    assert sorted(ledger.refunded) == ["id-0", "id-1", "id-2"]
    assert refunds.send(ledger, "id-4", "") and refunds.wait(5.0)


class LostRefunds(FakeLedger):
    """Books every Reserve and loses its answer; the first `lost_refunds`
    Refunds are lost before they reach it."""

    def __init__(self, lost_refunds: int) -> None:
        super().__init__()
        self.lost_refunds = lost_refunds
        self.refunds = 0

    def reserve_arguments(self, arguments, **options):  # type: ignore[no-untyped-def]
        super().reserve_arguments(arguments, **options)
        raise lost(grpc.StatusCode.DEADLINE_EXCEEDED)()

    def end(self, reservation_id, ending, **options):  # type: ignore[no-untyped-def]
        self.refunds += 1
        if self.refunds <= self.lost_refunds:
            raise lost(grpc.StatusCode.DEADLINE_EXCEEDED)()
        return super().end(reservation_id, ending, **options)


@pytest.mark.parametrize(("lost_refunds", "sent", "refunded"), [(2, 3, True), (10, 4, False)])
def test_a_background_refund_whose_answer_is_lost_is_sent_again_a_bounded_number_of_times(
    lost_refunds: int, sent: int, refunded: bool
) -> None:
    """It was sent once: under a flood it failed as the Reserve had, and the
    hold the ledger booked expired at its hold."""
    assert calls.UNANSWERED_REFUND_ATTEMPTS == 4  # as the Node client
    assert calls.UNANSWERED_REFUND_PAUSE_SECONDS == 0.25
    fake = LostRefunds(lost_refunds)
    client = client_on(fake, OutagePolicy.deny())
    assert isinstance(client, LaneClient)
    with client:
        with pytest.raises(Denied) as denied, call(client):
            raise AssertionError("the model must not be called")
        refunds_of(client)
    reservation_id = denied.value.reservation_id
    assert fake.refunds == sent
    kinds = fake.event_counts()[reservation_id]
    assert kinds == (["reserved", "refunded"] if refunded else ["reserved"])


# A retry under the id of an unanswered Reserve, without a journal -------------------------


class LostOnce(FakeLedger):
    """Books every Reserve (a repeat gets the first answer, as the ledger's);
    only the first one's answer is lost on the way back."""

    def __init__(self) -> None:
        super().__init__()
        self.error = lost(grpc.StatusCode.DEADLINE_EXCEEDED)
        self.lost = 0

    def reserve_arguments(self, arguments, **options):  # type: ignore[no-untyped-def]
        answer = super().reserve_arguments(arguments, **options)
        if self.lost == 0:
            self.lost += 1
            raise self.error()
        return answer


RETRIED_ID = "retried-call-1"


def retried(client: LaneClient) -> object:
    return client.model_call("model-a", REQUEST_BYTES, MAX_OUTPUT_TOKENS, reservation_id=RETRIED_ID)


def unanswered_then_refunded(client: LaneClient) -> None:
    with pytest.raises(Denied), retried(client):
        raise AssertionError("the model must not be called")
    refunds_of(client)  # the background refund has reached the ledger


def test_a_retry_after_the_background_refund_is_refused_and_never_called() -> None:
    # The leak: the retried Reserve gets the first answer (admitted) for a booking
    # already refunded, the paid call is made and its Settle is BOOKING_ALREADY_ENDED.
    fake = LostOnce()
    client = client_on(fake, OutagePolicy.deny())
    assert isinstance(client, LaneClient)
    made: list[object] = []
    with client:
        unanswered_then_refunded(client)
        with pytest.raises(errors.ReservationConflict) as refused, retried(client) as handle:
            made.append(handle)
            handle.succeeded(input_tokens=900, output_tokens=100)
    assert made == [], "the model call was made under a refunded booking"
    assert RETRIED_ID in str(refused.value) and "new reservation_id" in str(refused.value)
    assert refused.value.reason == "RESERVATION_ID_REUSED"
    assert not errors.is_retryable(refused.value)
    assert fake.event_counts() == {RETRIED_ID: ["reserved", "refunded"]}
    assert fake.rpcs == [("reserve", RETRIED_ID), ("end", RETRIED_ID)]  # the retry sent nothing


def test_a_bare_reserve_after_the_background_refund_is_refused_too() -> None:
    fake = LostOnce()
    client = client_on(fake, OutagePolicy.deny())
    assert isinstance(client, LaneClient)
    with client:
        unanswered_then_refunded(client)
        with pytest.raises(errors.ReservationConflict):
            client.reserve("model-a", REQUEST_BYTES, MAX_OUTPUT_TOKENS, reservation_id=RETRIED_ID)
    assert fake.rpcs == [("reserve", RETRIED_ID), ("end", RETRIED_ID)]


class SlowRefunds(LostOnce):
    """Refunds take `seconds` to reach the ledger."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.refund_started = threading.Event()

    def end(self, reservation_id, ending, **options):  # type: ignore[no-untyped-def]
        self.refund_started.set()
        threading.Event().wait(self.seconds)
        return super().end(reservation_id, ending, **options)


def unanswered_while_refunding(client: LaneClient, fake: SlowRefunds) -> None:
    with pytest.raises(Denied), retried(client):
        raise AssertionError("the model must not be called")
    assert fake.refund_started.wait(5.0)  # the background refund is under way


def test_a_retry_waits_for_the_refund_under_way_then_is_refused() -> None:
    fake = SlowRefunds(0.1)
    client = client_on(fake, OutagePolicy.deny(), deadline_seconds=1.0)
    assert isinstance(client, LaneClient)
    with client:
        unanswered_while_refunding(client, fake)
        with pytest.raises(errors.ReservationConflict), retried(client):
            raise AssertionError("the model must not be called")
    assert fake.rpcs == [("reserve", RETRIED_ID), ("end", RETRIED_ID)]


def test_a_retry_that_outwaits_its_deadline_is_an_outage_and_sends_nothing() -> None:
    fake = SlowRefunds(0.5)
    client = client_on(fake, OutagePolicy.deny(), deadline_seconds=0.05)
    assert isinstance(client, LaneClient)
    with client:
        unanswered_while_refunding(client, fake)
        with pytest.raises(Denied) as denied, retried(client):
            raise AssertionError("the model must not be called")
        assert denied.value.denial_reason is DenialReason.LEDGER_UNAVAILABLE
        refunds_of(client)
    assert fake.rpcs == [("reserve", RETRIED_ID), ("end", RETRIED_ID)]


class AwayForTheRefund(LostOnce):
    """The first Refund fails with `error`; `applied`: after it reached the ledger."""

    def __init__(self, error: Callable[[], errors.LedgerError], *, applied: bool) -> None:
        super().__init__()
        self.refund_error = error
        self.applied = applied
        self.failures = 1

    def end(self, reservation_id, ending, **options):  # type: ignore[no-untyped-def]
        if self.failures > 0:
            self.failures -= 1
            if self.applied:
                super().end(reservation_id, ending, **options)
            raise self.refund_error()
        return super().end(reservation_id, ending, **options)


def test_a_refund_whose_answer_was_lost_is_asked_again_before_a_retry() -> None:
    fake = AwayForTheRefund(lost(grpc.StatusCode.DEADLINE_EXCEEDED), applied=True)
    client = client_on(fake, OutagePolicy.deny())
    assert isinstance(client, LaneClient)
    with client:
        unanswered_then_refunded(client)
        with pytest.raises(errors.ReservationConflict), retried(client):
            raise AssertionError("the model must not be called")
    assert [method for method, _ in fake.rpcs] == ["reserve", "end", "end"]


def test_a_retry_whose_refund_is_still_unanswered_falls_back_even_on_an_allowance(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(calls, "MAX_IN_DOUBT_ENTRIES", 0)  # the refund goes in the background
    fake = AwayForTheRefund(lost(grpc.StatusCode.DEADLINE_EXCEEDED), applied=True)
    # Every attempt of the background refund, then the first asking again, lose their answers.
    fake.failures = calls.UNANSWERED_REFUND_ATTEMPTS + 1
    client = client_on(fake, allowance(tmp_path))
    assert isinstance(client, LaneClient)
    fake.error = lambda: errors.from_rpc_error(
        FakeRpcError(grpc.StatusCode.INTERNAL, (("ledger-reason", "INTERNAL"),))
    )  # no outage, so the allowance admits nothing; but it may have been booked
    with client:
        with pytest.raises(errors.LedgerInternal), retried(client):
            raise AssertionError("the model must not be called")
        refunds_of(client)
        with pytest.raises(Denied) as denied, retried(client):
            raise AssertionError("the model must not be called")
        assert denied.value.denial_reason is DenialReason.LEDGER_UNAVAILABLE
        assert RETRIED_ID in denied.value.message
        # Once the ledger answers the refund again, the id is refused for good.
        with pytest.raises(errors.ReservationConflict), retried(client):
            raise AssertionError("the model must not be called")
    ends = ["end"] * (calls.UNANSWERED_REFUND_ATTEMPTS + 2)
    assert [method for method, _ in fake.rpcs] == ["reserve", *ends]


def test_background_refunds_remember_the_latest_ended_ids_only() -> None:
    assert calls.MAX_ENDED_IDS == 1000
    fake = FakeLedger()
    refunds = calls.BackgroundRefunds(remember=2)
    for n in range(3):
        fake.reserve_arguments(ReserveArguments(f"id-{n}", "model-a", 1, 1))
        assert refunds.send(fake, f"id-{n}", "")
        assert refunds.wait(5.0)
    refunds.clear(fake, "id-0", "", 0.1)  # forgotten: a Reserve under it goes
    for n in (1, 2):
        with pytest.raises(errors.ReservationConflict):
            refunds.clear(fake, f"id-{n}", "", 0.1)


def test_a_retry_after_a_refund_that_found_nothing_is_made() -> None:
    # The ledger never booked the first Reserve: the refund finds nothing, the
    # retry books and the call is made and settled, as before.
    fake = FakeLedger()
    client = client_on(fake, OutagePolicy.deny())
    assert isinstance(client, LaneClient)
    fake.reachable = False
    with client:
        with pytest.raises(Denied), retried(client):
            raise AssertionError("the model must not be called")
        fake.reachable = True
        refunds_of(client)
        with retried(client) as handle:
            handle.succeeded(input_tokens=900, output_tokens=100)
    assert fake.event_counts() == {RETRIED_ID: ["reserved", "settled"]}


def test_a_retry_after_a_refund_the_ledger_definitely_refused_is_made() -> None:
    # The ledger booked it, but the refund was refused for lack of capacity
    # (it did nothing): the retry owns the open booking and settles it.
    fake = AwayForTheRefund(lost(grpc.StatusCode.RESOURCE_EXHAUSTED), applied=False)
    fake.failures = calls.UNANSWERED_REFUND_ATTEMPTS  # refused at every attempt
    client = client_on(fake, OutagePolicy.deny())
    assert isinstance(client, LaneClient)
    with client:
        unanswered_then_refunded(client)
        with retried(client) as handle:
            handle.succeeded(input_tokens=900, output_tokens=100)
    assert fake.event_counts() == {RETRIED_ID: ["reserved", "settled"]}


# Endings the ledger did not confirm are sent again ------------------------------------------


class LostEndings(FakeLedger):
    """The first `failures` Settles and Refunds fail with `error`."""

    def __init__(self, failures: int, error: Callable[[], errors.LedgerError]) -> None:
        super().__init__()
        self.failures = failures
        self.error = error
        self.end_attempts = 0

    def end(self, reservation_id, ending, **options):  # type: ignore[no-untyped-def]
        self.end_attempts += 1
        if self.failures > 0:
            self.failures -= 1
            raise self.error()
        return super().end(reservation_id, ending, **options)


@pytest.fixture
def pauses(monkeypatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr(calls.time, "sleep", slept.append)
    return slept


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED],
)
def test_an_unconfirmed_ending_is_sent_again_up_to_three_attempts(
    code: grpc.StatusCode, pauses: list[float]
) -> None:
    assert ClientSettings().end_attempts == 3  # the Node client's DEFAULT_END_ATTEMPTS
    fake = LostEndings(2, lost(code))
    client = client_on(fake, OutagePolicy.deny())
    assert isinstance(client, LaneClient)
    with client, call(client) as handle:
        handle.succeeded(input_tokens=900, output_tokens=100)
    assert fake.end_attempts == 3
    assert handle.result is not None and handle.end_error is None
    assert pauses == [0.02, 0.04]  # Node's END_RETRY_PAUSE_MS times the attempt
    assert fake.event_counts() == {handle.reservation_id: ["reserved", "settled"]}


def test_after_the_last_attempt_the_ending_is_journaled(tmp_path, pauses: list[float]) -> None:
    fake = LostEndings(3, lost(grpc.StatusCode.UNAVAILABLE))
    client = client_on(fake, OutagePolicy.deny(tmp_path / "journal.jsonl"))
    assert isinstance(client, LaneClient)
    with client:
        with call(client) as handle:
            handle.not_sent("circuit open")
        assert fake.end_attempts == 3 and pauses == [0.02, 0.04]
        assert isinstance(handle.end_error, errors.LedgerUnavailable) and handle.journaled
        assert client.replay_journal().landed == 1
    assert fake.event_counts() == {handle.reservation_id: ["reserved", "refunded"]}


def test_an_ending_the_server_was_too_busy_for_is_journaled_after_the_last_attempt(
    tmp_path, pauses: list[float]
) -> None:
    """TOO_MANY_CALLS is a retry, not an outage: still refused after the last
    attempt, the ending is kept for the replay instead of dropped (the hold
    would expire at the lane's expire_charge, the real cost never booked)."""
    busy = lambda: errors.TooManyCalls(grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_CALLS", "busy")  # noqa: E731
    fake = LostEndings(3, busy)
    client = client_on(fake, OutagePolicy.deny(tmp_path / "journal.jsonl"))
    assert isinstance(client, LaneClient)
    with client:
        with call(client) as handle:
            handle.succeeded(input_tokens=900, output_tokens=100)
        assert fake.end_attempts == 3 and pauses == [0.02, 0.04]
        assert isinstance(handle.end_error, errors.TooManyCalls) and handle.journaled
        assert client.replay_journal().landed == 1
    assert fake.event_counts() == {handle.reservation_id: ["reserved", "settled"]}


def test_a_refused_ending_is_not_sent_again(pauses: list[float]) -> None:
    refused = lambda: errors.BookingAlreadyEnded(grpc.StatusCode.FAILED_PRECONDITION, "", "ended")  # noqa: E731
    fake = LostEndings(1, refused)
    client = client_on(fake, OutagePolicy.deny())
    assert isinstance(client, LaneClient)
    with client, call(client) as handle:
        handle.succeeded(input_tokens=900, output_tokens=100)
    assert fake.end_attempts == 1 and pauses == []
    assert isinstance(handle.end_error, errors.BookingAlreadyEnded)


def test_the_attempts_are_a_setting(pauses: list[float]) -> None:
    fake = LostEndings(5, lost(grpc.StatusCode.UNAVAILABLE))
    client = client_on(fake, OutagePolicy.deny(), end_attempts=1)
    assert isinstance(client, LaneClient)
    with client, call(client) as handle:
        handle.succeeded(input_tokens=900, output_tokens=100)
    assert fake.end_attempts == 1 and pauses == []
    with pytest.raises(ValueError, match="end_attempts"):
        ClientSettings(end_attempts=0)


class LosesTheFirstAnswer(FakeLedger):
    """Books every Reserve; the first one's answer is lost on the way back
    as its deadline passes (so it is not sent again within the call)."""

    def __init__(self) -> None:
        super().__init__()
        self.lost = False

    def reserve_arguments(self, arguments, **options):  # type: ignore[no-untyped-def]
        answer = super().reserve_arguments(arguments, **options)
        if not self.lost:
            self.lost = True
            raise lost(grpc.StatusCode.DEADLINE_EXCEEDED)()
        return answer


def test_a_retry_with_the_same_id_is_not_refunded_behind_the_call(tmp_path) -> None:
    """The README says to send a LedgerUnavailable call again with the same
    reservation_id. The first Reserve's in-doubt refund must not then end the
    retried call's booking, neither while the call runs nor after it."""
    fake = LosesTheFirstAnswer()
    client = client_on(fake, OutagePolicy.deny(tmp_path / "journal.jsonl"))
    assert isinstance(client, LaneClient)
    with client:
        with pytest.raises(Denied) as denied, call(client):
            raise AssertionError("the model must not be called")
        rid = denied.value.reservation_id
        assert [entry.source for entry in client.journal.pending()] == [Source.IN_DOUBT]
        with client.model_call(
            "model-a", REQUEST_BYTES, MAX_OUTPUT_TOKENS, reservation_id=rid
        ) as handle:
            client.replay_journal()  # the replayer wakes while the call runs
            handle.succeeded(input_tokens=900, output_tokens=100)
        assert handle.result is not None
        client.replay_journal()
        assert client.journal.pending() == []
    assert fake.event_counts() == {rid: ["reserved", "settled"]}
    ending = fake.bookings[rid].ending
    assert ending is not None and ending.settlement is Settlement.SETTLE_SUCCEEDED
    assert [entry.replay for entry in client.journal.entries()] == [ReplayResult.SUPERSEDED]


def _listed_once(monkeypatch: pytest.MonkeyPatch, journal: object, stale: list[object]) -> None:
    """The replay's next look at the journal sees `stale`, as an attempt that
    listed the pending entries before a call in flight changed them."""
    real = journal.pending  # type: ignore[attr-defined]
    listed = iter([stale])
    monkeypatch.setattr(journal, "pending", lambda: next(listed, None) or real())


def test_a_replay_reads_an_entry_afresh_once_its_call_has_ended(
    fake, make_client, tmp_path, monkeypatch
) -> None:
    client = make_client(allowance(tmp_path))
    fake.reachable = False
    with call(client) as handle:
        stale = client.journal.pending()  # listed while the call is in flight
        handle.succeeded(input_tokens=900, output_tokens=100)
    fake.reachable = True
    _listed_once(monkeypatch, client.journal, stale)
    report = client.replay_journal()
    assert report.landed == 1 and report.remaining == 0
    ending = fake.bookings[handle.reservation_id].ending
    assert ending is not None and ending.settlement is Settlement.SETTLE_SUCCEEDED


def test_a_stale_in_doubt_refund_never_ends_the_retry_that_superseded_it(
    fake, make_client, tmp_path, monkeypatch
) -> None:
    client = make_client(OutagePolicy.deny(tmp_path / "journal.jsonl"))
    fake.reachable = False
    with pytest.raises(Denied), client.model_call("model-a", 100, 10, reservation_id="r-1"):
        pass
    stale = client.journal.pending()  # the in-doubt refund of r-1, listed by an attempt
    fake.reachable = True
    with client.model_call("model-a", 100, 10, reservation_id="r-1") as retry:  # admitted
        retry.succeeded(input_tokens=30, output_tokens=10)
        fake.reachable = False  # its settle cannot reach the ledger: journaled
    assert retry.journaled
    fake.reachable = True
    _listed_once(monkeypatch, client.journal, stale)
    client.replay_journal()
    ending = fake.bookings["r-1"].ending
    assert ending is not None and ending.settlement is Settlement.SETTLE_SUCCEEDED
    assert client.journal.pending() == []


def test_a_retry_after_its_in_doubt_refund_landed_is_refused_before_the_call(tmp_path) -> None:
    """Once the journal's in-doubt refund of an unanswered Reserve has reached
    the ledger, a Reserve under that id gets its first answer (admitted) for a
    booking that has ended: the call would be made and no Settle could book it.
    The retry is refused before the call, as with a background refund."""
    fake = LosesTheFirstAnswer()
    client = client_on(fake, OutagePolicy.deny(tmp_path / "journal.jsonl"))
    assert isinstance(client, LaneClient)
    with client:
        with pytest.raises(Denied) as denied, call(client):
            raise AssertionError("the model must not be called")
        rid = denied.value.reservation_id
        assert client.replay_journal().landed == 1  # the refund lands first
        with (
            pytest.raises(errors.ReservationConflict),
            client.model_call("model-a", REQUEST_BYTES, MAX_OUTPUT_TOKENS, reservation_id=rid),
        ):
            raise AssertionError("the model must not be called")
    assert fake.event_counts() == {rid: ["reserved", "refunded"]}


# A Reserve whose answer was lost is sent again within its deadline ----------------------


class ScriptedReserves(FakeLedger):
    """Books every Reserve (a repeat gets the first answer, as the ledger's);
    the answers of the first ones are lost with `errors_in_turn`, one each."""

    def __init__(self, *errors_in_turn: Callable[[], errors.LedgerError], limit_nanos: int = 10**9):
        super().__init__(limit_nanos)
        self.errors_in_turn = list(errors_in_turn)
        self.deadlines: list[float | None] = []

    def reserve_arguments(self, arguments, **options):  # type: ignore[no-untyped-def]
        self.deadlines.append(options.get("deadline_seconds"))
        answer = super().reserve_arguments(arguments, **options)
        if self.errors_in_turn:
            raise self.errors_in_turn.pop(0)()
        return answer


def reset() -> errors.LedgerError:
    """A connection reset under the call: a bare INTERNAL, the transport's."""
    return errors.from_rpc_error(FakeRpcError(grpc.StatusCode.INTERNAL, ()))


@pytest.mark.parametrize(
    "error", [lost(grpc.StatusCode.UNAVAILABLE), lost(grpc.StatusCode.CANCELLED), reset]
)
def test_a_reserve_whose_answer_was_lost_is_sent_again_and_admitted(
    error: Callable[[], errors.LedgerError], pauses: list[float]
) -> None:
    fake = ScriptedReserves(error)
    client = client_on(fake, OutagePolicy.deny())
    assert isinstance(client, LaneClient)
    with client:
        with call(client) as handle:
            handle.succeeded(input_tokens=900, output_tokens=100)
        assert refunds_of(client).running == 0
    rid = handle.reservation_id
    assert handle.source is CallSource.LEDGER and handle.result is not None
    assert fake.rpcs == [("reserve", rid), ("reserve", rid), ("end", rid)]  # no refund
    assert fake.event_counts() == {rid: ["reserved", "settled"]}
    assert pauses == [0.02]  # END_RETRY_PAUSE_SECONDS, as an ending's resend


def test_a_resent_reserve_that_is_denied_is_the_calls_denial(pauses: list[float]) -> None:
    fake = ScriptedReserves(lost(grpc.StatusCode.UNAVAILABLE), limit_nanos=HOLD_NANOS - 1)
    client = client_on(fake, OutagePolicy.deny())
    assert isinstance(client, LaneClient)
    with client:
        with pytest.raises(Denied) as denied, call(client):
            raise AssertionError("the model must not be called")
        refunds_of(client)
    assert denied.value.denial_reason is DenialReason.BUDGET_EXHAUSTED
    assert [method for method, _ in fake.rpcs] == ["reserve", "reserve"]  # no refund


def test_a_reserve_that_never_gets_an_answer_is_refunded_after_its_attempts(
    pauses: list[float],
) -> None:
    fake = ScriptedReserves(*[lost(grpc.StatusCode.UNAVAILABLE)] * 5)
    client = client_on(fake, OutagePolicy.deny())
    assert isinstance(client, LaneClient)
    with client:
        with pytest.raises(Denied) as denied, call(client):
            raise AssertionError("the model must not be called")
        refunds_of(client)
    assert denied.value.denial_reason is DenialReason.LEDGER_UNAVAILABLE
    assert [method for method, _ in fake.rpcs] == ["reserve"] * 3 + ["end"]
    assert pauses[:2] == [0.02, 0.04]  # then the background refund's own pauses, if any
    assert fake.event_counts() == {denied.value.reservation_id: ["reserved", "refunded"]}


@pytest.mark.parametrize(
    "error",
    [
        lost(grpc.StatusCode.DEADLINE_EXCEEDED),  # the call's deadline is spent
        lambda: errors.from_rpc_error(
            FakeRpcError(grpc.StatusCode.INTERNAL, (("ledger-reason", "INTERNAL"),))
        ),  # the ledger failed: final
    ],
)
def test_a_reserve_is_not_sent_again_after_its_deadline_or_a_final_error(
    error: Callable[[], errors.LedgerError], pauses: list[float]
) -> None:
    fake = ScriptedReserves(error)
    client = client_on(fake, OutagePolicy.deny())
    assert isinstance(client, LaneClient)
    with client:
        with pytest.raises((Denied, errors.LedgerInternal)), call(client):
            raise AssertionError("the model must not be called")
        refunds_of(client)
    assert [method for method, _ in fake.rpcs] == ["reserve", "end"]  # refunded, as before


class Clock:
    """calls.time for one test: each Reserve takes `reserve_seconds`, each pause its length."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_the_resends_stay_within_the_calls_deadline(monkeypatch) -> None:
    clock = Clock()
    monkeypatch.setattr(calls, "time", clock)
    fake = ScriptedReserves(*[lost(grpc.StatusCode.UNAVAILABLE)] * 5)
    real_reserve = fake.reserve_arguments

    def slow_reserve(arguments, **options):  # type: ignore[no-untyped-def]
        clock.now += 0.1
        return real_reserve(arguments, **options)

    fake.reserve_arguments = slow_reserve  # type: ignore[method-assign]
    client = client_on(fake, OutagePolicy.deny(), deadline_seconds=0.25)
    assert isinstance(client, LaneClient)
    client.reserve_arguments = slow_reserve  # type: ignore[method-assign]
    with client:
        with pytest.raises(Denied), call(client):
            raise AssertionError("the model must not be called")
        refunds_of(client)
    # 0.1 s, a 0.02 s pause, 0.1 s: 0.03 s are left, less than the next 0.04 s pause.
    assert fake.deadlines == [pytest.approx(0.25), pytest.approx(0.13)]
    assert clock.slept[:1] == [0.02]


def test_a_reserve_booked_then_refused_on_its_resend_is_still_refunded(
    pauses: list[float],
) -> None:
    # The first attempt may have booked it; the overloaded ledger then refuses
    # the resends (booking nothing): the first booking still needs its refund.
    fake = ScriptedReserves(
        lost(grpc.StatusCode.UNAVAILABLE), *[lost(grpc.StatusCode.RESOURCE_EXHAUSTED)] * 2
    )
    client = client_on(fake, OutagePolicy.deny())
    assert isinstance(client, LaneClient)
    with client:
        with pytest.raises(Denied), call(client):
            raise AssertionError("the model must not be called")
        refunds_of(client)
    assert [method for method, _ in fake.rpcs] == ["reserve"] * 3 + ["end"]
    assert [kinds for kinds in fake.event_counts().values()] == [["reserved", "refunded"]]


def test_a_resend_under_an_id_a_refund_has_since_ended_is_refused(pauses: list[float]) -> None:
    """While the first Reserve's answer is lost, another call under the same id
    (its own Reserve unanswered) has its refund end the booking: the ledger would
    answer the resend with its first answer, admitted, for a booking that has
    ended, and the paid call could never be settled."""
    fake = ScriptedReserves(lost(grpc.StatusCode.UNAVAILABLE))
    client = client_on(fake, OutagePolicy.deny())
    assert isinstance(client, LaneClient)
    real_reserve = fake.reserve_arguments

    def reserve_then_refund(arguments, **options):  # type: ignore[no-untyped-def]
        try:
            return real_reserve(arguments, **options)
        finally:
            if len(fake.deadlines) == 1:  # the other call's refund ends it meanwhile
                assert client._refunds.send(fake, arguments.reservation_id, "")
                assert client._refunds.wait(5.0)

    client.reserve_arguments = reserve_then_refund  # type: ignore[method-assign]
    made: list[object] = []
    with client, pytest.raises(errors.ReservationConflict), retried(client) as handle:
        made.append(handle)
    assert made == [], "the model call was made under a refunded booking"
    assert fake.rpcs == [("reserve", RETRIED_ID), ("end", RETRIED_ID)]  # no resend, one refund
    assert fake.event_counts() == {RETRIED_ID: ["reserved", "refunded"]}
