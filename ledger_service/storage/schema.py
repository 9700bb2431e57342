"""The schema, in SQLAlchemy 2 typed style. Alembic (`migrations/`) owns it.

Instants are integer microseconds since the Unix epoch and amounts integer
nanos, stored as BIGINT on both databases so that arithmetic stays exact.
"""

from __future__ import annotations

from typing import cast

from sqlalchemy import BigInteger, Index, Integer, MetaData, String, Table, Text, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only autoincrements an INTEGER PRIMARY KEY (the rowid alias).
SeqType = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class EventRow(Base):
    """The append-only log. Triggers refuse UPDATE and DELETE (see migrations)."""

    __tablename__ = "events"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(32))
    lane: Mapped[str] = mapped_column(String(200))
    occurred_at_us: Mapped[int] = mapped_column(BigInteger)
    reservation_id: Mapped[str] = mapped_column(String(200), default="")
    amount_nanos: Mapped[int] = mapped_column(BigInteger, default=0)
    previous_amount_nanos: Mapped[int] = mapped_column(BigInteger, default=0)
    model: Mapped[str] = mapped_column(String(200), default="")
    request_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    max_output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    estimate_nanos: Mapped[int | None] = mapped_column(BigInteger)
    requested_ttl_us: Mapped[int | None] = mapped_column(BigInteger)
    hold_nanos: Mapped[int] = mapped_column(BigInteger, default=0)
    cap_nanos: Mapped[int] = mapped_column(BigInteger, default=0)
    reserved_at_us: Mapped[int] = mapped_column(BigInteger, default=0)
    expires_at_us: Mapped[int] = mapped_column(BigInteger, default=0)
    retry_after_us: Mapped[int | None] = mapped_column(BigInteger)
    denial_reason: Mapped[str | None] = mapped_column(String(32))
    input_nanos_per_million_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    output_nanos_per_million_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_input_nanos_per_million_tokens: Mapped[int | None] = mapped_column(BigInteger)
    cache_write_nanos_per_million_tokens: Mapped[int | None] = mapped_column(BigInteger)
    expire_charge: Mapped[str | None] = mapped_column(String(8))
    outcome: Mapped[str | None] = mapped_column(String(16))
    input_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    billed_nanos: Mapped[int | None] = mapped_column(BigInteger)
    cached_input_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    cache_write_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    http_status: Mapped[int] = mapped_column(Integer, default=0)
    reason: Mapped[str] = mapped_column(Text, default="")
    policy_json: Mapped[str | None] = mapped_column(Text)
    trace_id: Mapped[str] = mapped_column(String(32), default="")
    spent_after_nanos: Mapped[int] = mapped_column(BigInteger, default=0)
    held_after_nanos: Mapped[int] = mapped_column(BigInteger, default=0)
    charged_after_nanos: Mapped[int] = mapped_column(BigInteger, default=0)
    limit_nanos: Mapped[int] = mapped_column(BigInteger, default=0)
    window_us: Mapped[int] = mapped_column(BigInteger, default=0)
    open_bookings_after: Mapped[int] = mapped_column(BigInteger, default=0)
    # For denied: the budget (this lane or an ancestor) that said no.
    denied_by: Mapped[str] = mapped_column(String(200), default="", server_default="")
    # For corrected: the operator's correction id and the grant that made it.
    correction_id: Mapped[str] = mapped_column(String(200), default="", server_default="")
    grant_id: Mapped[str] = mapped_column(String(200), default="", server_default="")
    # Tamper evidence: SHA-256 (hex) chaining each event to its lane's previous one.
    hash: Mapped[str] = mapped_column(String(64), default="", server_default="")
    previous_hash: Mapped[str] = mapped_column(String(64), default="", server_default="")

    __table_args__ = (
        Index("ix_events_lane_seq", "lane", "seq"),
        Index("ix_events_lane_reservation_id", "lane", "reservation_id"),
        # The permanent idempotency guarantee: one answer per reservation id,
        # whichever replica takes the request.
        Index(
            "uq_events_lane_reservation_id_answer",
            "lane",
            "reservation_id",
            unique=True,
            sqlite_where=text("kind IN ('reserved', 'denied')"),
            postgresql_where=text("kind IN ('reserved', 'denied')"),
        ),
        # A correction id names one correction per lane, whichever replica takes it.
        Index(
            "uq_events_lane_correction_id",
            "lane",
            "correction_id",
            unique=True,
            sqlite_where=text("kind = 'corrected'"),
            postgresql_where=text("kind = 'corrected'"),
        ),
        # The lanes the log configures, counted at every start (recovery/store.py).
        Index(
            "ix_events_lane_configured",
            "lane",
            sqlite_where=text("kind = 'lane_configured'"),
            postgresql_where=text("kind = 'lane_configured'"),
        ),
    )


