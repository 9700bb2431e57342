"""Cache prices and tokens, the max charge multiple, and operators' corrections.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 09:40:00

Columns are added in place (no batch copy): a copy of `events` would drop
its append-only triggers, and adding a column with a default is cheap on
both databases.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_PRICES = ("cached_input_nanos_per_million_tokens", "cache_write_nanos_per_million_tokens")
_TOKENS = ("cached_input_tokens", "cache_write_tokens")


def upgrade() -> None:
    for table in ("events", "bookings"):
        for name in _PRICES:
            op.add_column(table, sa.Column(name, sa.BigInteger(), nullable=True))
        for name in _TOKENS:
            op.add_column(
                table, sa.Column(name, sa.BigInteger(), nullable=False, server_default="0")
            )
    for name in ("correction_id", "grant_id"):
        op.add_column(
            "events",
            sa.Column(name, sa.String(length=200), nullable=False, server_default=""),
        )
    op.add_column(
        "lanes",
        sa.Column("max_charge_multiple", sa.BigInteger(), nullable=False, server_default="100"),
    )
    op.create_index(
        "uq_events_lane_correction_id",
        "events",
        ["lane", "correction_id"],
        unique=True,
        sqlite_where=sa.text("kind = 'corrected'"),
        postgresql_where=sa.text("kind = 'corrected'"),
    )


def downgrade() -> None:
    op.drop_index(
        "uq_events_lane_correction_id",
        table_name="events",
        sqlite_where=sa.text("kind = 'corrected'"),
        postgresql_where=sa.text("kind = 'corrected'"),
    )
    with op.batch_alter_table("lanes") as batch_op:
        batch_op.drop_column("max_charge_multiple")
    with op.batch_alter_table("bookings") as batch_op:
        for name in (*_PRICES, *_TOKENS):
            batch_op.drop_column(name)
    # The log keeps its columns: dropping them would copy the append-only table.
