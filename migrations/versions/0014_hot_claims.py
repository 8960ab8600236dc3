"""Claims are HOT updates (issue 36): the event row's open/closed state moves
out of `status` into a generated column the partial indexes are defined on.

- `events.outcome`: generated from `status`, NULL while the event is open
  (pending or running), else 'done' or 'dead'. `ix_events_open` and
  `ix_events_dead` are rebuilt under the same names on `outcome IS NULL` and
  `outcome = 'dead'`. A claim (pending to running) and a failed run's finish
  (running to pending) then change no column any index holds, so PostgreSQL
  can update the row in place on its page (a HOT update: no index entry at
  all) where before each wrote one entry in each of the three indexes the
  new version belonged to. Only the close (done or dead) still writes index
  entries (the primary key's and the source key's).
- `events` gets fillfactor 80: room on each page for the claims' new row
  versions. Applies to pages written from now on (the column's rewrite below
  writes every page once).

Adding a stored generated column rewrites the table under an ACCESS EXCLUSIVE
lock: ingest and runs wait for it (on this machine about 2 s per million
events; prune finished events first to shorten it).

Older code runs on it correctly but slowly: its statements say `status IN
('pending', 'running')`, which no index now matches, so they scan every
user's events. Stop every old worker, scheduler and dispatcher before this
migration, as for any upgrade that rebuilds the run path's indexes.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07
"""

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

EVENTS_FILLFACTOR = 80


def upgrade() -> None:
    op.execute(f"ALTER TABLE events SET (fillfactor = {EVENTS_FILLFACTOR})")
    op.execute("ALTER TABLE events ADD COLUMN outcome text"
               " GENERATED ALWAYS AS (CASE WHEN status IN ('done', 'dead') THEN status END) STORED")
    op.drop_index("ix_events_open", table_name="events")
    op.drop_index("ix_events_dead", table_name="events")
    op.execute("CREATE INDEX ix_events_open ON events (user_id, id) WHERE outcome IS NULL")
    op.execute("CREATE INDEX ix_events_dead ON events (id) WHERE outcome = 'dead'")


def downgrade() -> None:
    op.drop_index("ix_events_open", table_name="events")
    op.drop_index("ix_events_dead", table_name="events")
    op.execute("CREATE INDEX ix_events_open ON events (user_id, id)"
               " WHERE status IN ('pending', 'running')")
    op.execute("CREATE INDEX ix_events_dead ON events (id) WHERE status = 'dead'")
    op.drop_column("events", "outcome")
    op.execute("ALTER TABLE events RESET (fillfactor)")