class LaneRow(Base):
    """Projection: each lane's current policy."""

    __tablename__ = "lanes"

    lane: Mapped[str] = mapped_column(String(200), primary_key=True)
    limit_nanos: Mapped[int] = mapped_column(BigInteger)
    window_us: Mapped[int] = mapped_column(BigInteger)
    hold_ttl_us: Mapped[int] = mapped_column(BigInteger)
    bytes_per_token_milli: Mapped[int] = mapped_column(Integer)
    overhead_tokens: Mapped[int] = mapped_column(BigInteger)
    expire_charge: Mapped[str] = mapped_column(String(8))
    prices_json: Mapped[str] = mapped_column(Text)
    version: Mapped[int] = mapped_column(BigInteger)
    updated_at_us: Mapped[int] = mapped_column(BigInteger)
    # The parent budget's lane, if any.
    parent: Mapped[str | None] = mapped_column(String(200), index=True)
    max_charge_multiple: Mapped[int] = mapped_column(BigInteger, server_default="100")


class BookingRow(Base):
    """Projection: each booking as its events left it."""

    __tablename__ = "bookings"

    lane: Mapped[str] = mapped_column(String(200), primary_key=True)
    reservation_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    model: Mapped[str] = mapped_column(String(200))
    request_bytes: Mapped[int] = mapped_column(BigInteger)
    max_output_tokens: Mapped[int] = mapped_column(BigInteger)
    estimate_nanos: Mapped[int | None] = mapped_column(BigInteger)
    requested_ttl_us: Mapped[int | None] = mapped_column(BigInteger)
    cap_nanos: Mapped[int] = mapped_column(BigInteger)
    hold_nanos: Mapped[int] = mapped_column(BigInteger)
    reserved_at_us: Mapped[int] = mapped_column(BigInteger)
    expires_at_us: Mapped[int] = mapped_column(BigInteger)
    input_nanos_per_million_tokens: Mapped[int] = mapped_column(BigInteger)
    output_nanos_per_million_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_input_nanos_per_million_tokens: Mapped[int | None] = mapped_column(BigInteger)
    cache_write_nanos_per_million_tokens: Mapped[int | None] = mapped_column(BigInteger)
    expire_charge: Mapped[str] = mapped_column(String(8))
    state: Mapped[str] = mapped_column(String(16))
    amount_nanos: Mapped[int] = mapped_column(BigInteger)
    answer_seq: Mapped[int] = mapped_column(BigInteger)
    ended_seq: Mapped[int] = mapped_column(BigInteger)
    outcome: Mapped[str | None] = mapped_column(String(16))
    input_tokens: Mapped[int] = mapped_column(BigInteger)
    output_tokens: Mapped[int] = mapped_column(BigInteger)
    billed_nanos: Mapped[int | None] = mapped_column(BigInteger)
    cached_input_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    cache_write_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")

    __table_args__ = (
        Index("ix_bookings_lane_reserved_at_us", "lane", "reserved_at_us"),
        Index("ix_bookings_state_expires_at_us", "state", "expires_at_us"),
        # Open holds of a budget past their deadline: counted as expired at read time.
        Index("ix_bookings_lane_state_expires_at_us", "lane", "state", "expires_at_us"),
    )


class WindowStateRow(Base):
    """Projection: each budget's window sums as of one instant (domain WindowState).

    A cache the ledger keeps in step with the bookings in the same transaction;
    dropped when a lane's window or tree changes, and on every rebuild, and
    recomputed from the bookings when missing.
    """

    __tablename__ = "window_states"

    lane: Mapped[str] = mapped_column(String(200), primary_key=True)
    window_us: Mapped[int] = mapped_column(BigInteger)
    as_of_us: Mapped[int] = mapped_column(BigInteger)
    amount_nanos: Mapped[int] = mapped_column(BigInteger)
    open_amount_nanos: Mapped[int] = mapped_column(BigInteger)
    open_bookings: Mapped[int] = mapped_column(BigInteger)


