"""PostgreSQL: a function that locks a lane's row and then each ancestor's,
reading each parent from the row just locked.

One statement with a recursive chain would read the chain before its locks
are granted: a PutLane that moved an ancestor meanwhile would leave the move
holding the old ancestors' locks, out of the lane-upwards order, and two
moves could deadlock. The loop takes the locks exactly as a move took them
one round trip each, in one round trip.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05 23:55:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Each SELECT ... FOR UPDATE in a PL/pgSQL loop runs after the one before has
# its lock, and returns the row as last committed, so the next name is the
# locked row's parent. `levels` bounds the walk (the caller's nesting limit).
_CREATE = """
CREATE FUNCTION ledger_lock_chain(start_lane text, levels integer)
RETURNS SETOF lanes LANGUAGE plpgsql AS $$
DECLARE
    locked lanes;
    next_lane text := start_lane;
BEGIN
    FOR level IN 1..levels LOOP
        SELECT * INTO locked FROM lanes WHERE lane = next_lane FOR UPDATE;
        EXIT WHEN NOT FOUND;
        RETURN NEXT locked;
        EXIT WHEN locked.parent IS NULL;
        next_lane := locked.parent;
    END LOOP;
END
$$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_CREATE)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION ledger_lock_chain(text, integer)")
