"""SQLite's one writer, with what admission reads held in memory.

A SQLite database has one writer: this process's group committer
(storage/group_commit.py). It keeps, between its batches, everything a move
reads: the lanes' policies, their chain heads, every open booking, and for
each budget a move has used, its window as running sums (WindowState) with
the queue of the window's bookings in reserved_at order, which tells what
ages out of the window next. A move reads nothing from the database but a
booking that memory does not hold (a Reserve's new id, an old ended booking),
by primary key.

The kept windows live here only: SQLite has no windows table. A balance is
read in turn with the moves (`Store.run(..., in_turn=True)`), from this
memory, and a fresh writer sums its windows afresh from the bookings.

A move works on its own overlay (`WriterTransaction`): what it writes is
merged into memory only when it returns, so a move refused halfway leaves
nothing behind. The rows of a batch's merged moves are written at the
batch's end, one executemany per table, before its one durable commit; a
statement that must see them (a listing, a full sum) writes them first.

Memory is what this writer committed. At the start of every batch SQLite
says whether another connection committed since (PRAGMA data_version); if
one did and the log's end or the projections' marker moved, memory is
dropped and read again. It is dropped too when a batch fails. What it holds
grows with the open holds and the bookings inside the windows of the budgets
in use (about 200 MiB for a lane of 1,000,000: docs/benchmarks.md); a
budget's queue is read from the bookings table when a move first needs it.
A budget whose every booking has left its window is forgotten (checked once
a second of the moves' time), as is a lane's deadline heap once it has no open
hold: a lane left idle keeps only its policy and chain head.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from sqlalchemy import Connection, bindparam, case, delete, func, insert, null, select, text

from ledger_service.application.ports import EdgeQuery, Edges, EventQuery, StateTally
from ledger_service.domain import chain, policies
from ledger_service.domain.bookings import Booking, BookingState
from ledger_service.domain.errors import RecoveryRequired
from ledger_service.domain.events import Event, EventKind, evolve
from ledger_service.domain.policies import MAX_BUDGET_DEPTH, LanePolicy
from ledger_service.domain.window import Overdue, StoredSums, WindowState, WindowTotals
from ledger_service.storage import chaining, prepared, records
from ledger_service.storage.schema import (
    bookings,
    events,
    lanes,
    projection_position,
    window_states,
)

T = TypeVar("T")
# How often, in the moves' time, the writer forgets the budgets whose every
# booking has left the window (a scan of every budget it holds).
FORGET_EVERY_US = 1_000_000
_EVENT_COLUMNS = tuple(column.name for column in events.c)

_STATEMENTS = prepared.Statements(
    data_version=text("PRAGMA data_version"),
    last_seq=select(func.coalesce(func.max(events.c.seq), 0)),
    marker=select(
        projection_position.c.last_seq,
        projection_position.c.state,
        projection_position.c.owner,
        projection_position.c.updated_at_us,
    ).where(projection_position.c.id == chaining.POSITION_ROW_ID),
    lanes=select(lanes),
    open_bookings=select(bookings).where(bookings.c.state == BookingState.OPEN.value),
    booking=select(bookings).where(
        bookings.c.lane == bindparam("lane"),
        bookings.c.reservation_id == bindparam("reservation_id"),
    ),
    # One member's bookings after an instant, oldest first, the open ones by id.
    queue=select(
        bookings.c.reserved_at_us,
        bookings.c.amount_nanos,
        case(
            (bookings.c.state == BookingState.OPEN.value, bookings.c.reservation_id),
            else_=null(),
        ),
    )
    .where(
        bookings.c.lane == bindparam("lane"),
        bookings.c.reserved_at_us > bindparam("after"),
        bookings.c.state != BookingState.REJECTED.value,
    )
    .order_by(bookings.c.reserved_at_us),
    insert_event=insert(events).values({name: bindparam(name) for name in _EVENT_COLUMNS}),
    save_lane=prepared.upsert(lanes, ("lane",)),
    save_booking=prepared.upsert(bookings, ("lane", "reservation_id")),
)
# Kept windows live in memory on SQLite; rows an earlier version wrote would
# only mislead one that reads them, so they go when memory is loaded.
_FORGET_WINDOWS = delete(window_states)


@dataclasses.dataclass(eq=False, slots=True)
class Entry:
    """One booking in the window queues: its stored amount, and while it is
    open the booking itself (its deadline and hold). Shared by the queues of
    every budget the booking counts in."""

    reserved_at_us: int
    amount_nanos: int
    booking: Booking | None


_reserved_at = operator.attrgetter("reserved_at_us")


def _entries(cursor: Any, open_here: dict[str, Entry]) -> Iterator[Entry]:
    """Entries from a cursor of the `queue` statement: an open booking's is its
    entry in memory, shared by every queue it counts in."""
    for reserved_at_us, amount_nanos, open_id in cursor:
        yield Entry(reserved_at_us, amount_nanos, None) if open_id is None else open_here[open_id]


def _ended(deadline: tuple[int, str], open_here: dict[str, Entry]) -> bool:
    """Whether a deadlines heap entry is no longer an open hold's."""
    entry = open_here.get(deadline[1])
    return entry is None or entry.booking is None or entry.booking.expires_at_us != deadline[0]


