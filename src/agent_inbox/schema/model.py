"""The one description of agent-inbox's tables (SQLAlchemy Core).

Alembic's migrations create these tables and `alembic check` proves the two agree;
runtime SQL never goes through SQLAlchemy. Every table about users carries
`user_id` in its primary key, so a run touches one user's rows only, and the
user's `bucket` (bucket_column), which every statement about one user names, so
that Citus can distribute the tables by it (citus.py). A trigger (see the
first migration) gives every user with an event a lease row and notifies
waiting workers. Times are bigint epoch seconds: the timer occurrence key
`<timer_id>@<scheduled_at>` must stay exact whole seconds.
"""

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


DB_CLOCK = sa.text("floor(extract(epoch from clock_timestamp()))::bigint")

metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)


def bucket_column() -> sa.Column:
    """`agent_inbox_bucket(user_id)`, 0 to 63 (migration 0012; `store/keys.py`
    in Python): Citus's distribution column. Statements about one user name it
    with the user (`bucket = %(bucket)s AND user_id = %(user)s`), so one text
    serves both backends; a row inserted without it gets it from the table's
    `fill_bucket` trigger (on plain PostgreSQL)."""
    return sa.Column("bucket", sa.Integer, nullable=False)

# An event's outcome from its status (the generated column `outcome`).
OUTCOME = "CASE WHEN status IN ('done', 'dead') THEN status END"

events = sa.Table(
    "events",
    metadata,
    sa.Column("user_id", sa.Text, nullable=False),
    bucket_column(),
    sa.Column("id", sa.BigInteger, sa.Identity(always=True), nullable=False),
    sa.Column("source", sa.Text, nullable=False),
    sa.Column("source_id", sa.Text, nullable=False),
    sa.Column("payload", JSONB, nullable=False),
    sa.Column("status", sa.Text, nullable=False, server_default="pending"),
    # NULL while the event is open (pending or running), else its status:
    # what the partial indexes below are defined on (migration 0014), so that
    # a claim (pending to running) and a failed run's finish (running to
    # pending) leave every indexed column as it was and can be HOT updates.
    sa.Column("outcome", sa.Text, sa.Computed(OUTCOME, persisted=True)),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("claim_gen", sa.BigInteger),
    sa.Column("error", sa.Text),
    sa.Column("created_at", sa.BigInteger, nullable=False, server_default=DB_CLOCK),
    # A retry is claimable again from here: set at claim to now + backoff.
    sa.Column("available_at", sa.BigInteger, nullable=False, server_default=DB_CLOCK),
    sa.Column("claimed_at", sa.BigInteger),
    # What the provider calls the event (GitHub's X-GitHub-Event, Stripe's type).
    sa.Column("kind", sa.Text),
    # The W3C trace context the event arrived with (a webhook's traceparent).
    sa.Column("traceparent", sa.Text),
    sa.PrimaryKeyConstraint("user_id", "id"),
    sa.UniqueConstraint("user_id", "source", "source_id"),
    sa.CheckConstraint(
        "status IN ('pending', 'running', 'done', 'dead')", name="status"
    ),
    sa.CheckConstraint("attempts >= 0", name="attempts"),
)

# Claim reads one user's open events (finding work reads wakes, not events). The
# index holds open events only, so its size follows the work waiting, not the
# number of users or of finished events. A statement that should use it says
# `outcome IS NULL` (store/inbox.py's OPEN): the planner cannot prove it from
# `status`. The table's fillfactor, 50 (set by migration 0015; 80 by 0014),
# leaves each page room for the claims' HOT updates of its rows.
sa.Index(
    "ix_events_open",
    events.c.user_id,
    events.c.id,
    postgresql_where=sa.text("outcome IS NULL"),
)

# Operators' views of dead events across users (dead list, status); small, as
# dead events are few. Says `outcome = 'dead'`, for the same reason.
sa.Index("ix_events_dead", events.c.id, postgresql_where=sa.text("outcome = 'dead'"))

