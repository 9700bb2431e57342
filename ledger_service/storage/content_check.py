"""Walking ranges of the log's hash chain, in other processes.

A chain check has two parts (domain/chain.py). The link (an event's
previous_hash is its lane's previous hash) needs the log in order, but only
four short columns of it. The content (the event's fields still give its
hash) needs every column and most of the work: the row, its canonical text
and a SHA-256. Both are done in ranges (`walk_range`), each by a process of
its own with a ChainWalker of its own, which cannot know the heads the lanes
had before the range: it leaves each lane's events up to its first sealed
one to the caller (application/recovery.py: `take_range`), and checks every
later one itself. The caller's thread then does almost nothing per event,
and the cores are left to the walks and, in a rebuild, the fold.
A rebuild's digest has its bookings' lines made here too (`booking_lines`).

A range is read in one snapshot by a process of a pool (spawned, never
forked: the server's threads and connections are not copied), through its own
engine. Below `parallel_min_events`, or with no processes, ranges are walked
in the calling thread: starting the processes costs about a second.

An event's canonical text is made from the row's values directly
(chain.canonical_values), without building the Event: enum columns hold
their members' plain values, which are written the same. A row with a policy
(whose stored JSON is not the canonical text) or with a value no enum member
has takes the reference path, as events_from_rows and canonical_event would,
and fails as they would.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import multiprocessing
import operator
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine

from ledger_service.application.recovery import (
    BookingKey,
    ChainLink,
    WalkedRange,
)
from ledger_service.domain import chain, snapshots
from ledger_service.domain.errors import LedgerError, StoreUnavailable
from ledger_service.domain.events import DenialReason, Event, EventKind, Outcome
from ledger_service.domain.policies import ExpireCharge
from ledger_service.storage import database, records
from ledger_service.storage.schema import bookings, events
from ledger_service.storage.translate import translated

log = logging.getLogger(__name__)
T = TypeVar("T")

# At most this many processes check contents, whatever the settings say.
MAX_PROCESSES = 8
# Rows a check reads at a time.
FETCH_ROWS = 2000

_FIELD_NAMES = tuple(field.name for field in dataclasses.fields(Event))
_hashed = operator.itemgetter(*(_FIELD_NAMES.index(name) for name in chain.HASHED_NAMES))
_SEQ = _FIELD_NAMES.index("seq")
_HASH = _FIELD_NAMES.index("hash")
_PREVIOUS = _FIELD_NAMES.index("previous_hash")
_POLICY = _FIELD_NAMES.index("policy")
_LANE = _FIELD_NAMES.index("lane")
_LANE_CONFIGURED = EventKind.LANE_CONFIGURED.value
# Columns that hold an enum member's value, and the values they may hold.
_KIND, _DENIAL, _CHARGE, _OUTCOME = (
    _FIELD_NAMES.index(name) for name in ("kind", "denial_reason", "expire_charge", "outcome")
)
_KINDS = frozenset(member.value for member in EventKind)
# The optional ones may also be None.
_DENIALS = frozenset(member.value for member in DenialReason) | {None}
_CHARGES = frozenset(member.value for member in ExpireCharge) | {None}
_OUTCOMES = frozenset(member.value for member in Outcome) | {None}
assert records.EVENT_COLUMNS[_POLICY] == "policy_json"


def _text(row: Sequence[Any]) -> str:
    """chain.canonical_event of the row's event."""
    if (
        row[_POLICY] is None
        and row[_KIND] in _KINDS
        and row[_DENIAL] in _DENIALS
        and row[_CHARGE] in _CHARGES
        and row[_OUTCOME] in _OUTCOMES
    ):
        return chain.canonical_values(_hashed(row))
    return chain.canonical_event(records.events_from_rows([row])[0])


# One event as judged: (seq, lane, previous_hash, hash, whether its content
# no longer gives its hash, its whole row when it configures a lane).
Judged = tuple[int, str, str, str, bool, Sequence[Any] | None]


