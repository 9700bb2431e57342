"""Issue 25's reference design, built small, to measure beside the real server.

The issue's author measured a minimal pure-Python server at 0.49-0.51 of the
echo pair. This is that design on our proto, schema and domain rules, and
nothing else: grpc.server with sync handlers and no interceptors; the grant
checked by HMAC on every call (the domain's Keyring, our token format); the
rules from ledger_service/domain (cap, admission, settle, expiry, chain
sealing); lanes, windows and every booking of the run held in memory, so the
hot path reads nothing from the database; the first caller that finds no
commit running leads the group commit (one executemany of events, one of
bookings, the projections' marker, WAL and synchronous=FULL), and nothing is
answered before that commit is on disk.

Not the ledger: Reserve and Settle only, one process, no drain, no
deadlines, no limits, no recovery. A commit that fails ends the process
(memory would no longer match the database). The bench's load sends no
token (its servers run with auth off), so a call without one is checked
with a token issued at start: every call pays one HMAC verification.

    python -m bench.reference --database PATH --lanes LANE,... --listen 127.0.0.1:0
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import signal
import sqlite3
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import grpc

from bench import echo
from bench.scenarios import lane_policy
from ledger_service import server
from ledger_service.api import convert
from ledger_service.api.errors import status_of
from ledger_service.application.ledger import Ledger, with_balance
from ledger_service.domain import bookings, chain, errors, grants, moves
from ledger_service.domain.bookings import Booking
from ledger_service.domain.clock import SystemClock
from ledger_service.domain.events import Event
from ledger_service.domain.policies import LanePolicy
from ledger_service.domain.window import Balance, WindowTotals
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.settings import Settings, grpc_server_options
from ledger_service.storage import migrate
from ledger_service.storage.records import (
    BOOKING_COLUMNS,
    booking_rows,
    event_from_row,
    event_values,
)
from ledger_service.storage.schema import events as events_table

EVENT_COLUMNS = tuple(column.name for column in events_table.c)


def insert_text(table: str, columns: Sequence[str], mark: str) -> str:
    """INSERT of every column; `mark` the placeholder, "{}" in it replaced by
    the column's name ("?" for sqlite3, "%({})s" for named pyformat)."""
    marks = ", ".join(mark.format(name) for name in columns)
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks})"


def upsert_text(table: str, columns: Sequence[str], keys: int, mark: str) -> str:
    """insert_text, updating the row whose first `keys` columns (its key) match."""
    changed = ", ".join(f"{name} = excluded.{name}" for name in columns[keys:])
    return (
        f"{insert_text(table, columns, mark)} "
        f"ON CONFLICT ({', '.join(columns[:keys])}) DO UPDATE SET {changed}"
    )


def event_row(event: Event) -> tuple[Any, ...]:
    """The event's row, in EVENT_COLUMNS order (its seq included)."""
    values = event_values(event)
    return tuple(values.get(name, event.seq) for name in EVENT_COLUMNS)


_INSERT_EVENT = insert_text("events", EVENT_COLUMNS, "?")
_SAVE_BOOKING = upsert_text("bookings", BOOKING_COLUMNS, 2, "?")
_ADVANCE = "UPDATE projection_position SET last_seq = ? WHERE id = 1 AND state = 'current'"
_GRANT_SECONDS = 24 * 3600
Handler = Callable[[Any, grpc.ServicerContext], Any]


class Grants:
    """Every call's grant, checked by HMAC with the domain's Keyring (our token
    format). A call without a token (the bench's load sends none) is checked
    with one issued at start, so every call pays one verification."""

    def __init__(self, clock: SystemClock) -> None:
        self.clock = clock
        self.keyring = grants.Keyring({"ref": grants.new_key()}, "ref")
        now = clock.now_us()
        self.token = self.keyring.issue(
            [grants.ALL_LANES],
            [grants.Scope.CHARGE],
            issued_at_us=now,
            expires_at_us=now + _GRANT_SECONDS * 1_000_000,
        )

    def check(self, context: grpc.ServicerContext, lane: str) -> None:
        token = str(dict(context.invocation_metadata()).get("authorization", ""))
        try:
            grant = self.keyring.verify(
                token.removeprefix("Bearer ") or self.token, self.clock.now_us()
            )
        except grants.GrantRejected:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad grant")
        if not grant.allows(grants.Scope.CHARGE, lane):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "not on this lane")