events = cast(Table, EventRow.__table__)
lanes = cast(Table, LaneRow.__table__)
bookings = cast(Table, BookingRow.__table__)
window_states = cast(Table, WindowStateRow.__table__)


# Recovery (docs/recovery.md). None of these is an event: they are recoverable
# artefacts, rebuilt or thrown away, never the source of truth.


class ProjectionPositionRow(Base):
    """One row (id 1): the last event the projections have applied.

    Each append advances it in the same transaction, and only while `state` is
    "current": while a rebuild runs ("rebuilding", owned by `owner`, alive while
    `updated_at_us` is recent) or once the row is gone, appends are refused.
    """

    __tablename__ = "projection_position"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    last_seq: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16))
    owner: Mapped[str] = mapped_column(String(200), default="")
    updated_at_us: Mapped[int] = mapped_column(BigInteger, default=0)


class SnapshotRow(Base):
    """A snapshot of the projections right after event `position_seq`."""

    __tablename__ = "snapshots"

    id: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    # "taking" until every chunk is written, then "complete".
    state: Mapped[str] = mapped_column(String(16))
    position_seq: Mapped[int] = mapped_column(BigInteger)
    taken_at_us: Mapped[int] = mapped_column(BigInteger)
    format_version: Mapped[int] = mapped_column(Integer)
    lanes_count: Mapped[int] = mapped_column(BigInteger, default=0)
    bookings_count: Mapped[int] = mapped_column(BigInteger, default=0)
    digest: Mapped[str] = mapped_column(String(64), default="")
    chain_heads_json: Mapped[str] = mapped_column(Text)
    # 1 when every link of the log up to position_seq checked out when it was taken.
    chain_verified: Mapped[int] = mapped_column(Integer, default=0)


class ChainCheckpointRow(Base):
    """The last verified point: every link of the log through `through_seq`
    checked out, and the lanes' chain heads there. A start walks on from it
    (docs/recovery.md); `ledger verify` always walks from the start."""

    __tablename__ = "chain_checkpoints"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    through_seq: Mapped[int] = mapped_column(BigInteger)
    # The hash of event `through_seq` (empty when 0): a log that was swapped
    # for another is not taken on this row's word.
    event_hash: Mapped[str] = mapped_column(String(64))
    chain_heads_json: Mapped[str] = mapped_column(Text)
    verified_at_us: Mapped[int] = mapped_column(BigInteger)


class SnapshotChunkRow(Base):
    """Up to one rebuild batch of a snapshot's lanes or bookings, as JSON rows."""

    __tablename__ = "snapshot_chunks"

    snapshot_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    chunk_no: Mapped[int] = mapped_column(Integer, primary_key=True)
    # "lanes" or "bookings".
    kind: Mapped[str] = mapped_column(String(16))
    payload: Mapped[str] = mapped_column(Text)


class RecoveryManifestRow(Base):
    """Every recovery decision: the planner's manifest and what came of it."""

    __tablename__ = "recovery_manifests"

    id: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    created_at_us: Mapped[int] = mapped_column(BigInteger)
    # Who decided: "server <host>:<pid>" or "ledger recover".
    actor: Mapped[str] = mapped_column(String(200))
    verdict: Mapped[str] = mapped_column(String(32))
    # planned, rebuilt, refused, failed.
    outcome: Mapped[str] = mapped_column(String(32))
    digest: Mapped[str] = mapped_column(String(64))
    body_json: Mapped[str] = mapped_column(Text)
    # Wall-clock milliseconds the reconstruction really took (0 when none ran).
    elapsed_ms: Mapped[int] = mapped_column(BigInteger, default=0)


projection_position = cast(Table, ProjectionPositionRow.__table__)
snapshots = cast(Table, SnapshotRow.__table__)
snapshot_chunks = cast(Table, SnapshotChunkRow.__table__)
chain_checkpoints = cast(Table, ChainCheckpointRow.__table__)
recovery_manifests = cast(Table, RecoveryManifestRow.__table__)
