"""Reconciling estimated charges with the provider's usage export.

An UNKNOWN or expired booking is charged at its hold because nobody knew what
the call cost. A provider's export often does know: each matching row corrects
such a booking with a `reconciled` event, so the audit shows what was
estimated, what was real, and when it was corrected. Bookings that already
hold a real charge are not overwritten by default: a disagreement is flagged.
When the operator lets the bill win, such a charge is replaced by the bill,
recorded as a `corrected` event as an operator's correction would be.
"""

from __future__ import annotations

import collections
import contextlib
import csv
import dataclasses
import decimal
import enum
import io
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ledger_service.domain.bookings import CORRECTABLE_STATES, REAL_STATES, Booking, BookingState
from ledger_service.domain.errors import InvalidArgument
from ledger_service.domain.events import Event, EventKind, evolve
from ledger_service.domain.moves import (
    MAX_TOKENS,
    cache_part_past_input,
    ending_event,
    validate_reservation_id,
)
from ledger_service.domain.policies import validate_name
from ledger_service.domain.pricing import MAX_AMOUNT_NANOS, usd_text, usd_to_nanos

MAX_ROWS = 10_000
COLUMNS = frozenset(
    {"lane", "reservation_id", "billed_nanos", "billed_usd", "input_tokens", "output_tokens",
     "cached_input_tokens", "cache_write_tokens", "model"}
)  # fmt: skip


class ExportFormat(enum.Enum):
    CSV = "csv"
    JSONL = "jsonl"


class RowStatus(enum.Enum):
    CORRECTED = "corrected"
    MATCHED = "matched"
    UNMATCHED = "unmatched"
    DISAGREES = "disagrees"
    # A real charge that disagreed with the bill, replaced by it (bill wins).
    REPLACED = "replaced"
    OPEN = "open"
    REFUNDED = "refunded"
    BAD = "bad"
    # A good row of a file that was not applied because other rows are bad.
    NOT_APPLIED = "not_applied"


@dataclasses.dataclass(frozen=True)
class ExportRow:
    line: int
    lane: str
    reservation_id: str
    billed_nanos: int | None
    input_tokens: int
    output_tokens: int
    model: str
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0

    def real_cost(self, booking: Booking) -> int:
        if self.billed_nanos is not None:
            return self.billed_nanos
        return booking.price.real_cost(
            self.input_tokens, self.output_tokens, self.cached_input_tokens, self.cache_write_tokens
        )


@dataclasses.dataclass(frozen=True)
class RowResult:
    line: int
    lane: str
    reservation_id: str
    status: RowStatus
    before_nanos: int = 0
    after_nanos: int = 0
    field: str = ""
    message: str = ""


@dataclasses.dataclass(frozen=True)
class Parsed:
    rows: Sequence[ExportRow]
    bad: Sequence[RowResult]


def parse(content: bytes, export_format: ExportFormat, default_lane: str) -> Parsed:
    """Every row of the export, or the bad ones with their line numbers."""
    try:
        text = content.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise InvalidArgument("content", "must be UTF-8 text") from error
    records = _csv_records(text) if export_format is ExportFormat.CSV else _jsonl_records(text)
    rows: list[ExportRow] = []
    bad: list[RowResult] = []
    first_lines: dict[tuple[str, str], int] = {}
    for line, record in records:
        if len(rows) + len(bad) >= MAX_ROWS:
            raise InvalidArgument("content", f"holds more than {MAX_ROWS} rows; split the export")
        if isinstance(record, str):
            bad.append(RowResult(line, "", "", RowStatus.BAD, field="content", message=record))
            continue
        try:
            row = _row(line, record, default_lane)
            _once(row, first_lines)
            rows.append(row)
        except InvalidArgument as error:
            bad.append(
                RowResult(
                    line,
                    str(record.get("lane") or default_lane)[:200],
                    str(record.get("reservation_id") or "")[:200],
                    RowStatus.BAD,
                    field=error.field,
                    message=error.message,
                )
            )
    return Parsed(rows, bad)


def _once(row: ExportRow, first_lines: dict[tuple[str, str], int]) -> None:
    """One row a booking: a second would make the file's answer depend on its
    order, and a re-run replace the first row's charge with the second's."""
    first = first_lines.setdefault((row.lane, row.reservation_id), row.line)
    if first != row.line:
        raise InvalidArgument(
            "reservation_id", f"is the booking of line {first} too: one row a booking"
        )


