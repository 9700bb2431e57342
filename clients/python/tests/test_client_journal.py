"""The journal: durable, append-only, one process at a time, a torn tail tolerated."""

from __future__ import annotations

import datetime
import itertools
import json
import pathlib

import pytest
from ledger_client import journal as journal_module
from ledger_client.bookings import ReserveArguments, new_reservation_id
from ledger_client.journal import (
    Journal,
    JournalEntry,
    JournalError,
    JournalFull,
    JournalLocked,
    ReplayResult,
    Source,
    now_text,
)
from ledger_client.outage import OutagePolicy
from ledger_client.outcomes import Ending, Settlement, Usage
from ledger_client.pricing import ModelPrice

LANE = "recall"


def open_journal(path: pathlib.Path, **limits: int) -> Journal:
    return Journal(
        path,
        LANE,
        max_bytes=limits.get("max_bytes", 1 << 20),
        rotate_bytes=limits.get("rotate_bytes", 1 << 19),
    )


def entry(source: Source = Source.ALLOWANCE, hold_nanos: int = 100) -> JournalEntry:
    arguments = ReserveArguments(
        reservation_id=new_reservation_id(),
        model="model-a",
        request_bytes=1234,
        max_output_tokens=256,
        estimate_nanos=90,
        ttl_us=30_000_000,
    )
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    return JournalEntry(LANE, arguments, source, hold_nanos, now_text(), trace_id=trace_id)


SUCCESS = Ending(Settlement.SETTLE_SUCCEEDED, 200, Usage(10, 20, None))


