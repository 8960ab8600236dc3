"""Delivery without a held lock, and timers that cannot block each other.

- `deliveries`: one row per user with outbox messages: when a dispatcher should
  look next (`due_at`, the only index a dispatcher's scan reads), the pace
  (`last_sent_at`), the batch being sent with its claim (`sending_until`,
  `send_token`: the fence of its mark-sent), and its failed attempts.
- `outbox.failed_at` / `outbox.error`: a batch that could not be sent is parked.
- `timers.parked_at` / `timers.error`: a timer that raised while being fired.
- `operator_actions` records outbox repairs too (`outbox_batch`).

Filled from the outbox rows already there. Only adds and widens: older code
keeps running on it, but an older dispatcher must not run beside a newer one
(it paces by a session lock the newer one does not take).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "deliveries",
        sa.Column("user_id", sa.Text, nullable=False),
        sa.Column("due_at", sa.BigInteger),
        sa.Column("last_sent_at", sa.BigInteger),
        sa.Column("batch", sa.BigInteger),
        sa.Column("sending_until", sa.BigInteger),
        sa.Column("send_token", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("last_error", sa.Text),
        sa.PrimaryKeyConstraint("user_id", name="pk_deliveries"),
        sa.CheckConstraint("attempts >= 0", name="ck_deliveries_attempts"),
    )
    op.create_index("ix_deliveries_due_at", "deliveries", ["due_at"],
                    postgresql_where=sa.text("due_at IS NOT NULL"))
    op.add_column("outbox", sa.Column("failed_at", sa.BigInteger))
    op.add_column("outbox", sa.Column("error", sa.Text))
    op.add_column("timers", sa.Column("parked_at", sa.BigInteger))
    op.add_column("timers", sa.Column("error", sa.Text))
    op.add_column("operator_actions", sa.Column("outbox_batch", sa.BigInteger))
    # Widened, not changed: older code writes only what it wrote before.
    op.alter_column("operator_actions", "event_id", nullable=True)
    op.drop_constraint("ck_operator_actions_action", "operator_actions", type_="check")
    op.create_check_constraint(
        "ck_operator_actions_action", "operator_actions",
        "action IN ('requeue', 'discard', 'outbox_retry', 'outbox_discard')")
    op.create_check_constraint(
        "ck_operator_actions_one_target", "operator_actions",
        "(event_id IS NULL) <> (outbox_batch IS NULL)")
    # Every user holding messages is looked at once by the first dispatcher; the
    # pace carries on from the user's last send.
    op.execute("""
        INSERT INTO deliveries (user_id, due_at, last_sent_at, batch)
        SELECT user_id,
               CASE WHEN bool_or(sent_at IS NULL) THEN 0 END,
               max(sent_at),
               min(batch) FILTER (WHERE sent_at IS NULL)
          FROM outbox GROUP BY user_id
    """)


def downgrade() -> None:
    op.execute("DELETE FROM operator_actions WHERE outbox_batch IS NOT NULL")
    op.drop_constraint("ck_operator_actions_one_target", "operator_actions", type_="check")
    op.drop_constraint("ck_operator_actions_action", "operator_actions", type_="check")
    op.create_check_constraint("ck_operator_actions_action", "operator_actions",
                               "action IN ('requeue', 'discard')")
    op.alter_column("operator_actions", "event_id", nullable=False)
    op.drop_column("operator_actions", "outbox_batch")
    op.drop_column("timers", "error")
    op.drop_column("timers", "parked_at")
    op.drop_column("outbox", "error")
    op.drop_column("outbox", "failed_at")
    op.drop_table("deliveries")
