"""The drain (api/drain.py), without a server: a call in its handler runs to its
answer, a call after the drain began is held and then refused with
SHUTTING_DOWN once released (or near its own deadline), and the drain ends
when the last running call does, or at its deadline."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import grpc
import pytest

from ledger_service.api import drain as drain_module
from ledger_service.api.drain import HOLD_MARGIN_SECONDS, SETTLE_SECONDS, Drain
from ledger_service.application.throttle import ERROR_LOG_INTERVAL_SECONDS
from ledger_service.domain.errors import ShuttingDown

# How long a test waits for what must happen (a thread to start, a call to be
# answered): generous, as a loaded machine may be slow; passing tests never
# wait it out. A running call is held this long too, so that it is still
# running whenever the test looks, however late that is.
WAIT_SECONDS = 30.0


class Details(grpc.HandlerCallDetails):  # type: ignore[misc]
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


def _behaviour(drain: Drain, method: str, body: Any) -> Any:
    handler = grpc.unary_unary_rpc_method_handler(body)
    wrapped = drain.intercept_service(lambda _details: handler, Details(method))
    assert wrapped is not None
    return wrapped.unary_unary


def _slow_reserve(drain: Drain) -> tuple[Any, threading.Event, threading.Event]:
    """A Reserve that answers once released; set `entered` once running."""
    entered, release = threading.Event(), threading.Event()

    def slow(_request: Any, _context: Any) -> str:
        entered.set()
        release.wait(WAIT_SECONDS)
        return "answered"

    return _behaviour(drain, "/ledger.v1.Ledger/Reserve", slow), entered, release


def _running_reserve(drain: Drain) -> tuple[Any, threading.Thread, threading.Event]:
    """A slow Reserve started in its own thread and running: the call (to
    make again), the thread, and the event that releases it."""
    call, entered, release = _slow_reserve(drain)
    running = threading.Thread(target=call, args=(None, None))
    running.start()
    assert entered.wait(WAIT_SECONDS)
    return call, running, release


def test_a_running_call_is_answered_and_a_later_one_refused() -> None:
    drain = Drain()
    call, entered, release = _slow_reserve(drain)
    answers: list[str] = []
    running = threading.Thread(target=lambda: answers.append(call(None, None)))
    running.start()
    assert entered.wait(WAIT_SECONDS)
    left: list[int] = []
    draining = threading.Thread(target=lambda: left.append(drain.drain(time.monotonic() + 30)))
    draining.start()
    _until_draining(drain)
    refused: list[BaseException] = []
    context = Context(NO_DEADLINE_SECONDS)
    later = threading.Thread(target=lambda: _refusal(call, context, refused))
    later.start()
    assert context.asked.wait(WAIT_SECONDS)  # the drain has it
    later.join(SETTLE_SECONDS * 2)
    assert later.is_alive()  # held, not answered: its client sends nothing more
    assert draining.is_alive()  # still waiting for the running call
    release.set()
    running.join(WAIT_SECONDS)
    draining.join(WAIT_SECONDS)
    assert answers == ["answered"]
    assert left == [0]
    assert later.is_alive()  # held until grpcio takes no more calls
    drain.release()
    later.join(WAIT_SECONDS)
    assert [type(error) for error in refused] == [ShuttingDown]
    with pytest.raises(ShuttingDown):  # once released, at once
        call(None, None)


# grpcio's time remaining for a call sent without a deadline.
NO_DEADLINE_SECONDS = float(2**63)


class Context:
    def __init__(self, remaining_seconds: float) -> None:
        self.remaining_seconds = remaining_seconds
        # Set once the drain has asked: the call reached it and is held, so a
        # test that sees the call still running has not merely looked too soon.
        self.asked = threading.Event()

    def time_remaining(self) -> float:
        self.asked.set()
        return self.remaining_seconds


def _until_draining(drain: Drain) -> None:
    """Waits until the drain holds new calls (one with no time left is then
    refused at once, not run): its thread may start late on a loaded machine."""
    probe = _behaviour(drain, "/ledger.v1.Ledger/Reserve", lambda _r, _c: "ran")
    give_up = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < give_up:
        try:
            probe(None, Context(0.0))
        except ShuttingDown:
            return
        time.sleep(0.005)
    raise AssertionError("the drain did not begin")


def _refusal(call: Any, context: Any, refused: list[BaseException]) -> None:
    try:
        call(None, context)
    except BaseException as error:
        refused.append(error)


def test_a_held_call_is_refused_before_its_own_deadline() -> None:
    drain = Drain()
    drain.drain(time.monotonic())
    call = _behaviour(drain, "/ledger.v1.Ledger/Reserve", lambda _r, _c: "booked")
    began = time.monotonic()
    refused: list[BaseException] = []
    _refusal(call, Context(0.3), refused)
    assert [type(error) for error in refused] == [ShuttingDown]
    # Held until HOLD_MARGIN_SECONDS before its deadline, not refused at once.
    assert time.monotonic() - began >= 0.3 - HOLD_MARGIN_SECONDS - 0.01


def test_health_is_neither_counted_nor_refused() -> None:
    drain = Drain()
    drain.drain(time.monotonic())
    check = _behaviour(drain, "/grpc.health.v1.Health/Check", lambda _r, _c: "serving?")
    assert check(None, None) == "serving?"


def test_the_deadline_ends_a_drain_and_says_how_many_were_cut_off() -> None:
    drain = Drain()
    entered, release = threading.Event(), threading.Event()

    def stuck(_request: Any, _context: Any) -> None:
        entered.set()
        release.wait(WAIT_SECONDS)

    call = _behaviour(drain, "/ledger.v1.Ledger/Settle", stuck)
    running = threading.Thread(target=call, args=(None, None))
    running.start()
    assert entered.wait(WAIT_SECONDS)
    began = time.monotonic()
    # One still running: the drain ended at its deadline, not when the call did.
    assert drain.drain(began + 0.3) == 1
    assert time.monotonic() - began >= 0.3
    release.set()
    running.join(WAIT_SECONDS)


def test_the_drain_settles_after_the_last_call_ends_not_only_after_it_began() -> None:
    """The last running call's client may resend the instant it is answered:
    the drain waits SETTLE_SECONDS after that answer, so the resend is held
    rather than met by grpcio's stop."""
    drain = Drain()
    _, running, release = _running_reserve(drain)
    ended: list[float] = []
    draining = threading.Thread(
        target=lambda: (drain.drain(time.monotonic() + 30), ended.append(time.monotonic()))
    )
    draining.start()
    _until_draining(drain)
    # The drain began at least this long before the answer: settling from its
    # beginning alone would end it at once.
    time.sleep(SETTLE_SECONDS * 2)
    answered = time.monotonic()
    release.set()
    running.join(WAIT_SECONDS)
    draining.join(WAIT_SECONDS)
    assert ended and ended[0] - answered >= SETTLE_SECONDS * 0.9, ended[0] - answered


