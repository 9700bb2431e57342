"""One reader of the log's tail for every event stream in the process.

A stream that polled the store itself was woken by every local commit: with n
streams, every commit cost n reads. Here one thread reads each new stretch of
the log once and keeps the newest `buffer_events` in memory; streams take their
events from there. A stream further behind than the buffer reads its own pages
from the store until it reaches it, then joins.

Gap-free as the store's reads are: the feed reads in seq order up to the
store's commit horizon, so everything in (floor, through] is buffered, and a
stream's cursor only ever moves forward.

A stream whose reader stopped reading blocks in the transport's send; the feed
cancels one that has been blocked for `stall_seconds`, so that it cannot hold
a worker forever.
"""

from __future__ import annotations

import collections
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


@dataclasses.dataclass(frozen=True)
class _Stretch:
    """Every event of the log in (after_seq, through_seq]."""

    after_seq: int
    through_seq: int
    events: tuple[Event, ...]


class _Stream:
    def __init__(self, owner: str, cancel: Callable[[], None]) -> None:
        self.owner = owner
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
        self._condition = threading.Condition()
        self._stretches: collections.deque[_Stretch] = collections.deque()
        self._buffered = 0
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
        with self._condition:
            self._condition.notify_all()

    # The one reader ------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            generation = self._signal.generation()
            try:
                if self._any_streams():
                    self._read_on()
            except LedgerError as error:  # the store is down: streams wait, the feed retries
                log.warning("event feed: %s; will retry", error)
            except Exception:
                log.exception("event feed failed; will retry")
            self._cancel_stalled()
            self._signal.wait(generation, self._limits.poll_interval_seconds)

    def _any_streams(self) -> bool:
        with self._condition:
            return bool(self._streams)

    def _read_on(self) -> None:
        while not self._stopping.is_set():
            with self._condition:
                epoch, after = self._epoch, self._through
            query = EventQuery(after_seq=after, limit=self._limits.batch_events)
            events = tuple(self._read(query))
            if not events:
                return
            with self._condition:
                if epoch != self._epoch:
                    return
                self._append(_Stretch(after, events[-1].seq, events))
                self._condition.notify_all()
            if len(events) < self._limits.batch_events:
                return

    def _append(self, stretch: _Stretch) -> None:
        self._stretches.append(stretch)
        self._through = stretch.through_seq
        self._buffered += len(stretch.events)
        while self._buffered > self._limits.buffer_events and len(self._stretches) > 1:
            dropped = self._stretches.popleft()
            self._buffered -= len(dropped.events)
            self._floor = dropped.through_seq

    def _cancel_stalled(self) -> None:
        now = time.monotonic()
        with self._condition:
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
    def _joined(self, stream: _Stream) -> Iterator[None]:
        with self._condition:
            self._admit(stream.owner)
            idle = not self._streams
        if idle:  # nothing was read while no one watched: start at the log's end
            end = self._last_seq()
            with self._condition:
                if not self._streams:
                    self._epoch += 1
                    self._stretches.clear()
                    self._buffered = 0
                    self._floor = self._through = max(self._through, end)
        with self._condition:
            self._admit(stream.owner)
            self._streams.add(stream)
        try:
            yield
        finally:
            with self._condition:
                self._streams.discard(stream)

    def _admit(self, owner: str) -> None:
        if len(self._streams) >= self._limits.max_streams:
            raise TooManyWatchers(f"{self._limits.max_streams} event streams are open")
        mine = sum(1 for stream in self._streams if stream.owner == owner)
        if owner and mine >= self._limits.max_streams_per_owner:
            raise TooManyWatchers(
                f"this grant has {self._limits.max_streams_per_owner} event streams open"
            )

    def open_streams(self) -> int:
        with self._condition:
            return len(self._streams)

    def events(
        self,
        query: EventQuery,
        keep_going: Callable[[], bool],
        cancel: Callable[[], None],
        owner: str = "",
    ) -> Iterator[Event]:
        """Every event after query.after_seq (of query.lane, when given), then
        each new one as it commits, while keep_going(). Refused with
        TooManyWatchers past the limits (an empty `owner`, a server without
        grants, has only the overall one); `cancel` ends a stalled stream.
        Ends with ShuttingDown when the feed stops."""
        stream = _Stream(owner, cancel)
        cursor = query.after_seq
        with self._joined(stream):
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
        """The buffered events after `cursor`, waiting a poll interval for
        some; None when the buffer no longer reaches back to `cursor`."""
        with self._condition:
            if cursor < self._floor:
                return None
            if self._through <= cursor:
                self._condition.wait(self._limits.poll_interval_seconds)
                if cursor < self._floor:
                    return None
            newer = []
            for stretch in reversed(self._stretches):
                if stretch.through_seq <= cursor:
                    break
                newer.append(stretch)
            through = self._through
        taken = [
            event
            for stretch in reversed(newer)
            for event in stretch.events
            if event.seq > cursor and (not lane or event.lane == lane)
        ]
        return taken, max(cursor, through)
