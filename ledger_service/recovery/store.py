"""The SQL of recovery: facts, snapshots, rebuild ranges, manifests.

Reads run in one snapshot transaction each (`_reading`); writes that change the
position marker take the append lock (`_writing(marker=True)`, the one place
that does), so a claim, a finish and an append never interleave.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, Self

from sqlalchemy import (
    Connection,
    Engine,
    Row,
    Select,
    case,
    delete,
    distinct,
    func,
    insert,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError

from ledger_service.application.budgets import open_window
from ledger_service.application.ledger import last_event_at_us
from ledger_service.application.ports import EventQuery
from ledger_service.domain import bookings as booking_fold
from ledger_service.domain.bookings import Booking
from ledger_service.domain.errors import StoreUnavailable
from ledger_service.domain.events import Event, EventKind, Outcome
from ledger_service.domain.policies import LanePolicy, policy_from_dict
from ledger_service.domain.window import WindowTotals
from ledger_service.recovery.plan import Manifest
from ledger_service.recovery.snapshots import (
    FORMAT_VERSION,
    ChainPoint,
    ProjectionDigest,
    SnapshotInfo,
)
from ledger_service.storage import database, records, translate
from ledger_service.storage.chaining import POSITION_ROW_ID, STATE_CURRENT, STATE_REBUILDING
from ledger_service.storage.horizon import EVENT_APPEND_LOCK_KEY, CommitHorizon
from ledger_service.storage.schema import (
    bookings,
    chain_checkpoints,
    events,
    lanes,
    projection_position,
    recovery_manifests,
    snapshot_chunks,
    snapshots,
    window_states,
)
from ledger_service.storage.sql import SqlTransaction
from ledger_service.storage.translate import translated

# How long a write waits for this process's other SQLite writers (as busy_timeout).
WRITE_GATE_TIMEOUT_SECONDS = 5.0
# PostgreSQL: how long a snapshot waits for the appends in flight (settled_view).
SETTLE_WAIT_MS = 1000
# PostgreSQL: how long a planner's dry run waits for a row a replica's rebuild
# holds before it gives up (StoreUnavailable) instead of holding that rebuild up.
DRY_RUN_LOCK_WAIT_MS = 100

SNAPSHOT_TAKING = "taking"
SNAPSHOT_COMPLETE = "complete"
# How many complete snapshots are ever read: retention keeps fewer.
MAX_LISTED_SNAPSHOTS = 10
ANSWER_KINDS = ("reserved", "denied")
# How many lanes' configuring events one statement reads (_stale_lanes).
STALE_LANES_READ = 1000


# The outcome of a manifest whose rebuild was carried out (Recovery._record).
MANIFEST_REBUILT = "rebuilt"
# How many of those `accepted_breaks` reads, newest first.
MAX_ACCEPTING_MANIFESTS = 100


@dataclasses.dataclass(frozen=True)
class AcceptedBreak:
    """Which recovery accepted a broken link, when, and who ran it."""

    manifest_id: int
    created_at_us: int
    actor: str


@dataclasses.dataclass(frozen=True)
class Position:
    """The projections' position marker."""

    last_seq: int
    state: str
    owner: str
    updated_at_us: int

    def leased_to_another(self, owner: str, now_us: int, lease_us: int) -> bool:
        """Whether another owner's rebuild holds the marker, its lease still running."""
        return (
            self.state == STATE_REBUILDING
            and self.owner != owner
            and now_us - self.updated_at_us < lease_us
        )


@dataclasses.dataclass(frozen=True)
class LogFacts:
    """What one consistent, cheap look at the database shows."""

    position: Position | None
    head_seq: int
    event_count: int
    # reserved + denied events: each is one booking.
    answer_events: int
    # Lanes with a lane_configured event: each is one lanes row.
    configured_lanes: int
    bookings: int
    lanes: int
    # Bookings whose latest event (max of answer_seq, ended_seq) is missing or
    # names another amount, lane or reservation id.
    stale_bookings: int
    # Lanes whose row is not the policy of their latest lane_configured event.
    stale_lanes: int = 0


@dataclasses.dataclass(frozen=True)
class SnapshotChunk:
    lanes: Sequence[LanePolicy] = ()
    # Bookings as rows of BOOKING_COLUMNS, with each one's canonical text
    # (chain.canonical_json of its Booking): copied into a snapshot and back
    # without a Booking built for each.
    booking_rows: Sequence[Sequence[Any]] = ()
    booking_texts: Sequence[str] = ()

    def add_to(self, digest: ProjectionDigest) -> None:
        for policy in self.lanes:
            digest.add_lane(policy)
        for text in self.booking_texts:
            digest.add_booking_text(text)

    @property
    def rows(self) -> int:
        return len(self.lanes) + len(self.booking_rows)

    @classmethod
    def of_booking_rows(cls, rows: Sequence[Sequence[Any]]) -> SnapshotChunk:
        return cls(booking_rows=rows, booking_texts=records.booking_texts_from_rows(rows))


class RebuildClaimLost(Exception):
    """Another process took the rebuild over (its lease had expired for ours)."""


