"""The drain (api/drain.py), without a server: a call in its handler runs to its
answer, a call after the drain began is refused with SHUTTING_DOWN, and the
drain ends when the last running call does, or at its deadline."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import pytest

from ledger_service.api.drain import SETTLE_SECONDS, Drain
from ledger_service.domain.errors import ShuttingDown

WAIT_SECONDS = 5.0


class Details(grpc.HandlerCallDetails):  # type: ignore[misc]
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


def _behaviour(drain: Drain, method: str, body: Any) -> Any:
    handler = grpc.unary_unary_rpc_method_handler(body)
    wrapped = drain.intercept_service(lambda _details: handler, Details(method))
    assert wrapped is not None
    return wrapped.unary_unary


def test_a_running_call_is_answered_and_a_later_one_refused() -> None:
    drain = Drain()
    entered, release = threading.Event(), threading.Event()

    def slow(_request: Any, _context: Any) -> str:
        entered.set()
        release.wait(WAIT_SECONDS)
        return "answered"

    call = _behaviour(drain, "/ledger.v1.Ledger/Reserve", slow)
    answers: list[str] = []
    running = threading.Thread(target=lambda: answers.append(call(None, None)))
    running.start()
    assert entered.wait(WAIT_SECONDS)
    left: list[int] = []
    draining = threading.Thread(target=lambda: left.append(drain.drain(time.monotonic() + 30)))
    draining.start()
    time.sleep(SETTLE_SECONDS * 2)
    with pytest.raises(ShuttingDown):
        call(None, None)
    assert draining.is_alive()  # still waiting for the running call
    release.set()
    running.join(WAIT_SECONDS)
    draining.join(WAIT_SECONDS)
    assert answers == ["answered"]
    assert left == [0]


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
    assert drain.drain(began + 0.3) == 1
    assert 0.3 <= time.monotonic() - began < WAIT_SECONDS
    release.set()
    running.join(WAIT_SECONDS)
