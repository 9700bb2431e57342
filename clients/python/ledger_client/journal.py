"""The local journal: an append-only file of JSON lines, fsync'd line by line.

It holds what the ledger has not heard yet: calls made on the outage allowance
(written BEFORE the model call, with the full Reserve arguments and the
reservation_id), endings that could not reach the ledger, and Reserves that got
no answer. Later lines record each call's ending and, once the ledger has
acknowledged it, that it was replayed. Lines are never rewritten: the state of
an entry is the fold of its lines, so a crash at any point leaves a journal
that reads back to a consistent state. A torn last line (a crash in the middle
of a write) is ignored, and the next write starts on a fresh line.

One journal belongs to one lane and one process at a time (an exclusive
advisory lock enforces it).
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import errno
import fcntl
import json
import logging
import os
import pathlib
import threading
from typing import Any

from ledger_client.bookings import ReserveArguments
from ledger_client.errors import InvalidArgument
from ledger_client.outcomes import Ending, Settlement, Usage

log = logging.getLogger("ledger_client.journal")

FORMAT_VERSION = 1
# A journal is read whole at start-up; past this multiple of max_bytes it is not
# read at all (an operator must look at it) rather than read without bound.
READ_LIMIT_FACTOR = 4
# Archives a rotation may find already named by one clock reading.
MAX_ARCHIVES_PER_STAMP = 1_000


class JournalError(Exception):
    """The journal cannot be used; a lane in outage then fails closed."""


class JournalFull(JournalError):
    pass


class JournalLocked(JournalError):
    pass


class Source(enum.Enum):
    # Made on the outage allowance: the ledger has not seen its Reserve.
    ALLOWANCE = "allowance"
    # Admitted by the ledger; only its ending did not reach the ledger.
    LEDGER = "ledger"
    # The Reserve got no answer, so the call was not made; the ledger may or may
    # not hold a booking for it, which the replay refunds if it does.
    IN_DOUBT = "in_doubt"


class ReplayResult(enum.Enum):
    LANDED = "landed"  # the ledger has the booking and its ending
    DENIED = "denied"  # the ledger denied the replayed Reserve: spent without a booking
    ABSENT = "absent"  # an in-doubt Reserve never reached the ledger: nothing to undo
    REJECTED = "rejected"  # refused for good (see detail); an operator must look
    # An in-doubt Reserve sent again under its id and admitted: the call that
    # followed owns the booking and ends it, so there is nothing to refund.
    SUPERSEDED = "superseded"


@dataclasses.dataclass(frozen=True)
class JournalEntry:
    lane: str
    arguments: ReserveArguments
    source: Source
    local_hold_nanos: int
    written_at: str
    ending: Ending | None = None
    local_charge_nanos: int = 0
    replay: ReplayResult | None = None
    replay_detail: str = ""
    # The W3C trace id of the model call, so that its replay joins the same trace.
    trace_id: str = ""

    @property
    def reservation_id(self) -> str:
        return self.arguments.reservation_id


def now_text() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="microseconds")


def _line(record: dict[str, Any]) -> bytes:
    record = {"v": FORMAT_VERSION, "at": now_text(), **record}
    text = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return text.encode("ascii") + b"\n"


def _reserve_record(entry: JournalEntry) -> dict[str, Any]:
    arguments = entry.arguments
    return {
        "kind": "reserve",
        "at": entry.written_at,
        "lane": entry.lane,
        "source": entry.source.value,
        "reservation_id": arguments.reservation_id,
        "model": arguments.model,
        "request_bytes": arguments.request_bytes,
        "max_output_tokens": arguments.max_output_tokens,
        "estimate_nanos": arguments.estimate_nanos,
        "ttl_us": arguments.ttl_us,
        "local_hold_nanos": entry.local_hold_nanos,
        "trace_id": entry.trace_id,
    }


def _end_record(reservation_id: str, ending: Ending, local_charge_nanos: int) -> dict[str, Any]:
    usage = ending.usage
    return {
        "kind": "end",
        "reservation_id": reservation_id,
        "settlement": ending.settlement.value,
        "http_status": ending.http_status,
        "usage": None
        if usage is None
        else {
            "input_tokens": usage.input_tokens,
            "output_tokens": usage.output_tokens,
            "billed_nanos": usage.billed_nanos,
            "cached_input_tokens": usage.cached_input_tokens,
            "cache_write_tokens": usage.cache_write_tokens,
        },
        "reason": ending.reason,
        "local_charge_nanos": local_charge_nanos,
    }


def _int(record: dict[str, Any], key: str) -> int:
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} is not an integer")
    return value


def _optional_int(record: dict[str, Any], key: str) -> int | None:
    return None if record.get(key) is None else _int(record, key)


def _int_or_zero(record: dict[str, Any], key: str) -> int:
    """For keys added after the format's first lines: a line without one reads as 0."""
    return 0 if key not in record else _int(record, key)


