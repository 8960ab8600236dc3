"""Room on each events page for every claim's row version (issue 36).

`events` gets fillfactor 50 (80 since 0014). A claim changes no column an
index holds (0014), so it is a HOT update, with no index entry, whenever the
row's page has room for the new version; a run's close (done or dead) adds
one more version, on the same page where it fits. At 80 the pages of a
backlog ran out of room as its users were claimed: in W1 (1,000 users x 20
events, interleaved as they arrive) only a quarter of the claims were HOT,
the rest wrote an entry in each of the three indexes their new version
belonged to; at 50, 92 % were, and W1's drain was 1.16x (`python -m
bench.events_layout --reps 3`: 28,296 against 24,360 events/s, medians of 3
interleaved; bench/results/w1_fillfactor.json).

A page of `events` holds half the rows it held (a table twice the size for
the same events, until finished events are pruned). Applies to pages written
from now on: the rows already stored stay where they are (no rewrite, and
only a SHARE UPDATE EXCLUSIVE lock, which neither ingest nor the run path
waits for). Older code runs on it unchanged.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-07
"""

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

EVENTS_FILLFACTOR = 50


def upgrade() -> None:
    op.execute(f"ALTER TABLE events SET (fillfactor = {EVENTS_FILLFACTOR})")


def downgrade() -> None:
    op.execute("ALTER TABLE events SET (fillfactor = 80)")  # 0014's
