"""Reconciles served at once are bounded (settings.max_concurrent_reconciles):
unbounded, every caller parsed its 10,000 rows and waited for the one writer
with them in memory, so 24 operators' reconciles at once took a server from
284 to 854 MiB, and 21 of the 24 still ran out of time."""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
import pytest

from ledger_service.api import servicers
from ledger_service.cli import reconcile
from ledger_service.cli.connection import Session
from ledger_service.domain.errors import LedgerError, TooManyCalls, TooManyReconciles
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.server import LedgerServer

CONTENT = b"reservation_id,lane,billed_nanos\nr-1,recall,1\n"
WAIT_SECONDS = 10.0


class _Peak:
    """Wraps reconcile_export: counts the calls inside it at once. Each is held
    there until `release` is set (by the test, or once `release_at` calls are
    inside), then `hold_seconds` more: a wait on the calls, not on a time, so
    that a thread that starts late on a loaded machine changes nothing."""

    def __init__(self, hold_seconds: float = 0.0, release_at: int | None = None) -> None:
        self.inside = 0
        self.peak = 0
        self.entered = threading.Event()
        self.release = threading.Event()
        self._lock = threading.Lock()
        self._hold = hold_seconds
        self._release_at = release_at
        self._real = servicers.reconcile_export

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.inside += 1
            self.peak = max(self.peak, self.inside)
            if self._release_at is not None and self.inside >= self._release_at:
                self.release.set()
        self.entered.set()
        try:
            self.release.wait(WAIT_SECONDS)
            time.sleep(self._hold)
            return self._real(*args, **kwargs)
        finally:
            with self._lock:
                self.inside -= 1


def _reconcile(stub: pb_grpc.LedgerStub) -> str:
    """A call's status, with its ledger-reason when refused."""
    request = pb.ReconcileRequest(format=pb.ReconcileRequest.CSV, content=CONTENT, dry_run=True)
    try:
        stub.Reconcile(request, timeout=30)
    except grpc.RpcError as error:
        reason = dict(error.trailing_metadata() or ()).get("ledger-reason", "")
        return f"{error.code().name} {reason}"
    return "OK"


def _reconcile_all(stub: pb_grpc.LedgerStub, count: int) -> list[str]:
    with futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda _: _reconcile(stub), range(count)))


def test_at_most_two_reconciles_run_at_once_by_default(
    server: LedgerServer,
    open_ledger_channel: Callable[[LedgerServer], grpc.Channel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    peak = _Peak(hold_seconds=0.2, release_at=2)
    monkeypatch.setattr(servicers, "reconcile_export", peak)
    stub = pb_grpc.LedgerStub(open_ledger_channel(server))
    codes = _reconcile_all(stub, 6)
    assert codes == ["OK"] * 6  # the others waited for their turn
    assert peak.peak == 2


def test_a_reconcile_without_a_turn_in_time_is_too_many_reconciles(
    start_ledger_server: Callable[..., LedgerServer],
    open_ledger_channel: Callable[[LedgerServer], grpc.Channel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = start_ledger_server(max_concurrent_reconciles=1, request_deadline_seconds=0.3)
    peak = _Peak()
    monkeypatch.setattr(servicers, "reconcile_export", peak)
    stub = pb_grpc.LedgerStub(open_ledger_channel(server))
    with futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(_reconcile, stub)
        assert peak.entered.wait(WAIT_SECONDS)  # the first has the only turn, and keeps it
        started = time.monotonic()
        second = _reconcile(stub)
        waited = time.monotonic() - started
        peak.release.set()
        assert first.result(WAIT_SECONDS) == "OK"
    # Not STORE_UNAVAILABLE ("the database is unavailable"): the database answered.
    assert second == "RESOURCE_EXHAUSTED TOO_MANY_RECONCILES"
    assert peak.peak == 1
    # It waited at most the request deadline (0.3 s here), not the default 5 s
    # nor its caller's 30 s; the margin is for a loaded machine.
    assert waited < 3.0, waited


class _Refused(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    """A failed call as the CLI receives it: code, details and trailers."""

    def __init__(self, code: grpc.StatusCode, details: str, reason: str) -> None:
        self._code, self._details, self._reason = code, details, reason

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("ledger-reason", self._reason),) if self._reason else ()

    def __getattr__(self, name: str) -> Any:  # grpc.Call's other methods: unused here
        raise AttributeError(name)


@pytest.mark.parametrize(
    ("refusal", "said_first"),
    [
        (TooManyReconciles(2), "2 reconciles are running"),
        # The operator's grant had its share of the server's calls running.
        (TooManyCalls(96), "this grant has 96 calls running"),
    ],
)
def test_the_cli_says_a_reconcile_refused_for_capacity_changed_nothing(
    refusal: LedgerError, said_first: str
) -> None:
    """RESOURCE_EXHAUSTED used to mean only an answer past the message limit,
    told as "the file may have applied": without a turn, or past the grant's
    share of calls, nothing was read."""
    session = Session("ledger:1", None, None, 5.0, ())  # type: ignore[arg-type]
    arguments = argparse.Namespace(file="export.csv", dry_run=False)
    said = reconcile._reconcile_failure(
        _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(refusal), refusal.reason),
        arguments,
        session,
    )
    assert "may have applied" not in said.message, said.message
    assert said_first in said.message, said.message
    assert refusal.reason in said.message, said.message