class MarkerMoved(RebuildClaimLost):
    """A claim found the marker changed since the projections were assessed:
    another process rebuilt them (or began to) meanwhile."""


def marker_key(position: Position | None) -> tuple[str, str, int] | None:
    """What only a recovery changes in the marker (appends move last_seq at
    most): two keys differ when a rebuild claimed, advanced or ended between."""
    return None if position is None else (position.state, position.owner, position.updated_at_us)


class RebuildFailed(Exception):
    pass


class EventRefused(RebuildFailed):
    """The rebuild's fold cannot apply an event of the log (an event it needs
    was deleted by hand, say): which one, whose, and why."""

    def __init__(self, seq: int, kind: str, lane: str, reservation_id: str) -> None:
        if kind in {ending.value for ending in booking_fold.ENDING_STATES}:
            why = "has no reserve before it in the log"
        elif kind in {opening.value for opening in booking_fold.OPENING_STATES}:
            why = "has no expiry charge"
        else:
            why = "is of a kind this release does not know"
        super().__init__(
            f"event {seq} cannot be applied: the {kind} event of booking {reservation_id!r} "
            f"in lane {lane!r} {why}"
        )
        self.seq = seq


def _position(connection: Connection, head_seq: int | None = None) -> Position | None:
    """The marker's row, the one place it is read (`head_seq`: the log's end, if read)."""
    row = connection.execute(
        select(projection_position).where(projection_position.c.id == POSITION_ROW_ID)
    ).first()
    if row is None:
        return None
    last_seq = int(row.last_seq)
    if row.state == STATE_CURRENT and connection.dialect.name != "sqlite":
        # PostgreSQL's appends leave the marker alone (storage/chaining.py):
        # while current, the projections cover the whole log.
        last_seq = SqlTransaction(connection, False).last_seq() if head_seq is None else head_seq
    return Position(last_seq, str(row.state), str(row.owner), int(row.updated_at_us))


def _inserted_id(connection: Connection, table: Any, **values: Any) -> int:
    return int(
        connection.execute(insert(table).values(**values).returning(table.c.id)).scalar_one()
    )


def _stale_bookings(statement: Select[Any]) -> Select[Any]:
    """`statement` over the bookings whose latest event is missing or says
    another amount, lane or id, joined to that event."""
    latest_seq = case(
        (bookings.c.ended_seq > bookings.c.answer_seq, bookings.c.ended_seq),
        else_=bookings.c.answer_seq,
    )
    return statement.select_from(bookings.outerjoin(events, events.c.seq == latest_seq)).where(
        or_(
            events.c.seq.is_(None),
            events.c.amount_nanos != bookings.c.amount_nanos,
            events.c.lane != bookings.c.lane,
            events.c.reservation_id != bookings.c.reservation_id,
        )
    )


def _stale_lanes(connection: Connection) -> int:
    """How many lanes rows are not the policy of the event at their version (a
    damaged row still decodes); by primary key, not a scan of the log."""
    projected = [records.lane_from_row(row) for row in connection.execute(select(lanes)).mappings()]
    columns = [events.c[name] for name in records.EVENT_COLUMNS]
    setting: dict[int, Event] = {}
    for start in range(0, len(projected), STALE_LANES_READ):
        versions = [policy.version for policy in projected[start : start + STALE_LANES_READ]]
        rows = connection.execute(select(*columns).where(events.c.seq.in_(versions))).all()
        setting.update((event.seq, event) for event in records.events_from_rows(rows))
    return sum(1 for policy in projected if not _set_by(policy, setting.get(policy.version)))


def _set_by(policy: LanePolicy, event: Event | None) -> bool:
    return (
        event is not None
        and event.kind is EventKind.LANE_CONFIGURED
        and event.lane == policy.lane
        and event.policy is not None
        and policy_from_dict(event.policy, event.seq, event.occurred_at_us) == policy
    )


def _facts(connection: Connection) -> LogFacts:
    head, count = connection.execute(
        select(func.coalesce(func.max(events.c.seq), 0), func.count())
    ).one()
    # Inline, not bound: so the partial index of configurations serves it on
    # PostgreSQL's generic plans too.
    configuring = literal("lane_configured", literal_execute=True)
    counts = {
        "answer_events": select(func.count()).where(events.c.kind.in_(ANSWER_KINDS)),
        "configured_lanes": select(func.count(distinct(events.c.lane))).where(
            events.c.kind == configuring
        ),
        "bookings": select(func.count()).select_from(bookings),
        "lanes": select(func.count()).select_from(lanes),
        "stale_bookings": _stale_bookings(select(func.count())),
    }
    return LogFacts(
        position=_position(connection, int(head)),
        head_seq=int(head),
        event_count=int(count),
        **{name: int(connection.execute(query).scalar_one()) for name, query in counts.items()},
        stale_lanes=_stale_lanes(connection),
    )


def _quoted(values: Sequence[str]) -> str:
    assert all(value.replace("_", "").isalnum() for value in values), values
    return ", ".join(f"'{value}'" for value in values)


