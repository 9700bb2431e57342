"""Issue 24's reference on PostgreSQL: the smallest faithful server, to measure beside ours.

bench/reference.py's shell (sync grpc.server, no interceptors, each call's
grant checked by HMAC with the domain's Keyring) over one PostgreSQL
transaction a move that stays right for several replicas sharing the
database: nothing about lanes, windows or chains is kept in memory, so two
replicas can never disagree. A move is three round trips on one psycopg
connection a thread, each a pipeline of prepared statements sent through
ours' lean libpq path (storage/libpq.py: psycopg's cursor layer costs more
Python a statement than this whole reference saves; docs/benchmarks.md):

1. BEGIN; the lane's row and its ancestors' locked FOR UPDATE (migration
   0007's ledger_lock_chain), and behind the lock the lane's kept window,
   its chain head, the booking and a seq (taken after the lock's xid, as
   the commit horizon needs: storage/horizon.py);
2. the window's edges from the kept instant to now (the same statement as
   ours, built from the one SQL copy of the expiry rule);
3. the event's INSERT (sealed into the lane's chain), the booking's and the
   window's upserts, and COMMIT, before the answer.

The rules are the domain's (cap, admission, settle, expiry, chain.sealed,
bookings.apply) and the window's bookkeeping application/budgets.BudgetWindow.
Not the ledger: Reserve and Settle only; a lane under a parent is refused
(its lock is taken all the same); no retries, deadlines, drain or limits.

    python -m bench.reference_pg --database-url URL [--lanes A,B] --listen 127.0.0.1:0
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
import psycopg
from sqlalchemy import bindparam, select
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect

from bench.pg_floor import conninfo
from bench.reference import (
    EVENT_COLUMNS,
    Grants,
    balance_of,
    insert_text,
    sealed,
    serve_moves,
    upsert_text,
)
from bench.scenarios import lane_policy
from ledger_service import server
from ledger_service.api import convert
from ledger_service.api.errors import status_of
from ledger_service.application.budgets import BudgetWindow
from ledger_service.application.ledger import Ledger, SettleResult
from ledger_service.domain import bookings, chain, errors, moves
from ledger_service.domain.bookings import Booking, BookingState
from ledger_service.domain.clock import SystemClock
from ledger_service.domain.events import Event, Outcome
from ledger_service.domain.policies import MAX_BUDGET_DEPTH
from ledger_service.domain.window import Balance, Overdue, StoredSums, WindowState
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb
from ledger_service.settings import Settings
from ledger_service.storage import libpq, migrate, records, sql
from ledger_service.storage.records import BOOKING_COLUMNS, event_values
from ledger_service.storage.schema import bookings as bookings_table
from ledger_service.storage.schema import lanes as lanes_table
from ledger_service.storage.schema import window_states

_LANE_COLUMNS = tuple(column.name for column in lanes_table.c)
_WINDOW_COLUMNS = tuple(column.name for column in window_states.c)
_LOCK = f"SELECT {', '.join(_LANE_COLUMNS)} FROM ledger_lock_chain(%(lane)s, %(levels)s)"
_KEPT = f"SELECT {', '.join(_WINDOW_COLUMNS)} FROM window_states WHERE lane = %(lane)s"
_HEAD = "SELECT hash FROM events WHERE lane = %(lane)s ORDER BY seq DESC LIMIT 1"
_BOOKING = (
    f"SELECT {', '.join(BOOKING_COLUMNS)} FROM bookings "
    "WHERE lane = %(lane)s AND reservation_id = %(reservation_id)s"
)
_SEQ = "SELECT nextval('events_seq_seq')"
_EVENT = f"SELECT {', '.join(EVENT_COLUMNS)} FROM events WHERE seq = %(seq)s"
_HISTORY = (
    f"SELECT {', '.join(EVENT_COLUMNS)} FROM events WHERE lane = %(lane)s "
    "AND reservation_id = %(reservation_id)s AND kind = ANY(%(kinds)s::text[]) ORDER BY seq"
)
_LANE_KINDS = [kind.value for kind in moves.LANE_KINDS]


def _compiled(statement: Any) -> tuple[str, dict[str, Any]]:
    """A SQLAlchemy statement as psycopg's text, and the values it fixes itself."""
    compiled = statement.compile(dialect=psycopg_dialect.dialect())  # type: ignore[no-untyped-call]
    return str(compiled), {
        name: value for name, value in compiled.params.items() if value is not None
    }


