"""Peers that open calls and never finish sending the request (a slow loris).

A grpcio client calling a one-message method as a request stream sends the
call's headers, then whatever its request iterator yields: an iterator that
blocks sends nothing more, one that is empty ends the request with no message.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import grpc
import pytest

from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from tests.security.conftest import HOME_LANE, SecureLedger

BALANCE = "/ledger.v1.Ledger/GetBalance"
WATCH = "/ledger.v1.Ledger/WatchEvents"
# More stalled calls than the pool has threads (Settings.rpc_threads).
STALLED_CALLS = 12
CALL_SECONDS = 10.0


def _never(release: threading.Event) -> Iterator[bytes]:
    release.wait()
    yield from ()


def test_stalled_requests_do_not_starve_other_callers(
    start_secure_ledger: Callable[..., SecureLedger],
) -> None:
    # A pool of 6 threads, and a bound on a request's arrival far beyond the
    # calls' deadlines: only the pressure of calls waiting frees the threads.
    ledger = start_secure_ledger(
        max_workers=2, max_watchers=1, max_calls_per_grant=1, request_arrival_seconds=600.0
    )
    address = f"127.0.0.1:{ledger.server.port}"
    release = threading.Event()
    with grpc.insecure_channel(address) as flooding, grpc.insecure_channel(address) as other:
        stalled = [
            flooding.stream_unary(BALANCE).future(
                _never(release), metadata=ledger.admin, timeout=CALL_SECONDS * 3
            )
            for _ in range(STALLED_CALLS)
        ]
        balance = other.unary_unary(
            BALANCE,
            request_serializer=pb.GetBalanceRequest.SerializeToString,
            response_deserializer=pb.Balance.FromString,
        )
        # Before the bound on waiting calls, this waited for a thread until its deadline.
        answer = balance(
            pb.GetBalanceRequest(lane=HOME_LANE), metadata=ledger.admin, timeout=CALL_SECONDS
        )
        assert answer.lane == HOME_LANE
        release.set()
        codes = {call.exception().code() for call in stalled if call.exception() is not None}
        assert grpc.StatusCode.CANCELLED in codes, codes


def _after(release: threading.Event, request: bytes) -> Iterator[bytes]:
    release.wait()
    yield request


def test_slow_requests_are_not_cancelled_while_threads_are_free(
    start_secure_ledger: Callable[..., SecureLedger],
) -> None:
    """More calls than max_workers whose messages are still on their way (1 MiB
    over a slow link) while the pool has threads to spare: the pressure rule
    cancelled every one past max_workers after 0.2 s (37 of 120 such
    reconciles on one connection at a 0.2 s round trip)."""
    ledger = start_secure_ledger(max_workers=2, max_watchers=16, request_arrival_seconds=600.0)
    release = threading.Event()
    request = pb.GetBalanceRequest(lane=HOME_LANE).SerializeToString()
    with grpc.insecure_channel(f"127.0.0.1:{ledger.server.port}") as channel:
        slow = [
            channel.stream_unary(BALANCE).future(
                _after(release, request), metadata=ledger.admin, timeout=CALL_SECONDS
            )
            for _ in range(8)
        ]
        # Long past PRESSED_ARRIVAL_SECONDS: the watchman has looked several times.
        release.wait(1.0)
        release.set()
        codes = [call.exception(timeout=CALL_SECONDS) for call in slow]
    assert codes == [None] * len(slow), codes


def test_stalled_request_is_cancelled_at_the_arrival_bound(
    start_secure_ledger: Callable[..., SecureLedger],
) -> None:
    ledger = start_secure_ledger(request_arrival_seconds=0.5)
    release = threading.Event()
    with grpc.insecure_channel(f"127.0.0.1:{ledger.server.port}") as channel:
        call = channel.stream_unary(BALANCE).future(
            _never(release), metadata=ledger.admin, timeout=CALL_SECONDS
        )
        error = call.exception(timeout=CALL_SECONDS)
        release.set()
    assert error is not None
    assert error.code() is grpc.StatusCode.CANCELLED, error


def test_request_without_a_message_is_invalid_argument(
    start_secure_ledger: Callable[..., SecureLedger],
) -> None:
    """grpcio answered UNIMPLEMENTED ('requires exactly one request message')."""
    ledger = start_secure_ledger()
    with grpc.insecure_channel(f"127.0.0.1:{ledger.server.port}") as channel:
        for path, call in (
            (BALANCE, channel.stream_unary(BALANCE)),
            (WATCH, channel.stream_stream(WATCH)),
        ):
            try:
                answer = call(iter(()), metadata=ledger.admin, timeout=CALL_SECONDS)
                list(answer) if path == WATCH else None
            except grpc.RpcError as error:
                assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, (path, error)
                reasons = dict(error.trailing_metadata() or ())
                assert reasons.get("ledger-reason") == "UNDECODABLE_REQUEST", (path, reasons)
            else:
                raise AssertionError(f"{path}: a call with no request message was answered")
    assert ledger.event_count() == 2  # the two lanes put at start, nothing more


def test_request_cut_off_by_its_deadline_logs_no_error(
    start_secure_ledger: Callable[..., SecureLedger], caplog: pytest.LogCaptureFixture
) -> None:
    """A call cancelled while its request was awaited answered None, which
    grpcio logged as 'Exception serializing message!' with a traceback."""
    ledger = start_secure_ledger()
    release = threading.Event()
    with grpc.insecure_channel(f"127.0.0.1:{ledger.server.port}") as channel:
        call = channel.stream_unary(BALANCE).future(
            _never(release), metadata=ledger.admin, timeout=0.2
        )
        error = call.exception(timeout=CALL_SECONDS)
        release.set()
    assert error is not None and error.code() is grpc.StatusCode.DEADLINE_EXCEEDED, error
    assert ledger.server.stop(CALL_SECONDS)  # every call's handler has ended
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert errors == [], [record.getMessage() for record in errors]


def test_a_stop_keeps_the_arrival_bound_for_calls_still_waiting(
    start_secure_ledger: Callable[..., SecureLedger],
) -> None:
    """The watch was closed as the stop began, so a call still waiting for its
    request held the stop for the whole grace period (5 s after a SIGTERM,
    not the 2 s bound). Here the grace (60 s) is far past the wait for the
    call's end (10 s), and the bound (0.5 s) far inside it."""
    ledger = start_secure_ledger(request_arrival_seconds=0.5)
    release = threading.Event()
    with grpc.insecure_channel(f"127.0.0.1:{ledger.server.port}") as channel:
        call = channel.stream_unary(BALANCE).future(
            _never(release), metadata=ledger.admin, timeout=CALL_SECONDS * 9
        )
        stopping = threading.Thread(target=ledger.server.stop, args=(CALL_SECONDS * 6,))
        stopping.start()
        try:
            error = call.exception(timeout=CALL_SECONDS)
        finally:
            release.set()
            stopping.join()
    # Ended by the bound: cancelled, or cut off as the stop closed its connection.
    assert error is not None
    assert error.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE), error


def test_a_call_the_watch_cancelled_ends_with_its_abort_not_a_key_error() -> None:
    """The watch forgets a late call when it cancels it; the call's own end
    must not fail on finding it gone (a KeyError and a traceback in the log)."""
    from ledger_service.api.arrival import ArrivalWatch

    class Context:
        def __init__(self) -> None:
            self.cancelled = threading.Event()

        def cancel(self) -> None:
            self.cancelled.set()

        def abort(self, code: grpc.StatusCode, details: str) -> None:
            raise RuntimeError(code)

    class Cancelled(grpc.RpcError):
        pass

    context = Context()

    def requests() -> Iterator[object]:
        assert context.cancelled.wait(10), "the watch never cancelled the call"
        raise Cancelled()
        yield  # a generator

    watch = ArrivalWatch(arrival_seconds=0.01, max_waiting=100, threads=1)
    try:
        with pytest.raises(RuntimeError) as ended:
            watch.first_request(requests(), context)  # type: ignore[arg-type]
        assert ended.value.args == (grpc.StatusCode.CANCELLED,)
    finally:
        watch.close()
