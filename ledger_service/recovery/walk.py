"""The hash chain walked over ranges of the log, the contents checked by
helper processes (spawned, never forked) while this process walks the links
in order (`ChainWalk`), and the digest's lines made in parts (`BookingLines`);
where a helper cannot start or dies, the work is done here (docs/recovery.md).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import operator
import signal
import threading
from collections.abc import Collection, Iterator, Mapping, Sequence
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from typing import Any

from ledger_service.domain import chain
from ledger_service.domain.chain import ChainBreak, ChainWalker
from ledger_service.domain.errors import LedgerError, StoreUnavailable
from ledger_service.domain.events import DenialReason, Event, EventKind, Outcome
from ledger_service.domain.policies import ExpireCharge
from ledger_service.recovery.store import BookingKey, SqlRecoveryStore
from ledger_service.storage import database, records

log = logging.getLogger("ledger.recovery")

# At most this many chain breaks are named; more are only counted.
MAX_NAMED_BREAKS = 1000
# At most this many helper processes, whatever the settings say.
MAX_PROCESSES = 8

# Where a row of EVENT_COLUMNS holds what (they are Event's fields, in order).
_FIELD_NAMES = tuple(field.name for field in dataclasses.fields(Event))
assert (
    tuple("policy_json" if name == "policy" else name for name in _FIELD_NAMES)
    == records.EVENT_COLUMNS
)
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

    def after(self, seq: int) -> list[ChainBreak]:
        return [found for found in self.breaks if found.seq > seq]


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


def walk_links(
    walker: ChainWalker, links: Sequence[Sequence[Any]], altered: Collection[int]
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
    return walk_links(walker, [_link(row) for row in rows], set(altered_seqs(rows)))


def _lane_events(rows: Sequence[Sequence[Any]]) -> list[Event]:
    return records.events_from_rows([row for row in rows if row[_KIND] == _LANE_CONFIGURED])


# What a helper sends for a range: its altered seqs and its lane_configured events.
Content = tuple[list[int], list[Event]]


@contextmanager
def deaf_to_ctrl_c() -> Iterator[None]:
    """Processes started inside ignore Ctrl-C from birth (the command stops
    them); here it is only held back (blocked) until they have started. Off
    the main thread each helper ignores it once it runs (ignore_interrupts)."""
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


def ignore_interrupts() -> None:
    """In a helper process: Ctrl-C is the command's (deaf_to_ctrl_c)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


# What a helper sends instead of its Content when the database failed it.
HELPER_UNAVAILABLE = "the database is unavailable"


def received(message: object) -> Content:
    """A helper's Content; StoreUnavailable for HELPER_UNAVAILABLE."""
    if message == HELPER_UNAVAILABLE:
        raise StoreUnavailable()
    content: Content = message  # type: ignore[assignment]
    return content


def _helper(
    sender: multiprocessing.connection.Connection, url: str, ranges: Sequence[tuple[int, int]]
) -> None:
    """A helper process: each of its ranges' Content, in order (or
    HELPER_UNAVAILABLE); a caller gone ends it."""
    ignore_interrupts()
    engine = database.create(url, database.EngineLimits(pool_size=1, pool_max_overflow=0))
    store = SqlRecoveryStore(engine)
    try:
        for after_seq, through_seq in ranges:
            rows = store.event_rows(after_seq, through_seq)
            sender.send((altered_seqs(rows), _lane_events(rows)))
    except LedgerError:
        sender.send(HELPER_UNAVAILABLE)  # domain errors do not cross a process boundary
    except (BrokenPipeError, EOFError):
        pass
    finally:
        engine.dispose()


