"""`ledger history --limit N` shows the newest N events, however long the log:
it once read forward from the start for a bounded number of pages and showed
the last N of those (the oldest part of a long log), exiting 0.

Against a fake ListEvents that pages as the server does (small pages, holes in
the seqs, a lane filter), so that a log far past the paging bound costs
nothing to build."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

import pytest
from google.protobuf import duration_pb2, timestamp_pb2

from ledger_service.cli import exits, observe, reading
from ledger_service.cli.connection import MAX_PAGES
from ledger_service.generated.ledger.v1 import ledger_pb2 as pb


@dataclasses.dataclass
class _FakeLedger:
    events: list[pb.Event]
    max_page: int
    calls: int = 0

    def ListEvents(self, request: pb.ListEventsRequest, **_: Any) -> pb.ListEventsResponse:
        self.calls += 1
        after = int(request.page_token) if request.page_token else request.after_seq
        size = min(request.page_size or 100, self.max_page)
        found = [
            event
            for event in self.events
            if event.seq > after and (not request.lane or event.lane == request.lane)
        ]
        page = found[:size]
        token = str(page[-1].seq) if len(found) > size else ""
        return pb.ListEventsResponse(events=page, next_page_token=token)


@dataclasses.dataclass
class _FakeSession:
    ledger: _FakeLedger

    def options(self) -> dict[str, Any]:
        return {}


def _log(count: int) -> list[pb.Event]:
    # Every seventh seq is a hole; lanes alternate.
    seqs = [seq for seq in range(1, count * 7 // 6 + 2) if seq % 7][:count]
    return [pb.Event(seq=seq, lane="a" if seq % 2 else "b") for seq in seqs]


@pytest.mark.parametrize(
    ("count", "limit", "lane", "after_seq"),
    [
        (0, 5, "", 0),
        (3, 5, "", 0),
        (5, 5, "", 0),
        (6, 5, "", 0),
        (2_500, 3, "", 0),
        (2_500, 3, "b", 0),
        (2_500, 40, "a", 1_000),
        (2_500, 3, "", 2_900),
    ],
)
def test_history_shows_the_newest_events(count: int, limit: int, lane: str, after_seq: int) -> None:
    log = _log(count)
    fake = _FakeLedger(log, max_page=5)
    assert count < 1_000 or count > MAX_PAGES * fake.max_page, "the log must pass the bound"
    arguments = argparse.Namespace(lane=lane, reservation_id="")
    events, last_seq = reading.recent_events(arguments, _FakeSession(fake), after_seq, limit)  # type: ignore[arg-type]
    matching = [e for e in log if e.seq > after_seq and (not lane or e.lane == lane)]
    assert [e.seq for e in events] == [e.seq for e in matching[-limit:]]
    assert last_seq == (matching[-1].seq if matching else after_seq)
    assert fake.calls < 200


DAY_US = 86_400 * 1_000_000
START_US = 1_800_000_000 * 1_000_000


def _dated_log(count: int) -> list[pb.Event]:
    """`count` events of lane "a", one every hundredth of a day, with holes."""
    seqs = [seq for seq in range(1, count * 7 // 6 + 2) if seq % 7][:count]
    events = []
    for index, seq in enumerate(seqs):
        at_us = START_US + index * DAY_US // 100
        stamp = timestamp_pb2.Timestamp(seconds=at_us // 10**6, nanos=at_us % 10**6 * 1000)
        events.append(pb.Event(seq=seq, lane="a", occurred_at=stamp))
    return events


@pytest.mark.parametrize("count", [0, 50, 150, 2_500])
def test_the_report_reads_the_windows_of_a_long_lived_lane(count: int) -> None:
    """The report's two windows (a day each here) are the end of the lane's
    history: it once read from the lane's first event for a bounded number of
    pages, and on a long-lived lane never reached them."""
    log = _dated_log(count)
    fake = _FakeLedger(log, max_page=5)
    end_us = START_US + max(count - 1, 0) * DAY_US // 100
    as_of = timestamp_pb2.Timestamp(seconds=end_us // 10**6, nanos=end_us % 10**6 * 1000)
    balance = pb.Balance(lane="a", as_of=as_of, window=duration_pb2.Duration(seconds=86_400))
    kept, earlier, truncated = observe.window_events("a", balance, _FakeSession(fake))  # type: ignore[arg-type]
    assert not truncated
    in_window = [e.seq for e in log if end_us - DAY_US < _micros(e) <= end_us]
    before = [e.seq for e in log if end_us - 2 * DAY_US < _micros(e) <= end_us - DAY_US]
    assert [e.seq for e in kept] == in_window
    assert [e.seq for e in earlier] == before
    assert fake.calls < 200


def _micros(event: pb.Event) -> int:
    return event.occurred_at.seconds * 10**6 + event.occurred_at.nanos // 1000


@dataclasses.dataclass
class _FollowedLedger(_FakeLedger):
    """Its stream sends every event after the position asked, then ends."""

    def WatchEvents(self, request: pb.WatchEventsRequest, **_: Any) -> Any:
        return _Stream([e for e in self.events if e.seq > request.after_seq])


@dataclasses.dataclass
class _Stream:
    events: list[pb.Event]

    def __iter__(self) -> Any:
        return iter(self.events)

    def initial_metadata(self) -> tuple[()]:
        return ()

    def cancel(self) -> None:
        pass


@dataclasses.dataclass
class _FollowSession(_FakeSession):
    metadata: tuple[()] = ()
    server: str = "127.0.0.1:1"


def test_a_follow_resumed_after_a_seq_skips_none_of_the_events_after_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A follow that could not resume says `resume with --after-seq N`; run so,
    `history --after-seq N --follow` printed only the newest --limit (50) events
    after N and followed from the last, silently skipping the rest of what was
    logged while it was away."""
    log = _log(120)
    resumed_after = log[9].seq
    session = _FollowSession(_FollowedLedger(log, max_page=5))
    arguments = argparse.Namespace(
        lane="", reservation_id="", limit="50", after_seq=str(resumed_after), follow=True, json=True
    )
    with pytest.raises(exits.CliError, match="ended the stream"):
        reading.history(arguments, session)  # type: ignore[arg-type]
    printed = [json.loads(line)["seq"] for line in capsys.readouterr().out.splitlines()]
    assert printed == [e.seq for e in log if e.seq > resumed_after]