def _text(record: dict[str, Any], key: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f"{key} is not text")
    return value


def _entry_of(record: dict[str, Any]) -> JournalEntry:
    arguments = ReserveArguments(
        reservation_id=_text(record, "reservation_id"),
        model=_text(record, "model"),
        request_bytes=_int(record, "request_bytes"),
        max_output_tokens=_int(record, "max_output_tokens"),
        estimate_nanos=_optional_int(record, "estimate_nanos"),
        ttl_us=_optional_int(record, "ttl_us"),
    )
    return JournalEntry(
        lane=_text(record, "lane"),
        arguments=arguments,
        source=Source(_text(record, "source")),
        local_hold_nanos=_int(record, "local_hold_nanos"),
        written_at=_text(record, "at"),
        trace_id=_text(record, "trace_id") if "trace_id" in record else "",
    )


def _ending_of(record: dict[str, Any]) -> Ending:
    usage_record = record.get("usage")
    usage = None
    if usage_record is not None:
        if not isinstance(usage_record, dict):
            raise ValueError("usage is not an object")
        usage = Usage(
            input_tokens=_int(usage_record, "input_tokens"),
            output_tokens=_int(usage_record, "output_tokens"),
            billed_nanos=_optional_int(usage_record, "billed_nanos"),
            cached_input_tokens=_int_or_zero(usage_record, "cached_input_tokens"),
            cache_write_tokens=_int_or_zero(usage_record, "cache_write_tokens"),
        )
    return Ending(
        settlement=Settlement(_text(record, "settlement")),
        http_status=_int(record, "http_status"),
        usage=usage,
        reason=_text(record, "reason"),
    )


def _apply(entries: dict[str, JournalEntry], record: dict[str, Any]) -> None:
    """Folds one line into the entries; raises ValueError for a line that does
    not belong (unknown kind, unknown id, an ending twice)."""
    if record.get("v") != FORMAT_VERSION:
        raise ValueError("unknown journal format version")
    kind = record.get("kind")
    if kind == "reserve":
        entry = _entry_of(record)
        earlier = entries.get(entry.reservation_id)
        if earlier is not None and earlier.replay is None:
            raise ValueError("reservation_id journaled twice")
        entries[entry.reservation_id] = entry
        return
    current = entries[_text(record, "reservation_id")]
    if kind == "end" and current.ending is None:
        entries[current.reservation_id] = dataclasses.replace(
            current,
            ending=_ending_of(record),
            local_charge_nanos=_int(record, "local_charge_nanos"),
        )
    elif kind == "replayed" and current.replay is None:
        entries[current.reservation_id] = dataclasses.replace(
            current,
            replay=ReplayResult(_text(record, "result")),
            replay_detail=_text(record, "detail"),
        )
    else:
        raise ValueError(f"unexpected {kind!r} line")


