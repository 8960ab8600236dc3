"""steps: what a run's durable steps returned, for the next attempt to replay.

A record is written under the run's lease fence (store/steps.py) and belongs to
the exact set of events its run claimed and to its place in that run; the
run's successful finish deletes it. Only adds a table: older code runs on it
unchanged (and writes nothing to it). On Citus, `agent-inbox migrate --citus`
distributes it by bucket, co-located with the user's other rows.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

CLOCK = sa.text("floor(extract(epoch from clock_timestamp()))::bigint")


def upgrade() -> None:
    op.create_table(
        "steps",
        sa.Column("user_id", sa.Text, nullable=False),
        sa.Column("id", sa.BigInteger, sa.Identity(always=True), nullable=False),
        sa.Column("event_ids", sa.ARRAY(sa.BigInteger), nullable=False),
        sa.Column("position", sa.Integer, nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("occurrence", sa.Integer, nullable=False),
        sa.Column("result", JSONB, nullable=False),
        sa.Column("holder", sa.Text, nullable=False),
        sa.Column("gen", sa.BigInteger, nullable=False),
        sa.Column("recorded_at", sa.BigInteger, nullable=False, server_default=CLOCK),
        sa.PrimaryKeyConstraint("user_id", "id", name="pk_steps"),
        sa.UniqueConstraint("user_id", "event_ids", "position",
                            name="uq_steps_user_id_event_ids_position"),
        sa.CheckConstraint("position > 0 AND occurrence > 0", name="ck_steps_position"),
    )


def downgrade() -> None:
    op.drop_table("steps")