def _csv_records(text: str) -> list[tuple[int, Mapping[str, Any] | str]]:
    lines = _CountedLines(text)
    reader = csv.DictReader(lines)
    with _readable(lines):
        names = list(reader.fieldnames or ())
    # A spreadsheet's trailing comma: "unknown columns" would name nothing.
    blank = next((place for place, name in enumerate(names, start=1) if not name.strip()), 0)
    if blank:
        raise InvalidArgument("content", f"column {blank} of the CSV header has no name")
    header = set(names)
    if len(header) < len(names):
        # DictReader would keep a repeated column's last cell and drop the others unseen.
        raise InvalidArgument(
            "content", f"the CSV header names {_names(_repeated(names))} more than once"
        )
    if "reservation_id" not in header:
        raise InvalidArgument("content", "the CSV header must name a reservation_id column")
    unknown = header - COLUMNS
    if unknown:
        raise InvalidArgument("content", f"unknown CSV columns: {_names(unknown)}")
    records: list[tuple[int, Mapping[str, Any] | str]] = []
    for record in _csv_rows(reader, lines):
        if None in record:
            records.append((reader.line_num, "has more fields than the header"))
            continue
        values = {key: value for key, value in record.items() if value not in ("", None)}
        if values:
            records.append((reader.line_num, values))
    return records


class _CountedLines:
    """The text's lines, counting those handed out: on a csv.Error the reader's
    own line_num has not yet counted the line it failed on."""

    def __init__(self, text: str) -> None:
        self._lines = io.StringIO(text)
        self.read = 0

    def __iter__(self) -> _CountedLines:
        return self

    def __next__(self) -> str:
        line = next(self._lines)
        self.read += 1
        return line


@contextlib.contextmanager
def _readable(lines: _CountedLines) -> Iterator[None]:
    """A line the csv module cannot read (a field past its limit, a bare
    carriage return outside quotes) refuses the content, naming the line."""
    try:
        yield
    except csv.Error as error:
        why = str(error).split(" - ")[0]
        message = f"line {lines.read} is not valid CSV ({why})"
        raise InvalidArgument("content", message) from error


def _csv_rows(reader: csv.DictReader[str], lines: _CountedLines) -> Iterator[dict[str, Any]]:
    while True:
        with _readable(lines):
            try:
                row = next(reader)
            except StopIteration:
                return
        yield row


def _jsonl_records(text: str) -> list[tuple[int, Mapping[str, Any] | str]]:
    records: list[tuple[int, Mapping[str, Any] | str]] = []
    for line, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            value = json.loads(raw, parse_float=decimal.Decimal, object_pairs_hook=_once_each)
        except _RepeatedKeys as repeated:
            records.append((line, f"names {_names(repeated.keys)} more than once"))
            continue
        except ValueError:
            records.append((line, "is not valid JSON"))
            continue
        except RecursionError:
            records.append((line, "is nested too deeply to be a usage row"))
            continue
        if not isinstance(value, dict):
            records.append((line, "is not a JSON object"))
        elif not _is_text(value):
            records.append((line, "holds a \\u escape that is not text (a lone surrogate)"))
        elif set(value) - COLUMNS:
            records.append((line, f"unknown keys: {_names(set(value) - COLUMNS)}"))
        else:
            # null is an absent value, as an empty CSV cell is.
            records.append((line, {key: item for key, item in value.items() if item is not None}))
    return records


class _RepeatedKeys(Exception):
    def __init__(self, keys: set[str]) -> None:
        super().__init__()
        self.keys = keys


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused when it names a key twice: json.loads would keep
    the last value and drop the others unseen, as DictReader does a column's."""
    found = dict(pairs)
    if len(found) < len(pairs):
        raise _RepeatedKeys(_repeated([key for key, _ in pairs]))
    return found


def _repeated(names: list[str]) -> set[str]:
    return {name for name, count in collections.Counter(names).items() if count > 1}


# Unknown names are the caller's own text, so their echo is bounded: in full,
# a long one passed gRPC's metadata limit (a CSV header's refusal) or the
# answer's message limit (a JSONL row's message), and the caller heard
# RESOURCE_EXHAUSTED with no reason instead of what was wrong.
_SHOWN_NAMES = 10
_SHOWN_NAME_LENGTH = 40


