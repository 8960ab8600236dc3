"""The run path under a held xmin horizon (issue 21): fewer row versions for
VACUUM to leave behind, and none walked by a plan that reads across users.

- `ix_events_claimable` (open events by `available_at`) is dropped. It served
  finding work across users before wakes (0004); since then nothing reads it
  by design, yet every claim and finish wrote an entry to it (a status change
  is never a HOT update) and the planner used it for per-user questions
  (a user's claimable event, its next retry) by walking it from its head with
  a filter on the user: while a transaction held the horizon, 1,439 index
  tuples per scan, 267 million in three minutes at 400 events/s
  (bench/results/soak_explain_before.txt). Those questions now read
  `ix_events_open` by user.
- `leases` gets fillfactor 25: a take, a renewal and a release update a lease
  in place, on columns no index holds, so the new version is a HOT update
  whenever its page has room; the room keeps each user's versions on its page
  (one index entry, one page) for longer when pruning cannot remove them.
  Applies to pages written from now on (VACUUM FULL rewrites the old ones).

Older code runs on it unchanged: no statement names the index, only plans
chose it.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

LEASES_FILLFACTOR = 25


def upgrade() -> None:
    op.drop_index("ix_events_claimable", table_name="events")
    op.execute(f"ALTER TABLE leases SET (fillfactor = {LEASES_FILLFACTOR})")


def downgrade() -> None:
    op.execute("ALTER TABLE leases RESET (fillfactor)")
    op.create_index(
        "ix_events_claimable",
        "events",
        ["available_at", "id"],
        postgresql_where=sa.text("status IN ('pending', 'running')"),
    )