def test_entries_survive_a_reopen(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "journal.jsonl"
    first, second = entry(), entry(Source.LEDGER)
    with open_journal(path) as journal:
        journal.record_reserve(first)
        journal.record_end(first.reservation_id, SUCCESS, 42)
        journal.record_reserve(second)
    with open_journal(path) as journal:
        assert [e.reservation_id for e in journal.pending()] == [
            first.reservation_id,
            second.reservation_id,
        ]
        again = journal.entry(first.reservation_id)
        assert again is not None
        assert again.arguments == first.arguments  # the full Reserve arguments
        assert again.ending == SUCCESS and again.local_charge_nanos == 42
        assert journal.entry(second.reservation_id) == second
        journal.record_replay(first.reservation_id, ReplayResult.LANDED)
    with open_journal(path) as journal:
        assert [e.reservation_id for e in journal.pending()] == [second.reservation_id]
        assert journal.skipped_lines == 0


def test_the_journal_only_ever_grows(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "journal.jsonl"
    snapshots: list[bytes] = []
    with open_journal(path) as journal:
        one = entry()
        for write in (
            lambda: journal.record_reserve(one),
            lambda: journal.record_end(one.reservation_id, SUCCESS, 1),
            lambda: journal.record_replay(one.reservation_id, ReplayResult.LANDED),
            lambda: journal.record_reserve(entry()),
        ):
            write()
            snapshots.append(path.read_bytes())
    for earlier, later in itertools.pairwise(snapshots):
        assert later.startswith(earlier) and len(later) > len(earlier)
    lines = snapshots[-1].decode().splitlines()
    assert [json.loads(line)["kind"] for line in lines] == ["reserve", "end", "replayed", "reserve"]


def test_a_torn_last_line_is_ignored_and_sealed(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "journal.jsonl"
    kept = entry()
    with open_journal(path) as journal:
        journal.record_reserve(kept)
    whole = path.read_bytes()
    torn_line = json.dumps({"v": 1, "kind": "reserve", "reservation_id": "torn"})[:30]
    path.write_bytes(whole + torn_line.encode())  # a crash in the middle of a write

    later = entry()
    with open_journal(path) as journal:
        assert [e.reservation_id for e in journal.pending()] == [kept.reservation_id]
        assert journal.skipped_lines == 1
        journal.record_reserve(later)
    with open_journal(path) as journal:
        assert [e.reservation_id for e in journal.pending()] == [
            kept.reservation_id,
            later.reservation_id,
        ]
        assert journal.skipped_lines == 1, "the torn fragment stays a line of its own"
    assert path.read_bytes().startswith(whole + torn_line.encode() + b"\n")


def test_garbage_and_contradicting_lines_are_skipped(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "journal.jsonl"
    first = entry()
    with open_journal(path) as journal:
        journal.record_reserve(first)
    with path.open("ab") as file:
        file.write(b"[1, 2]\n")
        file.write(b'{"v": 1, "kind": "end", "reservation_id": "nobody"}\n')
        file.write(b'{"v": 99, "kind": "reserve"}\n')
    with open_journal(path) as journal:
        assert len(journal.pending()) == 1
        assert journal.skipped_lines == 3


def test_a_line_nested_past_the_parser_is_skipped_not_fatal(tmp_path: pathlib.Path) -> None:
    """Damage can be any bytes: a line of brackets nested deeper than the JSON
    parser recurses is one more unreadable line, not a RecursionError that
    keeps the lane's client from starting."""
    path = tmp_path / "journal.jsonl"
    kept = entry()
    with open_journal(path) as journal:
        journal.record_reserve(kept)
    with path.open("ab") as file:
        file.write(b"[" * 100_000 + b"]" * 100_000 + b"\n")
    with open_journal(path) as journal:
        assert [e.reservation_id for e in journal.pending()] == [kept.reservation_id]
        assert journal.skipped_lines == 1


def test_a_lost_line_is_logged_never_skipped_silently(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A damaged line in the middle (a disk error, a hand edit) may be the
    Reserve of a call made on the allowance: that call is then neither replayed
    nor counted against the allowance. The lane must say so, at every start."""
    path = tmp_path / "journal.jsonl"
    lost, kept = entry(), entry()
    with open_journal(path) as journal:
        journal.record_reserve(lost)
        journal.record_end(lost.reservation_id, SUCCESS, 42)
        journal.record_reserve(kept)
    lines = path.read_bytes().split(b"\n")
    lines[0] = lines[0][:40] + b"#" + lines[0][41:]
    path.write_bytes(b"\n".join(lines) + b'{"v": 1, "kind"')  # and a torn tail
    with caplog.at_level("WARNING", logger="ledger_client.journal"), open_journal(path) as journal:
        assert [e.reservation_id for e in journal.pending()] == [kept.reservation_id]
        assert journal.skipped_lines == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert str(path) in warnings[0]
    assert "2 unreadable lines" in warnings[0] and "torn last line" in warnings[0]


def test_one_client_at_a_time(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "journal.jsonl"
    with open_journal(path), pytest.raises(JournalLocked) as locked:
        open_journal(path)
    # Held by this very process: the message must not send the lane hunting
    # for another process.
    assert "another client (this process or another)" in str(locked.value)
    assert str(path) in str(locked.value)
    open_journal(path).close()  # free again once closed


def test_a_journal_belongs_to_one_lane(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "journal.jsonl"
    with open_journal(path) as journal:
        journal.record_reserve(entry())
    with pytest.raises(JournalError, match="another lane"):
        Journal(path, "other-lane", max_bytes=1 << 20, rotate_bytes=1 << 19)


def test_a_full_journal_refuses_new_entries_but_takes_endings(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "journal.jsonl"
    with open_journal(path, max_bytes=500, rotate_bytes=500) as journal:
        first = entry()
        journal.record_reserve(first)
        journal.record_reserve(entry())
        with pytest.raises(JournalFull):
            journal.record_reserve(entry())
        journal.record_end(first.reservation_id, SUCCESS, 5)
        journal.record_replay(first.reservation_id, ReplayResult.LANDED)


def test_a_replayed_journal_is_rotated_without_deleting_anything(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "journal.jsonl"
    with open_journal(path, max_bytes=4096, rotate_bytes=200) as journal:
        one = entry()
        journal.record_reserve(one)
        assert journal.rotate_if_replayed() is None, "pending entries keep the file"
        journal.record_end(one.reservation_id, SUCCESS, 5)
        journal.record_replay(one.reservation_id, ReplayResult.LANDED)
        archive = journal.rotate_if_replayed()
        assert archive is not None and archive.exists()
        assert journal.pending() == [] and journal.size_bytes == 0
        journal.record_reserve(entry())
    assert len(archive.read_bytes().splitlines()) == 3
    assert len(path.read_bytes().splitlines()) == 1


def test_rotating_twice_at_one_clock_reading_keeps_both_archives(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The archive is named by the wall clock, which can repeat (stepped back
    by NTP, frozen in a test harness, two rotations in one microsecond): a
    second rotation must not rename over the first archive, deleting it."""

    class FrozenClock(datetime.datetime):
        @classmethod
        def now(cls, tz: datetime.tzinfo | None = None) -> FrozenClock:
            return cls(2026, 10, 26, 12, 0, 0, tzinfo=tz)

    monkeypatch.setattr(journal_module.datetime, "datetime", FrozenClock)
    path = tmp_path / "journal.jsonl"
    archives = []
    with open_journal(path, max_bytes=4096, rotate_bytes=200) as journal:
        for _ in range(2):
            one = entry()
            journal.record_reserve(one)
            journal.record_end(one.reservation_id, SUCCESS, 5)
            journal.record_replay(one.reservation_id, ReplayResult.LANDED)
            archive = journal.rotate_if_replayed()
            assert archive is not None
            archives.append(archive)
    assert archives[0] != archives[1]
    ids = [json.loads(a.read_bytes().splitlines()[0])["reservation_id"] for a in archives]
    assert len(set(ids)) == 2, "each archive keeps its own rotation's lines"


def test_each_line_is_written_whole_before_the_call_returns(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "journal.jsonl"
    with open_journal(path) as journal:
        one = entry()
        journal.record_reserve(one)
        # Another reader sees the whole line at once (it was fsync'd, not buffered).
        record = json.loads(path.read_bytes().decode())
        assert record["reservation_id"] == one.reservation_id
        assert record["request_bytes"] == 1234 and record["estimate_nanos"] == 90
        assert record["ttl_us"] == 30_000_000 and record["lane"] == LANE


def test_cache_counts_survive_a_reopen(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "journal.jsonl"
    cached = Usage(10_000, 500, None, cached_input_tokens=6_000, cache_write_tokens=2_000)
    first = entry()
    with open_journal(path) as journal:
        journal.record_reserve(first)
        journal.record_end(
            first.reservation_id, Ending(Settlement.SETTLE_SUCCEEDED, 200, cached), 7
        )
    with open_journal(path) as journal:
        reread = journal.entry(first.reservation_id)
    assert reread is not None and reread.ending is not None
    assert reread.ending.usage == cached


def test_an_ending_journaled_before_the_cache_counts_reads_them_as_zero(
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "journal.jsonl"
    first = entry()
    with open_journal(path) as journal:
        journal.record_reserve(first)
    old_line = {
        "v": 1,
        "at": now_text(),
        "kind": "end",
        "reservation_id": first.reservation_id,
        "settlement": "settle_succeeded",
        "http_status": 200,
        "usage": {"input_tokens": 10, "output_tokens": 20, "billed_nanos": None},
        "reason": "",
        "local_charge_nanos": 42,
    }
    with path.open("ab") as file:
        file.write(json.dumps(old_line).encode() + b"\n")
    with open_journal(path) as journal:
        reread = journal.entry(first.reservation_id)
        assert journal.skipped_lines == 0
    assert reread is not None and reread.ending is not None
    assert reread.ending.usage == Usage(10, 20, None, cached_input_tokens=0, cache_write_tokens=0)


def test_a_line_the_ledger_would_refuse_is_skipped(tmp_path: pathlib.Path) -> None:
    """ReserveArguments and Ending raise InvalidArgument (not ValueError) for
    what the ledger would refuse: such a line is skipped like any bad one."""
    path = tmp_path / "journal.jsonl"
    first = entry()
    with open_journal(path) as journal:
        journal.record_reserve(first)
    good = json.loads(path.read_text().splitlines()[-1])
    with path.open("ab") as file:
        bad_reserve = {**good, "reservation_id": "another", "request_bytes": -1}
        file.write(json.dumps(bad_reserve).encode() + b"\n")
        bad_end = {"v": 1, "kind": "end", "reservation_id": first.reservation_id,
                   "settlement": "refund", "http_status": 0, "usage": None, "reason": "",
                   "local_charge_nanos": 0}  # fmt: skip
        file.write(json.dumps(bad_end).encode() + b"\n")
    with open_journal(path) as journal:
        assert [e.reservation_id for e in journal.pending()] == [first.reservation_id]
        assert journal.pending()[0].ending is None
        assert journal.skipped_lines == 2


@pytest.mark.parametrize("where", ["a directory", "under a file", "where nothing can be made"])
def test_a_journal_path_that_cannot_hold_a_journal_is_refused_naming_the_setting(
    tmp_path: pathlib.Path, where: str
) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    path = {
        "a directory": tmp_path,
        "under a file": tmp_path / "a-file" / "journal.jsonl",
        "where nothing can be made": pathlib.Path("/proc/ledger-journal.jsonl"),
    }[where]
    with pytest.raises(JournalError, match=r"^journal_path .*: cannot open the journal \("):
        open_journal(path)


def test_a_journal_path_under_a_file_says_not_a_directory(tmp_path: pathlib.Path) -> None:
    # It said "(File exists)", pathlib's mkdir on the file, which points the
    # operator at the wrong problem; the Node client says ENOTDIR.
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(JournalError, match=r"\(Not a directory\)$"):
        open_journal(tmp_path / "a-file" / "journal.jsonl")
    with pytest.raises(JournalError, match=r"\(Not a directory\)$"):
        open_journal(tmp_path / "a-file" / "deeper" / "journal.jsonl")


def test_an_empty_journal_path_is_refused_naming_the_setting() -> None:
    # pathlib reads "" as ".", the working directory: never a journal.
    prices = {"model-a": ModelPrice(1, 1)}
    with pytest.raises(ValueError, match="journal_path"):
        OutagePolicy.allowance(max_nanos=1, max_calls=1, journal_path="", prices=prices)
    with pytest.raises(ValueError, match="journal_path"):
        OutagePolicy.allowance(max_nanos=1, max_calls=1, journal_path=None, prices=prices)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="journal_path"):
        OutagePolicy.deny("")
