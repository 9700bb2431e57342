"""A partial index of the events that configure a lane.

The start-up assessment counts the lanes the log configures, to compare with
the lanes projected. Without this index that count reads every event (0.3 s
of a restart with 2,000,001 events); with it, one entry a configuration.
Moves append no lane_configured event, so they write nothing to it.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06 13:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_WHERE = sa.text("kind = 'lane_configured'")


def upgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        op.create_index("ix_events_lane_configured", "events", ["lane"], sqlite_where=_WHERE)
        return
    # CONCURRENTLY: a plain CREATE INDEX holds events' SHARE lock for the whole
    # build, and every replica's appends queue behind it (`ledger migrate` run
    # while replicas serve). A build that failed left an invalid index: dropped.
    # Such a build waits for every transaction with an older snapshot (a
    # pg_dump, a long export): the store's statement and lock timeouts (5 s)
    # would fail the migration, so this session waits them out, blocking no
    # append meanwhile. Reset after, for the connection goes back to a pool.
    with op.get_context().autocommit_block():
        op.execute("SET statement_timeout = 0")
        op.execute("SET lock_timeout = 0")
        try:
            op.drop_index(
                "ix_events_lane_configured",
                table_name="events",
                if_exists=True,
                postgresql_concurrently=True,
            )
            op.create_index(
                "ix_events_lane_configured",
                "events",
                ["lane"],
                postgresql_where=_WHERE,
                postgresql_concurrently=True,
            )
        finally:
            op.execute("RESET statement_timeout")
            op.execute("RESET lock_timeout")


def downgrade() -> None:
    op.drop_index("ix_events_lane_configured", table_name="events")
