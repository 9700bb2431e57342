"""One reader of the log's tail for every event stream in the process.

A stream that polled the store itself was woken by every local commit: with n
streams, every commit cost n reads. Here one thread reads each new stretch of
the log once and keeps the newest `buffer_events` in memory; streams take their
events from there. A stream further behind than the buffer reads its own pages
from the store until it reaches it, then joins.

Gap-free as the store's reads are: the feed reads in seq order up to the
store's commit horizon, so everything in (floor, through] is buffered (by
seq, and by lane), and a stream's cursor only ever moves forward. A new
stretch wakes only the streams of its lanes and those of every lane: 64
streams on a quiet lane cost a commit nothing.

A stream whose reader stopped reading blocks in the transport's send; the feed
cancels one that has been blocked for `stall_seconds`, so that it cannot hold
a worker forever.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from ledger_service.application.ports import EventQuery
from ledger_service.domain.errors import LedgerError, ShuttingDown, TooManyWatchers
from ledger_service.domain.events import Event

log = logging.getLogger("ledger.feed")

ReadFn = Callable[[EventQuery], Sequence[Event]]


class CommitSignal(Protocol):
    def generation(self) -> int: ...

    def wait(self, generation: int, timeout_seconds: float) -> None: ...


@dataclasses.dataclass(frozen=True)
class FeedLimits:
    # Streams open at once, in all and for one owner (a grant).
    max_streams: int = 64
    max_streams_per_owner: int = 16
    buffer_events: int = 10_000
    batch_events: int = 500
    poll_interval_seconds: float = 0.2
    stall_seconds: float = 30.0


class _Run:
    """Events in seq order, the oldest dropped first, found by seq in O(log n)."""

    def __init__(self) -> None:
        self._events: list[Event] = []
        self._seqs: list[int] = []
        self._start = 0

    def __len__(self) -> int:
        return len(self._seqs) - self._start

    def append(self, event: Event) -> None:
        self._events.append(event)
        self._seqs.append(event.seq)

    def pop_oldest(self) -> Event:
        event = self._events[self._start]
        self._start += 1
        if self._start > MIN_COMPACTED and self._start * 2 > len(self._seqs):
            del self._events[: self._start], self._seqs[: self._start]
            self._start = 0
        return event

    def after(self, seq: int) -> list[Event]:
        return self._events[bisect.bisect_right(self._seqs, seq, self._start) :]


# The feed reads at most once per this long: under load, a stretch of commits
# costs one read, and an event reaches its streams at most this much later.
READ_EVERY_SECONDS = 0.01
# A run drops its oldest entries from memory in steps of at least this many.
MIN_COMPACTED = 256


class _Stream:
    def __init__(self, owner: str, lane: str, cancel: Callable[[], None]) -> None:
        self.owner = owner
        self.lane = lane
        self.cancel = cancel
        # While the stream's last event is in the transport's hands.
        self.sending_since: float | None = None


class EventFeed:
    def __init__(
        self,
        read: ReadFn,
        last_seq: Callable[[], int],
        signal: CommitSignal,
        limits: FeedLimits,
    ) -> None:
        self._read = read
        self._last_seq = last_seq
        self._signal = signal
        self._limits = limits
        self._lock = threading.Lock()
        # Woken when a stream joins or the feed stops: the reader, idle.
        self._condition = threading.Condition(self._lock)
        # Woken when events come: per lane watched ("" for every lane).
        self._wakes: dict[str, threading.Condition] = {}
        self._all = _Run()
        self._lanes: dict[str, _Run] = {}
        self._floor = 0
        self._through = 0
        # Bumped when the feed restarts from the log's end: a read begun
        # before it is dropped.
        self._epoch = 0
        self._streams: set[_Stream] = set()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="event-feed", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            self._condition.notify_all()
            for wake in self._wakes.values():
                wake.notify_all()

    # The one reader ------------------------------------------------------------

    def _run(self) -> None:
        failing = ""  # the store's refusal last logged, until a read succeeds
        while not self._stopping.is_set():
            with self._condition:
                if not self._streams:  # idle: commits do not wake it, a stream does
                    self._condition.wait(self._limits.poll_interval_seconds)
                    continue
            generation = self._signal.generation()
            began = time.monotonic()
            try:
                self._read_on()
                if failing:
                    log.info("event feed: reading the log again")
                failing = ""
            except LedgerError as error:  # the store is down: streams wait, the feed retries
                if str(error) != failing:  # said once, not at every poll while it lasts
                    log.warning("event feed: %s; will retry", error)
                failing = str(error)
            except Exception:
                log.exception("event feed failed; will retry")
            self._cancel_stalled()
            # Commits that come meanwhile are read together, not one read each.
            self._stopping.wait(max(0.0, began + READ_EVERY_SECONDS - time.monotonic()))
            self._signal.wait(generation, self._limits.poll_interval_seconds)

    def _read_on(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                epoch, after = self._epoch, self._through
            query = EventQuery(after_seq=after, limit=self._limits.batch_events)
            events = self._read(query)
            if not events:
                return
            with self._lock:
                if epoch != self._epoch:
                    return
                self._append(events)
            if len(events) < self._limits.batch_events:
                return

    def _append(self, events: Sequence[Event]) -> None:
        """Buffers a read's events, drops the oldest past the limit, and wakes
        the streams of every lane among them."""
        lanes = set()
        for event in events:
            self._all.append(event)
            self._lanes.setdefault(event.lane, _Run()).append(event)
            lanes.add(event.lane)
        self._through = events[-1].seq
        while len(self._all) > self._limits.buffer_events:
            dropped = self._all.pop_oldest()
            run = self._lanes[dropped.lane]
            run.pop_oldest()
            if not run:
                del self._lanes[dropped.lane]
            self._floor = dropped.seq
        for lane in ("", *lanes):
            wake = self._wakes.get(lane)
            if wake is not None:
                wake.notify_all()

    def _cancel_stalled(self) -> None:
        now = time.monotonic()
        with self._lock:
            stalled = [
                stream
                for stream in self._streams
                if stream.sending_since is not None
                and now - stream.sending_since > self._limits.stall_seconds
            ]
        for stream in stalled:
            log.warning(
                "an event stream's reader took nothing for %.0f s; cancelling it",
                self._limits.stall_seconds,
            )
            stream.sending_since = None
            stream.cancel()

    # The streams ---------------------------------------------------------------

    @contextlib.contextmanager
    def _joined(self, stream: _Stream, lane: str) -> Iterator[None]:
        with self._lock:
            self._admit(stream.owner)
            idle = not self._streams
        if idle:  # nothing was read while no one watched: start at the log's end
            end = self._last_seq()
            with self._lock:
                if not self._streams:
                    self._epoch += 1
                    self._all, self._lanes = _Run(), {}
                    self._floor = self._through = max(self._through, end)
        with self._lock:
            self._admit(stream.owner)
            self._streams.add(stream)
            self._wakes.setdefault(lane, threading.Condition(self._lock))
            self._condition.notify_all()  # wakes the reader if it was idle
        try:
            yield
        finally:
            with self._lock:
                self._streams.discard(stream)
                if not any(other.lane == lane for other in self._streams):
                    self._wakes.pop(lane, None)

    def _admit(self, owner: str) -> None:
        if len(self._streams) >= self._limits.max_streams:
            raise TooManyWatchers(f"{self._limits.max_streams} event streams are open")
        mine = sum(1 for stream in self._streams if stream.owner == owner)
        if owner and mine >= self._limits.max_streams_per_owner:
            raise TooManyWatchers(
                f"this grant has {self._limits.max_streams_per_owner} event streams open"
            )

    def open_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    def events(
        self,
        query: EventQuery,
        keep_going: Callable[[], bool],
        cancel: Callable[[], None],
        owner: str = "",
        accepted: Callable[[], None] = lambda: None,
    ) -> Iterator[Event]:
        """Every event after query.after_seq (of query.lane, when given), then
        each new one as it commits, while keep_going(). Refused with
        TooManyWatchers past the limits (an empty `owner`, a server without
        grants, has only the overall one); `cancel` ends a stalled stream.
        `accepted` is called once the stream is admitted, before any event:
        the server answers its headers then, so a quiet lane's watcher can
        tell an accepted stream from a hung connection.
        Ends with ShuttingDown when the feed stops."""
        stream = _Stream(owner, query.lane, cancel)
        cursor = query.after_seq
        with self._joined(stream, query.lane):
            accepted()
            while keep_going() and not self._stopping.is_set():
                taken = self._take(cursor, query.lane)
                if taken is None:  # behind the buffer: a page of the store's own
                    floor = self._floor
                    page = self._read(dataclasses.replace(query, after_seq=cursor))
                    events: Sequence[Event] = page
                    # A short page read everything up to the horizon, which is
                    # past the floor the feed had already read through.
                    through = cursor if len(page) == query.limit else floor
                else:
                    events, through = taken
                for event in events:
                    stream.sending_since = time.monotonic()
                    yield event
                    stream.sending_since = None
                    cursor = event.seq
                cursor = max(cursor, through)
        if self._stopping.is_set():
            raise ShuttingDown()

    def _take(self, cursor: int, lane: str) -> tuple[list[Event], int] | None:
        """The buffered events (of `lane`, or of every lane) after `cursor`,
        waiting a poll interval for some, and the seq read through; None when
        the buffer no longer reaches back to `cursor`."""
        with self._lock:
            if cursor < self._floor:
                return None
            events = self._after(cursor, lane)
            if not events:
                # None of ours up to what was read: wait where only ours wake us.
                cursor = max(cursor, self._through)
                self._wakes[lane].wait(self._limits.poll_interval_seconds)
                if cursor < self._floor:
                    return None
                events = self._after(cursor, lane)
            return events, max(cursor, self._through)

    def _after(self, cursor: int, lane: str) -> list[Event]:
        run = self._lanes.get(lane) if lane else self._all
        return run.after(cursor) if run is not None else []