class _RebuildSql:
    """The rebuild's statements as plain SQL, run with tuples of parameters:
    per row, SQLAlchemy's own parameter handling costs more than the database.

    `fold` is `bookings.apply` over a range of the log, run by the database in
    one INSERT ... SELECT ... ON CONFLICT built from OPENING_STATES and
    ENDING_STATES; kept for the rebuild's target (docs/recovery.md), held to the
    domain's fold by tests/storage/test_sql_fold.py. `problem`: the first event
    the fold refused (it writes NULL into a NOT NULL column for a booking it
    cannot fold)."""

    def __init__(self, placeholder: str) -> None:
        p = placeholder
        between = f"FROM {events.name} WHERE seq > {p} AND seq <= {p} ORDER BY seq"
        self.events_between = f"SELECT {', '.join(records.EVENT_COLUMNS)} {between}"
        self.links_between = f"SELECT seq, lane, previous_hash, hash {between}"
        self.bookings_in_order = (
            f"SELECT {', '.join(records.BOOKING_COLUMNS)} FROM {bookings.name} "
            "ORDER BY lane, reservation_id"
        )
        self.insert_bookings = (
            f"INSERT INTO {bookings.name} ({', '.join(records.BOOKING_COLUMNS)}) "
            f"VALUES ({', '.join(p for _ in records.BOOKING_COLUMNS)})"
        )
        openings = _quoted([kind.value for kind in booking_fold.OPENING_STATES])
        endings = _quoted([kind.value for kind in booking_fold.ENDING_STATES])
        known = _quoted([kind.value for kind in EventKind])
        opened = " ".join(
            f"WHEN '{kind.value}' THEN '{state.value}'"
            for kind, state in booking_fold.OPENING_STATES.items()
        )
        ended = " ".join(
            f"WHEN '{kind.value}' THEN '{state.value}'"
            for kind, state in booking_fold.ENDING_STATES.items()
        )
        state = (
            f"CASE WHEN e.seq IS NULL THEN CASE o.kind {opened} END "
            f"WHEN e.kind = '{EventKind.SETTLED.value}' "
            f"AND e.outcome = '{Outcome.SUCCEEDED.value}' "
            f"THEN '{booking_fold.SETTLED_SUCCEEDED_STATE.value}' "
            f"ELSE CASE e.kind {ended} END END"
        )
        sources = {
            "state": state,
            "amount_nanos": "CASE WHEN e.seq IS NULL THEN o.amount_nanos ELSE e.amount_nanos END",
            # NULL, refused by the NOT NULL column, where the fold cannot apply
            # the range: no opening, or one after the booking's first ending.
            "answer_seq": "CASE WHEN o.seq < k.first_end OR k.first_end IS NULL THEN o.seq END",
            "ended_seq": "COALESCE(e.seq, 0)",
            "outcome": "e.outcome",
            "input_tokens": "COALESCE(e.input_tokens, 0)",
            "output_tokens": "COALESCE(e.output_tokens, 0)",
            "billed_nanos": "e.billed_nanos",
            "cached_input_tokens": "COALESCE(e.cached_input_tokens, 0)",
            "cache_write_tokens": "COALESCE(e.cache_write_tokens, 0)",
        }
        columns = records.BOOKING_COLUMNS
        # Every other column of a booking is its opening event's, by name.
        assert all(name in sources or name in events.c for name in columns)
        selected = ", ".join(sources.get(name, f"o.{name}") for name in columns)
        keys = ("lane", "reservation_id")
        updates = ", ".join(f"{name} = excluded.{name}" for name in columns if name not in keys)
        self.fold = (
            f"INSERT INTO {bookings.name} ({', '.join(columns)}) SELECT {selected} "
            f"FROM (SELECT lane, reservation_id, "
            f"min(CASE WHEN kind IN ({openings}) THEN seq END) AS opened, "
            f"min(CASE WHEN kind IN ({endings}) THEN seq END) AS first_end, "
            f"max(CASE WHEN kind IN ({endings}) THEN seq END) AS last_end FROM {events.name} "
            f"WHERE seq > {p} AND seq <= {p} AND kind IN ({openings}, {endings}) "
            "GROUP BY lane, reservation_id) AS k "
            # The opening and the latest ending are taken by seq from the range
            # itself where they are in it; only a booking opened (or last
            # ended) before the range is looked up by its key.
            f"LEFT JOIN {events.name} AS o ON o.seq = COALESCE(k.opened, "
            f"(SELECT y.seq FROM {events.name} AS y WHERE y.lane = k.lane "
            f"AND y.reservation_id = k.reservation_id AND y.kind IN ({openings}) "
            f"AND y.seq <= {p})) "
            f"LEFT JOIN {events.name} AS e ON e.seq = COALESCE(k.last_end, "
            f"(SELECT max(x.seq) FROM {events.name} AS x "
            "WHERE x.lane = k.lane AND x.reservation_id = k.reservation_id "
            f"AND x.kind IN ({endings}) AND x.seq <= {p})) "
            # SQLite reads ON CONFLICT after a bare FROM ... JOIN as the join's.
            "WHERE true "
            f"ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {updates}"
        )
        self.unknown_kind = (
            f"SELECT 1 FROM {events.name} WHERE seq > {p} AND seq <= {p} "
            f"AND kind NOT IN ({known}) LIMIT 1"
        )
        self.problem = (
            f"SELECT seq, kind, lane, reservation_id FROM {events.name} AS e "
            f"WHERE seq > {p} AND seq <= {p} AND ("
            f"(kind IN ({endings}) AND NOT EXISTS (SELECT 1 FROM {events.name} AS o "
            "WHERE o.lane = e.lane AND o.reservation_id = e.reservation_id "
            f"AND o.kind IN ({openings}) AND o.seq < e.seq)) "
            f"OR (kind IN ({openings}) AND expire_charge IS NULL) "
            f"OR kind NOT IN ({known})) ORDER BY seq LIMIT 1"
        )


