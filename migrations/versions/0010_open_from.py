"""A low-water mark per user, so that the scans of a user's open events start
past the dead row versions a held xmin horizon leaves (issue 21).

Every claim and finish changes an event's status, a column of
`ix_events_open`'s predicate, so neither is a HOT update and each leaves an
entry in the index that VACUUM removes only once no transaction can see it.
While the horizon is held, a scan of one user's open events walked all of that
user's past events (83 index entries per scan after ten minutes at 800 events/s,
against 1.3 unheld). With these columns it starts at the user's low-water mark:

- `leases.open_from`: no open event of the user has a lower id, except those a
  wake names. Raised only by a finish that releases the lease (it holds the
  lease's lock and reads with a snapshot taken after it), to the first event
  still open; lowered by nobody.
- `wakes.from_id`: the lowest id of the open events a wake stands for. The
  trigger below sets it on the wake of every insert of events (an event
  committed after a finish raised the mark, with a lower id, is found through
  its wake); an operator's requeue sets it; a take or finish that deletes wakes
  carries their lowest `from_id` into the wake or the mark it leaves.

The mark read by every scan is `least(open_from, min(from_id))` over the
user's lease and wakes (store/inbox.py, `low_water`). Existing rows get
`open_from` 0 and no `from_id`: every scan starts where it did before.

A rolling upgrade across this revision stops the older workers before the new
ones take work: an older take or finish deletes wakes without carrying their
`from_id`.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import context, op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# As in 0004, plus: each new wake names the lowest id of the events it stands for.
EVENTS_INSERTED_FUNCTION = """
CREATE OR REPLACE FUNCTION agent_inbox_events_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM new_events) THEN
        -- in user order: two transactions adding the same new users never deadlock
        INSERT INTO leases (user_id, holder, gen, until)
        SELECT DISTINCT user_id, '', 0, -1 FROM new_events ORDER BY user_id
        ON CONFLICT (user_id) DO NOTHING;
        INSERT INTO wakes (user_id, at, from_id)
        SELECT user_id, min(created_at), min(id) FROM new_events
         WHERE status IN ('pending', 'running')
         GROUP BY user_id ORDER BY user_id;
        PERFORM pg_notify('agent_inbox_work', '');
    END IF;
    RETURN NULL;
END
$$
"""

EVENTS_INSERTED_FUNCTION_0004 = """
CREATE OR REPLACE FUNCTION agent_inbox_events_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM new_events) THEN
        -- in user order: two transactions adding the same new users never deadlock
        INSERT INTO leases (user_id, holder, gen, until)
        SELECT DISTINCT user_id, '', 0, -1 FROM new_events ORDER BY user_id
        ON CONFLICT (user_id) DO NOTHING;
        INSERT INTO wakes (user_id, at)
        SELECT user_id, min(created_at) FROM new_events
         WHERE status IN ('pending', 'running')
         GROUP BY user_id ORDER BY user_id;
        PERFORM pg_notify('agent_inbox_work', '');
    END IF;
    RETURN NULL;
END
$$
"""


def _distributed() -> bool:
    """A database `migrate --citus` laid out: it has no events trigger (the
    code that inserts events does its work), so its function is left as it
    is; Citus would refuse to propagate it after this transaction's parallel
    DDL on distributed tables anyway. Offline (`migrate --sql`), the SQL is
    a plain database's: Citus is laid out online."""
    if context.is_offline_mode():
        return False
    bind = op.get_bind()
    if not bind.exec_driver_sql("SELECT 1 FROM pg_extension WHERE extname = 'citus'").first():
        return False
    return bind.exec_driver_sql("SELECT 1 FROM pg_dist_partition"
                                " WHERE logicalrelid = 'events'::regclass").first() is not None


def upgrade() -> None:
    op.add_column("leases", sa.Column("open_from", sa.BigInteger, nullable=False,
                                      server_default="0"))
    op.add_column("wakes", sa.Column("from_id", sa.BigInteger))
    if not _distributed():
        op.execute(EVENTS_INSERTED_FUNCTION)


def downgrade() -> None:
    if not _distributed():
        op.execute(EVENTS_INSERTED_FUNCTION_0004)
    op.drop_column("wakes", "from_id")
    op.drop_column("leases", "open_from")
