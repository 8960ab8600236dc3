"""console_sessions: the web console's live sessions, so that a logout or a
token's removal ends a session on the server, for every console process and
across restarts (a signed cookie alone stays valid until it expires).

Only adds: older code runs on it unchanged (and writes nothing to the table).

Revision ID: 0008
Revises: 0007
Create Date: 2027-01-10
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

CLOCK = sa.text("floor(extract(epoch from clock_timestamp()))::bigint")


def upgrade() -> None:
    op.create_table(
        "console_sessions",
        sa.Column("id", sa.Text, nullable=False),
        sa.Column("token_name", sa.Text, nullable=False),
        sa.Column("key_id", sa.Text, nullable=False),
        sa.Column("fingerprint", sa.Text, nullable=False),
        sa.Column("created_at", sa.BigInteger, nullable=False, server_default=CLOCK),
        sa.Column("expires_at", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_console_sessions"),
    )


def downgrade() -> None:
    op.drop_table("console_sessions")