class SqlRecoveryStore:
    def __init__(
        self, engine: Engine, *, batch_rows: int = 1000, horizon: CommitHorizon | None = None
    ) -> None:
        self.engine = engine
        self._sqlite = engine.dialect.name == "sqlite"
        self._batch = batch_rows
        placeholder = "?" if engine.dialect.paramstyle == "qmark" else "%s"
        self._sql = _RebuildSql(placeholder)
        # PostgreSQL: where a verified point may be set (storage/horizon.py): the
        # server's store's own horizon when given (one per process).
        self._horizon = None if self._sqlite else horizon or CommitHorizon()
        # A thread's open `view`: every read of that thread joins it.
        self._held = threading.local()

    # Transactions -----------------------------------------------------------

    @contextlib.contextmanager
    def _reading(self) -> Iterator[Connection]:
        """One snapshot transaction, its database errors translated: the
        thread's `view` when it holds one."""
        held: Connection | None = getattr(self._held, "connection", None)
        if held is not None:
            with translated(self.engine):
                yield held
            return
        with translated(self.engine), self.engine.connect() as connection:
            if not self._sqlite:
                connection = connection.execution_options(isolation_level="REPEATABLE READ")
            with connection.begin():
                yield connection

    @contextlib.contextmanager
    def _holding(self, connection: Connection) -> Iterator[Self]:
        """Every read of this thread in the block runs in `connection`'s transaction."""
        self._held.connection = connection
        try:
            yield self
        finally:
            self._held.connection = None

    @contextlib.contextmanager
    def view(self) -> Iterator[Self]:
        """This store, every read of this thread in the block at one instant
        (`ledger verify` beside serving replicas compares the log with the
        projections, and moves commit between its reads)."""
        if getattr(self._held, "connection", None) is not None:
            yield self  # inside one already
            return
        with self._reading() as connection, self._holding(connection):
            yield self

    @contextlib.contextmanager
    def _writing(self, *, marker: bool = False) -> Iterator[Connection]:
        # SQLite: in this process's write gate, beside the group commit (database.write_gate).
        gate = database.write_gate(self.engine)
        if gate is not None and not gate.acquire(timeout=WRITE_GATE_TIMEOUT_SECONDS):
            raise StoreUnavailable()
        try:
            with translated(self.engine), self.engine.connect() as connection:
                connection = connection.execution_options(ledger_write=True)
                with connection.begin():
                    if marker and not self._sqlite:
                        connection.execute(
                            select(func.pg_advisory_xact_lock(literal(EVENT_APPEND_LOCK_KEY)))
                        )
                    yield connection
        finally:
            if gate is not None:
                gate.release()

    # Reads -------------------------------------------------------------------

    def _all(self, statement: Select[Any]) -> Sequence[Row[Any]]:
        with self._reading() as connection:
            return connection.execute(statement).all()

    def facts(self) -> LogFacts:
        with self._reading() as connection:
            return _facts(connection)

    def position(self) -> Position | None:
        with self._reading() as connection:
            return _position(connection)

    @contextlib.contextmanager
    def settled_view(self) -> Iterator[Self]:
        """A `view` of an instant when no append was in flight (docs/recovery.md,
        Snapshots): on PostgreSQL, taken under the maintenance lock held on a
        second connection for at most SETTLE_WAIT_MS (then StoreUnavailable)."""
        if self._sqlite:  # one writer: a read transaction sees whole commits
            with self.view() as view:
                yield view
            return
        with (
            translated(self.engine),
            self.engine.connect() as gate,
            self.engine.connect() as connection,
        ):
            connection = connection.execution_options(isolation_level="REPEATABLE READ")
            with connection.begin():
                with gate.begin():
                    gate.exec_driver_sql(f"SET LOCAL lock_timeout = {SETTLE_WAIT_MS}")
                    gate.execute(select(func.pg_advisory_xact_lock(literal(EVENT_APPEND_LOCK_KEY))))
                    connection.execute(select(literal(1)))  # the view's snapshot is taken here
                with self._holding(connection) as view:
                    yield view

    def chain_heads(self, through_seq: int) -> Mapping[str, str]:
        """Each lane's chain head right after event `through_seq`."""
        last = (
            select(events.c.lane, func.max(events.c.seq).label("seq"))
            .where(events.c.seq <= through_seq)
            .group_by(events.c.lane)
            .subquery()
        )
        statement = (
            select(events.c.lane, events.c.hash)
            .join(last, events.c.seq == last.c.seq)
            # A lane whose events all predate the chain has no head, as in
            # ChainWalker.heads.
            .where(events.c.hash != "")
        )
        return {str(row.lane): str(row.hash) for row in self._all(statement)}

    def lanes(self) -> Iterator[LanePolicy]:
        with self._reading() as connection:
            result = connection.execution_options(yield_per=self._batch).execute(
                select(lanes).order_by(lanes.c.lane)
            )
            yield from map(records.lane_from_row, result.mappings())

    def _booking_rows(self, size: int) -> Iterator[list[tuple[Any, ...]]]:
        """Every booking's row, by (lane, reservation_id), `size` at a time."""
        with self._reading() as connection:
            result = connection.execution_options(stream_results=True).exec_driver_sql(
                self._sql.bookings_in_order
            )
            while rows := result.fetchmany(size):
                yield [tuple(row) for row in rows]

    def bookings(self) -> Iterator[Booking]:
        """Every booking, by (lane, reservation_id), `batch_rows` rows in memory at a time."""
        for rows in self._booking_rows(self._batch):
            yield from records.bookings_from_rows(rows)

    def booking_texts(self) -> Iterator[str]:
        """chain.canonical_json of every booking, in the order of `bookings`."""
        for rows in self._booking_rows(self._batch):
            yield from records.booking_texts_from_rows(rows)

    def chunks(self, size: int) -> Iterator[SnapshotChunk]:
        """The projections as a snapshot holds them: the lanes, then the
        bookings, `size` rows a chunk."""
        policies = self.lanes()
        lane_batches = iter(lambda: list(itertools.islice(policies, size)), [])
        yield from (SnapshotChunk(lanes=batch) for batch in lane_batches)
        yield from map(SnapshotChunk.of_booking_rows, self._booking_rows(size))

    def events_after(
        self, after_seq: int, limit: int, *, lane: str = "", kinds: tuple[str, ...] = ()
    ) -> Sequence[Event]:
        query = EventQuery(lane=lane, kinds=kinds, after_seq=after_seq, limit=limit)
        with self._reading() as connection:
            return SqlTransaction(connection, self._sqlite).list_events(query)

    def last_seq(self) -> int:
        with self._reading() as connection:
            return SqlTransaction(connection, self._sqlite).last_seq()

    def last_event_at_us(self) -> int:
        with self._reading() as connection:
            return last_event_at_us(SqlTransaction(connection, self._sqlite))

    def stale_latest_events(self, limit: int) -> Sequence[Event]:
        """The latest events (first by seq) of bookings that differ from them."""
        columns = [events.c[name] for name in records.EVENT_COLUMNS]
        statement = _stale_bookings(select(*columns)).where(events.c.seq.is_not(None))
        return records.events_from_rows(self._all(statement.order_by(events.c.seq).limit(limit)))

    def final_seq(self) -> int:
        """The last event below which none is in flight (storage/horizon.py);
        read committed, as the horizon moves when transactions end."""
        with translated(self.engine), self.engine.connect() as connection, connection.begin():
            return SqlTransaction(connection, self._sqlite, horizon=self._horizon).last_seq()

    def checkpoint(self) -> ChainPoint | None:
        """The last verified point, or None when there is none or the event it
        names is no longer the one it checked."""
        with self._reading() as connection:
            row = connection.execute(
                select(chain_checkpoints).where(chain_checkpoints.c.id == POSITION_ROW_ID)
            ).first()
            if row is None or _event_hash(connection, int(row.through_seq)) != row.event_hash:
                return None
        return ChainPoint(int(row.through_seq), json.loads(row.chain_heads_json))

    def save_checkpoint(self, point: ChainPoint, now_us: int) -> None:
        """Moves the verified point forward to `point` (never back)."""
        heads = _heads_json(point.chain_heads)
        with self._writing() as connection:
            values = {
                "through_seq": point.position_seq,
                "event_hash": _event_hash(connection, point.position_seq),
                "chain_heads_json": heads,
                "verified_at_us": now_us,
            }
            dialect_insert = sqlite.insert if self._sqlite else postgresql.insert
            statement = dialect_insert(chain_checkpoints).values(id=POSITION_ROW_ID, **values)
            connection.execute(
                statement.on_conflict_do_update(
                    index_elements=["id"],
                    set_=values,
                    where=chain_checkpoints.c.through_seq < point.position_seq,
                )
            )

    def check_integrity(self) -> None:
        """StoreDamaged when SQLite's integrity_check finds the file damaged
        (docs/recovery.md); on PostgreSQL amcheck is the operator's."""
        if not self._sqlite:
            return
        with self._reading() as connection:
            limit = translate.MAX_INTEGRITY_PROBLEMS
            rows = connection.exec_driver_sql(f"PRAGMA integrity_check({limit})").all()
        problems = [str(row[0]) for row in rows]
        if problems != ["ok"]:
            raise translate.integrity_damage(problems)

    def count_events_after(self, after_seq: int) -> int:
        return int(self._all(select(func.count()).where(events.c.seq > after_seq))[0][0])

    def log_lanes(self) -> Sequence[str]:
        rows = self._all(select(events.c.lane).distinct().order_by(events.c.lane))
        return [str(lane) for (lane,) in rows]

    def projected_bookings(self, lane: str) -> Iterator[Booking]:
        """The lane's bookings by reservation id, `batch_rows` rows in memory at a time."""
        with self._reading() as connection:
            result = connection.execution_options(yield_per=self._batch).execute(
                select(bookings).where(bookings.c.lane == lane).order_by(bookings.c.reservation_id)
            )
            for row in result.mappings():
                yield records.booking_from_row(row)

    def window_totals(self, lane: str, now_us: int, window_us: int) -> WindowTotals:
        with self._reading() as connection:
            return SqlTransaction(connection, self._sqlite).window_totals(lane, now_us, window_us)

    def kept_window(self, policy: LanePolicy, now_us: int) -> tuple[int, WindowTotals] | None:
        """When the budget's kept sums (PostgreSQL's window_states) were last
        moved, and the window a move would read from them now; None on SQLite."""
        if self._sqlite:
            return None
        with self._reading() as connection:
            tx = SqlTransaction(connection, self._sqlite)
            state = tx.window_state(policy.lane)
            if state is None:
                return None
            return state.as_of_us, open_window(tx, policy, now_us).totals

    # Snapshots -------------------------------------------------------------------

    def snapshots(self) -> Sequence[SnapshotInfo]:
        rows = self._all(
            select(snapshots)
            .where(snapshots.c.state == SNAPSHOT_COMPLETE)
            .order_by(snapshots.c.position_seq.desc(), snapshots.c.id.desc())
            .limit(MAX_LISTED_SNAPSHOTS)
        )
        return [_snapshot_info(row) for row in rows]

    def snapshot_chunks(self, snapshot_id: int) -> Iterator[SnapshotChunk]:
        """One chunk per read, so no transaction stays open while it is used."""
        after = -1
        while True:
            with self._reading() as connection:
                row = connection.execute(
                    select(snapshot_chunks)
                    .where(
                        snapshot_chunks.c.snapshot_id == snapshot_id,
                        snapshot_chunks.c.chunk_no > after,
                    )
                    .order_by(snapshot_chunks.c.chunk_no)
                    .limit(1)
                ).first()
            if row is None:
                return
            after = int(row.chunk_no)
            yield _chunk_of(str(row.kind), json.loads(row.payload))

    def begin_snapshot(
        self, position_seq: int, chain_heads: Mapping[str, str], taken_at_us: int
    ) -> int:
        with self._writing() as connection:
            return _inserted_id(
                connection,
                snapshots,
                state=SNAPSHOT_TAKING,
                position_seq=position_seq,
                taken_at_us=taken_at_us,
                format_version=FORMAT_VERSION,
                lanes_count=0,
                bookings_count=0,
                digest="",
                chain_heads_json=_heads_json(chain_heads),
                chain_verified=0,
            )

    def write_snapshot_chunk(self, snapshot_id: int, chunk_no: int, chunk: SnapshotChunk) -> None:
        kind, rows = _rows_of(chunk)
        with self._writing() as connection:
            connection.execute(
                insert(snapshot_chunks).values(
                    snapshot_id=snapshot_id,
                    chunk_no=chunk_no,
                    kind=kind,
                    payload=json.dumps(rows, sort_keys=True, separators=(",", ":")),
                )
            )

    def complete_snapshot(
        self, snapshot_id: int, digest: ProjectionDigest, chain_verified: bool
    ) -> SnapshotInfo:
        with self._writing() as connection:
            row = connection.execute(
                update(snapshots)
                .where(snapshots.c.id == snapshot_id)
                .values(
                    state=SNAPSHOT_COMPLETE,
                    lanes_count=digest.lanes,
                    bookings_count=digest.bookings,
                    digest=digest.hexdigest(),
                    chain_verified=int(chain_verified),
                )
                .returning(*snapshots.c)
            ).one()
        return _snapshot_info(row)

    def prune_snapshots(self, keep: int, unfinished_before_us: int) -> int:
        """Keeps the newest `keep` complete snapshots and unfinished ones still
        young enough to be in progress; deletes the rest with their chunks."""
        with self._writing() as connection:
            kept = (
                select(snapshots.c.id)
                .where(snapshots.c.state == SNAPSHOT_COMPLETE)
                .order_by(snapshots.c.position_seq.desc(), snapshots.c.id.desc())
                .limit(max(keep, 1))
            )
            doomed = connection.scalars(
                select(snapshots.c.id).where(
                    snapshots.c.id.not_in(kept),
                    or_(
                        snapshots.c.state == SNAPSHOT_COMPLETE,
                        snapshots.c.taken_at_us < unfinished_before_us,
                    ),
                )
            ).all()
            if doomed:
                connection.execute(
                    delete(snapshot_chunks).where(snapshot_chunks.c.snapshot_id.in_(doomed))
                )
                connection.execute(delete(snapshots).where(snapshots.c.id.in_(doomed)))
            return len(doomed)

    # Rebuilding ------------------------------------------------------------------

    def claim_rebuild(
        self,
        owner: str,
        now_us: int,
        lease_us: int,
        assessed: tuple[str, str, int] | Literal["any"] | None = "any",
    ) -> bool:
        """Marks the projections ours to rebuild; False while another's lease
        runs. `assessed`: the marker_key seen (else MarkerMoved), or "any"."""
        with self._writing(marker=True) as connection:
            row = _position(connection)
            ours = row is not None and row.state == STATE_REBUILDING and row.owner == owner
            if assessed != "any" and not ours and marker_key(row) != assessed:
                raise MarkerMoved("the projections were recovered since they were assessed")
            if row is not None and row.leased_to_another(owner, now_us, lease_us):
                return False
            values = {"state": STATE_REBUILDING, "owner": owner, "updated_at_us": now_us}
            if row is None:
                connection.execute(
                    insert(projection_position).values(id=POSITION_ROW_ID, last_seq=0, **values)
                )
            else:
                connection.execute(
                    update(projection_position)
                    .where(projection_position.c.id == POSITION_ROW_ID)
                    .values(**values)
                )
            return True

    def reset_projections(self, owner: str, position_seq: int, now_us: int) -> None:
        with self._writing() as connection:
            _advance(connection, owner, {"last_seq": position_seq, "updated_at_us": now_us})
            connection.execute(delete(bookings))
            connection.execute(delete(lanes))
            # Kept window sums are a cache over the bookings: recomputed on first use.
            connection.execute(delete(window_states))

    def restore_chunk(self, owner: str, chunk: SnapshotChunk, now_us: int) -> None:
        with self._writing() as connection:
            _advance(connection, owner, {"updated_at_us": now_us})
            if chunk.booking_rows:
                connection.exec_driver_sql(self._sql.insert_bookings, list(chunk.booking_rows))
            elif chunk.lanes:
                connection.execute(insert(lanes), _rows_of(chunk)[1])

    def event_rows(self, after_seq: int, through_seq: int) -> list[tuple[Any, ...]]:
        """The events in (after_seq, through_seq] as rows of EVENT_COLUMNS, in seq order."""
        return self._range(self._sql.events_between, after_seq, through_seq)

    def link_rows(self, after_seq: int, through_seq: int) -> list[tuple[Any, ...]]:
        """(seq, lane, previous_hash, hash) of the events in (after_seq, through_seq]."""
        return self._range(self._sql.links_between, after_seq, through_seq)

    def _range(self, sql: str, after_seq: int, through_seq: int) -> list[tuple[Any, ...]]:
        # Through the driver's own cursor: rows as plain tuples, in one read.
        with (
            self._reading() as connection,
            contextlib.closing(connection.connection.cursor()) as cursor,
        ):
            cursor.execute(sql, (after_seq, through_seq))
            return list(cursor.fetchall())

    def fold_events(
        self,
        owner: str,
        policies: Sequence[LanePolicy],
        after_seq: int,
        through_seq: int,
        now_us: int,
        *,
        dry_run: bool = False,
    ) -> None:
        with translated(self.engine), self.engine.connect() as connection:
            connection = connection.execution_options(ledger_write=True)
            range_parameters = (after_seq, through_seq)
            error: IntegrityError | None = None
            with connection.begin() as transaction:
                if dry_run and not self._sqlite:
                    connection.exec_driver_sql(f"SET LOCAL lock_timeout = {DRY_RUN_LOCK_WAIT_MS}")
                unknown = connection.exec_driver_sql(self._sql.unknown_kind, range_parameters)
                refused = unknown.first() is not None
                if not refused:
                    if not dry_run:
                        values = {"last_seq": through_seq, "updated_at_us": now_us}
                        _advance(connection, owner, values)
                        for policy in policies:
                            SqlTransaction(connection, self._sqlite).save_lane(policy)
                    try:
                        connection.exec_driver_sql(
                            self._sql.fold, (after_seq, through_seq, through_seq, through_seq)
                        )
                    except IntegrityError as caught:
                        refused, error = True, caught
                if refused or dry_run:
                    transaction.rollback()
            if refused:
                with connection.begin():
                    found = connection.exec_driver_sql(self._sql.problem, range_parameters).first()
                if found is None:
                    # Refused by the database for a reason the fold does not know.
                    raise error or RebuildFailed(f"events after {after_seq} cannot be applied")
                seq, kind, lane, reservation_id = found
                raise EventRefused(int(seq), str(kind), str(lane), str(reservation_id))

    def release_rebuild(self, owner: str) -> None:
        """Ends our lease at once; the marker stays "rebuilding", and the next
        assessment plans again instead of waiting for the lease."""
        with self._writing(marker=True) as connection, contextlib.suppress(RebuildClaimLost):
            _advance(connection, owner, {"updated_at_us": 0})

    def finish_rebuild(self, owner: str, applied_seq: int) -> bool:
        with self._writing(marker=True) as connection:
            if SqlTransaction(connection, self._sqlite).last_seq() != applied_seq:
                return False
            _advance(
                connection, owner, {"state": STATE_CURRENT, "owner": "", "last_seq": applied_seq}
            )
            return True

    # Manifests ---------------------------------------------------------------------

    def save_manifest(
        self, manifest: Manifest, actor: str, created_at_us: int, outcome: str
    ) -> int:
        with self._writing() as connection:
            return _inserted_id(
                connection,
                recovery_manifests,
                created_at_us=created_at_us,
                actor=actor[:200],
                verdict=manifest.verdict.value,
                outcome=outcome,
                digest=manifest.digest,
                body_json=manifest.to_json(),
                elapsed_ms=0,
            )

    def update_manifest(self, manifest_id: int, outcome: str, elapsed_ms: int) -> None:
        with self._writing() as connection:
            connection.execute(
                update(recovery_manifests)
                .where(recovery_manifests.c.id == manifest_id)
                .values(outcome=outcome, elapsed_ms=elapsed_ms)
            )

    def accepted_breaks(self) -> Mapping[str, AcceptedBreak]:
        """The broken links accepted by carried-out recoveries, by description,
        each with the first manifest (of the newest MAX_ACCEPTING_MANIFESTS)."""
        rows = self._all(
            select(
                recovery_manifests.c.id,
                recovery_manifests.c.created_at_us,
                recovery_manifests.c.actor,
                recovery_manifests.c.body_json,
            )
            .where(recovery_manifests.c.outcome == MANIFEST_REBUILT)
            .order_by(recovery_manifests.c.id.desc())
            .limit(MAX_ACCEPTING_MANIFESTS)
        )
        accepted: dict[str, AcceptedBreak] = {}
        for manifest_id, created_at_us, actor, body_json in reversed(rows):
            body = json.loads(body_json)
            for described in body.get("accepted_breaks", ()):
                accepted.setdefault(
                    str(described), AcceptedBreak(int(manifest_id), int(created_at_us), str(actor))
                )
        return accepted

    def manifests(self, limit: int = 10) -> Sequence[Mapping[str, Any]]:
        """The newest manifests, newest first (for people and tests)."""
        rows = self._all(
            select(recovery_manifests).order_by(recovery_manifests.c.id.desc()).limit(limit)
        )
        return [dict(row._mapping) for row in rows]