def _names(names: set[str]) -> str:
    """The first few names, each cut short, and how many more there are."""
    ordered = sorted(names)
    shown = [
        name if len(name) <= _SHOWN_NAME_LENGTH else name[:_SHOWN_NAME_LENGTH] + "..."
        for name in ordered[:_SHOWN_NAMES]
    ]
    shown = [name if name.strip() else json.dumps(name) for name in shown]  # "" is seen
    more = len(ordered) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")


def _is_text(value: Any) -> bool:
    """Whether every string in the JSON value is Unicode text: JSON's \\u
    escapes can spell a lone surrogate, which no answer can carry back."""
    try:
        json.dumps(value, ensure_ascii=False, default=str).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_TEXT_KEYS = ("lane", "reservation_id", "model")


def _row(line: int, record: Mapping[str, Any], default_lane: str) -> ExportRow:
    for key in _TEXT_KEYS:  # a JSON number here is no name: 5 is not the lane "5"
        if not isinstance(record.get(key, ""), str):
            raise InvalidArgument(key, "must be text (a JSON string)")
    lane = str(record.get("lane") or default_lane)
    validate_name("lane", lane)
    reservation_id = str(record.get("reservation_id") or "")
    validate_reservation_id(reservation_id)
    billed = _billed_nanos(record)
    input_tokens = _count(record, "input_tokens")
    output_tokens = _count(record, "output_tokens")
    cached_input_tokens = _count(record, "cached_input_tokens")
    cache_write_tokens = _count(record, "cache_write_tokens")
    if billed is None and "input_tokens" not in record and "output_tokens" not in record:
        raise InvalidArgument("billed_nanos", "a row needs a billed amount or token counts")
    past = cache_part_past_input(input_tokens, cached_input_tokens, cache_write_tokens)
    if past and billed is None:
        raise InvalidArgument(past, "cached and cache-write tokens are parts of input_tokens")
    model = str(record.get("model") or "")
    if model:
        validate_name("model", model)
    return ExportRow(
        line,
        lane,
        reservation_id,
        billed,
        input_tokens,
        output_tokens,
        model,
        cached_input_tokens,
        cache_write_tokens,
    )


def _billed_nanos(record: Mapping[str, Any]) -> int | None:
    nanos = _billed_usd_nanos(record)
    if "billed_nanos" not in record:
        return nanos
    billed = _whole(record["billed_nanos"], "billed_nanos", MAX_AMOUNT_NANOS)
    if nanos is not None and nanos != billed:
        # Two bills on one row: neither may be dropped without a word.
        raise InvalidArgument(
            "billed_usd", f"is {nanos} nanos, and billed_nanos of the same row says {billed}"
        )
    return billed


def _billed_usd_nanos(record: Mapping[str, Any]) -> int | None:
    if "billed_usd" in record:
        text = str(record["billed_usd"]).strip()
        try:
            if not text.isascii() or "_" in text:  # Decimal would read 1_000 and ٣
                raise decimal.InvalidOperation(text)
            usd = decimal.Decimal(text)
            if not usd.is_finite():  # Decimal reads NaN and Infinity too
                raise decimal.InvalidOperation(text)
        except decimal.InvalidOperation as error:
            raise InvalidArgument("billed_usd", "must be a decimal number of dollars") from error
        nanos = usd_to_nanos(usd)
        if nanos is None:
            raise InvalidArgument("billed_usd", "must be exact to the nano-dollar")
        if not 0 <= nanos <= MAX_AMOUNT_NANOS:
            # The column is in dollars, and so are its bounds.
            largest = usd_text(MAX_AMOUNT_NANOS)
            raise InvalidArgument("billed_usd", f"must be between 0 and {largest} dollars")
        return nanos
    return None


def _count(record: Mapping[str, Any], field: str) -> int:
    return _whole(record.get(field, 0), field, MAX_TOKENS)


def _whole(value: Any, field: str, high: int) -> int:
    if isinstance(value, bool):
        raise InvalidArgument(field, "must be a whole number")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        digits = value.strip().lstrip("0") or "0"
        # Past the bound's own length it is out of range (and int() caps digits).
        number = int(digits) if len(digits) <= len(str(high)) else high + 1
    else:
        raise InvalidArgument(field, "must be a whole, non-negative number")
    if not 0 <= number <= high:
        raise InvalidArgument(field, f"must be between 0 and {high}")
    return number


