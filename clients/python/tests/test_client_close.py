"""close(): new calls are refused at once with ClientClosed (the lane's own
mistake, never an outage), calls under way finish within the grace, and what
is left after it is cancelled (README, "Closing the client")."""

from __future__ import annotations

import math
import pathlib
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from ledger_client import ClientClosed, ClientSettings, LaneClient, ModelPrice, OutagePolicy
from ledger_client.errors import LedgerUnavailable
from ledger_client.generated.ledger.v1 import ledger_pb2 as pb
from ledger_client.generated.ledger.v1 import ledger_pb2_grpc as pb_grpc


class SlowLedger(pb_grpc.LedgerServicer):
    """Admits every Reserve after `reserve_seconds`; settles every Settle."""

    def __init__(self) -> None:
        self.reserve_seconds = 0.0
        self.methods: list[str] = []
        self.lock = threading.Lock()
        self.reserve_arrived = threading.Event()

    def _note(self, method: str) -> None:
        with self.lock:
            self.methods.append(method)

    def Reserve(
        self, request: pb.ReserveRequest, context: grpc.ServicerContext
    ) -> pb.ReserveResponse:
        self._note("Reserve")
        self.reserve_arrived.set()
        threading.Event().wait(self.reserve_seconds)
        return pb.ReserveResponse(decision=pb.ADMITTED, hold_nanos=1, cap_nanos=1)

    def Settle(self, request: pb.SettleRequest, context: grpc.ServicerContext) -> pb.SettleResponse:
        self._note("Settle")
        return pb.SettleResponse(charged_nanos=1, state=pb.SETTLED)


@pytest.fixture
def ledger() -> Iterator[tuple[SlowLedger, str]]:
    servicer = SlowLedger()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_LedgerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def test_every_call_after_close_is_client_closed_and_spends_no_allowance(
    ledger: tuple[SlowLedger, str], tmp_path: pathlib.Path
) -> None:
    """It said "the ledger is unreachable" (LedgerUnavailable), which sent a
    model_call to the lane's outage mode: a closed client took its allowance."""
    servicer, address = ledger
    outage = OutagePolicy.allowance(
        max_nanos=10**9,
        max_calls=10,
        journal_path=tmp_path / "journal",
        prices={"m": ModelPrice(1_000_000, 1_000_000)},
    )
    client = LaneClient(address, "recall", outage=outage)
    made_before = client.model_call("m", 10, 10)
    client.close()
    with pytest.raises(ClientClosed, match="closed"), client.model_call("m", 10, 10):
        raise AssertionError("a closed client ran a model call")
    with pytest.raises(ClientClosed, match="closed"), made_before:
        raise AssertionError("a closed client ran a model call")
    for use in (
        lambda: client.reserve("m", 10, 10),
        lambda: client.settle("abc"),
        lambda: client.refund("abc", reason="not sent"),
        client.balance,
        lambda: client.booking_state("abc"),
        client.list_events,
        client.all_events,
        client.watch_events,
        client.replay_journal,
    ):
        with pytest.raises(ClientClosed) as closed:
            use()
        assert not isinstance(closed.value, LedgerUnavailable)
    assert servicer.methods == [], "nothing was sent"
    journal = client.journal
    assert journal is not None and journal.pending() == [], "no call on the allowance"


def test_close_lets_a_model_call_under_way_end_and_refuses_new_ones(
    ledger: tuple[SlowLedger, str],
) -> None:
    """close() cut a Reserve under way off (its hold booked, its answer lost,
    left to expire) and refused the Settle of a block already running."""
    servicer, address = ledger
    servicer.reserve_seconds = 0.3
    client = LaneClient(address, "recall", settings=ClientSettings(deadline_seconds=2.0))
    entered = threading.Event()
    release = threading.Event()
    outcome: list[object] = []

    def lane() -> None:
        with client.model_call("m", 10, 10) as call:
            entered.set()
            release.wait(5)
            call.succeeded(10, 10)
        outcome.append(call.result)
        outcome.append(call.end_error)

    worker = threading.Thread(target=lane)
    worker.start()
    assert servicer.reserve_arrived.wait(5)
    closing = threading.Thread(target=client.close)
    closing.start()
    # Refused at once, while the call under way goes on.
    for _ in range(100):
        try:
            client.balance()
        except ClientClosed:
            break
        threading.Event().wait(0.01)
    else:
        raise AssertionError("close() did not refuse new calls")
    assert entered.wait(5), "the Reserve under way got its answer"
    release.set()
    worker.join(5)
    closing.join(5)
    assert not closing.is_alive()
    assert outcome[1] is None, f"the ending was refused: {outcome[1]}"
    assert outcome[0] is not None
    assert servicer.methods == ["Reserve", "Settle"]