def _advance(connection: Connection, owner: str, values: Mapping[str, Any]) -> None:
    """UPDATEs the marker while it is `owner`'s rebuild (moves it on, ends it);
    RebuildClaimLost once it is not: another process took the rebuild over."""
    result = connection.execute(
        update(projection_position)
        .where(
            projection_position.c.id == POSITION_ROW_ID,
            projection_position.c.state == STATE_REBUILDING,
            projection_position.c.owner == owner,
        )
        .values(**values)
    )
    if result.rowcount != 1:
        raise RebuildClaimLost("the rebuild was taken over by another process")


def _heads_json(heads: Mapping[str, str]) -> str:
    """Chain heads as stored, in snapshots and the verified point alike."""
    return json.dumps(dict(sorted(heads.items())))


def _event_hash(connection: Connection, seq: int) -> str:
    found = connection.execute(select(events.c.hash).where(events.c.seq == seq)).scalar()
    return str(found or "")


def _snapshot_info(row: Any) -> SnapshotInfo:
    return SnapshotInfo(
        snapshot_id=int(row.id),
        position_seq=int(row.position_seq),
        taken_at_us=int(row.taken_at_us),
        format_version=int(row.format_version),
        lanes_count=int(row.lanes_count),
        bookings_count=int(row.bookings_count),
        digest=str(row.digest),
        chain_heads=json.loads(row.chain_heads_json),
        chain_verified=bool(row.chain_verified),
    )