@dataclasses.dataclass(frozen=True)
class BillWins:
    """Replace disagreeing real charges: the id of this row's correction, and
    of the grant that asked."""

    correction_id: str
    grant_id: str


def decide(
    booking: Booking | None,
    row: ExportRow,
    now_us: int,
    bill_wins: BillWins | None = None,
    grant_id: str = "",
) -> tuple[RowResult, Event | None]:
    """What one export row does to its booking (already expired if past its
    deadline). `grant_id`: the grant that reconciles, recorded on the event."""
    result = RowResult(row.line, row.lane, row.reservation_id, RowStatus.UNMATCHED)
    if booking is None:
        return dataclasses.replace(result, message="no such booking in this lane"), None
    current = booking.amount_at(now_us)
    unchanged = dataclasses.replace(result, before_nanos=current, after_nanos=current)
    if booking.state is BookingState.REJECTED:
        # A denied Reserve booked no call: a bill of zero agrees with it.
        if row.real_cost(booking) == 0:
            return dataclasses.replace(unchanged, status=RowStatus.MATCHED), None
        message = "the Reserve was denied: no call was booked"
        return dataclasses.replace(unchanged, status=RowStatus.DISAGREES, message=message), None
    if row.model and row.model != booking.model:
        message = f"the export says model {row.model!r}, the booking {booking.model!r}"
        return dataclasses.replace(unchanged, status=RowStatus.DISAGREES, message=message), None
    if booking.state is BookingState.OPEN:
        return dataclasses.replace(unchanged, status=RowStatus.OPEN), None
    # Priced only where the price is used: a row that a denied, open or
    # other-model booking answers is reported, whatever its tokens would cost.
    real = _priced_row(row, booking)
    result = dataclasses.replace(result, before_nanos=current, after_nanos=real)
    if booking.state in REAL_STATES or booking.state is BookingState.REFUNDED:
        if real == current:
            return dataclasses.replace(result, status=RowStatus.MATCHED), None
        if bill_wins is not None and booking.state in REAL_STATES:
            return _replaced(booking, row, result, now_us, bill_wins)
        status = (
            RowStatus.REFUNDED if booking.state is BookingState.REFUNDED else RowStatus.DISAGREES
        )
        message = (
            f"the bill says {real} nanos, the ledger holds {current} ({booking.state.value}); "
            "not overwritten"
        )
        return dataclasses.replace(
            result, status=status, after_nanos=current, message=message
        ), None
    assert booking.state in CORRECTABLE_STATES
    event = evolve(
        ending_event(booking, EventKind.RECONCILED, real, now_us),
        input_tokens=row.input_tokens,
        output_tokens=row.output_tokens,
        billed_nanos=row.billed_nanos,
        cached_input_tokens=row.cached_input_tokens,
        cache_write_tokens=row.cache_write_tokens,
        reason=f"provider export line {row.line}",
        grant_id=grant_id,
    )
    return dataclasses.replace(result, status=RowStatus.CORRECTED), event


def _priced_row(row: ExportRow, booking: Booking) -> int:
    """The row's charge. Tokens priced past the largest amount are one amount
    too large, refused naming the row's line (a bill cannot be: parse bounds
    it), as a Settle refuses them, whether or not any window would hold it."""
    real = row.real_cost(booking)
    if real > MAX_AMOUNT_NANOS:
        raise InvalidArgument(
            "content",
            f"line {row.line}: input_tokens and output_tokens price this usage at "
            f"{real} nanos, above the largest amount ({MAX_AMOUNT_NANOS})",
        )
    return real


def _replaced(
    booking: Booking, row: ExportRow, result: RowResult, now_us: int, bill_wins: BillWins
) -> tuple[RowResult, Event]:
    """The bill replaces a real charge that disagrees with it: a correction."""
    event = evolve(
        ending_event(booking, EventKind.CORRECTED, result.after_nanos, now_us),
        reason=f"the provider's bill wins: export line {row.line}",
        correction_id=bill_wins.correction_id,
        grant_id=bill_wins.grant_id,
    )
    message = f"the ledger held {result.before_nanos} nanos ({booking.state.value}); the bill wins"
    return dataclasses.replace(result, status=RowStatus.REPLACED, message=message), event