def _judged_rows(rows: Iterable[Sequence[Any]]) -> Iterator[Judged]:
    """Events judged from their whole rows (of EVENT_COLUMNS), texts made here."""
    matches = chain.content_matches
    for row in rows:
        seq, lane, previous, hash_ = row[_SEQ], row[_LANE], row[_PREVIOUS], row[_HASH]
        changed = bool(hash_) and not matches(previous, hash_, _text(row))
        yield seq, lane, previous, hash_, changed, row if row[_KIND] == _LANE_CONFIGURED else None


_COLUMNS_SQL = ", ".join(records.EVENT_COLUMNS)
_RANGE_SQL = f"SELECT {_COLUMNS_SQL} FROM {events.name} WHERE seq > ? AND seq <= ? ORDER BY seq"


def _paramstyled(engine: Engine, sql: str) -> str:
    return sql if engine.dialect.paramstyle == "qmark" else sql.replace("?", "%s")


def _judged_range(connection: Connection, after_seq: int, through_seq: int) -> Iterator[Judged]:
    """The events in (after_seq, through_seq], judged, FETCH_ROWS rows in
    memory at a time."""
    engine = connection.engine
    result = connection.exec_driver_sql(_paramstyled(engine, _RANGE_SQL), (after_seq, through_seq))
    while rows := result.fetchmany(FETCH_ROWS):
        yield from _judged_rows(rows)


def walk_rows(rows: Sequence[Sequence[Any]]) -> WalkedRange:
    """The WalkedRange of `rows` (of EVENT_COLUMNS, a range of the log in seq
    order): each lane's leading events left to the caller, every later one
    checked, link and content."""
    return _walk(_judged_rows(rows))


def _walk(judged: Iterable[Judged]) -> WalkedRange:
    walker = chain.ChainWalker()
    heads = walker.heads
    leading: list[ChainLink] = []
    altered: list[int] = []
    breaks: list[chain.ChainBreak] = []
    lane_events: list[Event] = []
    count = last_seq = 0
    for seq, lane, previous, hash_, changed, lane_row in judged:
        count += 1
        last_seq = seq
        if lane_row is not None:
            lane_events += records.events_from_rows([lane_row])
        if lane not in heads:
            # The head before the range decides this one: the caller's.
            leading.append(ChainLink(seq, lane, previous, hash_))
            if changed:
                altered.append(seq)
            if hash_:
                heads[lane] = hash_
            continue
        found = walker.check_link(seq, lane, previous, hash_)
        if found is None and changed:
            found = chain.altered(seq, lane)
        if found is not None:
            breaks.append(found)
    return WalkedRange(
        events=count,
        last_seq=last_seq,
        leading=leading,
        altered=altered,
        breaks=breaks,
        heads=dict(heads),
        unsealed=walker.unsealed,
        lane_events=lane_events,
    )


def walk_range(engine: Engine, after_seq: int, through_seq: int) -> WalkedRange:
    """walk_rows over the events in (after_seq, through_seq], read in one
    transaction."""
    with translated(), engine.connect() as connection, connection.begin():
        return _walk(_judged_range(connection, after_seq, through_seq))


_BOOKING_KEY = "(lane, reservation_id)"


def booking_lines(
    engine: Engine, after: BookingKey | None, through: BookingKey | None
) -> tuple[int, bytes]:
    """How many bookings have keys in (after, through] (None: from the first,
    to the last), and snapshots.booking_lines of their texts, in key order,
    read in one transaction."""
    conditions: list[str] = []
    parameters: list[str] = []
    if after is not None:
        conditions.append(f"{_BOOKING_KEY} > (?, ?)")
        parameters += after
    if through is not None:
        conditions.append(f"{_BOOKING_KEY} <= (?, ?)")
        parameters += through
    where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
    sql = (
        f"SELECT {', '.join(records.BOOKING_COLUMNS)} FROM {bookings.name}{where} "
        "ORDER BY lane, reservation_id"
    )
    with translated(), engine.connect() as connection, connection.begin():
        result = connection.exec_driver_sql(_paramstyled(engine, sql), tuple(parameters))
        texts = records.booking_texts_from_rows([tuple(row) for row in result])
    return len(texts), snapshots.booking_lines(texts)