# Updated in place on every take, renewal and release: fillfactor 25 (set by
# migration 0009) leaves room for those HOT updates on each row's page, and
# workers rewrite the table without its dead versions when a held horizon
# piles them up (store/compaction.py).
leases = sa.Table(
    "leases",
    metadata,
    sa.Column("user_id", sa.Text, nullable=False),
    bucket_column(),
    sa.Column("holder", sa.Text, nullable=False),
    sa.Column("gen", sa.BigInteger, nullable=False),
    sa.Column("until", sa.BigInteger, nullable=False),
    # The user's low-water mark (migration 0010): no open event of the user has
    # a lower id, but for those a wake's `from_id` names. The scans of a user's
    # open events start here, past the dead versions a held horizon leaves.
    sa.Column("open_from", sa.BigInteger, nullable=False, server_default="0"),
    # A paused user (migration 0013, store/pauses.py): since when, and why.
    # Every take reads this row already: a paused user is never taken.
    sa.Column("paused_at", sa.BigInteger),
    sa.Column("paused_reason", sa.Text),
    sa.PrimaryKeyConstraint("user_id"),
    sa.CheckConstraint("gen >= 0", name="gen"),
)
sa.Index("ix_leases_paused", leases.c.user_id, postgresql_where=sa.text("paused_at IS NOT NULL"))

# The fleet's pause (`pause --all`, store/pauses.py): no row while the fleet
# runs, one while it is paused. Every take and every dispatcher's scan reads it.
fleet_pause = sa.Table(
    "fleet_pause",
    metadata,
    sa.Column("id", sa.SmallInteger, nullable=False, server_default="1"),
    sa.Column("paused_at", sa.BigInteger, nullable=False, server_default=DB_CLOCK),
    sa.Column("actor", sa.Text, nullable=False),
    sa.Column("reason", sa.Text),
    sa.PrimaryKeyConstraint("id"),
    sa.CheckConstraint("id = 1", name="one_row"),
)

# "Look at this user at `at`": what finding work walks (ix_wakes_at, due first),
# so the open events of users whose lease is held are never read by a take.
# Inserted by every path that can make a user takeable sooner (the events
# trigger, finish with release, release, hand-back, requeue); deleted by the
# take that looked at the user (store/inbox.py, TAKE_WORK) and by a finish with
# release. Only inserted and deleted: an ingest never waits on a wake's lock.
# Partitioned by `ring` (migration 0011): workers move the live wakes to a clean
# ring when the dead ones pile up and the run path reads the live rings only
# (store/wake_rings.py): a held xmin horizon, even a pg_dump's, must not slow
# finding work. The partitions (`wakes_<ring>`) are made by the migration and
# by rotations, not described here.
wakes = sa.Table(
    "wakes",
    metadata,
    sa.Column("user_id", sa.Text, nullable=False),
    bucket_column(),
    sa.Column("id", sa.BigInteger, nullable=False,
              server_default=sa.text("nextval('wakes_ids')")),
    sa.Column("at", sa.BigInteger, nullable=False),
    # The lowest id of the open events this wake stands for, where it may be
    # below the lease's `open_from` (new events, requeued ones, a wake carried
    # over from deleted ones); NULL for a wake that stands for no event.
    sa.Column("from_id", sa.BigInteger),
    # The partition: where `wakes_insert_ring` said new wakes go when it was
    # inserted, or where a rotation moved it.
    sa.Column("ring", sa.SmallInteger, nullable=False,
              server_default=sa.text(
                  "pg_sequence_last_value('wakes_insert_ring'::regclass)::smallint")),
    sa.PrimaryKeyConstraint("user_id", "id", "ring"),
    postgresql_partition_by="LIST (ring)",
)
sa.Index("ix_wakes_at", wakes.c.at, wakes.c.id)

# The ring the last rotation moved the live wakes to (one row); with the
# sequence `wakes_insert_ring` (where new wakes go), the rings the run path reads.
wakes_ring = sa.Table(
    "wakes_ring",
    metadata,
    sa.Column("ring", sa.SmallInteger, nullable=False),
    sa.Column("one", sa.Boolean, nullable=False, server_default=sa.true()),
    sa.PrimaryKeyConstraint("one"),
    sa.CheckConstraint("one", name="one"),
)

