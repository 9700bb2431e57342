"""A lane with a long history: N settled bookings inside its window, bulk-inserted.

Writing a million bookings through the server would take the better part of an
hour, so the rows are inserted in batches instead (`ledger_service.seeding`,
the service's one seeding entry point), and made to be exactly the rows the
server would have written:

- The lane and booking 0 are made by the application itself: `Ledger.put_lane`,
  `Ledger.reserve` and `Ledger.settle` on the server's own store, in a scratch
  SQLite database (`seeding.ScratchLedger`), and their rows are read back.
- Every other booking's rows are booking 0's rows with the fields that vary
  (reservation id, instants, the balance after each event, seqs, hashes)
  filled in, and every event is sealed into the lane's hash chain: the seeded
  log is indistinguishable from a served one, and a rebuild verifies its hashes.
- Pair assertion: a few bookings are made again through the application, in a
  scratch database holding the template rows of the bookings before them, and
  must give the very same rows and hashes. The rest is checked by the server:
  at start-up it walks the whole chain and compares the projections with the
  log, and the history scenario fails if that start-up had to recover anything.

Projections the store keeps only as a cache (the incremental window sums) are
not seeded: the first Reserve computes them, inside the warm-up.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from json.encoder import encode_basestring_ascii
from typing import Any

from ledger_service import seeding
from ledger_service.domain import moves
from ledger_service.domain.clock import MICROS_PER_SECOND
from ledger_service.domain.events import Event, Outcome
from ledger_service.domain.policies import LanePolicy
from ledger_service.seeding import ScratchLedger

MAX_BOOKINGS = 10_000_000
DEFAULT_BATCH_ROWS = 5_000
# The bookings are spread over this span, ending this long before "now".
SPAN_US = 3600 * MICROS_PER_SECOND
END_BEFORE_NOW_US = 60 * MICROS_PER_SECOND
# Bookings made again through the application and compared (booking 0 makes the templates).
CHECKED_INDEXES = (1, 2, 37)

_EVENT_DEFAULTS = {
    field.name: field.default
    for field in dataclasses.fields(Event)
    if field.default is not dataclasses.MISSING
}

Row = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class BookingShape:
    """What every seeded booking asks for and is settled with."""

    model: str
    request_bytes: int
    max_output_tokens: int
    input_tokens: int
    output_tokens: int
    http_status: int


@dataclasses.dataclass(frozen=True)
class BookingRows:
    reserved: Row
    settled: Row
    booking: Row


@dataclasses.dataclass(frozen=True)
class Timeline:
    """When the lane is configured, and when booking i is reserved and settled."""

    first_us: int
    step_us: int

    @property
    def configured_at(self) -> int:
        return self.first_us - MICROS_PER_SECOND

    def reserved_at(self, index: int) -> int:
        return self.first_us + index * self.step_us

    def settled_at(self, index: int) -> int:
        return self.reserved_at(index) + self.step_us // 2


def reservation_id(index: int) -> str:
    return f"seed-{index:08d}"


def book(
    scratch: ScratchLedger, shape: BookingShape, lane: str, index: int, timeline: Timeline
) -> None:
    """Booking `index`, made as the load generator's calls make theirs."""
    name = reservation_id(index)
    scratch.clock.set_us(timeline.reserved_at(index))
    reserve = moves.ReserveCommand(
        lane,
        name,
        shape.model,
        request_bytes=shape.request_bytes,
        max_output_tokens=shape.max_output_tokens,
    )
    assert scratch.ledger.reserve(reserve).admitted, "a seeded booking must be admitted"
    scratch.clock.set_us(timeline.settled_at(index))
    settle = moves.SettleCommand(
        lane,
        name,
        Outcome.SUCCEEDED,
        input_tokens=shape.input_tokens,
        output_tokens=shape.output_tokens,
        http_status=shape.http_status,
    )
    scratch.ledger.settle(settle)


def rows_of(scratch: ScratchLedger, lane: str, index: int) -> BookingRows:
    return BookingRows(*scratch.booking_rows(lane, reservation_id(index)))


def _canonical(row: Row) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(seeding.canonical_text(row))
    return loaded


