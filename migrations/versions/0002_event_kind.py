"""An event's kind: what the provider calls it (GitHub's X-GitHub-Event, Stripe's
`type`, a generic source's X-Event-Type header), beside the body.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A nullable column without a default: no table rewrite, a brief lock only.
    op.add_column("events", sa.Column("kind", sa.Text))


def downgrade() -> None:
    op.drop_column("events", "kind")