# Durable steps (steps.py): what a run's `ctx.step` calls returned, recorded
# under the run's lease fence so that a later attempt at the same events
# replays them instead of calling them again. A record belongs to the exact set
# of events its run claimed (`event_ids`, ascending) and to its place in that
# run (`position`, from 1; `name` and `occurrence` say which call it was), so a
# retry that claimed other events never replays it. Deleted by the run's
# successful finish (and with a requeued or discarded event, or by prune).
steps = sa.Table(
    "steps",
    metadata,
    sa.Column("user_id", sa.Text, nullable=False),
    bucket_column(),
    sa.Column("id", sa.BigInteger, sa.Identity(always=True), nullable=False),
    sa.Column("event_ids", sa.ARRAY(sa.BigInteger), nullable=False),
    sa.Column("position", sa.Integer, nullable=False),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("occurrence", sa.Integer, nullable=False),
    sa.Column("result", JSONB, nullable=False),
    sa.Column("holder", sa.Text, nullable=False),
    sa.Column("gen", sa.BigInteger, nullable=False),
    sa.Column("recorded_at", sa.BigInteger, nullable=False, server_default=DB_CLOCK),
    sa.PrimaryKeyConstraint("user_id", "id"),
    sa.UniqueConstraint("user_id", "event_ids", "position"),
    sa.CheckConstraint("position > 0 AND occurrence > 0", name="position"),
)

timers = sa.Table(
    "timers",
    metadata,
    sa.Column("user_id", sa.Text, nullable=False),
    bucket_column(),
    sa.Column("timer_id", sa.Text, nullable=False),
    sa.Column("due", sa.BigInteger, nullable=False),
    sa.Column("every", sa.BigInteger),
    # A recurring timer repeats by `every` seconds or by a cron expression in `timezone`.
    sa.Column("cron", sa.Text),
    sa.Column("timezone", sa.Text),
    # Missed occurrences: 'coalesce' into one event, or 'catch_up' with one event
    # each, at most catch_up_limit per firing (the overflow is reported).
    sa.Column("missed", sa.Text, nullable=False, server_default="coalesce"),
    sa.Column("catch_up_limit", sa.Integer, nullable=False, server_default="100"),
    sa.Column("payload", JSONB, nullable=False),
    sa.Column("event_source", sa.Text),
    sa.Column("event_source_id", sa.Text),
    sa.Column("done", sa.Boolean, nullable=False, server_default=sa.false()),
    # A timer that raised while being fired (a time zone this host lacks) is
    # parked with its error, skipped by schedulers until add_timer replaces it.
    sa.Column("parked_at", sa.BigInteger),
    sa.Column("error", sa.Text),
    sa.PrimaryKeyConstraint("user_id", "timer_id"),
    sa.CheckConstraint("every IS NULL OR every > 0", name="every"),
    sa.CheckConstraint("every IS NULL OR cron IS NULL", name="every_or_cron"),
    sa.CheckConstraint("(cron IS NULL) = (timezone IS NULL)", name="cron_has_timezone"),
    sa.CheckConstraint("missed IN ('coalesce', 'catch_up')", name="missed"),
    sa.CheckConstraint("catch_up_limit > 0", name="catch_up_limit"),
    sa.CheckConstraint(
        "(every IS NULL AND cron IS NULL) OR event_source IS NULL",
        name="recurring_has_no_fixed_key",
    ),
    sa.CheckConstraint(
        "(event_source IS NULL) = (event_source_id IS NULL)", name="key_is_pair"
    ),
)

# The scheduler's scan across users: only timers still to fire.
sa.Index("ix_timers_due", timers.c.due, postgresql_where=sa.text("NOT done"))

outbox = sa.Table(
    "outbox",
    metadata,
    sa.Column("user_id", sa.Text, nullable=False),
    bucket_column(),
    sa.Column("id", sa.BigInteger, sa.Identity(always=True), nullable=False),
    sa.Column("body", sa.Text, nullable=False),
    sa.Column("created", sa.BigInteger, nullable=False),
    sa.Column("sent_at", sa.BigInteger),
    # Urgent messages are sent at once, regardless of the user's outbox gap.
    sa.Column("urgent", sa.Boolean, nullable=False, server_default=sa.false()),
    # The batch a row was assigned to before sending (its first row's id): a
    # batch resent after a crash holds the same rows and carries the same key.
    sa.Column("batch", sa.BigInteger),
    # A batch that could not be sent (too many attempts, or a permanent refusal)
    # is parked: failed_at and the error, until an operator retries or discards it.
    sa.Column("failed_at", sa.BigInteger),
    sa.Column("error", sa.Text),
    # The trace context of the run that queued it, for the send's span.
    sa.Column("traceparent", sa.Text),
    sa.PrimaryKeyConstraint("user_id", "id"),
)