def test_close_cancels_what_is_left_after_its_grace(ledger: tuple[SlowLedger, str]) -> None:
    servicer, address = ledger
    servicer.reserve_seconds = 2.0
    client = LaneClient(address, "recall")
    pool = futures.ThreadPoolExecutor(max_workers=1)
    reserve = pool.submit(client.reserve, "m", 10, 10, deadline_seconds=5.0)
    assert servicer.reserve_arrived.wait(5)
    client.close(grace_seconds=0.1)
    with pytest.raises(ClientClosed) as cut_off:
        reserve.result(5)
    assert cut_off.value.may_have_applied
    pool.shutdown()


def test_the_grace_is_checked() -> None:
    """Bounded as the Node client's graceMs, [0, 60 s]: an infinite grace
    (inf, or NaN, which no comparison refused) let close() wait forever."""
    client = LaneClient("127.0.0.1:1", "recall")
    for wrong in (-1, 60.001, math.inf, math.nan):
        with pytest.raises(ValueError, match="grace_seconds"):
            client.close(grace_seconds=wrong)
    with pytest.raises(TypeError, match="grace_seconds"):
        client.close(grace_seconds="5")  # type: ignore[arg-type]
    client.close(grace_seconds=60)  # the most: nothing under way, so at once


def test_close_inside_a_model_call_block_lets_that_block_end_its_booking(
    ledger: tuple[SlowLedger, str], tmp_path: pathlib.Path
) -> None:
    """close() waited its whole grace for the very block it was called in, then
    cut that block's Settle off: the booking was left to expire at its hold,
    and nothing was journaled (the journal closed first)."""
    servicer, address = ledger
    client = LaneClient(address, "recall", outage=OutagePolicy.deny(tmp_path / "journal"))
    with client.model_call("m", 10, 10) as call:
        client.close(grace_seconds=1.0)
        with pytest.raises(ClientClosed, match="closed"):
            client.balance()  # new calls are refused at once, as ever
        call.succeeded(5, 5)
    assert call.end_error is None
    assert call.result is not None
    assert servicer.methods == ["Reserve", "Settle"]
    with pytest.raises(ClientClosed, match="closed"), client.model_call("m", 10, 10):
        raise AssertionError("a closed client ran a model call")
    client.close()  # idempotent


def test_close_on_a_thread_that_entered_a_block_another_thread_left_closes_the_journal(
    ledger: tuple[SlowLedger, str], tmp_path: pathlib.Path
) -> None:
    """A block entered on one thread and left on another (as asyncio.to_thread
    does) is not one close() is called inside: close() on the first thread
    closes the channel and the journal, whose lock a new client then takes."""
    _servicer, address = ledger
    journal = tmp_path / "journal"
    client = LaneClient(address, "recall", outage=OutagePolicy.deny(journal))
    block = client.model_call("m", 10, 10)
    with futures.ThreadPoolExecutor(max_workers=1) as worker:
        call = worker.submit(block.__enter__).result()
        call.succeeded(5, 5)
        block.__exit__(None, None, None)  # left here, on another thread
        worker.submit(client.close, 1.0).result()  # closed there
    assert call.end_error is None
    LaneClient(address, "recall", outage=OutagePolicy.deny(journal)).close()


class StallingLedger(pb_grpc.LedgerServicer):
    """Stalls the Reserves and Settles of ids starting with `stall-reserve` and
    `stall-settle` until `unstall` is set; answers the rest at once. Notes
    every move it receives as (method, reservation_id)."""

    def __init__(self) -> None:
        self.moves: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.unstall = threading.Event()
        self.stalled = threading.Semaphore(0)

    def _note(self, method: str, reservation_id: str, stall: bool) -> None:
        with self.lock:
            self.moves.append((method, reservation_id))
        if stall:
            self.stalled.release()
            self.unstall.wait(10)

    def Reserve(
        self, request: pb.ReserveRequest, context: grpc.ServicerContext
    ) -> pb.ReserveResponse:
        self._note("Reserve", request.reservation_id, request.reservation_id.startswith("stall-r"))
        return pb.ReserveResponse(decision=pb.ADMITTED, hold_nanos=1, cap_nanos=1)

    def Settle(self, request: pb.SettleRequest, context: grpc.ServicerContext) -> pb.SettleResponse:
        self._note("Settle", request.reservation_id, request.reservation_id.startswith("stall-s"))
        return pb.SettleResponse(charged_nanos=1, state=pb.SETTLED)

    def Refund(self, request: pb.RefundRequest, context: grpc.ServicerContext) -> pb.RefundResponse:
        self._note("Refund", request.reservation_id, False)
        return pb.RefundResponse()

    def ended(self) -> set[str]:
        with self.lock:
            return {rid for method, rid in self.moves if method in ("Settle", "Refund")}


