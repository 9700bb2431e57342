"""The last verified point of the hash chain, so that a start walks only what follows it.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 14:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "chain_checkpoints",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("through_seq", sa.BigInteger(), nullable=False),
        sa.Column("event_hash", sa.String(length=64), nullable=False),
        sa.Column("chain_heads_json", sa.Text(), nullable=False),
        sa.Column("verified_at_us", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_chain_checkpoints")),
    )


def downgrade() -> None:
    op.drop_table("chain_checkpoints")