class Queue:
    """A budget's window: the sums kept as of `state.as_of_us` (None until a
    move saved them) and every booking of its members reserved after
    `covers_after_us`, oldest first."""

    def __init__(self, members: Sequence[str], covers_after_us: int, entries: list[Entry]) -> None:
        self.members = tuple(members)
        self.covers_after_us = covers_after_us
        self.entries = entries
        self.start = 0
        self.state: WindowState | None = None

    def sums(self, after_us: int, until_us: int) -> StoredSums:
        """The stored amounts of the bookings with after < reserved_at <= until."""
        if after_us >= until_us:
            return StoredSums()
        entries = self.entries
        low = bisect.bisect_right(entries, after_us, self.start, key=_reserved_at)
        high = bisect.bisect_right(entries, until_us, low, key=_reserved_at)
        amount = open_amount = count = 0
        for index in range(low, high):
            entry = entries[index]
            amount += entry.amount_nanos
            if entry.booking is not None:
                open_amount += entry.amount_nanos
                count += 1
        return StoredSums(amount, open_amount, count)

    def aging(self, now_us: int, window_us: int) -> Iterator[tuple[int, int]]:
        """(reserved_at, amount now) of the bookings inside the window, oldest first."""
        entries = self.entries
        low = bisect.bisect_right(entries, now_us - window_us, self.start, key=_reserved_at)
        for index in range(low, len(entries)):
            entry = entries[index]
            if entry.reserved_at_us > now_us:
                break
            booking = entry.booking
            amount = booking.amount_at(now_us) if booking is not None else entry.amount_nanos
            yield entry.reserved_at_us, amount

    def add(self, entry: Entry) -> None:
        entries = self.entries
        if not entries or entries[-1].reserved_at_us <= entry.reserved_at_us:
            entries.append(entry)
        else:
            bisect.insort_right(entries, entry, self.start, key=_reserved_at)

    def keep(self, state: WindowState) -> None:
        """Keeps the sums `state`; forgets the bookings that have left its window."""
        self.state = state
        edge = state.as_of_us - state.window_us
        entries = self.entries
        start = bisect.bisect_right(entries, edge, self.start, key=_reserved_at)
        self.covers_after_us = max(self.covers_after_us, edge)
        if start > 1024 and start * 2 > len(entries):
            del entries[:start]
            start = 0
        self.start = start