class HistoryRows:
    """The rows of booking i, fast: booking 0's rows with the varying fields set."""

    def __init__(
        self, lane_event: Row, lane_row: Row, first: BookingRows, timeline: Timeline
    ) -> None:
        self.lane_event, self.lane_row = lane_event, lane_row
        self.lane = str(lane_row["lane"])
        self.timeline = timeline
        self.templates = first
        # Booking 0 was made with no charge before it; its settle says the charge.
        self.charge_nanos = int(first.settled["amount_nanos"])
        self.hold_nanos = int(first.reserved["hold_nanos"])
        self.ttl_us = int(first.reserved["expires_at_us"]) - int(first.reserved["reserved_at_us"])
        self.first_seq = int(first.reserved["seq"])
        reserved_fields, settled_fields, _ = self.varying(1)
        self.canonical = (
            CanonicalTemplate(_canonical(first.reserved), list(reserved_fields)),
            CanonicalTemplate(_canonical(first.settled), list(settled_fields)),
        )

    @property
    def genesis(self) -> str:
        """The chain's head before booking 0: the lane_configured event's hash."""
        return str(self.lane_event["hash"])

    def varying(self, index: int) -> tuple[Row, Row, Row]:
        """The fields of booking i's reserved event, settled event and booking row
        that differ from booking 0's (seqs and hashes aside)."""
        reserved_at = self.timeline.reserved_at(index)
        charged_before = index * self.charge_nanos
        common = {
            "reservation_id": reservation_id(index),
            "reserved_at_us": reserved_at,
            "expires_at_us": reserved_at + self.ttl_us,
        }
        reserved = {
            **common,
            "occurred_at_us": reserved_at,
            "spent_after_nanos": charged_before + self.hold_nanos,
            "held_after_nanos": self.hold_nanos,
            "charged_after_nanos": charged_before,
        }
        settled = {
            **common,
            "occurred_at_us": self.timeline.settled_at(index),
            "spent_after_nanos": charged_before + self.charge_nanos,
            "charged_after_nanos": charged_before + self.charge_nanos,
        }
        seq = self.first_seq + 2 * index
        return reserved, settled, {**common, "answer_seq": seq, "ended_seq": seq + 1}

    def rows(self, index: int, head: str) -> tuple[BookingRows, str]:
        """Booking i's rows, sealed after `head`; and the chain's new head."""
        reserved_fields, settled_fields, booking_fields = self.varying(index)
        reserved_hash = self.canonical[0].hash(head, reserved_fields)
        settled_hash = self.canonical[1].hash(reserved_hash, settled_fields)
        seq = self.first_seq + 2 * index
        reserved = {
            **self.templates.reserved,
            **reserved_fields,
            "seq": seq,
            "previous_hash": head,
            "hash": reserved_hash,
        }
        settled = {
            **self.templates.settled,
            **settled_fields,
            "seq": seq + 1,
            "previous_hash": reserved_hash,
            "hash": settled_hash,
        }
        booking = {**self.templates.booking, **booking_fields}
        return BookingRows(reserved, settled, booking), settled_hash

    def all_rows(self, count: int) -> Iterator[BookingRows]:
        head = self.genesis
        for index in range(count):
            made, head = self.rows(index, head)
            yield made

    def head_seq(self, count: int) -> int:
        return self.first_seq + 2 * count - 1


def templates(
    policy: LanePolicy, timeline: Timeline, shape: BookingShape, directory: pathlib.Path
) -> HistoryRows:
    """The lane and booking 0, made by the application and read back as rows."""
    scratch = ScratchLedger(directory, timeline.configured_at)
    try:
        scratch.ledger.put_lane(policy)
        book(scratch, shape, policy.lane, 0, timeline)
        lane_event, lane_row = scratch.lane_rows(policy.lane)
        return HistoryRows(lane_event, lane_row, rows_of(scratch, policy.lane, 0), timeline)
    finally:
        scratch.close()


def check(history: HistoryRows, shape: BookingShape, index: int, directory: pathlib.Path) -> None:
    """The pair assertion: booking `index` made by the application, after the
    template rows of the bookings before it, has the template's rows."""
    scratch = ScratchLedger(directory, history.timeline.configured_at)
    try:
        scratch.insert_history(
            history.lane_event, history.lane_row, _batches(history, index, DEFAULT_BATCH_ROWS)
        )
        book(scratch, shape, history.lane, index, history.timeline)
        made = rows_of(scratch, history.lane, index)
    finally:
        scratch.close()
    head = history.genesis
    for before in history.all_rows(index):
        head = str(before.settled["hash"])
    fast, _ = history.rows(index, head)
    for name, got, want in (
        ("reserved event", fast.reserved, made.reserved),
        ("settled event", fast.settled, made.settled),
        ("booking", fast.booking, made.booking),
    ):
        differing = sorted(key for key in got.keys() | want.keys() if got.get(key) != want.get(key))
        assert not differing, f"seeded {name} {index} differs from the application's: {differing}"


