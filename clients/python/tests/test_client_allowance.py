"""The model call wrapper and the outage modes, against an in-memory ledger."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
from client_fakes import FakeLedger, client_on
from ledger_client import (
    CallNotSent,
    CallSource,
    DenialReason,
    Denied,
    LaneClient,
    ModelPrice,
    OutagePolicy,
    Settlement,
    Source,
    Usage,
)
from ledger_client.outcomes import CallFailure

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
