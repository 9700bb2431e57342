"""Time through real gRPC stubs: the rolling window to the microsecond,
retry_after, expiry at the deadline with and without the sweeper, and the policy
a booking keeps.

The test clock starts at START_US, an instant with a sub-second part
(.123456 s), so that an edge off by one microsecond shows.
"""

from __future__ import annotations

import pathlib
import sqlite3
import threading
import time
from typing import Any

import pytest
from google.protobuf import empty_pb2

from ledger_service import cli
from ledger_service.cli import render
from ledger_service.domain.clock import ManualClock, SystemClock
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.server import LedgerServer
from tests.conftest import START_US, ledger_settings

SECOND_US = 1_000_000
DAY_US = 86_400 * SECOND_US
# 300_000 bytes and 500 output tokens cap at 8_772 nanos: room for any estimate here.
BIG_BYTES = 300_000
CAP_10K_500 = 486
# How long a test waits for what must happen (a sweep, an event): generous, as
# a loaded machine may be slow; passing tests never wait it out.
WAIT_SECONDS = 30.0


@pytest.fixture
def harness(ledger_harness: Any) -> Any:
    ledger_harness.make_lane()
    return ledger_harness


@pytest.fixture
def unswept(start_ledger_server: Any, harness_for: Any) -> Any:
    """A harness on a server whose sweeper never runs within a test."""
    harness = harness_for(start_ledger_server(sweep_interval_seconds=3600))
    harness.make_lane()
    return harness