def _is_default(name: str, value: Any) -> bool:
    default = _EVENT_DEFAULTS.get(name, dataclasses.MISSING)
    return type(value) is type(default) and bool(value == default)


def _encoded(value: Any) -> str:
    """json.dumps(value, ensure_ascii=True), quicker for the two types that vary."""
    if type(value) is int:
        return str(value)
    if type(value) is str:
        return str(encode_basestring_ascii(value))
    return json.dumps(value, ensure_ascii=True)


def _dumps(data: Mapping[str, Any]) -> str:
    # chain.canonical_json's encoding, of values that are already plain.
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


class CanonicalTemplate:
    """chain.canonical_event of a template event with some fields changed.

    The template's canonical text is cut where the varying fields' values go,
    so that each event costs a few string joins instead of a JSON encoding. A
    field at its default is left out of the text (as canonical_event does); when
    any is, the slow path encodes the whole object. `check` compares the
    result with the hashes the application makes.
    """

    def __init__(self, canonical: Mapping[str, Any], varying: Sequence[str]) -> None:
        self.canonical = dict(canonical)
        markers = {name: f"@@{name}@@" for name in varying}
        text = _dumps({**self.canonical, **markers})
        self.order = sorted(varying)
        self.pieces: list[str] = []
        for name in self.order:
            before, text = text.split(json.dumps(markers[name]), 1)
            self.pieces.append(before)
        self.pieces.append(text)

    def text(self, fields: Mapping[str, Any]) -> str:
        values = [fields[name] for name in self.order]
        if any(_is_default(name, value) for name, value in zip(self.order, values, strict=True)):
            data = dict(self.canonical)
            for name, value in fields.items():
                if _is_default(name, value):
                    data.pop(name, None)
                else:
                    data[name] = value
            return _dumps(data)
        parts = [self.pieces[0]]
        for value, piece in zip(values, self.pieces[1:], strict=True):
            parts += (_encoded(value), piece)
        return "".join(parts)

    def hash(self, previous: str, fields: Mapping[str, Any]) -> str:
        """chain.event_hash(previous, template event with `fields`)."""
        return hashlib.sha256(f"{previous}\n{self.text(fields)}".encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class SeedReport:
    lane: str
    bookings: int
    events: int
    head_seq: int
    checked_bookings: int
    first_reserved_at_us: int
    last_reserved_at_us: int
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def seed(
    database_url: str,
    policy: LanePolicy,
    count: int,
    now_us: int,
    shape: BookingShape,
    *,
    batch_rows: int = DEFAULT_BATCH_ROWS,
) -> SeedReport:
    """Migrates a fresh SQLite database and fills `policy.lane` with `count` bookings."""
    if not 1 <= count <= MAX_BOOKINGS:
        raise ValueError(f"count must be between 1 and {MAX_BOOKINGS}")
    started = time.perf_counter()
    step_us = max(2, SPAN_US // count)
    first_us = now_us - END_BEFORE_NOW_US - step_us * count
    assert count * step_us < policy.window_us, "every seeded booking must be inside the window"
    timeline = Timeline(first_us, step_us)
    with tempfile.TemporaryDirectory(prefix="ledger-seed-") as scratch:
        history = templates(policy, timeline, shape, pathlib.Path(scratch) / "templates")
        assert step_us // 2 < history.ttl_us, "a seeded booking must be settled before it expires"
        checked = [index for index in CHECKED_INDEXES if index < count]
        for index in checked:
            check(history, shape, index, pathlib.Path(scratch) / f"check-{index}")
    seeding.insert_history(
        database_url, history.lane_event, history.lane_row, _batches(history, count, batch_rows)
    )
    return SeedReport(
        lane=policy.lane,
        bookings=count,
        events=history.head_seq(count),
        head_seq=history.head_seq(count),
        checked_bookings=1 + len(checked),
        first_reserved_at_us=first_us,
        last_reserved_at_us=timeline.reserved_at(count - 1),
        seconds=time.perf_counter() - started,
    )


def _batches(history: HistoryRows, count: int, size: int) -> Iterator[list[tuple[Row, Row, Row]]]:
    """Bookings 0 to count-1 as (reserved, settled, booking) rows, `size` at a time."""
    batch: list[tuple[Row, Row, Row]] = []
    for made in history.all_rows(count):
        batch.append((made.reserved, made.settled, made.booking))
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
