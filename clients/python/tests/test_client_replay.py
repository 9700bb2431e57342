"""The journal replay against an in-memory ledger: bounded, resumable, once."""

from __future__ import annotations

import pathlib
import shutil
import time

import pytest
from client_fakes import FakeLedger
from ledger_client import ClientSettings, ReplayResult, Source
from ledger_client.bookings import ReserveArguments, new_reservation_id
from ledger_client.journal import Journal, JournalEntry, now_text
from ledger_client.outcomes import Ending, Settlement, Usage
from ledger_client.replay import ORPHAN_REASON, Replayer

LANE = "lane"
SETTINGS = ClientSettings(replay_interval_seconds=None, max_replay_entries_per_attempt=50)
SUCCESS = Ending(Settlement.SETTLE_SUCCEEDED, 200, Usage(10, 10))


def open_journal(path: pathlib.Path) -> Journal:
    return Journal(path, LANE, max_bytes=1 << 20, rotate_bytes=1 << 19)


def journal_calls(journal: Journal, count: int, *, ended: bool = True) -> list[str]:
    ids = []
    for _ in range(count):
        arguments = ReserveArguments(new_reservation_id(), "model-a", 100, 10)
        journal.record_reserve(JournalEntry(LANE, arguments, Source.ALLOWANCE, 110, now_text()))
        if ended:
            journal.record_end(arguments.reservation_id, SUCCESS, 30)
        ids.append(arguments.reservation_id)
    return ids


@pytest.fixture
def journal(tmp_path: pathlib.Path):
    with open_journal(tmp_path / "journal.jsonl") as opened:
        yield opened


def test_replay_lands_each_call_with_its_original_id(journal: Journal) -> None:
    fake = FakeLedger()
    ids = journal_calls(journal, 3)
    report = Replayer(fake, journal, SETTINGS).replay_once()
    assert (report.landed, report.remaining, report.stopped_early) == (3, 0, False)
    assert fake.event_counts() == {rid: ["reserved", "settled"] for rid in ids}
    assert [fake.bookings[rid].arguments.reservation_id for rid in ids] == ids


def test_replaying_twice_books_nothing_twice(tmp_path: pathlib.Path) -> None:
    """A crash after the ledger answered but before `replayed` was journaled."""
    fake = FakeLedger()
    path = tmp_path / "journal.jsonl"
    with open_journal(path) as journal:
        ids = journal_calls(journal, 3)
    shutil.copy(path, tmp_path / "before-replay.jsonl")
    with open_journal(path) as journal:
        assert Replayer(fake, journal, SETTINGS).replay_once().landed == 3
    shutil.copy(tmp_path / "before-replay.jsonl", path)  # the markers were lost
    with open_journal(path) as journal:
        assert Replayer(fake, journal, SETTINGS).replay_once().landed == 3
        assert journal.pending() == []
    assert fake.event_counts() == {rid: ["reserved", "settled"] for rid in ids}


def test_an_attempt_is_bounded_and_the_next_resumes(journal: Journal) -> None:
    fake = FakeLedger()
    ids = journal_calls(journal, 5)
    replayer = Replayer(fake, journal, SETTINGS)
    first = replayer.replay_once(max_entries=2)
    assert (first.landed, first.remaining, first.stopped_early) == (2, 3, True)
    second = replayer.replay_once(max_entries=2)
    assert (second.landed, second.remaining) == (2, 1)
    third = replayer.replay_once()
    assert (third.landed, third.remaining, third.stopped_early) == (1, 0, False)
    assert [rid for _, rid in fake.events[::2]] == ids, "in journal order"


def test_an_attempt_stops_when_the_ledger_goes_away_and_resumes(journal: Journal) -> None:
    fake = FakeLedger()
    ids = journal_calls(journal, 4)
    fake.calls_until_outage = 3  # reserve+settle of the first, then the reserve of the second
    replayer = Replayer(fake, journal, SETTINGS)
    report = replayer.replay_once()
    assert (report.landed, report.remaining, report.stopped_early) == (1, 3, True)
    fake.reachable, fake.calls_until_outage = True, None
    assert replayer.replay_once().landed == 3
    assert fake.event_counts() == {rid: ["reserved", "settled"] for rid in ids}


