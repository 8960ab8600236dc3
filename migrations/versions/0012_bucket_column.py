"""Every user-keyed table gets `bucket`, on plain PostgreSQL too (issue 19).

`bucket` is `agent_inbox_bucket(user_id)` (the first 28 bits of md5(user_id)
modulo 64, the same in Python: `citus.bucket`). On Citus it is the
distribution column; with it in the plain schema as well, every statement
about one user can name its bucket (`bucket = %(bucket)s AND user_id =
%(user)s`) in one text that both backends run as written: Citus routes it to
the bucket's shard, plain PostgreSQL finds the rows by `user_id` as before.
Only the column is added: plain keys stay what they were (an older worker's
`ON CONFLICT (user_id, ...)` still finds its arbiter index), and `migrate
--citus` rebuilds them bucket first when it distributes.

Existing rows are filled here, in the migration's transaction (one UPDATE a
table: a rewrite of every row, under the ADD COLUMN's lock: plan the upgrade's
pause by the tables' size). A row inserted later by code that does not name the
bucket (an older worker during a rolling upgrade, the events trigger) gets it
from a BEFORE INSERT trigger, whose WHEN clause skips the call for a row that
names it. The events trigger names it itself.

On a database `migrate --citus` laid out, every table has the column already
and nothing changes here.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05
"""

from alembic import context, op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

TABLES = ("leases", "events", "wakes", "timers", "outbox", "deliveries", "operator_actions",
          "steps", "memory", "policies", "permit_decisions")

BUCKET_FUNCTION = """
CREATE OR REPLACE FUNCTION agent_inbox_bucket(user_id text) RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS
$$ SELECT (('x' || substr(md5(user_id), 1, 7))::bit(28)::int) % 64 $$
"""

FILL_FUNCTION = """
CREATE FUNCTION agent_inbox_fill_bucket() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.bucket := agent_inbox_bucket(NEW.user_id);
    RETURN NEW;
END
$$
"""

# As in 0010, with the bucket named in the rows it inserts.
EVENTS_INSERTED_FUNCTION = """
CREATE OR REPLACE FUNCTION agent_inbox_events_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM new_events) THEN
        -- in user order: two transactions adding the same new users never deadlock
        INSERT INTO leases (bucket, user_id, holder, gen, until)
        SELECT DISTINCT bucket, user_id, '', 0, -1 FROM new_events ORDER BY user_id
        ON CONFLICT (user_id) DO NOTHING;
        INSERT INTO wakes (bucket, user_id, at, from_id)
        SELECT min(bucket), user_id, min(created_at), min(id) FROM new_events
         WHERE status IN ('pending', 'running')
         GROUP BY user_id ORDER BY user_id;
        PERFORM pg_notify('agent_inbox_work', '');
    END IF;
    RETURN NULL;
END
$$
"""

EVENTS_INSERTED_FUNCTION_0010 = """
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


def _distributed() -> bool:
    """A database `migrate --citus` laid out (its tables have the column
    already). Offline (`migrate --sql`), the SQL is a plain database's."""
    if context.is_offline_mode():
        return False
    bind = op.get_bind()
    if not bind.exec_driver_sql("SELECT 1 FROM pg_extension WHERE extname = 'citus'").first():
        return False
    return bind.exec_driver_sql("SELECT 1 FROM pg_dist_partition"
                                " WHERE logicalrelid = 'events'::regclass").first() is not None


def upgrade() -> None:
    if _distributed():
        return
    op.execute(BUCKET_FUNCTION)
    op.execute(FILL_FUNCTION)
    for table in TABLES:
        op.execute(f"ALTER TABLE {table} ADD COLUMN bucket int")
        op.execute(f"UPDATE {table} SET bucket = agent_inbox_bucket(user_id)")
        op.execute(f"ALTER TABLE {table} ALTER COLUMN bucket SET NOT NULL")
        op.execute(f"CREATE TRIGGER fill_bucket BEFORE INSERT ON {table} FOR EACH ROW"
                   " WHEN (NEW.bucket IS NULL) EXECUTE FUNCTION agent_inbox_fill_bucket()")
    op.execute(EVENTS_INSERTED_FUNCTION)


def downgrade() -> None:
    if _distributed():
        return
    op.execute(EVENTS_INSERTED_FUNCTION_0010)
    for table in TABLES:
        op.execute(f"DROP TRIGGER fill_bucket ON {table}")
        op.execute(f"ALTER TABLE {table} DROP COLUMN bucket")
    op.execute("DROP FUNCTION agent_inbox_fill_bucket()")
    op.execute("DROP FUNCTION agent_inbox_bucket(text)")
