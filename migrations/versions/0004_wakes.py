"""Finding work walks users, not events: `wakes`, "look at this user at `at`".

A take reads the due wakes (`ix_wakes_at`), not the open events, so the pending
events of users whose lease is held cost a take nothing (their wake is at their
lease's end). Every path that can make a user takeable sooner inserts a wake
(the trigger below for every insert of events; finish-with-release, release,
hand-back, operator requeue); a take deletes only the wakes its own snapshot
shows, of users whose lease it has locked, after inserting the wake their state
calls for (see store/inbox.py, TAKE_WORK). Wakes are only ever inserted and
deleted, so an ingest never waits on a lock for them.

Filled with one wake, due now, per user with open events. Only adds (a table,
and the trigger function replaced by one doing what it did plus the wake): older
code keeps running on it, but its takes and finishes neither read nor delete
wakes, so wakes accumulate until newer workers run, and a user an older worker
released is looked at again by a newer one at the lease's end at the latest.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# As in 0001, plus: each user with new open events gets a wake at their arrival.
EVENTS_INSERTED_FUNCTION = """
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

EVENTS_INSERTED_FUNCTION_0001 = """
CREATE OR REPLACE FUNCTION agent_inbox_events_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM new_events) THEN
        -- in user order: two transactions adding the same new users never deadlock
        INSERT INTO leases (user_id, holder, gen, until)
        SELECT DISTINCT user_id, '', 0, -1 FROM new_events ORDER BY user_id
        ON CONFLICT (user_id) DO NOTHING;
        PERFORM pg_notify('agent_inbox_work', '');
    END IF;
    RETURN NULL;
END
$$
"""


def upgrade() -> None:
    op.create_table(
        "wakes",
        sa.Column("user_id", sa.Text, nullable=False),
        sa.Column("id", sa.BigInteger, sa.Identity(always=True), nullable=False),
        sa.Column("at", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("user_id", "id", name="pk_wakes"),
    )
    op.create_index("ix_wakes_at", "wakes", ["at", "id"])
    op.execute(EVENTS_INSERTED_FUNCTION)
    op.execute("""
        INSERT INTO wakes (user_id, at)
        SELECT user_id, min(created_at) FROM events
         WHERE status IN ('pending', 'running')
         GROUP BY user_id ORDER BY user_id
    """)


def downgrade() -> None:
    op.execute(EVENTS_INSERTED_FUNCTION_0001)
    op.drop_table("wakes")
