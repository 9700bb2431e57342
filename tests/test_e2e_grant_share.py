"""One grant's share of the server's calls at once (docs/semantics.md, limits):
a lane that floods the server with calls held in flight, on as many
connections as it likes, gets `max_calls_per_grant` of them served and the
rest refused at once with RESOURCE_EXHAUSTED / TOO_MANY_CALLS, while another
lane's Reserve and the health check are still answered."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ledger_service.domain.clock import SystemClock
from ledger_service.domain.grants import Scope
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc
from ledger_service.server import LedgerServer
from ledger_service.settings import Settings
from tests.conftest import GrantInterceptor, lane_message

WAIT_SECONDS = 30.0
CALL_SECONDS = 60.0
HOUR_US = 3_600_000_000
_DEFAULTS = {field.name: field.default for field in dataclasses.fields(Settings)}
SHARE: int = _DEFAULTS["max_calls_per_grant"]  # type: ignore[assignment]
# The flood: more calls than one grant's share and the pool's threads, held in flight on
# three connections, since one connection carries at most 128 at once.
FLOOD_CONNECTIONS = 3
FLOOD_CALLS_PER_CONNECTION = 110


class HeldBalances:
    """Holds every GetBalance of the given lanes inside the server until
    released, counting those held: a call held there has passed every check
    and holds one of the server's threads, as a call waiting on a slow store
    does."""

    def __init__(self, server: LedgerServer, *lanes: str) -> None:
        self._balance = server.ledger.balance
        self._lanes = lanes
        self._changed = threading.Condition()
        self._released = False
        self.held = 0

    def balance(self, lane: str, *args: Any, **kwargs: Any) -> Any:
        if lane in self._lanes:
            with self._changed:
                self.held += 1
                self._changed.notify_all()
                self._changed.wait_for(lambda: self._released)
        return self._balance(lane, *args, **kwargs)

    def wait_for(self, predicate: Callable[[], bool]) -> bool:
        """Waits until `predicate()` (called under the lock, woken by each call
        held and by `notify`), at most WAIT_SECONDS; whether it came true."""
        with self._changed:
            return self._changed.wait_for(predicate, WAIT_SECONDS)

    def notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def release(self) -> None:
        with self._changed:
            self._released = True
            self._changed.notify_all()


def _grant(server: LedgerServer, *lanes: str) -> str:
    now_us = SystemClock().now_us()
    return server.keyring.issue(
        list(lanes), [Scope.CHARGE], issued_at_us=now_us, expires_at_us=now_us + HOUR_US
    )


@contextlib.contextmanager
def _connection(server: LedgerServer, grant: str) -> Iterator[grpc.Channel]:
    """A connection of its own (channels with the same arguments share one),
    every call carrying `grant`."""
    raw = grpc.insecure_channel(
        f"127.0.0.1:{server.port}", options=[("grpc.use_local_subchannel_pool", 1)]
    )
    try:
        yield grpc.intercept_channel(raw, GrantInterceptor(grant))
    finally:
        raw.close()


def _reason(error: BaseException) -> str:
    assert isinstance(error, grpc.Call), error
    return dict(error.trailing_metadata() or ()).get("ledger-reason", "")


def _reserve(lane: str, rid: str) -> pb.ReserveRequest:
    return pb.ReserveRequest(
        lane=lane, reservation_id=rid, model="jev", request_bytes=4_000, max_output_tokens=100
    )


class Flood:
    """GetBalances of flooding grants sent at once, each noted when answered."""

    def __init__(self, holding: HeldBalances) -> None:
        self.holding = holding
        self.calls: list[grpc.Future] = []
        self.answered: list[grpc.Future] = []

    def send(self, stub: pb_grpc.LedgerStub, lane: str, calls: int) -> None:
        for _ in range(calls):
            call = stub.GetBalance.future(pb.GetBalanceRequest(lane=lane), timeout=CALL_SECONDS)
            call.add_done_callback(self._on_answer)
            self.calls.append(call)

    def _on_answer(self, call: grpc.Future) -> None:
        self.answered.append(call)
        self.holding.notify()

    def settled(self) -> bool:
        """Waits until every call sent is held in the server or answered (none
        waits behind the held ones for a thread); whether that came."""
        holding = self.holding
        return holding.wait_for(lambda: holding.held + len(self.answered) == len(self.calls))

    def refusals(self) -> list[BaseException | None]:
        """The answered calls' errors, each asserted to be TOO_MANY_CALLS."""
        refused = [call.exception() for call in self.answered]
        assert {error.code() for error in refused if error is not None} == {  # type: ignore[attr-defined]
            grpc.StatusCode.RESOURCE_EXHAUSTED
        }
        assert {_reason(error) for error in refused if error is not None} == {"TOO_MANY_CALLS"}
        assert all(error is not None for error in refused)
        return refused

    def release(self) -> None:
        self.holding.release()
        for call in self.calls:
            call.exception()