# The edges, and a denial's aging, as ours reads them (one SQL copy of the expiry rule).
_EDGES, _EDGES_FIXED = _compiled(sql._window_edges(bookings_table.c.lane == bindparam("lane")))
_AGING, _AGING_FIXED = _compiled(
    select(bookings_table.c.reserved_at_us, sql.amount_at(bindparam("now")))
    .where(
        bookings_table.c.lane == bindparam("lane"),
        bookings_table.c.reserved_at_us > bindparam("window_start"),
        bookings_table.c.reserved_at_us <= bindparam("now"),
        bookings_table.c.state != "rejected",
    )
    .order_by(bookings_table.c.reserved_at_us)
)
_INSERT_EVENT = insert_text("events", EVENT_COLUMNS, "%({})s")
_SAVE_BOOKING = upsert_text("bookings", BOOKING_COLUMNS, 2, "%({})s")
_SAVE_WINDOW = upsert_text("window_states", _WINDOW_COLUMNS, 1, "%({})s")
_COMMIT = "COMMIT"
# Each as libpq.Statement: prepared once a connection, run in pipelines (ours' driver path).
_STATEMENTS = {
    text: libpq.Statement(text, {}, describe=False)
    for text in (
        _LOCK, _KEPT, _HEAD, _BOOKING, _SEQ, _EVENT, _HISTORY, _EDGES, _AGING,
        _INSERT_EVENT, _SAVE_BOOKING, _SAVE_WINDOW, _COMMIT,
    )
}  # fmt: skip


class _Connection:
    """One thread's psycopg connection, and what libpq.pipeline remembers of it."""

    def __init__(self, info: str) -> None:
        # psycopg's own preparing off: its ROLLBACK would DEALLOCATE ALL (storage/libpq.py).
        self.driver = psycopg.connect(info, prepare_threshold=None)
        self.info: dict[str, Any] = {}

    def run(self, *calls: tuple[str, Mapping[str, Any]]) -> list[libpq.Rows]:
        """The statements in order in one round trip (BEGIN first when idle)."""
        return libpq.pipeline(
            self.driver, self.info, [(_STATEMENTS[text], values) for text, values in calls]
        )