class WriterState:
    """What the one writer knows. `begin` and `end` frame each batch's
    transaction; `failed` follows a batch that was rolled back."""

    def __init__(self) -> None:
        self._data_version: int | None = None
        self._known: tuple[Any, ...] | None = None
        self._appended = False  # this batch wrote events
        # The latest time a move kept a window at, and when budgets were last forgotten.
        self._latest_us = 0
        self._forgotten_at_us = 0
        self.clear()

    def clear(self) -> None:
        """Forgets everything: it is read again at the next batch."""
        self.loaded = False
        self.current = False
        self.last_seq = 0
        self.lanes: dict[str, LanePolicy] = {}
        self.children: dict[str, set[str]] = {}
        self.heads: dict[str, str] = {}
        # Every open booking, by lane and reservation id; and each lane's
        # deadlines of open holds, a heap of (expires_at_us, reservation id)
        # with the entries of ended ones dropped as they reach its top.
        self.open: dict[str, dict[str, Entry]] = {}
        self.deadlines: dict[str, list[tuple[int, str]]] = {}
        self.queues: dict[str, Queue] = {}
        # Rows of merged moves not yet written.
        self.pending_events: dict[int, tuple[dict[str, Any], Event]] = {}
        self.pending_bookings: dict[tuple[str, str], Booking] = {}
        self.pending_lanes: dict[str, LanePolicy] = {}
        self._known = None

    # Batches -------------------------------------------------------------------

    def begin(self, connection: Connection) -> None:
        """First in a batch's transaction: memory is checked against the file."""
        row = _STATEMENTS("data_version", connection).one(connection, {})
        version = int(row[0]) if row is not None else None
        moved = self.loaded and version != self._data_version
        if moved and self._fingerprint(connection) != self._known:
            self.clear()
        self._data_version = version
        self._appended = False
        if not self.loaded:
            self._load(connection)

    def end(self, connection: Connection) -> None:
        """Last before the batch's commit: its rows, and the marker moved to the log's end."""
        self.flush(connection)
        if self._appended:
            chaining.advance_position_to_log_end(connection)
            marker = self._known[1] if self._known else None
            if marker is not None:  # the marker row as the advance left it
                marker = (self.last_seq, *marker[1:])
            self._known = (self.last_seq, marker)
        if self._latest_us - self._forgotten_at_us >= FORGET_EVERY_US:
            self._forgotten_at_us = self._latest_us
            self.forget_aged_out(self._latest_us)

    def forget_aged_out(self, now_us: int) -> None:
        """Drops the queues whose every booking has left the budget's window at
        `now_us` (a lane left idle would keep them for ever): read again, with
        nothing in them, when a move next needs one."""
        for lane, queue in list(self.queues.items()):
            policy = self.lanes.get(lane)
            windows = [found.window_us for found in (queue.state, policy) if found is not None]
            if not windows:
                continue
            window_us = max(windows)  # a put may have widened it since the sums were kept
            entries = queue.entries
            if len(entries) == queue.start or entries[-1].reserved_at_us <= now_us - window_us:
                del self.queues[lane]

    def failed(self) -> None:
        self.clear()

    def run(
        self,
        connection: Connection,
        work: Callable[[Any], T],
        sql: Callable[[Connection], Any],
        *,
        write: bool = True,
    ) -> T:
        """One move of a batch: `work` on a WriterTransaction, merged if it
        returns. A read (`write` False) sees memory as the moves before it left
        it, and is never merged."""
        if not self.loaded:
            self._load(connection)
        move = WriterTransaction(self, connection, sql(connection))
        result = work(move)
        if write:
            self.merge(move)
        else:
            assert not (move.appended or move.saved_bookings or move.saved_lanes), "a read wrote"
        return result

    def _fingerprint(self, connection: Connection) -> tuple[Any, ...]:
        """What moves if another connection appended or touched the marker."""
        last = _STATEMENTS("last_seq", connection).one(connection, {})
        marker = _STATEMENTS("marker", connection).one(connection, {})
        return (int(last[0]) if last else 0, tuple(marker) if marker else None)

    def _load(self, connection: Connection) -> None:
        self._known = self._fingerprint(connection)
        self.last_seq, marker = self._known
        self.current = marker is not None and marker[1] == chaining.STATE_CURRENT
        for row in self._mappings(connection, "lanes"):
            self._keep_lane(records.lane_from_row(row))
        for row in self._mappings(connection, "open_bookings"):
            self._keep_open(records.booking_from_row(row))
        connection.execute(_FORGET_WINDOWS)
        self.loaded = True

    @staticmethod
    def _mappings(connection: Connection, name: str) -> list[dict[str, Any]]:
        statement = _STATEMENTS(name, connection)
        cursor = statement.cursor(connection, {})
        try:
            rows = cursor.fetchall()
        finally:
            cursor.close()
        return [mapping for row in rows if (mapping := statement.as_mapping(row, cursor))]

    def flush(self, connection: Connection) -> None:
        """Writes the merged moves' rows: one executemany per table."""
        if self.pending_events:
            _STATEMENTS("insert_event", connection).run_many(
                connection, [values for values, _ in self.pending_events.values()]
            )
            self.pending_events.clear()
            self._appended = True
        if self.pending_lanes:
            _STATEMENTS("save_lane", connection).run_many(
                connection, [records.lane_values(p) for p in self.pending_lanes.values()]
            )
            self.pending_lanes.clear()
        if self.pending_bookings:
            _STATEMENTS("save_booking", connection).run_many(
                connection, [records.booking_values(b) for b in self.pending_bookings.values()]
            )
            self.pending_bookings.clear()

    # What moves read -------------------------------------------------------------

    def _keep_lane(self, policy: LanePolicy) -> None:
        before = self.lanes.get(policy.lane)
        if before is not None and before.parent is not None:
            self.children.get(before.parent, set()).discard(policy.lane)
        self.lanes[policy.lane] = policy
        if policy.parent is not None:
            self.children.setdefault(policy.parent, set()).add(policy.lane)

    def subtree(self, lane: str, max_depth: int) -> list[list[str]]:
        return policies.subtree(lane, lambda parent: self.children.get(parent, ()), max_depth)

    def members(self, lane: str) -> list[str]:
        return policies.members(lane, lambda parent: self.children.get(parent, ()))

    def budgets_of(self, lane: str) -> list[str]:
        """The lane and its ancestors: every budget its bookings count in."""
        found = [lane]
        parent = self.lanes[lane].parent if lane in self.lanes else None
        while parent is not None and parent not in found and len(found) < MAX_BUDGET_DEPTH:
            found.append(parent)
            policy = self.lanes.get(parent)
            parent = policy.parent if policy is not None else None
        return found

    def queue(self, connection: Connection, lane: str, after_us: int) -> Queue:
        """The budget's queue, covering every booking reserved after `after_us`:
        read from the bookings table when memory does not cover that far."""
        found = self.queues.get(lane)
        if found is not None and found.covers_after_us <= after_us:
            return found
        self.flush(connection)
        members = self.members(lane)
        statement = _STATEMENTS("queue", connection)
        cursors = [statement.cursor(connection, {"lane": m, "after": after_us}) for m in members]
        try:
            streams = [
                _entries(cursor, self.open.get(m, {}))
                for m, cursor in zip(members, cursors, strict=True)
            ]
            merged = streams[0] if len(streams) == 1 else heapq.merge(*streams, key=_reserved_at)
            entries = list(merged)
        finally:
            for cursor in cursors:
                cursor.close()
        queue = self.queues[lane] = Queue(members, after_us, entries)
        return queue

    def _keep_open(self, booking: Booking) -> Entry:
        entry = Entry(booking.reserved_at_us, booking.amount_nanos, booking)
        self.open.setdefault(booking.lane, {})[booking.reservation_id] = entry
        heapq.heappush(
            self.deadlines.setdefault(booking.lane, []),
            (booking.expires_at_us, booking.reservation_id),
        )
        return entry

    def overdue(self, members: Sequence[str], now_us: int, window_us: int) -> Overdue:
        """The members' open holds inside the window whose deadline has passed:
        the heap's entries at or before now, found without visiting the rest."""
        held = charge = count = 0
        for member in members:
            heap = self.deadlines.get(member, [])
            open_here = self.open.get(member, {})
            while heap and _ended(heap[0], open_here):
                heapq.heappop(heap)
            pending = [0] if heap else []
            while pending:
                index = pending.pop()
                expires_at_us, reservation_id = heap[index]
                if expires_at_us > now_us:
                    continue  # and so is every entry below it
                entry = open_here.get(reservation_id)
                booking = entry.booking if entry is not None else None
                if (
                    booking is not None
                    and booking.expires_at_us == expires_at_us
                    and now_us - window_us < booking.reserved_at_us <= now_us
                ):
                    held += booking.amount_nanos
                    charge += booking.expire_charge_nanos
                    count += 1
                pending += [child for child in (2 * index + 1, 2 * index + 2) if child < len(heap)]
        return Overdue(held, charge, count)

    def booking(self, connection: Connection, lane: str, reservation_id: str) -> Booking | None:
        entry = self.open.get(lane, {}).get(reservation_id)
        if entry is not None:
            return entry.booking
        pending = self.pending_bookings.get((lane, reservation_id))
        if pending is not None:
            return pending
        row = _STATEMENTS("booking", connection).mapping(
            connection, {"lane": lane, "reservation_id": reservation_id}
        )
        return records.booking_from_row(row) if row is not None else None

    def head(self, connection: Connection, lane: str) -> str:
        head = self.heads.get(lane)
        if head is None:
            head = self.heads[lane] = chaining.lane_head(connection, lane)
        return head

    # Merging a move ----------------------------------------------------------------

    def merge(self, move: WriterTransaction) -> None:
        """Takes in what a move that returned wrote."""
        for lane in move.dropped_windows:
            self.queues.pop(lane, None)
        for policy in move.saved_lanes.values():
            self._keep_lane(policy)
            self.pending_lanes[policy.lane] = policy
        for seq, (values, event) in move.appended.items():
            self.pending_events[seq] = (values, event)
            self.heads[event.lane] = event.hash
            self.last_seq = seq
        for state in move.saved_windows.values():
            self._latest_us = max(self._latest_us, state.as_of_us)
            queue = self.queues.get(state.lane)
            if queue is not None:
                queue.keep(state)
        for key, booking in move.saved_bookings.items():
            self._merge_booking(key, booking, move.saved_windows)
            self.pending_bookings[key] = booking

    def _merge_booking(
        self, key: tuple[str, str], booking: Booking, saved: dict[str, WindowState]
    ) -> None:
        lane, reservation_id = key
        open_here = self.open.get(lane, {})
        entry = open_here.get(reservation_id)
        budgets = self.budgets_of(lane)
        if entry is not None:
            entry.amount_nanos = booking.amount_nanos
            if booking.state is BookingState.OPEN:
                entry.booking = booking
            else:
                entry.booking = None
                del open_here[reservation_id]
                if not open_here:
                    # Every entry of its deadline heap is an ended hold's.
                    del self.open[lane]
                    self.deadlines.pop(lane, None)
            return
        if booking.state is not BookingState.OPEN:
            # A denial counts in no window; an ended booking that changed (a
            # correction) had its queues dropped (WriterTransaction.save_booking).
            return
        entry = self._keep_open(booking)
        for name in budgets:
            queue = self.queues.get(name)
            if queue is None:
                continue
            if name not in saved or booking.reserved_at_us <= queue.covers_after_us:
                # Kept sums that did not follow this booking: read again when next needed.
                del self.queues[name]
                continue
            queue.add(entry)


