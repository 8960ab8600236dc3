"""Pause a user or the fleet, and cancel a run in flight (issue 35).

- `leases.paused_at`, `leases.paused_reason`: a paused user's lease row says
  so, and every take already reads that row (store/inbox.py, TAKE_WORK; the
  Citus PICK and STALE): a paused user is never taken, with no statement
  added to the hot path. `ix_leases_paused` (partial: only paused rows) lists
  them for `status` and the metrics; a take never changes `paused_at`, so its
  lease updates stay HOT.
- `fleet_pause`: no row while the fleet runs, one row (its key `id` is always 1) while it is paused (`pause --all`). Every take reads it in
  an initplan, and so does the dispatchers' scan. An empty table is the
  running fleet, so a TRUNCATE of every table can only resume a fleet, never
  stop it silently. On Citus it is a reference table (a copy on every node:
  a bucket's take reads it where it runs).
- `operator_actions` widened: pause, resume and cancel of a user, and the
  fleet's pause and resume (their `user_id` is '': no user is named '').

Only adds and widens: older code runs on it unchanged (it does not read the
new columns, so it takes paused users: stop every old worker before relying on
a pause during a rolling upgrade).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

OLD_ACTIONS = ("'requeue', 'discard', 'outbox_retry', 'outbox_discard', "
               "'memory_set', 'memory_clear', 'policy_set', 'policy_clear'")
OLD_NO_TARGET = "'memory_set', 'memory_clear', 'policy_set', 'policy_clear'"
PAUSE_ACTIONS = "'pause', 'resume', 'cancel', 'fleet_pause', 'fleet_resume'"


def _widen(actions: str, no_target: str) -> None:
    op.drop_constraint("ck_operator_actions_action", "operator_actions", type_="check")
    op.create_check_constraint("ck_operator_actions_action", "operator_actions",
                               f"action IN ({actions})")
    op.drop_constraint("ck_operator_actions_one_target", "operator_actions", type_="check")
    op.create_check_constraint(
        "ck_operator_actions_one_target", "operator_actions",
        f"CASE WHEN action IN ({no_target}) THEN event_id IS NULL AND outbox_batch IS NULL"
        " ELSE (event_id IS NULL) <> (outbox_batch IS NULL) END")


def upgrade() -> None:
    op.add_column("leases", sa.Column("paused_at", sa.BigInteger))
    op.add_column("leases", sa.Column("paused_reason", sa.Text))
    op.create_index("ix_leases_paused", "leases", ["user_id"],
                    postgresql_where=sa.text("paused_at IS NOT NULL"))
    op.create_table(
        "fleet_pause",
        sa.Column("id", sa.SmallInteger, nullable=False, server_default="1"),
        sa.Column("paused_at", sa.BigInteger, nullable=False,
                  server_default=sa.text("floor(extract(epoch from clock_timestamp()))::bigint")),
        sa.Column("actor", sa.Text, nullable=False),
        sa.Column("reason", sa.Text),
        sa.PrimaryKeyConstraint("id", name="pk_fleet_pause"),
        sa.CheckConstraint("id = 1", name="one_row"),
    )
    _widen(f"{OLD_ACTIONS}, {PAUSE_ACTIONS}", f"{OLD_NO_TARGET}, {PAUSE_ACTIONS}")


def downgrade() -> None:
    op.execute(f"DELETE FROM operator_actions WHERE action IN ({PAUSE_ACTIONS})")
    _widen(OLD_ACTIONS, OLD_NO_TARGET)
    op.drop_table("fleet_pause")
    op.drop_index("ix_leases_paused", "leases")
    op.drop_column("leases", "paused_reason")
    op.drop_column("leases", "paused_at")
