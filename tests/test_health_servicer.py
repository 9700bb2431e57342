"""The health servicer against gRPC's threading: a watch's end runs on gRPC's
polling thread, and a send to a watcher waits for that thread to report the
send done. grpcio's stock servicer sent under the lock the end also takes, so
a status change (the database going away, a stop) that met a watch ending hung
the polling thread, and with it the whole server (seen at a test's teardown)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from grpc_health.v1 import health_pb2

from ledger_service.api.health import HealthServicer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
# How long a thread waits for another: generous, as a loaded machine may be
# slow. A passing test never waits it out; the hang it looks for does.
WAIT_SECONDS = 30.0


class _Context:
    """A call's context as far as Watch uses it: the callbacks run at its end."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []

    def add_callback(self, callback: Callable[[], None]) -> bool:
        self.callbacks.append(callback)
        return True

    def end(self) -> None:
        for callback in self.callbacks:
            callback()


def _watch(servicer: HealthServicer, service: str, send: Callable[[Any], None]) -> _Context:
    context = _Context()
    servicer.Watch(health_pb2.HealthCheckRequest(service=service), context, send)
    return context


def test_a_status_change_meeting_a_watch_that_ends_does_not_hang() -> None:
    servicer = HealthServicer(["ledger.v1.Ledger"])
    servicer.set("", SERVING)
    polled = threading.Event()
    sending = threading.Event()
    timed_out: list[str] = []

    def slow_send(response: Any) -> None:
        """Like gRPC's send: it returns once the polling thread reports it done."""
        if response is not None and response.status == NOT_SERVING:
            sending.set()
            if not polled.wait(WAIT_SECONDS):
                timed_out.append("the send waited on a polling thread that was stuck")

    _watch(servicer, "", slow_send)
    ending = _watch(servicer, "", lambda response: None)

    def polling_thread() -> None:
        if sending.wait(WAIT_SECONDS):
            ending.end()  # the other watch ends while the send waits
            polled.set()

    poller = threading.Thread(target=polling_thread, daemon=True)
    poller.start()
    servicer.set("", NOT_SERVING)
    poller.join(WAIT_SECONDS * 2)
    assert sending.is_set() and polled.is_set()  # the watch ended during the send
    assert timed_out == []


def test_watchers_see_each_change_in_order_and_nothing_is_kept_once_they_end() -> None:
    servicer = HealthServicer(["ledger.v1.Ledger"])
    seen: list[Any] = []
    context = _watch(servicer, "ledger.v1.Ledger", seen.append)
    servicer.set("ledger.v1.Ledger", SERVING)
    servicer.set("ledger.v1.Ledger", NOT_SERVING)
    context.end()
    servicer.set("ledger.v1.Ledger", SERVING)
    assert [r.status if r is not None else None for r in seen] == [
        UNKNOWN,
        SERVING,
        NOT_SERVING,
        None,
    ]
    assert servicer.watcher_count() == 0


def test_a_name_not_served_is_unknown_and_kept_nowhere() -> None:
    servicer = HealthServicer(["ledger.v1.Ledger"])
    seen: list[Any] = []
    context = _watch(servicer, "made.up", seen.append)
    assert servicer.watcher_count() == 0
    context.end()
    assert [r.status if r is not None else None for r in seen] == [UNKNOWN, None]


def test_after_a_graceful_shutdown_every_name_is_not_serving_for_good() -> None:
    servicer = HealthServicer(["ledger.v1.Ledger"])
    servicer.set("ledger.v1.Ledger", SERVING)
    seen: list[Any] = []
    _watch(servicer, "", seen.append)
    servicer.enter_graceful_shutdown()
    servicer.set("", SERVING)
    assert [r.status for r in seen] == [SERVING, NOT_SERVING]
    for name in ("", "ledger.v1.Ledger"):
        answer = servicer.Check(health_pb2.HealthCheckRequest(service=name), _Context())
        assert answer.status == NOT_SERVING