class WriterTransaction:
    """One move of the writer: reads memory, writes an overlay that
    WriterState.merge takes in if the move returns. What memory does not
    answer goes to `sql` (a SqlTransaction on the batch's connection), after
    the merged moves' rows are written."""

    def __init__(self, state: WriterState, connection: Connection, sql: Any) -> None:
        self._state = state
        self._connection = connection
        self._sql = sql
        self.saved_lanes: dict[str, LanePolicy] = {}
        self.saved_bookings: dict[tuple[str, str], Booking] = {}
        self.saved_windows: dict[str, WindowState] = {}
        self.dropped_windows: set[str] = set()
        self.appended: dict[int, tuple[dict[str, Any], Event]] = {}
        self._heads: dict[str, str] = {}
        self._last_seq = state.last_seq
        # Bookings that this move found ended in the store (a correction's own).
        self._ended: set[tuple[str, str]] = set()

    def _flushed(self) -> Any:
        self._state.flush(self._connection)
        return self._sql

    # Lanes -----------------------------------------------------------------

    def lock_configuration(self) -> None:
        """The writer is SQLite's one writer: configurations are serialized already."""

    def lock_lane(
        self, lane: str, reservation_id: str = "", *, budgets: bool = True
    ) -> LanePolicy | None:
        if not self._state.current:
            raise RecoveryRequired()
        return self.get_lane(lane)

    def get_lane(self, lane: str) -> LanePolicy | None:
        saved = self.saved_lanes.get(lane)
        return saved if saved is not None else self._state.lanes.get(lane)

    def list_lanes(self, after_lane: str, limit: int) -> Sequence[LanePolicy]:
        return self._flushed().list_lanes(after_lane, limit)  # type: ignore[no-any-return]

    def save_lane(self, policy: LanePolicy) -> None:
        self.saved_lanes[policy.lane] = policy

    def subtree(self, lane: str, max_depth: int) -> Sequence[Sequence[str]]:
        assert not self.saved_lanes, "a move reads its subtree before it saves a lane"
        return self._state.subtree(lane, max_depth)

    # Bookings --------------------------------------------------------------

    def get_booking(self, lane: str, reservation_id: str) -> Booking | None:
        key = (lane, reservation_id)
        saved = self.saved_bookings.get(key)
        if saved is not None:
            return saved
        found = self._state.booking(self._connection, lane, reservation_id)
        if found is not None and found.state is not BookingState.OPEN:
            self._ended.add(key)
        return found

    def save_booking(self, booking: Booking) -> None:
        key = (booking.lane, booking.reservation_id)
        if key in self._ended:
            # An ended booking changed (a correction): the queues that hold it
            # are read again, since an entry of an ended booking is not found by key.
            self.dropped_windows.update(self._state.budgets_of(booking.lane))
        self.saved_bookings[key] = booking

    # Windows -----------------------------------------------------------------

    def window_state(self, lane: str) -> WindowState | None:
        if lane in self.saved_windows:
            return self.saved_windows[lane]
        if lane in self.dropped_windows:
            return None
        queue = self._state.queues.get(lane)
        return queue.state if queue is not None else None

    def save_window_state(self, state: WindowState) -> None:
        self.saved_windows[state.lane] = state

    def drop_window_states(self, lanes: Sequence[str]) -> None:
        self.dropped_windows.update(lanes)
        for lane in lanes:
            self.saved_windows.pop(lane, None)

    def window_edges(self, queries: Sequence[EdgeQuery]) -> list[Edges]:
        assert not self.saved_bookings, "a move reads its windows before it writes"
        return [self._edges(query) for query in queries]

    def _edges(self, query: EdgeQuery) -> Edges:
        now_us, window_us = query.now_us, query.window_us
        lowest = min(query.entering[0], query.leaving[0], now_us - window_us)
        queue = self._state.queue(self._connection, query.lane, lowest)
        overdue = self._state.overdue(queue.members, now_us, window_us)
        return queue.sums(*query.entering), queue.sums(*query.leaving), overdue

    def window_totals(self, lane: str, now_us: int, window_us: int) -> WindowTotals:
        assert not self.saved_bookings, "a full sum before the move's own writes"
        return self._flushed().window_totals(lane, now_us, window_us)  # type: ignore[no-any-return]

    def aging(self, lane: str, now_us: int, window_us: int) -> Iterator[tuple[int, int]]:
        queue = self._state.queue(self._connection, lane, now_us - window_us)
        return queue.aging(now_us, window_us)

    def expired_open_bookings(self, now_us: int, limit: int) -> Sequence[Booking]:
        return self._flushed().expired_open_bookings(now_us, limit)  # type: ignore[no-any-return]

    # Events ----------------------------------------------------------------

    def append(self, event: Event) -> Event:
        if not self._state.current:
            raise RecoveryRequired()
        previous = self._heads.get(event.lane) or self._state.head(self._connection, event.lane)
        digest = chain.event_hash(previous, event)
        self._last_seq += 1
        seq = self._last_seq
        values = records.event_values(event)
        values["hash"], values["previous_hash"], values["seq"] = digest, previous, seq
        if event.policy is not None:
            # As a reader will see it: the policy through its JSON column.
            stored = records.event_from_row(values)
        else:
            stored = evolve(event, seq=seq, hash=digest, previous_hash=previous)
        self.appended[seq] = (values, stored)
        self._heads[event.lane] = digest
        return stored

    def get_event(self, seq: int) -> Event | None:
        for pending in (self.appended, self._state.pending_events):
            if seq in pending:
                return pending[seq][1]
        return self._sql.get_event(seq)  # type: ignore[no-any-return]

    def get_correction(self, lane: str, correction_id: str) -> Event | None:
        for pending in (self.appended, self._state.pending_events):
            for _, event in pending.values():
                if (
                    event.kind is EventKind.CORRECTED
                    and event.lane == lane
                    and event.correction_id == correction_id
                ):
                    return event
        return self._sql.get_correction(lane, correction_id)  # type: ignore[no-any-return]

    def list_events(self, query: EventQuery) -> Sequence[Event]:
        return self._flushed().list_events(query)  # type: ignore[no-any-return]

    def last_seq(self) -> int:
        return self._last_seq

    def last_handed_seq(self) -> int:
        return self._last_seq

    def execute_text(self, sql: str) -> None:
        """For tests of the append-only guard only: memory is dropped after it."""
        self._flushed().execute_text(sql)
        self._state.clear()

    # The audit (read transactions use SqlTransaction; these for completeness) --

    def window_tally(
        self, lanes: Sequence[str], now_us: int, window_us: int
    ) -> Sequence[StateTally]:
        return self._flushed().window_tally(lanes, now_us, window_us)  # type: ignore[no-any-return]

    def biggest_bookings(
        self, lanes: Sequence[str], now_us: int, window_us: int, limit: int
    ) -> Sequence[Booking]:
        return self._flushed().biggest_bookings(lanes, now_us, window_us, limit)  # type: ignore[no-any-return]

    def next_release(
        self, lanes: Sequence[str], now_us: int, window_us: int
    ) -> tuple[int, int] | None:
        return self._flushed().next_release(lanes, now_us, window_us)  # type: ignore[no-any-return]