class ChainWalk:
    """Each WalkedRange of the ranges ending at `ends`, from `heads` after
    `after_seq`; `processes` helpers, started at once, check every n-th
    range's contents. Its end stops them."""

    def __init__(
        self,
        store: SqlRecoveryStore,
        heads: Mapping[str, str],
        after_seq: int,
        ends: Sequence[int],
        *,
        processes: int = 0,
    ) -> None:
        self._store, self._heads, self._after, self._ends = store, dict(heads), after_seq, ends
        self._helpers: list[tuple[multiprocessing.process.BaseProcess, Any]] = []
        if processes <= 0 or multiprocessing.current_process().daemon:
            return
        context = multiprocessing.get_context("spawn")
        url = database.source_url(store.engine)
        pairs = list(zip([after_seq, *ends], ends, strict=False))
        count = min(processes, MAX_PROCESSES, max(1, len(pairs)))
        for index in range(count):
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(
                target=_helper,
                args=(sender, url, pairs[index::count]),
                name=f"ledger-chain-check-{index}",
                daemon=True,
            )
            try:
                with deaf_to_ctrl_c():
                    process.start()
            except (OSError, RuntimeError) as error:
                log.warning("no chain-checking process (%s); checking in this process", error)
                receiver.close()
                self.__exit__()
                return
            finally:
                sender.close()
            self._helpers.append((process, receiver))

    def __enter__(self) -> ChainWalk:
        return self

    def __exit__(self, *exc_info: object) -> None:
        helpers, self._helpers = self._helpers, []
        for process, receiver in helpers:
            receiver.close()
            process.join(timeout=1)
            if process.is_alive():
                process.kill()
                process.join()

    def _content(self, index: int) -> Content | None:
        """The helpers' Content of the index-th range; None once they failed."""
        if not self._helpers:
            return None
        try:
            message = self._helpers[index % len(self._helpers)][1].recv()
        except (EOFError, OSError):
            log.warning("a chain-checking process died; checking in this process")
            self.__exit__()
            return None
        return received(message)

    def __iter__(self) -> Iterator[WalkedRange]:
        walker = ChainWalker(self._heads)
        after = self._after
        for index, through in enumerate(self._ends):
            content = self._content(index)
            if content is None:
                rows = self._store.event_rows(after, through)
                links = [_link(row) for row in rows]
                altered, lane_events = set(altered_seqs(rows)), _lane_events(rows)
            else:
                links = self._store.link_rows(after, through)
                altered, lane_events = set(content[0]), content[1]
            unsealed = walker.unsealed
            found = walk_links(walker, links, altered)
            heads = dict(walker.heads)
            yield WalkedRange(
                after, through, len(links), found, heads, walker.unsealed - unsealed, lane_events
            )
            after = through


# A rebuild's digest, in parts ---------------------------------------------------

_part_stores: dict[str, SqlRecoveryStore] = {}


def _part_lines(
    url: str, part: tuple[BookingKey | None, BookingKey | None]
) -> tuple[int, bytes] | None:
    """store.booking_lines of one part, in a pool's process; None: the database failed."""
    store = _part_stores.get(url)
    if store is None:
        limits = database.EngineLimits(pool_size=1, pool_max_overflow=0)
        store = _part_stores[url] = SqlRecoveryStore(database.create(url, limits))
    try:
        return store.booking_lines(*part)
    except LedgerError:
        return None


class BookingLines:
    """store.booking_lines of parts, in order, by a pool of `processes`
    (started at once), or here when there are none or they fail."""

    def __init__(self, store: SqlRecoveryStore, processes: int) -> None:
        self._store = store
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        if processes > 0 and not multiprocessing.current_process().daemon:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                min(processes, MAX_PROCESSES),
                mp_context=multiprocessing.get_context("spawn"),
                initializer=ignore_interrupts,
            )
            with deaf_to_ctrl_c():  # the pool starts its processes here
                for _ in range(min(processes, MAX_PROCESSES)):
                    self._pool.submit(int)

    def __enter__(self) -> BookingLines:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def lines(
        self, parts: Sequence[tuple[BookingKey | None, BookingKey | None]]
    ) -> Iterator[tuple[int, bytes]]:
        done = 0
        if self._pool is not None:
            url = database.source_url(self._store.engine)
            try:
                for made in self._pool.map(_part_lines, [url] * len(parts), parts):
                    if made is None:
                        raise StoreUnavailable()
                    done += 1
                    yield made
            except (BrokenProcessPool, OSError) as error:
                log.warning("no digest processes (%s); making the lines here", error)
        for part in parts[done:]:
            yield self._store.booking_lines(*part)
