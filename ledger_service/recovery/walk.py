"""The hash chain walked over ranges of the log, the events' contents checked
by a pool of helper processes (docs/recovery.md)."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import multiprocessing
import operator
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from typing import Any

from ledger_service.domain import chain
from ledger_service.domain.chain import ChainBreak, ChainWalker
from ledger_service.domain.errors import LedgerError, StoreUnavailable
from ledger_service.domain.events import DenialReason, Event, EventKind, Outcome
from ledger_service.domain.policies import ExpireCharge
from ledger_service.recovery.store import SqlRecoveryStore
from ledger_service.storage import database, records

log = logging.getLogger("ledger.recovery")

# At most this many chain breaks are named; more are only counted.
MAX_NAMED_BREAKS = 1000
# At most this many helper processes, whatever the settings say.
MAX_PROCESSES = 8
# How often a helper looks whether its parent is still there.
PARENT_CHECK_SECONDS = 0.5

# Where a row of EVENT_COLUMNS holds what (records.py: Event's fields, in order).
_FIELD_NAMES = tuple(field.name for field in dataclasses.fields(Event))
_hashed = operator.itemgetter(*(_FIELD_NAMES.index(name) for name in chain.HASHED_NAMES))
_SEQ, _LANE, _HASH, _PREVIOUS, _POLICY = (
    _FIELD_NAMES.index(name) for name in ("seq", "lane", "hash", "previous_hash", "policy")
)
_KIND, _DENIAL, _CHARGE, _OUTCOME = (
    _FIELD_NAMES.index(name) for name in ("kind", "denial_reason", "expire_charge", "outcome")
)
_LANE_CONFIGURED = EventKind.LANE_CONFIGURED.value
_link = operator.itemgetter(_SEQ, _LANE, _PREVIOUS, _HASH)
# The values enum columns may hold (the optional ones None as well).
_KINDS = frozenset(member.value for member in EventKind)
_DENIALS = frozenset(member.value for member in DenialReason) | {None}
_CHARGES = frozenset(member.value for member in ExpireCharge) | {None}
_OUTCOMES = frozenset(member.value for member in Outcome) | {None}


@dataclasses.dataclass(frozen=True)
class WalkedRange:
    """What the walk found in (after_seq, through_seq], in seq order, and the
    lanes' heads right after it."""

    after_seq: int
    through_seq: int
    events: int
    breaks: Sequence[ChainBreak]
    heads: Mapping[str, str]
    unsealed: int
    # Its lane_configured events, which the fold needs as Events.
    lane_events: Sequence[Event]


@dataclasses.dataclass
class Walk:
    """What walking the chain over a part of the log found."""

    breaks: list[ChainBreak] = dataclasses.field(default_factory=list)
    break_count: int = 0
    unsealed: int = 0
    # The walker's heads right after each requested position.
    heads_at: dict[int, dict[str, str]] = dataclasses.field(default_factory=dict)

    def note(self, found: ChainBreak) -> None:
        self.break_count += 1
        if len(self.breaks) < MAX_NAMED_BREAKS:
            self.breaks.append(found)


def ranges(after_seq: int, through_seq: int, size: int, cuts: Sequence[int] = ()) -> list[int]:
    """The ends of the ranges from after_seq to through_seq: at most `size`
    seqs each, and one ending at each of `cuts` in between."""
    ends: list[int] = []
    pending = collections.deque(sorted({cut for cut in cuts if after_seq < cut < through_seq}))
    at = after_seq
    while at < through_seq:
        end = min(at + size, through_seq)
        if pending and pending[0] <= end:
            end = pending.popleft()
        ends.append(end)
        at = end
    return ends


def _text(row: Sequence[Any]) -> str:
    """chain.canonical_event of the row's event; from its Event (which fails as
    building it does) when it has a policy or a value no enum has."""
    if (
        row[_POLICY] is None
        and row[_KIND] in _KINDS
        and row[_DENIAL] in _DENIALS
        and row[_CHARGE] in _CHARGES
        and row[_OUTCOME] in _OUTCOMES
    ):
        return chain.canonical_values(_hashed(row))
    return chain.canonical_event(records.events_from_rows([row])[0])


def altered_seqs(rows: Sequence[Sequence[Any]]) -> list[int]:
    """The seqs of sealed events among `rows` that no longer give their hash."""
    matches = chain.content_matches
    return [
        row[_SEQ]
        for row in rows
        if row[_HASH] and not matches(row[_PREVIOUS], row[_HASH], _text(row))
    ]


def _walk_links(
    walker: ChainWalker, links: Sequence[Sequence[Any]], altered: set[int]
) -> list[ChainBreak]:
    """What walker.check finds over (seq, lane, previous_hash, hash) links,
    given the seqs whose content does not give their hash."""
    found: list[ChainBreak] = []
    for seq, lane, previous, hash_ in links:
        broken = walker.check_link(seq, lane, previous, hash_)
        if broken is None and seq in altered:
            broken = chain.altered(seq, lane)
        if broken is not None:
            found.append(broken)
    return found


