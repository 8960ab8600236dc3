"""The outbox: a run's messages, sent paced per user.

At most one send per `gap` seconds per user; everything held goes as one text,
joined by a blank line; rows are marked sent in the same transaction as the
send, under a per-user transaction lock, so two dispatchers never both send the
same rows nor two batches inside one gap. A crash after the send and before the
commit sends again: delivery is at-least-once.
"""

from psycopg.rows import class_row

from agent_inbox.records import OutboxMessage
from agent_inbox.store.clock import NOW

# One dispatcher per user at a time; the others skip the user at once. (A hash
# collision between two users makes one of them wait for the next pass.)
TRY_LOCK_USER = """
SELECT pg_try_advisory_xact_lock(hashtextextended('agent_inbox.outbox:' || %(user)s, 0))
"""

# The held rows, if the user's last send is at least `gap` seconds old or one of
# them is urgent.
HELD = f"""
WITH clock AS (
    SELECT {NOW} AS now
), last AS (
    SELECT max(sent_at) AS sent_at FROM outbox WHERE user_id = %(user)s
), held AS (
    SELECT id, body, urgent FROM outbox WHERE user_id = %(user)s AND sent_at IS NULL
)
SELECT h.id, h.body, clock.now
  FROM held h, clock, last
 WHERE last.sent_at IS NULL OR clock.now - last.sent_at >= %(gap)s
    OR EXISTS (SELECT 1 FROM held WHERE urgent)
 ORDER BY h.id
"""

MARK_SENT = """
UPDATE outbox SET sent_at = %(now)s WHERE user_id = %(user)s AND id = ANY(%(ids)s::bigint[])
"""


def take_held(conn, user: str, gap: int, now: int | None) -> tuple[list[int], list[str], int] | None:
    """Lock the user's outbox and return (ids, bodies, now) if a send is due."""
    if not conn.execute(TRY_LOCK_USER, {"user": user}).fetchone()[0]:
        return None
    rows = conn.execute(HELD, {"user": user, "gap": gap, "now": now}).fetchall()
    if not rows:
        return None
    return [r[0] for r in rows], [r[1] for r in rows], rows[0][2]


def mark_sent(conn, user: str, ids: list[int], now: int) -> None:
    conn.execute(MARK_SENT, {"user": user, "ids": ids, "now": now})


# Spans users (the dispatcher's scan): users holding messages whose send is due.
USERS_DUE = f"""
WITH clock AS (SELECT {NOW} AS now)
SELECT h.user_id
  FROM (SELECT user_id, bool_or(urgent) AS urgent FROM outbox
         WHERE sent_at IS NULL GROUP BY user_id) h, clock
 WHERE h.urgent
    OR NOT EXISTS (SELECT 1 FROM outbox s
                    WHERE s.user_id = h.user_id AND s.sent_at > clock.now - %(gap)s)
 ORDER BY h.user_id
 LIMIT %(limit)s
"""


def users_due(conn, gap: int, now: int | None, limit: int) -> list[str]:
    rows = conn.execute(USERS_DUE, {"gap": gap, "now": now, "limit": limit}).fetchall()
    return [r[0] for r in rows]


LIST = """
SELECT id, body, created, sent_at FROM outbox WHERE user_id = %(user)s ORDER BY id
"""


def list_messages(conn, user: str) -> list[OutboxMessage]:
    with conn.cursor(row_factory=class_row(OutboxMessage)) as cur:
        return cur.execute(LIST, {"user": user}).fetchall()