def _calm_lane_served(server: LedgerServer, stack: contextlib.ExitStack) -> None:
    """The calm lane's Reserve is admitted and health says SERVING, each
    within a deadline far shorter than the flood is held."""
    calm = stack.enter_context(_connection(server, _grant(server, "calm")))
    reserved = pb_grpc.LedgerStub(calm).Reserve(_reserve("calm", "c1"), timeout=5)
    assert reserved.decision == pb.ADMITTED
    health = health_pb2_grpc.HealthStub(calm).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_a_flooding_lane_leaves_another_lanes_reserve_and_health_served(
    start_ledger_server: Callable[..., LedgerServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = start_ledger_server()
    holding = HeldBalances(server, "flood")
    monkeypatch.setattr(server.ledger, "balance", holding.balance)
    with contextlib.ExitStack() as stack:
        admin = pb_grpc.LaneAdminStub(stack.enter_context(_connection(server, server.admin_grant)))
        for lane in ("flood", "calm"):
            admin.PutLane(pb.PutLaneRequest(lane=lane_message(lane)), timeout=CALL_SECONDS)
        flood_grant = _grant(server, "flood")
        flood = Flood(holding)
        try:
            for _ in range(FLOOD_CONNECTIONS):
                stub = pb_grpc.LedgerStub(stack.enter_context(_connection(server, flood_grant)))
                flood.send(stub, "flood", FLOOD_CALLS_PER_CONNECTION)
            settled = flood.settled()
            _calm_lane_served(server, stack)
            assert settled, (holding.held, len(flood.answered), len(flood.calls))
            assert holding.held == SHARE
            # The rest were refused at once, by the share: none by gRPC's total.
            assert len(flood.refusals()) == len(flood.calls) - SHARE
        finally:
            flood.release()
        # The held ones were served once released.
        assert sum(call.exception() is None for call in flood.calls) == SHARE


def test_a_grant_has_its_share_and_not_one_call_more(
    start_ledger_server: Callable[..., LedgerServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The boundary: `share` calls of one grant run, the next is refused at
    once and changes nothing; another grant's calls, the operator's, streams
    and health are not counted in it; a call that ends gives its place back."""
    share = 3
    server = start_ledger_server(max_calls_per_grant=share)
    holding = HeldBalances(server, "flood")
    monkeypatch.setattr(server.ledger, "balance", holding.balance)
    with contextlib.ExitStack() as stack:
        operator = stack.enter_context(_connection(server, server.admin_grant))
        for lane in ("flood", "calm"):
            pb_grpc.LaneAdminStub(operator).PutLane(
                pb.PutLaneRequest(lane=lane_message(lane)), timeout=CALL_SECONDS
            )
        flood = pb_grpc.LedgerStub(
            stack.enter_context(_connection(server, _grant(server, "flood")))
        )
        held = [
            flood.GetBalance.future(pb.GetBalanceRequest(lane="flood"), timeout=CALL_SECONDS)
            for _ in range(share)
        ]
        try:
            assert holding.wait_for(lambda: holding.held == share)
            with pytest.raises(grpc.RpcError) as refused:
                flood.Reserve(_reserve("flood", "f1"), timeout=CALL_SECONDS)
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
            assert _reason(refused.value) == "TOO_MANY_CALLS"
            assert f"this grant has {share} calls running" in refused.value.details()  # type: ignore[attr-defined]
            # A stream of the same grant is counted in the feed's share, not this one.
            watch = flood.WatchEvents(pb.WatchEventsRequest(lane="flood"), timeout=CALL_SECONDS)
            assert watch.initial_metadata() is not None
            watch.cancel()
            calm = stack.enter_context(_connection(server, _grant(server, "calm")))
            answer = pb_grpc.LedgerStub(calm).Reserve(_reserve("calm", "c1"), timeout=CALL_SECONDS)
            assert answer.decision == pb.ADMITTED
            assert (
                pb_grpc.LedgerStub(operator)
                .GetBalance(pb.GetBalanceRequest(lane="calm"), timeout=CALL_SECONDS)
                .lane
                == "calm"
            )
            health = health_pb2_grpc.HealthStub(calm).Check(
                health_pb2.HealthCheckRequest(), timeout=CALL_SECONDS
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            holding.release()
            for call in held:
                call.exception()
        assert [call.exception() for call in held] == [None] * share
        # Their places are back: the refused Reserve, sent again, is admitted (nothing was booked).
        assert flood.Reserve(_reserve("flood", "f1"), timeout=CALL_SECONDS).decision == pb.ADMITTED
    assert server.call_shares.running() == 0


def test_three_flooding_lanes_leave_a_fourth_lanes_reserve_and_health_served(
    start_ledger_server: Callable[..., LedgerServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Grants' floods whose calls never end took every thread of the pool
    (two shares were past max_workers + max_watchers + one share): a calm
    lane's Reserve waited for a thread until its deadline. Now two floods
    have their whole shares, a third a calm grant's few, and the last places
    of the grants' total are kept for grants running few calls."""
    share = 8
    server = start_ledger_server(max_workers=4, max_watchers=1, max_calls_per_grant=share)
    lanes = ("flood-a", "flood-b", "flood-c")
    holding = HeldBalances(server, *lanes)
    monkeypatch.setattr(server.ledger, "balance", holding.balance)
    with contextlib.ExitStack() as stack:
        admin = pb_grpc.LaneAdminStub(stack.enter_context(_connection(server, server.admin_grant)))
        for lane in (*lanes, "calm"):
            admin.PutLane(pb.PutLaneRequest(lane=lane_message(lane)), timeout=CALL_SECONDS)
        flood = Flood(holding)
        try:
            # One after the other, each on a connection of its own, so that
            # what each holds is known: the first two their whole shares, the
            # third a calm grant's few.
            settled = []
            for lane in lanes:
                connection = stack.enter_context(_connection(server, _grant(server, lane)))
                flood.send(pb_grpc.LedgerStub(connection), lane, 2 * share)
                settled.append(flood.settled())
            _calm_lane_served(server, stack)
            assert settled == [True] * 3, (holding.held, len(flood.answered), len(flood.calls))
            shares = server.call_shares
            assert holding.held == 2 * share + shares.calm
            assert shares.running() == holding.held <= shares.total
            assert len(flood.refusals()) == len(flood.calls) - holding.held
        finally:
            flood.release()
    assert server.call_shares.running() == 0