class _Lane:
    """A lane's policy, chain head and rolling window: running sums plus its
    bookings in reserved_at order (a lone lane: no parents here)."""

    def __init__(self, policy: LanePolicy, head: str) -> None:
        self.policy, self.head = policy, head
        self.held = self.charged = self.open = 0
        self.queue: collections.deque[tuple[int, str]] = collections.deque()
        self.bookings: dict[str, Booking] = {}

    def age(self, now_us: int) -> None:
        """Drops what left the window; a booking dropped is forgotten."""
        edge = now_us - self.policy.window_us
        while self.queue and self.queue[0][0] <= edge:
            self.count(self.bookings.pop(self.queue.popleft()[1]), -1, now_us)

    def count(self, booking: Booking, sign: int, now_us: int) -> None:
        held, charged = booking.contribution(now_us)
        self.held += sign * held
        self.charged += sign * charged
        self.open += sign * booking.is_open_at(now_us)

    def totals(self) -> WindowTotals:
        return WindowTotals(self.held, self.charged, self.open)


class _Batch:
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.bookings: list[Booking] = []
        self.done = False


class Reference:
    def __init__(self, database: pathlib.Path, lanes: dict[str, _Lane], last_seq: int) -> None:
        self.lanes, self.seq = lanes, last_seq
        self.clock = SystemClock()
        self.cond = threading.Condition()
        self.batch, self.committing = _Batch(), False
        self.db = sqlite3.connect(database, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.grants = Grants(self.clock)

    # The moves: decided and applied in memory under the lock, answered after the commit.

    def reserve(self, request: pb.ReserveRequest, context: grpc.ServicerContext) -> Any:
        command = convert.reserve_command(request)
        command.validate()
        return self._move(
            context, command.lane, lambda lane, now: self._reserve(lane, command, now)
        )

    def settle(self, request: pb.SettleRequest, context: grpc.ServicerContext) -> Any:
        command = convert.settle_command(request)
        command.validate()
        return self._move(context, command.lane, lambda lane, now: self._settle(lane, command, now))

    def _reserve(self, lane: _Lane, command: moves.ReserveCommand, now: int) -> Callable[[], Any]:
        existing = lane.bookings.get(command.reservation_id)
        if existing is not None:
            moves.check_reserve_repeat(existing, command)
            raise _Repeat(existing)
        budget = moves.Budget(lane.policy, lane.totals(), lambda: self._aging(lane, now))
        event, _ = self._record(lane, None, moves.decide_reserve([budget], command, now), now)
        return lambda: convert.reserve_response(event, balance_of(event))

    def _settle(self, lane: _Lane, command: moves.SettleCommand, now: int) -> Callable[[], Any]:
        booking = lane.bookings.get(command.reservation_id)
        if booking is None:
            raise errors.BookingNotFound(lane.policy.lane, command.reservation_id)
        if booking.is_expired_at(now):
            _, booking = self._record(lane, booking, moves.expire(booking, now), now)
        verdict = moves.decide_settle(booking, command, now, lane.policy.max_charge_multiple)
        if verdict.event is None:  # a repeat: the reference keeps no past answers
            raise errors.BookingAlreadyEnded("repeated Settle (not kept by the reference)")
        event, after = self._record(lane, booking, verdict.event, now)
        answer = pb.SettleResponse(
            charged_nanos=event.amount_nanos, state=convert.booking_state(after.state)
        )
        convert.fill_balance(answer.balance, balance_of(event))
        return lambda: answer

    def _aging(self, lane: _Lane, now: int) -> list[tuple[int, int]]:
        return [(at, lane.bookings[rid].amount_at(now)) for at, rid in lane.queue]

    def _record(
        self, lane: _Lane, before: Booking | None, event: Event, now: int
    ) -> tuple[Event, Booking]:
        """Seals the event into the lane's chain, applies it to memory and queues its rows."""
        if before is not None:
            lane.count(before, -1, now)
        preview = bookings.apply(event, before)
        lane.count(preview, +1, now)
        self.seq += 1
        event = sealed(event, self.seq, lane.policy, lane.totals(), lane.head)
        lane.head = event.hash
        after = bookings.apply(event, before)
        if before is None and event.amount_nanos:
            lane.queue.append((after.reserved_at_us, after.reservation_id))
        lane.bookings[after.reservation_id] = after
        self.batch.events.append(event_row(event))
        self.batch.bookings.append(after)
        return event, after

    def _move(self, context: grpc.ServicerContext, lane_name: str, work: Any) -> Any:
        self.grants.check(context, lane_name)
        try:
            with self.cond:
                lane = self.lanes.get(lane_name)
                if lane is None:
                    raise errors.LaneNotFound(lane_name)
                now = self.clock.now_us()
                lane.age(now)
                answer = work(lane, now)
                self._commit_with(self.batch)
            return answer()
        except _Repeat as repeat:  # the first answer, once it is durable
            with self.cond:
                self._commit_with(self.batch)
            event = _first_answer(repeat.booking, self)
            return convert.reserve_response(event, balance_of(event), already_reserved=True)
        except errors.LedgerError as error:
            with self.cond:  # an expiry recorded before the refusal is written all the same
                self._commit_with(self.batch)
            context.abort(status_of(error), error.message)

    def _commit_with(self, batch: _Batch) -> None:
        """Waits (holding self.cond) until `batch` is committed, leading a commit
        whenever none is running: it takes every move queued so far."""
        while not batch.done:
            if self.committing:
                self.cond.wait()
                continue
            self.committing, taken, self.batch = True, self.batch, _Batch()
            self.cond.release()
            try:
                self._write(taken)
            except BaseException:
                os._exit(3)  # memory is ahead of the database: no answer may follow
            finally:
                self.cond.acquire()
            taken.done, self.committing = True, False
            self.cond.notify_all()

    def _write(self, batch: _Batch) -> None:
        if not batch.events:
            return
        self.db.execute("BEGIN IMMEDIATE")
        self.db.executemany(_INSERT_EVENT, batch.events)
        self.db.executemany(_SAVE_BOOKING, booking_rows(batch.bookings))
        self.db.execute(_ADVANCE, (batch.events[-1][0],))
        self.db.execute("COMMIT")


class _Repeat(Exception):
    def __init__(self, booking: Booking) -> None:
        self.booking = booking


def _first_answer(booking: Booking, reference: Reference) -> Event:
    row = reference.db.execute("SELECT * FROM events WHERE seq = ?", (booking.answer_seq,))
    names = [column[0] for column in row.description]
    return event_from_row(dict(zip(names, row.fetchone(), strict=True)))


def sealed(event: Event, seq: int, policy: LanePolicy, totals: WindowTotals, head: str) -> Event:
    """The event with its seq and the lane's balance after it, sealed onto the
    lane's chain head."""
    return chain.sealed(with_balance(event, policy, totals, seq=seq), head)


def balance_of(event: Event) -> Balance:
    """The balance an event's after-fields record: its move's answer."""
    totals = WindowTotals(
        event.held_after_nanos, event.charged_after_nanos, event.open_bookings_after
    )
    return Balance(event.lane, event.limit_nanos, event.window_us, event.occurred_at_us, totals)


def prepare(database: pathlib.Path, names: Sequence[str]) -> tuple[dict[str, _Lane], int]:
    """Migrates the database and puts the lanes through our own Ledger (so the
    lanes table and their lane_configured events are ours), then reads the
    lanes' chain heads and the last seq."""
    store = server.build_store(
        Settings(database_url=f"sqlite:///{database}", data_dir=database.parent)
    )
    try:
        migrate.upgrade(store.engine)
        ledger = Ledger(store, SystemClock())
        policies = {name: ledger.put_lane(lane_policy(name)) for name in names}
    finally:
        store.close()
    with sqlite3.connect(database) as db:
        head = "SELECT hash FROM events WHERE lane = ? ORDER BY seq DESC LIMIT 1"
        lanes = {
            name: _Lane(p, db.execute(head, (name,)).fetchone()[0]) for name, p in policies.items()
        }
        last_seq = db.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()[0]
    return lanes, last_seq


def serve(database: pathlib.Path, lanes: Sequence[str], listen: str) -> int:
    reference = Reference(database, *prepare(database, lanes))
    return serve_moves(reference.reserve, reference.settle, listen)


def serve_moves(reserve: Handler, settle: Handler, listen: str, name: str = "reference") -> int:
    """Serves Reserve and Settle (and the echo's probe) on a sync grpc.server
    with no interceptors until SIGTERM or SIGINT."""
    settings = echo.echo_settings(listen)
    grpc_server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=settings.max_workers, thread_name_prefix="rpc"),
        maximum_concurrent_rpcs=settings.max_concurrent_rpcs,
        options=grpc_server_options(settings),
    )
    handlers = {
        "Reserve": grpc.unary_unary_rpc_method_handler(
            reserve,
            pb.ReserveRequest.FromString,
            pb.ReserveResponse.SerializeToString,
        ),
        "Settle": grpc.unary_unary_rpc_method_handler(
            settle, pb.SettleRequest.FromString, pb.SettleResponse.SerializeToString
        ),
    }
    grpc_server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    grpc_server.add_registered_method_handlers(SERVICE, handlers)  # type: ignore[attr-defined]
    # The echo's method too: the bench waits for a server without health until it echoes.
    probe = {echo.METHOD: grpc.unary_unary_rpc_method_handler(echo.echo)}
    grpc_server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(echo.SERVICE, probe),)
    )
    port = grpc_server.add_insecure_port(listen)
    grpc_server.start()
    print(f"{name} listening on {listen.rsplit(':', 1)[0]}:{port}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    grpc_server.stop(settings.grace_period_seconds).wait()
    return 0


SERVICE = "ledger.v1.Ledger"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reference")
    parser.add_argument("--database", type=pathlib.Path, required=True, help="a new SQLite file")
    parser.add_argument("--lanes", required=True, help="the lanes to put, comma-separated")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0 picks one)")
    arguments = parser.parse_args(argv)
    return serve(arguments.database, arguments.lanes.split(","), arguments.listen)


if __name__ == "__main__":
    sys.exit(main())
