"""run_stats: what the worker runtime did, per minute and per process.

The console's last-hour chart (runs finished, fence refusals, takeovers, events
parked dead) reads this table; nothing else does. Each worker process adds to
its own row for the current minute (store/stats.py), so there is no row that
the whole fleet writes. Only adds a table: older code runs on it unchanged
(and writes nothing to it).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "run_stats",
        sa.Column("minute", sa.BigInteger, nullable=False),
        sa.Column("process", sa.Text, nullable=False),
        sa.Column("finished", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("refused", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("takeovers", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("died", sa.BigInteger, nullable=False, server_default="0"),
        sa.PrimaryKeyConstraint("minute", "process", name="pk_run_stats"),
    )


def downgrade() -> None:
    op.drop_table("run_stats")
