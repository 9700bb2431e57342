"""The event feed (application/feed.py): one reader of the log's tail, many streams.

Driven with an in-memory log and a real thread; no server, no database.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from ledger_service.application.feed import EventFeed, FeedLimits
from ledger_service.application.ledger import EventSignal
from ledger_service.application.ports import EventQuery
from ledger_service.domain.errors import ShuttingDown, StoreUnavailable, TooManyWatchers
from ledger_service.domain.events import Event, EventKind

WAIT_SECONDS = 5.0


class Log:
    """Events in seq order, with holes (a rolled-back append leaves one)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.reads = 0
        self.signal = EventSignal()
        self._lock = threading.Lock()

    def append(self, lane: str, count: int = 1, *, skip: int = 0) -> None:
        with self._lock:
            for _ in range(count):
                seq = (self.events[-1].seq if self.events else 0) + 1 + skip
                self.events.append(
                    Event(kind=EventKind.RESERVED, lane=lane, occurred_at_us=seq, seq=seq)
                )
        self.signal.notify()

    def read(self, query: EventQuery) -> Sequence[Event]:
        with self._lock:
            self.reads += 1
            found = [
                event
                for event in self.events
                if event.seq > query.after_seq and (not query.lane or event.lane == query.lane)
            ]
        return found[: query.limit]

    def last_seq(self) -> int:
        with self._lock:
            return self.events[-1].seq if self.events else 0


@pytest.fixture
def log() -> Log:
    return Log()


def _feed(log: Log, **limits: object) -> EventFeed:
    values: dict[str, object] = {"buffer_events": 20, "batch_events": 7}
    values.update(limits)
    values.setdefault("poll_interval_seconds", 0.02)
    feed = EventFeed(log.read, log.last_seq, log.signal, FeedLimits(**values))  # type: ignore[arg-type]
    feed.start()
    return feed


class Reader:
    """A stream's consumer on a thread of its own."""

    def __init__(self, stream: Iterator[Event], *, pause_after: int | None = None) -> None:
        self.seqs: list[int] = []
        self.error: Exception | None = None
        self._stream = stream
        self._pause_after = pause_after
        self.resume = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for event in self._stream:
                self.seqs.append(event.seq)
                if self._pause_after is not None and len(self.seqs) == self._pause_after:
                    self.resume.wait(WAIT_SECONDS)
        except Exception as error:
            self.error = error

    def wait_for(self, count: int) -> list[int]:
        give_up = time.monotonic() + WAIT_SECONDS
        while len(self.seqs) < count and time.monotonic() < give_up and self.error is None:
            time.sleep(0.005)
        return list(self.seqs)

    def join(self) -> None:
        self._thread.join(WAIT_SECONDS)