def read_entries(data: bytes) -> tuple[dict[str, JournalEntry], int, bool]:
    """The entries of a journal's bytes, how many lines were skipped, and
    whether the last line is torn (no newline at its end)."""
    entries: dict[str, JournalEntry] = {}
    lines = data.split(b"\n")
    torn = lines[-1] != b""
    skipped = 0
    for raw in lines[:-1]:
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
            if not isinstance(record, dict):
                raise ValueError("not an object")
            _apply(entries, record)
        # InvalidArgument: a line whose Reserve or ending the ledger would refuse.
        # RecursionError: damage nested deeper than the parser recurses.
        except (ValueError, KeyError, TypeError, RecursionError, InvalidArgument):
            skipped += 1
    return entries, skipped, torn


class Journal:
    """The durable, append-only record of what the ledger has not heard yet."""

    def __init__(self, path: pathlib.Path, lane: str, *, max_bytes: int, rotate_bytes: int) -> None:
        self.path = pathlib.Path(path)
        self.lane = lane
        self._max_bytes = max_bytes
        self._rotate_bytes = rotate_bytes
        self._lock = threading.RLock()
        self._descriptor = -1
        self._entries: dict[str, JournalEntry] = {}
        self._needs_newline = False
        self.skipped_lines = 0
        self.size_bytes = 0
        self._open()

    def _open(self) -> None:
        try:
            self._open_file()
        except OSError as error:  # a directory, under a file, unwritable, ...
            reason = error.strerror or type(error).__name__
            raise JournalError(
                f"journal_path {self.path}: cannot open the journal ({reason})"
            ) from error

    def _open_file(self) -> None:
        created = not self.path.exists()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except FileExistsError as error:
            # A file where a directory of the path should be: mkdir says
            # "File exists", which names the wrong problem.
            raise NotADirectoryError(
                errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(self.path.parent)
            ) from error
        descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as error:
            os.close(descriptor)
            # flock() conflicts between two descriptors of one process as well: the
            # holder may be another LaneClient of this process.
            raise JournalLocked(
                f"journal {self.path} is in use by another client (this process or another)"
            ) from error
        try:
            self._load(descriptor)
            if created:
                _sync_directory(self.path.parent)
        except BaseException:
            os.close(descriptor)
            raise
        self._descriptor = descriptor

    def _load(self, descriptor: int) -> None:
        size = os.fstat(descriptor).st_size
        if size > self._max_bytes * READ_LIMIT_FACTOR:
            raise JournalError(f"journal {self.path} is larger than it may grow; look at it")
        data = os.pread(descriptor, size, 0)
        entries, skipped, torn = read_entries(data)
        for entry in entries.values():
            if entry.lane != self.lane:
                raise JournalError(f"journal {self.path} belongs to another lane")
        self._entries = entries
        self.skipped_lines = skipped + (1 if torn else 0)
        self._needs_newline = torn
        self.size_bytes = size
        if skipped or torn:
            _log_skipped(self.path, skipped, torn)

    def close(self) -> None:
        with self._lock:
            if self._descriptor >= 0:
                os.close(self._descriptor)  # also releases the lock
                self._descriptor = -1

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # Reads -------------------------------------------------------------------

    def pending(self) -> list[JournalEntry]:
        """Entries the ledger has not acknowledged yet, oldest first."""
        with self._lock:
            return [entry for entry in self._entries.values() if entry.replay is None]

    def entry(self, reservation_id: str) -> JournalEntry | None:
        with self._lock:
            return self._entries.get(reservation_id)

    def entries(self) -> list[JournalEntry]:
        with self._lock:
            return list(self._entries.values())

    # Writes ------------------------------------------------------------------

    def record_reserve(self, entry: JournalEntry) -> None:
        """Journals a new entry. Refused when the journal is full (fail closed)."""
        if entry.lane != self.lane:
            raise JournalError("an entry for another lane")
        with self._lock:
            earlier = self._entries.get(entry.reservation_id)
            # An id may come back once its earlier entry was replayed (a retry).
            if earlier is not None and earlier.replay is None:
                raise JournalError("reservation_id already journaled")
            if self.size_bytes >= self._max_bytes:
                raise JournalFull(f"journal {self.path} is full")
            self._append(_line(_reserve_record(entry)))
            self._entries[entry.reservation_id] = entry

    def record_in_doubt(self, entry: JournalEntry, ending: Ending, limit: int) -> bool:
        """Journals an unanswered Reserve (Source.IN_DOUBT) and the refund that
        ends it, unless `limit` such entries are pending already; whether it
        did. Counted and written under one lock, so calls at once cannot pass
        the limit together."""
        with self._lock:
            pending = sum(1 for known in self.pending() if known.source is Source.IN_DOUBT)
            if pending >= limit:
                return False
            self.record_reserve(entry)
            self.record_end(entry.reservation_id, ending, 0)
            return True

    def record_end(self, reservation_id: str, ending: Ending, local_charge_nanos: int) -> None:
        with self._lock:
            current = self._entries[reservation_id]
            if current.ending is not None:
                raise JournalError("this entry already has its ending")
            self._append(_line(_end_record(reservation_id, ending, local_charge_nanos)))
            self._entries[reservation_id] = dataclasses.replace(
                current, ending=ending, local_charge_nanos=local_charge_nanos
            )

    def record_replay(self, reservation_id: str, result: ReplayResult, detail: str = "") -> None:
        record = {
            "kind": "replayed",
            "reservation_id": reservation_id,
            "result": result.value,
            "detail": detail,
        }
        with self._lock:
            current = self._entries[reservation_id]
            if current.replay is not None:
                raise JournalError("this entry was already replayed")
            self._append(_line(record))
            self._entries[reservation_id] = dataclasses.replace(
                current, replay=result, replay_detail=detail
            )

    def _append(self, line: bytes) -> None:
        """Writes one whole line and waits until it is on disk."""
        if self._descriptor < 0:
            raise JournalError("the journal is closed")
        if self._needs_newline:
            line = b"\n" + line  # seals a torn last line so it stays unreadable
        view = memoryview(line)
        while view:
            written = os.write(self._descriptor, view)
            view = view[written:]
        os.fsync(self._descriptor)
        self._needs_newline = False
        self.size_bytes += len(line)

    def rotate_if_replayed(self) -> pathlib.Path | None:
        """Once every entry is replayed and the file is large, moves it aside
        (nothing is deleted) and starts an empty journal. Returns the archive."""
        with self._lock:
            if self.size_bytes < self._rotate_bytes or self.pending():
                return None
            archive = self._free_archive_name()
            if archive is None:
                return None  # stays where it is, as a small replayed journal does
            os.rename(self.path, archive)
            _sync_directory(self.path.parent)
            self.close()
            self._open()
            return archive

    def _free_archive_name(self) -> pathlib.Path | None:
        """A name no archive has: the clock can repeat a reading (stepped back,
        frozen, two rotations in one microsecond), and rename() would replace
        the earlier archive, deleting it. Only this journal's lock holder
        makes these names, so a name free now is still free at the rename."""
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S%fZ")
        for attempt in range(MAX_ARCHIVES_PER_STAMP):
            suffix = "" if attempt == 0 else f"-{attempt}"
            archive = self.path.with_name(f"{self.path.name}.{stamp}{suffix}.done")
            if not os.path.lexists(archive):
                return archive
        log.warning("journal %s: not rotated, every archive name at %s is taken", self.path, stamp)
        return None


def _log_skipped(path: pathlib.Path, skipped: int, torn: bool) -> None:
    """Never silent: a skipped line may be the Reserve of a call made on the
    allowance, which is then neither replayed nor counted against it."""
    parts = []
    if skipped:
        parts.append(
            f"{skipped} unreadable line{'s' if skipped != 1 else ''} skipped (a call they "
            "record is neither replayed to the ledger nor counted against the allowance: "
            "look at the file)"
        )
    if torn:
        parts.append("a torn last line skipped and sealed (a write the lane did not finish)")
    log.warning("journal %s: %s", path, "; ".join(parts))


def _sync_directory(directory: pathlib.Path) -> None:
    """Makes a created or renamed file's name durable, not only its bytes."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