class Sweeps:
    """Counts the server's sweeps as they begin and end, so that a test waits
    for sweeps, not for the time they take (a loaded machine sweeps late)."""

    def __init__(self, server: LedgerServer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.begun = self.ended = 0
        self.changed = threading.Condition()
        sweep = server.ledger.sweep

        def counted(batch_size: int) -> int:
            with self.changed:
                self.begun += 1
            try:
                return sweep(batch_size)
            finally:
                with self.changed:
                    self.ended += 1
                    self.changed.notify_all()

        monkeypatch.setattr(server.ledger, "sweep", counted)

    def wait_for_new(self, count: int) -> None:
        """Until `count` sweeps begun from now on have ended."""
        with self.changed:
            target = self.begun + count
            assert self.changed.wait_for(lambda: self.ended >= target, WAIT_SECONDS)


# The rolling window -------------------------------------------------------------


def test_a_booking_counts_until_one_microsecond_before_it_ages_out(harness: Any) -> None:
    start = harness.START_US
    harness.reserve("first")
    harness.settle("first", input_tokens=1_000)  # 100 nanos, dated at start
    harness.advance_us(1)
    harness.reserve("second")
    harness.settle("second", input_tokens=2_000)  # 200 nanos, dated at start + 1 us
    assert harness.micros_of(harness.booking("first").ages_out_at) == start + DAY_US

    harness.set_time_us(start + DAY_US - 1)
    assert harness.balance().spent_nanos == 300
    harness.set_time_us(start + DAY_US)
    balance = harness.balance()
    assert (balance.spent_nanos, balance.charged_nanos) == (200, 200)
    assert harness.micros_of(balance.as_of) == start + DAY_US
    harness.set_time_us(start + DAY_US + 1)
    assert harness.balance().spent_nanos == 0


def test_a_late_charge_stays_dated_at_reserved_at(harness: Any) -> None:
    start = harness.START_US
    harness.reserve("r1", estimate_nanos=300, request_bytes=BIG_BYTES)
    harness.settle("r1", pb.UNKNOWN)
    harness.set_time_us(start + DAY_US - 10)
    # A late answer corrects the charge but never moves its date.
    harness.settle("r1", input_tokens=5_000)
    assert harness.balance().charged_nanos == 500
    harness.set_time_us(start + DAY_US)
    assert harness.balance().spent_nanos == 0


def test_an_open_hold_ages_out_too_never_piling_up(harness: Any) -> None:
    harness.reserve("lost", request_bytes=BIG_BYTES)
    harness.set_time_us(harness.START_US + DAY_US)
    balance = harness.balance()
    assert (balance.spent_nanos, balance.held_nanos, balance.open_bookings) == (0, 0, 0)


# Denials and retry_after ----------------------------------------------------------


def test_denial_says_exactly_when_the_hold_will_fit(harness: Any) -> None:
    start = harness.START_US
    harness.make_lane(limit_nanos=10_000, window_seconds=3600)
    big = {"request_bytes": BIG_BYTES}
    assert harness.reserve("a", estimate_nanos=4_000, **big).decision == pb.ADMITTED
    harness.advance_us(10 * SECOND_US)
    assert harness.reserve("b", estimate_nanos=5_000, **big).decision == pb.ADMITTED
    harness.advance_us(10 * SECOND_US)

    small = harness.reserve("c", estimate_nanos=3_000, **big)
    assert small.decision == pb.DENIED
    assert small.denial_reason == pb.BUDGET_EXHAUSTED
    assert small.balance.available_nanos == 1_000
    # 2_000 more are needed: "a" (4_000) frees them when it ages out.
    assert harness.micros_of(small.retry_after) == start + 3600 * SECOND_US
    large = harness.reserve("d", estimate_nanos=6_000, **big)
    # 5_000 more are needed: "a" and then "b" must age out.
    assert harness.micros_of(large.retry_after) == start + 3610 * SECOND_US

    # The denial is recorded, with its retry_after.
    (event,) = harness.events("recall", reservation_id="c")
    assert event.kind == "denied"
    assert event.retry_after == small.retry_after
    assert event.denial_reason == pb.BUDGET_EXHAUSTED

    # One microsecond early it still does not fit; at retry_after it does.
    harness.set_time_us(start + 3600 * SECOND_US - 1)
    early = harness.reserve("c-early", estimate_nanos=3_000, **big)
    assert early.decision == pb.DENIED
    assert early.retry_after == small.retry_after
    harness.set_time_us(start + 3600 * SECOND_US)
    assert harness.reserve("c-again", estimate_nanos=3_000, **big).decision == pb.ADMITTED


def test_retry_after_counts_only_aging_of_current_amounts(harness: Any) -> None:
    start = harness.START_US
    harness.make_lane(limit_nanos=10_000, window_seconds=3600)
    big = {"request_bytes": BIG_BYTES}
    harness.reserve("a", estimate_nanos=1_000, **big)
    harness.settle("a", input_tokens=1_000)  # 100 nanos now
    harness.advance_us(SECOND_US)
    harness.reserve("b", estimate_nanos=8_000, **big)
    harness.advance_us(SECOND_US)
    denied = harness.reserve("c", estimate_nanos=2_001, **big)
    # Available 1_900, 101 more needed: "a" frees only its 100 (not its old 1_000
    # hold), so "b" must age out too.
    assert denied.balance.available_nanos == 1_900
    assert harness.micros_of(denied.retry_after) == start + SECOND_US + 3600 * SECOND_US


def test_a_hold_above_the_limit_is_denied_without_retry_after(harness: Any) -> None:
    harness.make_lane(limit_nanos=1_000)
    denied = harness.reserve("huge", request_bytes=BIG_BYTES)
    assert denied.decision == pb.DENIED
    assert denied.denial_reason == pb.HOLD_EXCEEDS_LIMIT
    assert not denied.HasField("retry_after")
    assert denied.reason
    assert denied.hold_nanos == denied.cap_nanos == 8_772
    assert denied.balance.spent_nanos == 0


# Expiry ---------------------------------------------------------------------------


def test_expiry_is_exact_at_the_deadline_without_the_sweeper(unswept: Any) -> None:
    start = unswept.START_US
    unswept.reserve("r1", estimate_nanos=300, request_bytes=BIG_BYTES, ttl_us=30 * SECOND_US)
    unswept.set_time_us(start + 30 * SECOND_US - 1)
    assert unswept.booking("r1").state == pb.OPEN
    balance = unswept.balance()
    assert (balance.held_nanos, balance.charged_nanos, balance.open_bookings) == (300, 0, 1)

    unswept.set_time_us(start + 30 * SECOND_US)
    booking = unswept.booking("r1")
    assert (booking.state, booking.amount_nanos) == (pb.EXPIRED, 300)
    balance = unswept.balance()
    assert (balance.held_nanos, balance.charged_nanos, balance.open_bookings) == (0, 300, 0)
    assert not unswept.events("recall", kinds=["expired"]), "the sweeper was not to run"


def test_expire_charge_zero_costs_nothing_at_the_deadline(unswept: Any) -> None:
    unswept.make_lane(expire_charge=pb.ZERO)
    unswept.reserve("r1", request_bytes=BIG_BYTES, ttl_us=30 * SECOND_US)
    unswept.set_time_us(unswept.START_US + 30 * SECOND_US)
    booking = unswept.booking("r1")
    assert (booking.state, booking.amount_nanos) == (pb.EXPIRED, 0)
    assert unswept.balance().spent_nanos == 0


def test_after_expiry_unknown_changes_nothing(unswept: Any) -> None:
    unswept.reserve("r1", estimate_nanos=300, request_bytes=BIG_BYTES, ttl_us=30 * SECOND_US)
    unswept.set_time_us(unswept.START_US + 31 * SECOND_US)
    answer = unswept.settle("r1", pb.UNKNOWN, billed_nanos=5)
    assert (answer.charged_nanos, answer.state) == (300, pb.EXPIRED)
    assert answer.balance.charged_nanos == 300
    kinds = [event.kind for event in unswept.events("recall", reservation_id="r1")]
    assert kinds == ["reserved", "expired"]


def test_after_expiry_refund_zeroes_the_charge(unswept: Any) -> None:
    unswept.reserve("r1", estimate_nanos=300, request_bytes=BIG_BYTES, ttl_us=30 * SECOND_US)
    unswept.set_time_us(unswept.START_US + 31 * SECOND_US)
    assert unswept.refund("r1", 403).balance.spent_nanos == 0
    booking = unswept.booking("r1")
    assert (booking.state, booking.amount_nanos) == (pb.REFUNDED, 0)


def test_after_expiry_a_late_success_replaces_the_charge(unswept: Any) -> None:
    unswept.reserve("r1", estimate_nanos=300, request_bytes=BIG_BYTES, ttl_us=30 * SECOND_US)
    unswept.set_time_us(unswept.START_US + 31 * SECOND_US)
    corrected = unswept.settle("r1", input_tokens=4_000, output_tokens=10)
    assert (corrected.charged_nanos, corrected.state) == (400 + 4, pb.SETTLED)
    assert unswept.balance().charged_nanos == 404
    (expired, settled) = unswept.events("recall", kinds=["expired", "settled"])
    assert (expired.previous_amount_nanos, expired.amount_nanos) == (300, 300)
    assert (settled.previous_amount_nanos, settled.amount_nanos) == (300, 404)


def test_the_sweeper_records_expiry_at_its_first_sweep_past_the_deadline(
    harness: Any, server: LedgerServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within a second, as the contract says, because it sweeps every second
    (here every 50 ms): the first sweep that begins once a hold's deadline has
    passed records its expiry, and none before it does."""
    sweeps = Sweeps(server, monkeypatch)
    start = harness.START_US
    harness.make_lane("zero", expire_charge=pb.ZERO)
    harness.reserve("hold", estimate_nanos=300, request_bytes=BIG_BYTES, ttl_us=5 * SECOND_US)
    harness.reserve("zero", lane="zero", request_bytes=BIG_BYTES, ttl_us=5 * SECOND_US)

    harness.advance_us(5 * SECOND_US - 1)
    sweeps.wait_for_new(4)  # none may expire a hold before its deadline
    assert not harness.events("", kinds=["expired"])

    harness.advance_us(1)
    sweeps.wait_for_new(1)
    (held,) = harness.events("recall", kinds=["expired"])
    assert (held.reservation_id, held.previous_amount_nanos, held.amount_nanos) == (
        "hold",
        300,
        300,
    )
    assert harness.micros_of(held.occurred_at) == start + 5 * SECOND_US
    assert harness.micros_of(held.reserved_at) == start
    (zeroed,) = harness.events("zero", kinds=["expired"])
    assert (zeroed.previous_amount_nanos, zeroed.amount_nanos) == (8_772, 0)
    assert harness.booking("hold").state == pb.EXPIRED
    assert harness.balance().charged_nanos == 300
    assert harness.balance("zero").spent_nanos == 0


# The policy a booking keeps ----------------------------------------------------------


def test_a_booking_keeps_the_policy_it_was_reserved_under(unswept: Any) -> None:
    start = unswept.START_US
    unswept.reserve("old-settled", request_bytes=BIG_BYTES)
    unswept.reserve("old-open", estimate_nanos=700, request_bytes=BIG_BYTES)
    unswept.make_lane(
        prices={"jev": (1_000_000, 4_000_000)}, hold_ttl_seconds=60, expire_charge=pb.ZERO
    )
    # Old prices: 4_000 tokens in at 0.1 nano, 10 out at 0.4 nano.
    assert unswept.settle("old-settled", input_tokens=4_000, output_tokens=10).charged_nanos == 404
    new = unswept.reserve("new", request_bytes=10_000, max_output_tokens=500)
    assert new.cap_nanos == 2_858 + 2_000
    assert unswept.micros_of(new.expires_at) == start + 60 * SECOND_US
    # The old hold keeps its 120 s ttl and its HOLD expire charge.
    unswept.set_time_us(start + 60 * SECOND_US)
    assert unswept.booking("old-open").state == pb.OPEN
    unswept.set_time_us(start + 120 * SECOND_US)
    booking = unswept.booking("old-open")
    assert (booking.state, booking.amount_nanos) == (pb.EXPIRED, 700)
    assert unswept.booking("new").amount_nanos == 0


def test_a_new_limit_applies_to_admissions_at_once(harness: Any) -> None:
    harness.reserve("a", estimate_nanos=5_000, request_bytes=BIG_BYTES)
    harness.make_lane(limit_nanos=5_100)
    assert harness.balance().available_nanos == 100
    assert harness.reserve("b", estimate_nanos=101, request_bytes=BIG_BYTES).decision == pb.DENIED
    assert harness.reserve("c", estimate_nanos=100, request_bytes=BIG_BYTES).decision == pb.ADMITTED
    harness.make_lane(limit_nanos=4_000)
    balance = harness.balance()
    assert (balance.limit_nanos, balance.available_nanos) == (4_000, -1_100)
    assert harness.reserve("d", estimate_nanos=0).decision == pb.DENIED
    harness.make_lane(limit_nanos=6_000)
    assert harness.reserve("e", estimate_nanos=900, request_bytes=BIG_BYTES).decision == (
        pb.ADMITTED
    )


def test_a_new_window_applies_at_once_and_ages_out_at_says_so(harness: Any) -> None:
    start = harness.START_US
    harness.reserve("r1", estimate_nanos=300, request_bytes=BIG_BYTES)
    harness.settle("r1", pb.UNKNOWN)
    harness.make_lane(window_seconds=3_600)
    # The window is the lane's, not the booking's: spent follows the new one...
    harness.set_time_us(start + 3_600 * SECOND_US - 1)
    assert harness.balance().spent_nanos == 300
    harness.set_time_us(start + 3_600 * SECOND_US)
    assert harness.balance().spent_nanos == 0
    # ...and so does the instant the booking reports it leaves the window.
    assert harness.micros_of(harness.booking("r1").ages_out_at) == start + 3_600 * SECOND_US


def test_the_test_clock_stays_exactly_where_it_was_set(harness: Any) -> None:
    instant = harness.START_US + 987_654_321
    assert harness.set_time_us(instant) == instant
    time.sleep(0.05)
    assert harness.now_us() == instant
    assert harness.advance_us(1) == instant + 1
    assert harness.micros_of(harness.balance().as_of) == instant + 1


def test_a_restarted_test_clock_resumes_no_earlier_than_the_last_event(
    tmp_path: pathlib.Path, harness_for: Any, open_ledger_channel: Any
) -> None:
    """The test clock starts at wall time; after a restart that would put the
    ledger's time before what it recorded, and a future-dated hold would stop
    counting. It resumes at the last recorded event instead."""
    settings = ledger_settings(tmp_path, sweep_interval_seconds=3600)
    first = LedgerServer(settings)
    first.start()
    try:
        harness = harness_for(first)
        harness.make_lane()
        held = harness.reserve("r1").hold_nanos
        recorded_at = harness.now_us()
    finally:
        first.stop(0)
    assert recorded_at > time.time() * 1_000_000, "the clock must be ahead of the wall here"
    second = LedgerServer(settings)
    second.start()
    try:
        channel = open_ledger_channel(second)
        now = pb_grpc.TestClockStub(channel).GetTime(empty_pb2.Empty(), timeout=30)
        assert harness.micros_of(now) == recorded_at
        balance = pb_grpc.LedgerStub(channel).GetBalance(
            pb.GetBalanceRequest(lane="recall"), timeout=30
        )
        assert balance.held_nanos == held
    finally:
        second.stop(0)


# A server's own clock stepped back ------------------------------------------------
#
# A server without --test-clock reads the system clock, which NTP or a resumed
# virtual machine may step back. A ManualClock passed in as that clock stands
# for it here: the server does not serve it, the test moves it.


def _one_of_one_and_a_half_holds(harness: Any) -> pb.ReserveResponse:
    """A lane whose limit fits one and a half holds, and its first Reserve."""
    harness.make_lane(limit_nanos=CAP_10K_500 + CAP_10K_500 // 2)
    booked = harness.reserve("r1")
    assert booked.decision == pb.ADMITTED
    return booked


def _second_denied_no_earlier(harness: Any, booked: pb.ReserveResponse) -> None:
    again = harness.reserve("r2")
    assert again.decision == pb.DENIED, "the lane was booked past its limit"
    assert harness.micros_of(again.reserved_at) >= harness.micros_of(booked.reserved_at)


def _booked_then_stepped_back(
    settings: Any, harness_for: Any
) -> tuple[ManualClock, pb.ReserveResponse]:
    """A server whose clock stands ten seconds ahead books one hold and stops;
    then its clock steps back ten seconds."""
    system = ManualClock(START_US + 10 * SECOND_US)
    first = LedgerServer(settings, clock=system)
    first.start()
    try:
        booked = _one_of_one_and_a_half_holds(harness_for(first))
    finally:
        first.stop(0)
    system.set_us(START_US)  # stepped back ten seconds
    return system, booked


def test_a_restart_behind_the_last_event_still_counts_it(
    tmp_path: pathlib.Path, harness_for: Any
) -> None:
    """Restarted with its clock behind a booking it recorded, a server must
    not date a Reserve before it: the booking would fall out of the window
    (reserved_at <= now) and the lane would be booked past its limit."""
    settings = ledger_settings(tmp_path, test_clock=False, sweep_interval_seconds=3600)
    system, booked = _booked_then_stepped_back(settings, harness_for)
    second = LedgerServer(settings, clock=system)
    second.start()
    try:
        harness = harness_for(second)
        assert harness.balance().held_nanos == CAP_10K_500
        _second_denied_no_earlier(harness, booked)
    finally:
        second.stop(0)


def test_a_clock_stepped_back_while_serving_never_dates_a_move_earlier(
    tmp_path: pathlib.Path, harness_for: Any
) -> None:
    """A put drops the lane's kept window; a clock stepped back after it must
    still not date the next Reserve before the bookings already recorded."""
    settings = ledger_settings(tmp_path, test_clock=False, sweep_interval_seconds=3600)
    system = ManualClock(START_US + 10 * SECOND_US)
    server = LedgerServer(settings, clock=system)
    server.start()
    try:
        harness = harness_for(server)
        booked = _one_of_one_and_a_half_holds(harness)
        system.set_us(START_US)  # stepped back ten seconds
        harness.make_lane(limit_nanos=CAP_10K_500 + CAP_10K_500 // 2 + 1)
        _second_denied_no_earlier(harness, booked)
    finally:
        server.stop(0)


def test_a_start_the_database_did_not_answer_resumes_its_clock_once_it_does(
    tmp_path: pathlib.Path, harness_for: Any
) -> None:
    """A server whose database was locked by another process at start could not
    read its last event then; once the database answers, its clock must still
    resume there before it takes a move."""
    settings = ledger_settings(
        tmp_path, test_clock=False, sweep_interval_seconds=3600,
        recovery_check_interval_seconds=0.05,
    )  # fmt: skip
    system, booked = _booked_then_stepped_back(settings, harness_for)
    holder = sqlite3.connect(tmp_path / "ledger.db", isolation_level=None)
    # The database does not answer this start: no other connection may even read.
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        second = LedgerServer(settings, clock=system)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    second.start()
    try:
        deadline = time.monotonic() + 30
        while not second.guard.is_ready():
            assert time.monotonic() < deadline, "the server never became ready"
            time.sleep(0.02)
        _second_denied_no_earlier(harness_for(second), booked)
    finally:
        second.stop(0)


def test_verify_sums_the_windows_at_the_ledgers_time_not_before_its_last_event(
    tmp_path: pathlib.Path, harness_for: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ledger ahead of the wall clock (a clock stepped back, a test clock run
    forward): verify summed the windows at the wall's now, before every
    booking, where they hold nothing, and so checked nothing."""
    settings = ledger_settings(tmp_path, test_clock=False, sweep_interval_seconds=3600)
    ahead_us = SystemClock().now_us() + 86_400 * SECOND_US
    server = LedgerServer(settings, clock=ManualClock(ahead_us))
    server.start()
    try:
        booked = _one_of_one_and_a_half_holds(harness_for(server))
    finally:
        server.stop(0)
    capsys.readouterr()
    assert cli.main(["verify", "--database-url", settings.database_url]) == 0
    shown = render.micros_time_text(booked.reserved_at.ToMicroseconds())
    assert f"window totals at {shown}: OK" in capsys.readouterr().out
