"""The inbox, leases, timers and outbox, each keyed by user.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

DB_CLOCK = sa.text("floor(extract(epoch from clock_timestamp()))::bigint")


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("user_id", sa.Text, nullable=False),
        sa.Column("id", sa.BigInteger, sa.Identity(always=True), nullable=False),
        sa.Column("source", sa.Text, nullable=False),
        sa.Column("source_id", sa.Text, nullable=False),
        sa.Column("payload", JSONB, nullable=False),
        sa.Column("status", sa.Text, nullable=False, server_default="pending"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("claim_gen", sa.BigInteger),
        sa.Column("error", sa.Text),
        sa.Column("created_at", sa.BigInteger, nullable=False, server_default=DB_CLOCK),
        sa.Column("available_at", sa.BigInteger, nullable=False, server_default=DB_CLOCK),
        sa.Column("claimed_at", sa.BigInteger),
        sa.PrimaryKeyConstraint("user_id", "id", name="pk_events"),
        sa.UniqueConstraint("user_id", "source", "source_id", name="uq_events_user_id_source_source_id"),
        sa.CheckConstraint("status IN ('pending', 'running', 'done', 'dead')", name="ck_events_status"),
        sa.CheckConstraint("attempts >= 0", name="ck_events_attempts"),
    )
    op.create_index(
        "ix_events_open",
        "events",
        ["user_id", "id"],
        postgresql_where=sa.text("status IN ('pending', 'running')"),
    )
    op.create_index(
        "ix_events_claimable",
        "events",
        ["available_at", "id"],
        postgresql_where=sa.text("status IN ('pending', 'running')"),
    )

    op.create_index("ix_events_dead", "events", ["id"], postgresql_where=sa.text("status = 'dead'"))

    op.create_table(
        "leases",
        sa.Column("user_id", sa.Text, nullable=False),
        sa.Column("holder", sa.Text, nullable=False),
        sa.Column("gen", sa.BigInteger, nullable=False),
        sa.Column("until", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("user_id", name="pk_leases"),
        sa.CheckConstraint("gen >= 0", name="ck_leases_gen"),
    )

    op.create_table(
        "timers",
        sa.Column("user_id", sa.Text, nullable=False),
        sa.Column("timer_id", sa.Text, nullable=False),
        sa.Column("due", sa.BigInteger, nullable=False),
        sa.Column("every", sa.BigInteger),
        sa.Column("cron", sa.Text),
        sa.Column("timezone", sa.Text),
        sa.Column("missed", sa.Text, nullable=False, server_default="coalesce"),
        sa.Column("catch_up_limit", sa.Integer, nullable=False, server_default="100"),
        sa.Column("payload", JSONB, nullable=False),
        sa.Column("event_source", sa.Text),
        sa.Column("event_source_id", sa.Text),
        sa.Column("done", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.PrimaryKeyConstraint("user_id", "timer_id", name="pk_timers"),
        sa.CheckConstraint("every IS NULL OR every > 0", name="ck_timers_every"),
        sa.CheckConstraint("every IS NULL OR cron IS NULL", name="ck_timers_every_or_cron"),
        sa.CheckConstraint("(cron IS NULL) = (timezone IS NULL)", name="ck_timers_cron_has_timezone"),
        sa.CheckConstraint("missed IN ('coalesce', 'catch_up')", name="ck_timers_missed"),
        sa.CheckConstraint("catch_up_limit > 0", name="ck_timers_catch_up_limit"),
        sa.CheckConstraint(
            "(every IS NULL AND cron IS NULL) OR event_source IS NULL",
            name="ck_timers_recurring_has_no_fixed_key",
        ),
        sa.CheckConstraint(
            "(event_source IS NULL) = (event_source_id IS NULL)", name="ck_timers_key_is_pair"
        ),
    )
    op.create_index("ix_timers_due", "timers", ["due"], postgresql_where=sa.text("NOT done"))

    op.create_table(
        "outbox",
        sa.Column("user_id", sa.Text, nullable=False),
        sa.Column("id", sa.BigInteger, sa.Identity(always=True), nullable=False),
        sa.Column("body", sa.Text, nullable=False),
        sa.Column("created", sa.BigInteger, nullable=False),
        sa.Column("sent_at", sa.BigInteger),
        sa.Column("urgent", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("batch", sa.BigInteger),
        sa.PrimaryKeyConstraint("user_id", "id", name="pk_outbox"),
    )
    op.create_index("ix_outbox_sent", "outbox", ["user_id", "sent_at"])
    op.create_index(
        "ix_outbox_held", "outbox", ["user_id", "id"], postgresql_where=sa.text("sent_at IS NULL")
    )
    op.create_table(
        "operator_actions",
        sa.Column("user_id", sa.Text, nullable=False),
        sa.Column("id", sa.BigInteger, sa.Identity(always=True), nullable=False),
        sa.Column("at", sa.BigInteger, nullable=False, server_default=DB_CLOCK),
        sa.Column("actor", sa.Text, nullable=False),
        sa.Column("action", sa.Text, nullable=False),
        sa.Column("event_id", sa.BigInteger, nullable=False),
        sa.Column("detail", JSONB, nullable=False),
        sa.PrimaryKeyConstraint("user_id", "id", name="pk_operator_actions"),
        sa.CheckConstraint("action IN ('requeue', 'discard')", name="ck_operator_actions_action"),
    )

    op.execute(EVENTS_INSERTED_FUNCTION)
    op.execute(EVENTS_INSERTED_TRIGGER)


# Every path that inserts events (ingest, the scheduler, approval answers) goes
# through this: the user gets a lease row (an expired generation 0) so workers can
# find and lock it, and waiting workers are woken by a notification on commit.
EVENTS_INSERTED_FUNCTION = """
CREATE FUNCTION agent_inbox_events_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
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

EVENTS_INSERTED_TRIGGER = """
CREATE TRIGGER events_inserted AFTER INSERT ON events
REFERENCING NEW TABLE AS new_events
FOR EACH STATEMENT EXECUTE FUNCTION agent_inbox_events_inserted()
"""


def downgrade() -> None:
    op.execute("DROP TRIGGER events_inserted ON events")
    op.execute("DROP FUNCTION agent_inbox_events_inserted()")
    op.drop_table("operator_actions")
    op.drop_table("outbox")
    op.drop_table("timers")
    op.drop_table("leases")
    op.drop_table("events")