def walk_rows(walker: ChainWalker, rows: Sequence[Sequence[Any]]) -> list[ChainBreak]:
    """What walker.check finds over rows of EVENT_COLUMNS, in seq order."""
    return _walk_links(walker, [_link(row) for row in rows], set(altered_seqs(rows)))


def _lane_events(rows: Sequence[Sequence[Any]]) -> list[Event]:
    return records.events_from_rows([row for row in rows if row[_KIND] == _LANE_CONFIGURED])


# A range's altered seqs and lane_configured events, as a helper finds them.
Content = tuple[list[int], list[Event]]

_stores: dict[str, SqlRecoveryStore] = {}


def _store_for(url: str) -> SqlRecoveryStore:
    """In a helper process: its one store (one connection) on `url`."""
    if url not in _stores:
        limits = database.EngineLimits(pool_size=1, pool_max_overflow=0)
        _stores[url] = SqlRecoveryStore(database.create(url, limits))
    return _stores[url]


def _content(url: str, after_seq: int, through_seq: int) -> Content | None:
    """In a helper: what the walk needs of a range besides its links; None: the database failed."""
    try:
        rows = _store_for(url).event_rows(after_seq, through_seq)
    except LedgerError:  # domain errors do not cross a process boundary
        return None
    return altered_seqs(rows), _lane_events(rows)


def _done(made: Any) -> Any:
    if made is None:
        raise StoreUnavailable()
    return made


def _start_helper(parent: int) -> None:
    """In a helper: Ctrl-C is the command's, which stops the helpers; and it
    ends once its parent is gone (a pool's idle worker would wait for ever)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_end_with, args=(parent,), daemon=True).start()


def _end_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_SECONDS)
    os._exit(1)


class Helpers:
    """A pool of `processes` spawned helpers (none in a daemonic process) that
    check ranges' contents; where they cannot start or die, this thread does."""

    def __init__(self, store: SqlRecoveryStore, processes: int) -> None:
        self._store, self._url = store, database.source_url(store.engine)
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        if processes <= 0 or multiprocessing.current_process().daemon:
            return
        count = min(processes, MAX_PROCESSES)
        try:
            # Making the pool can fail too: its queues' locks need
            # multiprocessing's resource tracker, itself a spawned process.
            self._pool = concurrent.futures.ProcessPoolExecutor(
                count,
                multiprocessing.get_context("spawn"),
                initializer=_start_helper,
                initargs=(os.getpid(),),
            )
            with _deaf_to_ctrl_c():  # the pool starts its processes here
                for _ in range(count):
                    self._pool.submit(int)
        except (OSError, RuntimeError, BrokenProcessPool) as error:
            self._broken(error)

    def __enter__(self) -> Helpers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _broken(self, error: BaseException) -> None:
        log.warning("no helper processes (%s); working in this process", error)
        self.__exit__()
        self._pool = None

    def walk(
        self, heads: Mapping[str, str], after_seq: int, ends: Sequence[int]
    ) -> Iterator[WalkedRange]:
        """Each WalkedRange of the ranges ending at `ends`, from `heads` after `after_seq`."""
        pairs = list(zip([after_seq, *ends], ends, strict=False))
        pending = self._submit(pairs)
        walker = ChainWalker(heads)
        for index, (after, through) in enumerate(pairs):
            content = self._result(pending[index]) if self._pool else None
            if content is None:
                rows = self._store.event_rows(after, through)
                links = [_link(row) for row in rows]
                content = altered_seqs(rows), _lane_events(rows)
            else:
                links = self._store.link_rows(after, through)
            unsealed = walker.unsealed
            found = _walk_links(walker, links, set(content[0]))
            unsealed = walker.unsealed - unsealed
            yield WalkedRange(
                after, through, len(links), found, dict(walker.heads), unsealed, content[1]
            )

    def _submit(self, pairs: Sequence[tuple[int, int]]) -> list[concurrent.futures.Future[Any]]:
        if self._pool is None:
            return []
        try:
            return [self._pool.submit(_content, self._url, *pair) for pair in pairs]
        except (BrokenProcessPool, OSError) as error:  # a submit may start a process
            self._broken(error)
            return []

    def _result(self, future: concurrent.futures.Future[Any]) -> Any:
        """A helper's answer; None once the pool broke (this thread does the rest)."""
        try:
            return _done(future.result())
        except (BrokenProcessPool, OSError) as error:
            self._broken(error)
            return None


@contextmanager
def _deaf_to_ctrl_c() -> Iterator[None]:
    """Processes started inside ignore Ctrl-C from birth (the command stops
    them); here it is only held back until they have started."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