def _logged(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    """Whether a record containing `text` is logged within WAIT_SECONDS: a
    background thread's line, waited for rather than expected at once."""
    give_up = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < give_up:
        if any(text in record.getMessage() for record in list(caplog.records)):
            return True
        time.sleep(0.005)
    return False


def _stream(feed: EventFeed, after: int = 0, lane: str = "", **kwargs: object) -> Reader:
    stop = threading.Event()
    stream = feed.events(
        EventQuery(lane=lane, after_seq=after, limit=5),
        lambda: not stop.is_set(),
        stop.set,
        **kwargs,  # type: ignore[arg-type]
    )
    reader = Reader(stream)
    reader.stop = stop  # type: ignore[attr-defined]
    return reader


def test_a_stream_gets_the_past_then_each_new_event_once_in_order(log: Log) -> None:
    log.append("a", 30)
    feed = _feed(log)
    reader = _stream(feed)
    assert reader.wait_for(30) == list(range(1, 31))
    log.append("a", 45)  # more than the buffer holds, in several reads
    log.append("b", 3, skip=2)  # holes in the seqs
    expected = [*range(1, 76), 78, 81, 84]
    assert reader.wait_for(len(expected)) == expected
    feed.stop()
    reader.join()
    assert isinstance(reader.error, ShuttingDown)
    assert reader.seqs == expected


def test_many_streams_cost_one_read_of_each_new_stretch(log: Log) -> None:
    feed = _feed(log, poll_interval_seconds=1.0)
    readers = [_stream(feed) for _ in range(8)]
    give_up = time.monotonic() + WAIT_SECONDS
    while feed.open_streams() < 8 and time.monotonic() < give_up:
        time.sleep(0.005)
    log.reads = 0
    log.append("a", 7)
    for reader in readers:
        assert reader.wait_for(7) == list(range(1, 8))
    # One full batch and the short read after it, whatever the number of streams.
    assert log.reads <= 3
    feed.stop()


def test_a_lane_stream_gets_its_lane_only_and_one_far_behind_catches_up(log: Log) -> None:
    log.append("a", 10)
    log.append("b", 10)
    feed = _feed(log)
    live = _stream(feed, lane="b")
    assert live.wait_for(10) == list(range(11, 21))
    log.append("a", 50)
    log.append("b", 2)
    assert live.wait_for(12) == [*range(11, 21), 71, 72]
    # Joins after the buffer has moved past seq 3: its first pages come from the log.
    late = _stream(feed, after=3, lane="a")
    assert late.wait_for(57) == [*range(4, 11), *range(21, 71)]
    feed.stop()


def test_a_reader_that_pauses_past_the_buffer_misses_nothing(log: Log) -> None:
    feed = _feed(log)
    stop = threading.Event()
    reader = Reader(
        feed.events(EventQuery(after_seq=0, limit=5), lambda: not stop.is_set(), stop.set),
        pause_after=1,
    )
    log.append("a")
    assert reader.wait_for(1) == [1]
    log.append("a", 100)  # five times the buffer while the reader sleeps
    # Another stream from the same place has them all: the feed has read past
    # the buffer's reach back to it (or that stream fell behind it as well).
    assert _stream(feed, after=1).wait_for(100) == list(range(2, 102))
    reader.resume.set()
    assert reader.wait_for(101) == list(range(1, 102))
    feed.stop()


def test_the_limits_hold_overall_and_per_grant(log: Log) -> None:
    feed = _feed(log, max_streams=3, max_streams_per_owner=2)
    first = [_stream(feed, owner="g1"), _stream(feed, owner="g1")]
    give_up = time.monotonic() + WAIT_SECONDS
    while feed.open_streams() < 2 and time.monotonic() < give_up:
        time.sleep(0.005)
    refused = _stream(feed, owner="g1")
    refused.join()
    assert isinstance(refused.error, TooManyWatchers)
    assert "this grant" in str(refused.error)
    _stream(feed, owner="g2")
    while feed.open_streams() < 3 and time.monotonic() < give_up:
        time.sleep(0.005)
    full = _stream(feed, owner="g3")
    full.join()
    assert isinstance(full.error, TooManyWatchers)
    # A stream that ends gives its slot back.
    first[0].stop.set()  # type: ignore[attr-defined]
    first[0].join()
    while feed.open_streams() > 2 and time.monotonic() < give_up:
        time.sleep(0.005)
    assert feed.open_streams() == 2
    feed.stop()


def test_a_stream_blocked_in_its_send_is_cancelled_after_the_stall_limit(log: Log) -> None:
    feed = _feed(log, stall_seconds=0.1)
    cancelled = threading.Event()
    stream = feed.events(EventQuery(after_seq=0, limit=5), lambda: True, cancelled.set)
    log.append("a")
    assert next(stream).seq == 1  # handed over; the "transport" never asks for more
    assert cancelled.wait(WAIT_SECONDS)
    feed.stop()


def test_a_store_that_keeps_refusing_is_logged_once_until_it_reads_again(
    log: Log, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ledger.feed")
    refusing = threading.Event()
    refusing.set()
    read = log.read

    def flaky(query: EventQuery) -> Sequence[Event]:
        if refusing.is_set():
            log.reads += 1
            raise StoreUnavailable()
        return read(query)

    log.read = flaky  # type: ignore[method-assign]
    feed = _feed(log)
    reader = _stream(feed)
    give_up = time.monotonic() + WAIT_SECONDS
    while log.reads < 10 and time.monotonic() < give_up:
        time.sleep(0.01)
    refusing.clear()
    log.append("a")
    assert reader.wait_for(1) == [1]
    # The feed hands the event to the streams before it logs its return, so
    # the reader may have it first: wait for the line, not for a time.
    assert _logged(caplog, "reading the log again")
    feed.stop()
    warnings = [record for record in caplog.records if "will retry" in record.getMessage()]
    assert log.reads >= 10 and len(warnings) == 1, (log.reads, warnings)