@pytest.mark.slow  # starts a server or spawns a process
def test_every_block_cut_off_by_close_has_its_ending_journaled_and_replayed(
    tmp_path: pathlib.Path,
) -> None:
    """close() closed the journal right after the channel: blocks cut off at the
    end of its grace (11 to 13 of about 40) could not journal their endings, and
    a cut-off Reserve was not journaled in doubt at all, so their holds stayed
    open until they expired. Every one is now journaled, and a new client on
    the same journal ends them all."""
    servicer = StallingLedger()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
    pb_grpc.add_LedgerServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    journal = tmp_path / "journal"
    settings = ClientSettings(deadline_seconds=10.0, replay_interval_seconds=None)
    client = LaneClient(address, "recall", outage=OutagePolicy.deny(journal), settings=settings)
    # Groups: stalled in the Reserve, stalled in the Settle, still in the body.
    ids = [f"stall-reserve-{n}" for n in range(8)] + [f"stall-settle-{n}" for n in range(8)]
    ids += [f"body-{n}" for n in range(8)]
    in_body = threading.Semaphore(0)
    leave_body = threading.Event()
    calls: dict[str, object] = {}

    def lane(reservation_id: str) -> None:
        try:
            with client.model_call("m", 10, 10, reservation_id=reservation_id) as call:
                calls[reservation_id] = call
                if reservation_id.startswith("body"):
                    in_body.release()
                    leave_body.wait(10)
                call.succeeded(5, 5)
        except ClientClosed:
            calls[reservation_id] = "cut off in its Reserve"

    workers = [threading.Thread(target=lane, args=(rid,)) for rid in ids]
    for worker in workers:
        worker.start()
    for _ in range(16):  # the stalled Reserves and Settles have arrived
        assert servicer.stalled.acquire(timeout=10)
    for _ in range(8):
        assert in_body.acquire(timeout=10)
    # The body blocks leave just after the grace, once the channel is closed.
    threading.Timer(0.3, leave_body.set).start()
    client.close(grace_seconds=0.1)
    for worker in workers:
        worker.join(10)
    servicer.unstall.set()
    assert len(calls) == len(ids)
    with servicer.lock:
        servicer.moves.clear()
    replaying = LaneClient(address, "recall", outage=OutagePolicy.deny(journal), settings=settings)
    replaying.replay_journal()
    replaying.close()
    server.stop(0)
    assert sorted(set(ids) - servicer.ended()) == [], "holds left to expire"


def test_a_block_that_does_not_return_holds_close_only_a_bounded_time(
    ledger: tuple[SlowLedger, str], tmp_path: pathlib.Path
) -> None:
    """The journal waits for cut-off blocks at most CLOSE_JOURNAL_WAIT_SECONDS:
    close() returns while a block is still in its model call, and the journal
    is closed (a new client takes its lock); that block's ending is not
    journaled, as the README says."""
    _servicer, address = ledger
    journal = tmp_path / "journal"
    client = LaneClient(address, "recall", outage=OutagePolicy.deny(journal))
    entered = threading.Event()
    release = threading.Event()
    outcome: list[object] = []

    def lane() -> None:
        with client.model_call("m", 10, 10) as call:
            entered.set()
            release.wait(30)
            call.succeeded(5, 5)
        outcome.append(call)

    worker = threading.Thread(target=lane)
    worker.start()
    assert entered.wait(5)
    closing = threading.Thread(target=client.close, args=(0.0,))
    closing.start()
    closing.join(20)
    assert not closing.is_alive(), "close() waited for a block that had not returned"
    assert worker.is_alive()
    LaneClient(address, "recall", outage=OutagePolicy.deny(journal)).close()
    release.set()
    worker.join(5)
    (call,) = outcome
    assert isinstance(call.end_error, ClientClosed)  # type: ignore[attr-defined]
    assert not call.journaled  # type: ignore[attr-defined]