def test_an_orphan_of_a_dead_process_ends_unknown(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "journal.jsonl"
    with open_journal(path) as journal:
        (orphan,) = journal_calls(journal, 1, ended=False)  # the lane died mid-call
    fake = FakeLedger()
    with open_journal(path) as journal:
        assert Replayer(fake, journal, SETTINGS).replay_once().landed == 1
    ending = fake.bookings[orphan].ending
    assert ending is not None and ending.settlement is Settlement.SETTLE_UNKNOWN
    assert ending.reason == ORPHAN_REASON


def test_a_call_in_flight_in_this_process_is_left_alone(journal: Journal) -> None:
    fake = FakeLedger()
    (running,) = journal_calls(journal, 1, ended=False)
    replayer = Replayer(fake, journal, SETTINGS)
    replayer.hold(running)
    report = replayer.replay_once()
    assert (report.landed, report.remaining) == (0, 1) and fake.events == []
    journal.record_end(running, SUCCESS, 30)
    replayer.release(running)
    assert replayer.replay_once().landed == 1


def test_a_replayed_reserve_the_ledger_denies_is_reported_and_resolved(journal: Journal) -> None:
    fake = FakeLedger(limit_nanos=150)  # room for one hold of 110
    first, second = journal_calls(journal, 2)
    report = Replayer(fake, journal, SETTINGS).replay_once()
    assert (report.landed, report.denied, report.remaining) == (1, 1, 0)
    entry = journal.entry(second)
    assert entry is not None and entry.replay is ReplayResult.DENIED
    assert fake.event_counts() == {first: ["reserved", "settled"], second: ["denied"]}


def test_a_conflict_is_rejected_for_good_not_retried_for_ever(journal: Journal) -> None:
    fake = FakeLedger()
    (rid,) = journal_calls(journal, 1)
    # Someone booked this id with other arguments.
    fake.reserve_arguments(ReserveArguments(rid, "model-a", 999, 10))
    report = Replayer(fake, journal, SETTINGS).replay_once()
    assert (report.rejected, report.remaining) == (1, 0)
    entry = journal.entry(rid)
    assert entry is not None and entry.replay_detail == "ALREADY_EXISTS"


def test_background_replay_runs_and_stops(tmp_path: pathlib.Path) -> None:
    fake = FakeLedger()
    with open_journal(tmp_path / "journal.jsonl") as journal:
        journal_calls(journal, 2)
        replayer = Replayer(fake, journal, SETTINGS)
        replayer.start(interval_seconds=60.0)
        try:
            replayer.wake()
            for _ in range(200):
                if not journal.pending():
                    break
                time.sleep(0.01)
        finally:
            replayer.stop()
        assert journal.pending() == []


def test_an_orphan_whose_own_ending_reached_the_ledger_has_landed(tmp_path: pathlib.Path) -> None:
    """The lane's Settle reached the ledger and the process died before it
    journaled the ending. The replay's UNKNOWN then meets that ending, which
    was reported as refused for good, for an operator to look at."""
    path = tmp_path / "journal.jsonl"
    fake = FakeLedger()
    arguments = ReserveArguments(new_reservation_id(), "model-a", 100, 10)
    with open_journal(path) as journal:
        fake.reserve_arguments(arguments)
        journal.record_reserve(JournalEntry(LANE, arguments, Source.LEDGER, 110, now_text()))
        fake.end(arguments.reservation_id, SUCCESS)  # its answer never journaled
    with open_journal(path) as journal:
        report = Replayer(fake, journal, SETTINGS).replay_once()
        assert (report.landed, report.rejected, report.remaining) == (1, 0, 0)
        entry = journal.entry(arguments.reservation_id)
        assert entry is not None and entry.replay is ReplayResult.LANDED
    assert fake.event_counts() == {arguments.reservation_id: ["reserved", "settled"]}
    ending = fake.bookings[arguments.reservation_id].ending
    assert ending is not None and ending.settlement is Settlement.SETTLE_SUCCEEDED


def test_a_journaled_ending_the_ledger_holds_otherwise_is_still_rejected(
    journal: Journal,
) -> None:
    fake = FakeLedger()
    arguments = ReserveArguments(new_reservation_id(), "model-a", 100, 10)
    fake.reserve_arguments(arguments)
    fake.end(arguments.reservation_id, Ending(Settlement.REFUND, 403, None))
    journal.record_reserve(JournalEntry(LANE, arguments, Source.LEDGER, 110, now_text()))
    journal.record_end(arguments.reservation_id, SUCCESS, 30)
    report = Replayer(fake, journal, SETTINGS).replay_once()
    assert (report.landed, report.rejected) == (0, 1)