def test_hurry_ends_a_drain_at_once_and_says_how_many_were_cut_off() -> None:
    """A second stop signal: the drain returns without waiting for its deadline."""
    drain = Drain()
    _, running, release = _running_reserve(drain)
    left: list[int] = []
    draining = threading.Thread(
        target=lambda: left.append(drain.drain(time.monotonic() + 600)), daemon=True
    )
    draining.start()
    _until_draining(drain)  # hurried during the drain, not before it
    assert draining.is_alive()  # waiting for the running call
    drain.hurry()
    draining.join(WAIT_SECONDS)
    assert left == [1]
    release.set()
    running.join(WAIT_SECONDS)


def test_hurry_before_the_drain_begins_ends_it_at_once() -> None:
    """The second signal may be handled before the stop has begun to drain."""
    drain = Drain()
    call, running, release = _running_reserve(drain)
    drain.hurry()
    assert drain.drain(time.monotonic() + 600) == 1
    drain.release()
    with pytest.raises(ShuttingDown):  # later calls are still refused
        call(None, None)
    release.set()
    running.join(WAIT_SECONDS)


def test_a_held_call_without_a_deadline_is_refused_once_released() -> None:
    """grpcio gives a call without a deadline about 2^63 s remaining, past
    what a wait takes: it is held until released, then SHUTTING_DOWN."""
    drain = Drain()
    drain.drain(time.monotonic())
    call = _behaviour(drain, "/ledger.v1.Ledger/Reserve", lambda _r, _c: "booked")
    refused: list[BaseException] = []
    context = Context(NO_DEADLINE_SECONDS)
    held = threading.Thread(target=_refusal, args=(call, context, refused))
    held.start()
    assert context.asked.wait(WAIT_SECONDS)  # the drain has it
    held.join(SETTLE_SECONDS)
    assert held.is_alive()
    drain.release()
    held.join(WAIT_SECONDS)
    assert [type(error) for error in refused] == [ShuttingDown]


def test_held_calls_are_logged_once_an_interval_per_method(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An operator reads which methods still arrive at a stopping server; a
    flood of them is a line per method and interval, with a count, not a
    line a call."""
    drain = Drain()
    now = [1000.0]
    drain._held_log.clock = lambda: now[0]
    drain.drain(time.monotonic())
    drain.release()  # held calls are refused at once
    calls = {
        method: _behaviour(drain, f"/ledger.v1.Ledger/{method}", lambda _r, _c: "ran")
        for method in ("Reserve", "GetBalance")
    }

    def held(method: str, count: int) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=drain_module.log.name):
            for _ in range(count):
                with pytest.raises(ShuttingDown):
                    calls[method](None, Context(NO_DEADLINE_SECONDS))
        return [record.getMessage() for record in caplog.records]

    said = "holding a call that arrived while draining: /ledger.v1.Ledger/"
    assert held("Reserve", 40) == [f"{said}Reserve{HELD_TAIL}"]
    assert held("GetBalance", 3) == [f"{said}GetBalance{HELD_TAIL}"]
    now[0] += ERROR_LOG_INTERVAL_SECONDS
    assert held("Reserve", 5) == [f"{said}Reserve{HELD_TAIL} (and 39 more like it, not logged)"]


HELD_TAIL = "; it is refused SHUTTING_DOWN (safe to send again) once the server takes no more calls"