# A chunk's kinds (docs/recovery.md, Snapshots).
CHUNK_LANES = "lanes"
CHUNK_BOOKING_ROWS = "booking_rows"


def _rows_of(chunk: SnapshotChunk) -> tuple[str, Any]:
    """A chunk's kind and its payload, ready for JSON."""
    if chunk.lanes:
        return CHUNK_LANES, [records.lane_values(policy) for policy in chunk.lanes]
    return CHUNK_BOOKING_ROWS, {
        "columns": records.BOOKING_COLUMNS,
        "rows": [list(row) for row in chunk.booking_rows],
    }


def _chunk_of(kind: str, payload: Any) -> SnapshotChunk:
    """A chunk read back; ValueError for another format (an older release's
    kind or columns) or a bad enum, KeyError for a missing field."""
    if kind == CHUNK_LANES:
        return SnapshotChunk(lanes=[records.lane_from_row(row) for row in payload])
    if kind != CHUNK_BOOKING_ROWS:
        raise ValueError(f"a chunk of kind {kind!r}, a format this release no longer reads")
    columns = list(payload["columns"])
    if columns != list(records.BOOKING_COLUMNS):
        missing = [name for name in records.BOOKING_COLUMNS if name not in columns]
        raise ValueError(
            "its bookings' columns are not this release's "
            + (f"(it lacks {', '.join(missing)})" if missing else "(another set or order)")
        )
    return SnapshotChunk.of_booking_rows([tuple(row) for row in payload["rows"]])
