"""memory, policies, permit decisions and fleet limits: the guide's other parts.

- `memory`: one JSON document per user, replaced by a run's fenced finish.
- `policies` (per user) and `default_policies`: what `ctx.permit(tool, args)`
  answers; `permit_decisions`: every answer given, with the rule that gave it.
- `limits`: named rate budgets shared by every worker (`ctx.limit`).
- `events.traceparent` and `outbox.traceparent`: the W3C trace context a
  webhook brought, carried to the run and to the message's send (tracing).
- `operator_actions` widened: memory and policy changes are audited there too
  (they name no event and no outbox batch).

Only adds and widens: older code runs on it unchanged (and writes nothing to
the new tables).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

CLOCK = sa.text("floor(extract(epoch from clock_timestamp()))::bigint")
ANSWERS = "answer IN ('allow', 'deny', 'ask')"
MEMORY_AND_POLICY_ACTIONS = "'memory_set', 'memory_clear', 'policy_set', 'policy_clear'"


def upgrade() -> None:
    op.create_table(
        "memory",
        sa.Column("user_id", sa.Text, nullable=False),
        sa.Column("doc", JSONB, nullable=False),
        sa.Column("updated_at", sa.BigInteger, nullable=False, server_default=CLOCK),
        sa.Column("updated_by", sa.Text, nullable=False),
        sa.Column("gen", sa.BigInteger),
        sa.PrimaryKeyConstraint("user_id", name="pk_memory"),
    )
    for table, key in (("policies", ("user_id", "tool")), ("default_policies", ("tool",))):
        op.create_table(
            table,
            *([sa.Column("user_id", sa.Text, nullable=False)] if "user_id" in key else []),
            sa.Column("tool", sa.Text, nullable=False),
            sa.Column("answer", sa.Text, nullable=False),
            sa.Column("ask_expires_in", sa.BigInteger, nullable=False, server_default="86400"),
            sa.Column("updated_at", sa.BigInteger, nullable=False, server_default=CLOCK),
            sa.Column("updated_by", sa.Text, nullable=False),
            sa.PrimaryKeyConstraint(*key, name=f"pk_{table}"),
            sa.CheckConstraint(ANSWERS, name=f"ck_{table}_answer"),
            sa.CheckConstraint("ask_expires_in > 0", name=f"ck_{table}_ask_expires_in"),
        )
    op.create_table(
        "permit_decisions",
        sa.Column("user_id", sa.Text, nullable=False),
        sa.Column("id", sa.BigInteger, sa.Identity(always=True), nullable=False),
        sa.Column("at", sa.BigInteger, nullable=False, server_default=CLOCK),
        sa.Column("tool", sa.Text, nullable=False),
        sa.Column("args_digest", sa.Text, nullable=False),
        sa.Column("answer", sa.Text, nullable=False),
        sa.Column("rule", sa.Text, nullable=False),
        sa.Column("holder", sa.Text, nullable=False),
        sa.Column("gen", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("user_id", "id", name="pk_permit_decisions"),
        sa.CheckConstraint(ANSWERS, name="ck_permit_decisions_answer"),
    )
    op.create_table(
        "limits",
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("rate", sa.BigInteger, nullable=False),
        sa.Column("per_seconds", sa.BigInteger, nullable=False),
        sa.Column("burst", sa.BigInteger, nullable=False),
        sa.Column("tokens", sa.Float(precision=53), nullable=False),
        sa.Column("refilled_at", sa.Float(precision=53), nullable=False),
        sa.Column("updated_at", sa.BigInteger, nullable=False, server_default=CLOCK),
        sa.Column("updated_by", sa.Text, nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_limits"),
        sa.CheckConstraint("rate > 0 AND per_seconds > 0 AND burst >= 0", name="ck_limits_rate"),
    )
    op.add_column("events", sa.Column("traceparent", sa.Text))
    op.add_column("outbox", sa.Column("traceparent", sa.Text))
    # Widened, not changed: older code writes only what it wrote before.
    op.drop_constraint("ck_operator_actions_action", "operator_actions", type_="check")
    op.create_check_constraint(
        "ck_operator_actions_action", "operator_actions",
        f"action IN ('requeue', 'discard', 'outbox_retry', 'outbox_discard', "
        f"{MEMORY_AND_POLICY_ACTIONS})")
    op.drop_constraint("ck_operator_actions_one_target", "operator_actions", type_="check")
    op.create_check_constraint(
        "ck_operator_actions_one_target", "operator_actions",
        f"CASE WHEN action IN ({MEMORY_AND_POLICY_ACTIONS})"
        " THEN event_id IS NULL AND outbox_batch IS NULL"
        " ELSE (event_id IS NULL) <> (outbox_batch IS NULL) END")


def downgrade() -> None:
    op.execute(f"DELETE FROM operator_actions WHERE action IN ({MEMORY_AND_POLICY_ACTIONS})")
    op.drop_constraint("ck_operator_actions_one_target", "operator_actions", type_="check")
    op.create_check_constraint("ck_operator_actions_one_target", "operator_actions",
                               "(event_id IS NULL) <> (outbox_batch IS NULL)")
    op.drop_constraint("ck_operator_actions_action", "operator_actions", type_="check")
    op.create_check_constraint(
        "ck_operator_actions_action", "operator_actions",
        "action IN ('requeue', 'discard', 'outbox_retry', 'outbox_discard')")
    op.drop_column("outbox", "traceparent")
    op.drop_column("events", "traceparent")
    for table in ("limits", "permit_decisions", "default_policies", "policies", "memory"):
        op.drop_table(table)