# The worker processes' side -----------------------------------------------------

_worker_engines: dict[str, Engine] = {}
# How often a checking process looks whether the process that started it is
# still there.
PARENT_POLL_SECONDS = 1.0


def _start_checking(parent_pid: int) -> None:
    """A checking process's initializer: the process ends itself once the
    process that started it is gone (killed, say), instead of waiting for
    work forever."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(0)

    threading.Thread(target=watch, name="ledger-check-parent", daemon=True).start()


def _in_worker(work: Callable[..., T], url: str, *arguments: Any) -> T | None:
    """walk_range or booking_lines in a worker process; None when the
    database failed (domain errors do not cross a process boundary: the
    caller reports StoreUnavailable)."""
    engine = _worker_engines.get(url)
    if engine is None:
        engine = database.create(url, database.EngineLimits(pool_size=1, pool_max_overflow=0))
        _worker_engines[url] = engine
    try:
        return work(engine, *arguments)
    except LedgerError:
        return None


# The caller's side -------------------------------------------------------------


class ContentChecks:
    """Checks ranges of the log's contents: `submit` returns a future of the
    altered seqs of a range, raising StoreUnavailable from `result` when the
    database failed.

    When the processes cannot run (a program that starts a rebuild from an
    unguarded main module cannot spawn any, as multiprocessing documents) or
    one dies, the ranges are checked in this process instead: slower, never
    skipped."""

    def __init__(self, engine: Engine, processes: int) -> None:
        self._engine = engine
        self._url = database.source_url(engine)
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        # A daemonic process may not start processes of its own.
        if processes > 0 and not multiprocessing.current_process().daemon:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=min(processes, MAX_PROCESSES),
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_checking,
                initargs=(os.getpid(),),
            )

    def submit_walk(
        self, after_seq: int, through_seq: int
    ) -> concurrent.futures.Future[WalkedRange]:
        return self._submit(walk_range, after_seq, through_seq)

    def submit_booking_lines(
        self, after: BookingKey | None, through: BookingKey | None
    ) -> concurrent.futures.Future[tuple[int, bytes]]:
        return self._submit(booking_lines, after, through)

    def _submit(self, work: Callable[..., T], *arguments: Any) -> concurrent.futures.Future[T]:
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        pool = self._pool
        if pool is not None:
            try:
                running = pool.submit(_in_worker, work, self._url, *arguments)
            except (BrokenProcessPool, OSError, AssertionError, RuntimeError):
                # Broken, or its processes could not start (no resources, a
                # daemonic or bootstrapping parent).
                self._broken()
            else:
                running.add_done_callback(lambda ran: self._settle(done, ran, work, arguments))
                return done
        self._run_here(done, work, arguments)
        return done

    def _run_here(
        self,
        done: concurrent.futures.Future[T],
        work: Callable[..., T],
        arguments: tuple[Any, ...],
    ) -> None:
        try:
            done.set_result(work(self._engine, *arguments))
        except Exception as error:
            done.set_exception(error)

    def _broken(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            log.warning("content-checking processes failed; checking in this process")
            pool.shutdown(wait=False, cancel_futures=True)

    def _settle(
        self,
        done: concurrent.futures.Future[T],
        ran: concurrent.futures.Future[T | None],
        work: Callable[..., T],
        arguments: tuple[Any, ...],
    ) -> None:
        try:
            found = ran.result()
        except BrokenProcessPool:
            self._broken()
            self._run_here(done, work, arguments)
            return
        except concurrent.futures.CancelledError:
            done.cancel()
            return
        except Exception as error:
            done.set_exception(error)
            return
        if found is None:
            done.set_exception(StoreUnavailable())
        else:
            done.set_result(found)

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def content_checks(engine: Engine, processes: int) -> Iterator[ContentChecks]:
    checks = ContentChecks(engine, processes)
    try:
        yield checks
    finally:
        checks.close()