# Pacing reads the user's last send; dispatch reads the user's held rows.
sa.Index("ix_outbox_sent", outbox.c.user_id, outbox.c.sent_at)
sa.Index(
    "ix_outbox_held",
    outbox.c.user_id,
    outbox.c.id,
    postgresql_where=sa.text("sent_at IS NULL"),
)

# A user's delivery state: when a dispatcher should look at the user next
# (`due_at`: NULL when nothing is held; the dispatchers' scan reads this index
# only, whatever the number of held messages), the pace (`last_sent_at`), and
# the batch being sent: claimed by one dispatcher until `sending_until`, its
# mark-sent fenced by `send_token`, its failed sends counted in `attempts`.
deliveries = sa.Table(
    "deliveries",
    metadata,
    sa.Column("user_id", sa.Text, nullable=False),
    bucket_column(),
    sa.Column("due_at", sa.BigInteger),
    sa.Column("last_sent_at", sa.BigInteger),
    sa.Column("batch", sa.BigInteger),
    sa.Column("sending_until", sa.BigInteger),
    sa.Column("send_token", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("last_error", sa.Text),
    sa.PrimaryKeyConstraint("user_id"),
    sa.CheckConstraint("attempts >= 0", name="attempts"),
)
sa.Index("ix_deliveries_due_at", deliveries.c.due_at,
         postgresql_where=sa.text("due_at IS NOT NULL"))

# Operators' repairs (dead requeue, dead discard, outbox retry and discard), recorded in the transaction
# that made them: who, when, which event, and the state it had before.
operator_actions = sa.Table(
    "operator_actions",
    metadata,
    sa.Column("user_id", sa.Text, nullable=False),
    bucket_column(),
    sa.Column("id", sa.BigInteger, sa.Identity(always=True), nullable=False),
    sa.Column("at", sa.BigInteger, nullable=False, server_default=DB_CLOCK),
    sa.Column("actor", sa.Text, nullable=False),
    sa.Column("action", sa.Text, nullable=False),
    sa.Column("event_id", sa.BigInteger),
    sa.Column("detail", JSONB, nullable=False),
    # the outbox batch an outbox_retry or outbox_discard was about
    sa.Column("outbox_batch", sa.BigInteger),
    sa.PrimaryKeyConstraint("user_id", "id"),
    sa.CheckConstraint(
        "action IN ('requeue', 'discard', 'outbox_retry', 'outbox_discard', "
        "'memory_set', 'memory_clear', 'policy_set', 'policy_clear', "
        "'pause', 'resume', 'cancel', 'fleet_pause', 'fleet_resume')", name="action"
    ),
    # An event's repair names the event, an outbox repair its batch; a memory or
    # policy change, a pause, resume or cancel names neither (the fleet's: user '').
    sa.CheckConstraint(
        "CASE WHEN action IN ('memory_set', 'memory_clear', 'policy_set', 'policy_clear',"
        " 'pause', 'resume', 'cancel', 'fleet_pause', 'fleet_resume')"
        " THEN event_id IS NULL AND outbox_batch IS NULL"
        " ELSE (event_id IS NULL) <> (outbox_batch IS NULL) END", name="one_target"),
)

# A user's memory (store/memory.py): one JSON document, read with the run's
# claim and replaced only by a run's fenced finish (`updated_by` its holder,
# `gen` its generation) or by an operator while no run holds the lease
# (`updated_by` "operator:<actor>", `gen` NULL).
memory = sa.Table(
    "memory",
    metadata,
    sa.Column("user_id", sa.Text, nullable=False),
    bucket_column(),
    sa.Column("doc", JSONB, nullable=False),
    sa.Column("updated_at", sa.BigInteger, nullable=False, server_default=DB_CLOCK),
    sa.Column("updated_by", sa.Text, nullable=False),
    sa.Column("gen", sa.BigInteger),
    sa.PrimaryKeyConstraint("user_id"),
)

# What `ctx.permit(tool, args)` answers (store/policies.py): a user's rule for a
# tool (or for every tool, `*`), else the default's; 'ask' turns the call into
# an approval request that waits `ask_expires_in` seconds for its answer.
POLICY_ANSWERS = "answer IN ('allow', 'deny', 'ask')"


def _policy_columns() -> list:
    return [
        sa.Column("tool", sa.Text, nullable=False),
        sa.Column("answer", sa.Text, nullable=False),
        sa.Column("ask_expires_in", sa.BigInteger, nullable=False, server_default="86400"),
        sa.Column("updated_at", sa.BigInteger, nullable=False, server_default=DB_CLOCK),
        sa.Column("updated_by", sa.Text, nullable=False),
        sa.CheckConstraint(POLICY_ANSWERS, name="answer"),
        sa.CheckConstraint("ask_expires_in > 0", name="ask_expires_in"),
    ]


policies = sa.Table(
    "policies",
    metadata,
    sa.Column("user_id", sa.Text, nullable=False),
    bucket_column(),
    *_policy_columns(),
    sa.PrimaryKeyConstraint("user_id", "tool"),
)

default_policies = sa.Table(
    "default_policies",
    metadata,
    *_policy_columns(),
    sa.PrimaryKeyConstraint("tool"),
)

# Every answer `ctx.permit` gave: which run asked, about which tool and
# arguments (a digest), and the rule that answered.
permit_decisions = sa.Table(
    "permit_decisions",
    metadata,
    sa.Column("user_id", sa.Text, nullable=False),
    bucket_column(),
    sa.Column("id", sa.BigInteger, sa.Identity(always=True), nullable=False),
    sa.Column("at", sa.BigInteger, nullable=False, server_default=DB_CLOCK),
    sa.Column("tool", sa.Text, nullable=False),
    sa.Column("args_digest", sa.Text, nullable=False),
    sa.Column("answer", sa.Text, nullable=False),
    sa.Column("rule", sa.Text, nullable=False),
    sa.Column("holder", sa.Text, nullable=False),
    sa.Column("gen", sa.BigInteger, nullable=False),
    sa.PrimaryKeyConstraint("user_id", "id"),
    sa.CheckConstraint(POLICY_ANSWERS, name="answer"),
)

# Named rate budgets every worker shares (`ctx.limit`): `rate` per
# `per_seconds`, at most `burst` at once; `tokens` left as of `refilled_at`
# (epoch seconds with a fraction). Not keyed by user: it describes the fleet.
limits = sa.Table(
    "limits",
    metadata,
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("rate", sa.BigInteger, nullable=False),
    sa.Column("per_seconds", sa.BigInteger, nullable=False),
    sa.Column("burst", sa.BigInteger, nullable=False),
    sa.Column("tokens", sa.Float(precision=53), nullable=False),
    sa.Column("refilled_at", sa.Float(precision=53), nullable=False),
    sa.Column("updated_at", sa.BigInteger, nullable=False, server_default=DB_CLOCK),
    sa.Column("updated_by", sa.Text, nullable=False),
    sa.PrimaryKeyConstraint("name"),
    sa.CheckConstraint("rate > 0 AND per_seconds > 0 AND burst >= 0", name="rate"),
)

# What the worker runtime did, per minute (epoch seconds // 60 * 60) and per
# process (its holder id): runs finished, finishes the fence refused, takeovers
# (runs that took over a user whose last run ended without a finish) and events
# parked dead. Each process adds to its own row only (store/stats.py); read by
# the console's last-hour chart. Not keyed by user: it describes the fleet.
run_stats = sa.Table(
    "run_stats",
    metadata,
    sa.Column("minute", sa.BigInteger, nullable=False),
    sa.Column("process", sa.Text, nullable=False),
    sa.Column("finished", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("refused", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("takeovers", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("died", sa.BigInteger, nullable=False, server_default="0"),
    sa.PrimaryKeyConstraint("minute", "process"),
)


# The web console's live sessions (console/auth.py): the SHA-256 of a session's
# nonce, whose token (by name, and by its fingerprint under the signing key
# `key_id`), and until when. A logout deletes its row, a console's start deletes
# those of tokens it no longer has: the cookie then opens nothing. Not keyed by
# user: it describes the console's operators.
console_sessions = sa.Table(
    "console_sessions",
    metadata,
    sa.Column("id", sa.Text, nullable=False),
    sa.Column("token_name", sa.Text, nullable=False),
    sa.Column("key_id", sa.Text, nullable=False),
    sa.Column("fingerprint", sa.Text, nullable=False),
    sa.Column("created_at", sa.BigInteger, nullable=False, server_default=DB_CLOCK),
    sa.Column("expires_at", sa.BigInteger, nullable=False),
    sa.PrimaryKeyConstraint("id"),
)