class _Move:
    """One move's transaction on one connection, from its locks to its COMMIT."""

    def __init__(self, connection: _Connection, lane: str, reservation_id: str) -> None:
        self.connection, self.lane = connection, lane
        keys = {"lane": lane}
        locked, kept, head, booking, seq = connection.run(
            (_LOCK, {"lane": lane, "levels": MAX_BUDGET_DEPTH}),
            (_KEPT, keys),
            (_HEAD, keys),
            (_BOOKING, {"lane": lane, "reservation_id": reservation_id}),
            (_SEQ, {}),
        )
        rows = locked.fetchall()
        if not rows:
            raise errors.LaneNotFound(lane)
        if len(rows) > 1:
            raise errors.InvalidArgument("lane", "the reference keeps no parents' budgets")
        self.policy = records.lane_from_row(dict(zip(_LANE_COLUMNS, rows[0], strict=True)))
        found = kept.fetchone()
        state = (
            sql._window_state_of(dict(zip(_WINDOW_COLUMNS, found, strict=True))) if found else None
        )
        # A window kept for another length is not this one (application/budgets._kept).
        self.kept = state if state and state.window_us == self.policy.window_us else None
        self.head = (head.fetchone() or (None,))[0] or chain.GENESIS_HASH
        row = booking.fetchone()
        self.booking = (
            records.booking_from_row(dict(zip(BOOKING_COLUMNS, row, strict=True))) if row else None
        )
        self.seqs = [int(seq.rows[0][0])]
        self.events: list[Event] = []

    def window(self, clock_us: int) -> tuple[BudgetWindow, int]:
        """The lane's window at the lane's time (never before what a replica
        recorded: application/budgets.lane_time), moved from its kept instant."""
        kept, now = self.kept, clock_us
        if kept is not None:
            now = max(now, kept.as_of_us)
        window_us = self.policy.window_us
        if kept is None:
            entering, leaving = (now - window_us, now), (now, now)
        else:
            entering, leaving = kept.edges_to(now)
        bounds = {
            **_EDGES_FIXED,
            "lane": self.lane,
            "enter_after": entering[0],
            "enter_until": entering[1],
            "leave_after": leaving[0],
            "leave_until": leaving[1],
            "now": now,
            "window_start": now - window_us,
        }
        values = [int(value) for value in self.connection.run((_EDGES, bounds))[0].rows[0]]
        entered, left = StoredSums(*values[0:3]), StoredSums(*values[3:6])
        if kept is None:
            state = WindowState(self.lane, window_us, now, entered)
        else:
            state = kept.moved_to(now, entered, left)
        return BudgetWindow(self.policy, state, Overdue(*values[6:9])), now

    def record(
        self, window: BudgetWindow, before: Booking | None, event: Event, now: int
    ) -> tuple[Event, Booking]:
        """Seals the event into the lane's chain and projects it (application/
        ledger.record_booking_event's steps); written at commit()."""
        window.change(before, bookings.apply(event, before), now)
        if not self.seqs:
            self.seqs.append(int(self.connection.run((_SEQ, {}))[0].rows[0][0]))
        event = sealed(event, self.seqs.pop(), self.policy, window.totals, self.head)
        self.head = event.hash
        self.events.append(event)
        return event, bookings.apply(event, before)

    def commit(self, after: Booking, window: BudgetWindow) -> None:
        """The event rows, the booking's, the window's and the COMMIT: one round trip."""
        self.connection.run(
            *[(_INSERT_EVENT, {**event_values(event), "seq": event.seq}) for event in self.events],
            (_SAVE_BOOKING, records.booking_values(after)),
            (_SAVE_WINDOW, records.window_values(window.state)),
            (_COMMIT, {}),
        )

    def event(self, seq: int) -> Event:
        rows = self.connection.run((_EVENT, {"seq": seq}))[0].rows
        assert rows, f"event {seq} named by a booking is missing"
        return records.event_from_row(dict(zip(EVENT_COLUMNS, rows[0], strict=True)))

    def history(self, booking: Booking) -> Booking:
        """The booking as its lane's own moves left it (a replaced charge)."""
        keys = {"lane": booking.lane, "reservation_id": booking.reservation_id}
        rows = self.connection.run((_HISTORY, {**keys, "kinds": _LANE_KINDS}))[0].rows
        found = [records.event_from_row(dict(zip(EVENT_COLUMNS, row, strict=True))) for row in rows]
        return moves.as_the_lane_left_it(found)


class ReferencePg:
    def __init__(self, info: str) -> None:
        self.info = info
        self.clock = SystemClock()
        self.grants = Grants(self.clock)
        self.local = threading.local()

    def _connection(self) -> _Connection:
        """This thread's connection (one a gRPC worker thread)."""
        connection: _Connection | None = getattr(self.local, "connection", None)
        if connection is None or connection.driver.closed:
            connection = self.local.connection = _Connection(self.info)
        return connection

    def reserve(self, request: pb.ReserveRequest, context: grpc.ServicerContext) -> Any:
        command = convert.reserve_command(request)
        command.validate()
        return self._move(context, command.lane, command.reservation_id, self._reserve(command))

    def settle(self, request: pb.SettleRequest, context: grpc.ServicerContext) -> Any:
        command = convert.settle_command(request)
        command.validate()
        return self._move(context, command.lane, command.reservation_id, self._settle(command))

    def _reserve(self, command: moves.ReserveCommand) -> Callable[[_Move], Any]:
        def work(move: _Move) -> Any:
            if move.booking is not None:
                moves.check_reserve_repeat(move.booking, command)
                first = move.event(move.booking.answer_seq)
                move.connection.driver.rollback()
                return convert.reserve_response(first, balance_of(first), already_reserved=True)
            window, now = move.window(self.clock.now_us())
            budget = moves.Budget(move.policy, window.totals, lambda: _aging(move, now))
            event, after = move.record(
                window, None, moves.decide_reserve([budget], command, now), now
            )
            move.commit(after, window)
            return convert.reserve_response(event, balance_of(event))

        return work

    def _settle(self, command: moves.SettleCommand) -> Callable[[_Move], Any]:
        def work(move: _Move) -> Any:
            booking = move.booking
            if booking is None:
                raise errors.BookingNotFound(command.lane, command.reservation_id)
            window, now = move.window(self.clock.now_us())
            if booking.is_expired_at(now):
                _, booking = move.record(window, booking, moves.expire(booking, now), now)
            verdict = moves.decide_settle(
                booking,
                command,
                now,
                move.policy.max_charge_multiple,
                lambda: move.history(booking),
            )
            if verdict.event is None:
                result = _unchanged(move, booking, verdict.repeat_seq, window, now)
                move.connection.driver.rollback()
                return convert.settle_response(result)
            event, after = move.record(window, booking, verdict.event, now)
            moves.check_window_sums([window.totals.spent_nanos], command.charge_field)
            move.commit(after, window)
            return convert.settle_response(
                SettleResult(event.amount_nanos, after.state, balance_of(event))
            )

        return work

    def _move(
        self,
        context: grpc.ServicerContext,
        lane: str,
        reservation_id: str,
        work: Callable[[_Move], Any],
    ) -> Any:
        self.grants.check(context, lane)
        connection = self._connection()
        try:
            return work(_Move(connection, lane, reservation_id))
        except errors.LedgerError as error:
            connection.driver.rollback()
            context.abort(status_of(error), error.message)
        except BaseException:
            if not connection.driver.closed:
                connection.driver.rollback()
            raise


def _aging(move: _Move, now: int) -> list[tuple[int, int]]:
    """The window's bookings oldest first, for a denial's retry_after."""
    values = {
        **_AGING_FIXED,
        "lane": move.lane,
        "window_start": now - move.policy.window_us,
        "now": now,
    }
    rows = move.connection.run((_AGING, values))[0].rows
    return [(int(at), int(amount)) for at, amount in rows]


def _unchanged(
    move: _Move, booking: Booking, repeat_seq: int, window: BudgetWindow, now: int
) -> SettleResult:
    """A Settle that writes nothing: the first answer repeated, or the charge as it stands."""
    if repeat_seq:
        first = move.event(repeat_seq)
        state = (
            BookingState.SETTLED
            if first.outcome is Outcome.SUCCEEDED
            else BookingState.SETTLED_UNKNOWN
        )
        return SettleResult(first.amount_nanos, state, balance_of(first))
    policy = move.policy
    balance = Balance(policy.lane, policy.limit_nanos, policy.window_us, now, window.totals)
    return SettleResult(booking.amount_at(now), booking.state, balance)


def prepare(url: str, names: Sequence[str]) -> None:
    """Migrates the database and puts the lanes through our own Ledger."""
    with tempfile.TemporaryDirectory(prefix="reference-pg-") as data_dir:
        settings = Settings(database_url=url, data_dir=pathlib.Path(data_dir))
        store = server.build_store(settings)
        try:
            migrate.upgrade(store.engine)
            ledger = Ledger(store, SystemClock())
            for name in names:
                ledger.put_lane(lane_policy(name))
        finally:
            store.close()


def serve(url: str, lanes: Sequence[str], listen: str) -> int:
    if lanes:
        prepare(url, lanes)
    reference = ReferencePg(conninfo(url))
    return serve_moves(reference.reserve, reference.settle, listen, "reference-pg")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reference_pg")
    parser.add_argument("--database-url", required=True, help="SQLAlchemy's PostgreSQL URL")
    parser.add_argument("--lanes", default="", help="lanes to migrate for and put, comma-separated")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0 picks one)")
    arguments = parser.parse_args(argv)
    lanes = [name for name in arguments.lanes.split(",") if name]
    return serve(arguments.database_url, lanes, arguments.listen)


if __name__ == "__main__":
    sys.exit(main())
