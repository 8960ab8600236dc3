"""The outbox: a run's messages, sent paced per user, in batches with stable keys.

At most one send per `gap` seconds per user (an urgent message goes at once);
everything held goes as one text, joined by a blank line. A dispatch holds a
per-user session lock from choosing the batch to marking it sent, so two
dispatchers never send the same rows nor two batches inside one gap. The batch
is written down (`batch` = its first row's id) before it is sent: a dispatcher
that crashed after sending and before marking is followed by one that resends
exactly those rows under the same key, so the channel can drop the repeat
(at-least-once). At-most-once channels mark the batch sent before sending.
"""

import contextlib
from collections.abc import Iterator

from psycopg.rows import class_row

from agent_inbox.records import OutboxMessage
from agent_inbox.store.clock import NOW

# One dispatcher per user at a time; the others skip the user at once. A session
# lock, held across the batch's transactions and released by UNLOCK_USER (or by
# the connection's end). A hash collision between two users makes one of them
# wait for the next pass.
TRY_LOCK_USER = """
SELECT pg_try_advisory_lock(hashtextextended('agent_inbox.outbox:' || %(user)s, 0))
"""
UNLOCK_USER = """
SELECT pg_advisory_unlock(hashtextextended('agent_inbox.outbox:' || %(user)s, 0))
"""

# A batch written down and not yet marked sent: a previous dispatch died after
# choosing it (and perhaps after sending it). It goes again, whatever the gap.
UNFINISHED_BATCH = """
SELECT id, body, batch FROM outbox
 WHERE user_id = %(user)s AND sent_at IS NULL
   AND batch = (SELECT min(batch) FROM outbox
                 WHERE user_id = %(user)s AND sent_at IS NULL AND batch IS NOT NULL)
 ORDER BY id
"""

# Write down a new batch: every held row, if the user's last send is at least
# `gap` seconds old or a held row is urgent.
NEW_BATCH = f"""
WITH clock AS (
    SELECT {NOW} AS now
), last AS (
    SELECT max(sent_at) AS sent_at FROM outbox WHERE user_id = %(user)s
), held AS (
    SELECT id, urgent FROM outbox WHERE user_id = %(user)s AND sent_at IS NULL
), due AS (
    SELECT h.id FROM held h, clock, last
     WHERE last.sent_at IS NULL OR clock.now - last.sent_at >= %(gap)s
        OR EXISTS (SELECT 1 FROM held WHERE urgent)
)
UPDATE outbox o SET batch = (SELECT min(id) FROM due)
  FROM due
 WHERE o.user_id = %(user)s AND o.id = due.id
RETURNING o.id, o.body, o.batch
"""

MARK_SENT = f"""
UPDATE outbox SET sent_at = {NOW}
 WHERE user_id = %(user)s AND batch = %(batch)s AND sent_at IS NULL
"""


@contextlib.contextmanager
def user_lock(conn, user: str) -> Iterator[bool]:
    """Hold the user's dispatch lock for the block if it is free; yields whether
    it was taken. A broken connection has released it already."""
    taken = conn.execute(TRY_LOCK_USER, {"user": user}).fetchone()[0]
    try:
        yield taken
    finally:
        if taken and not conn.broken:
            conn.execute(UNLOCK_USER, {"user": user})


def choose_batch(conn, user: str, gap: int, now: int | None) -> tuple[int, list[int], list[str]] | None:
    """(batch, ids, bodies) to send now, written down; None if nothing is due.
    Call while holding the user's lock."""
    rows = conn.execute(UNFINISHED_BATCH, {"user": user}).fetchall()
    if not rows:
        rows = sorted(conn.execute(NEW_BATCH, {"user": user, "gap": gap, "now": now}).fetchall())
    if not rows:
        return None
    return rows[0][2], [r[0] for r in rows], [r[1] for r in rows]


def mark_sent(conn, user: str, batch: int, now: int | None) -> None:
    conn.execute(MARK_SENT, {"user": user, "batch": batch, "now": now})


# Spans users (the dispatcher's scan): users holding messages whose send is due
# (gap passed, an urgent message, or an unfinished batch).
USERS_DUE = f"""
WITH clock AS (SELECT {NOW} AS now)
SELECT h.user_id
  FROM (SELECT user_id, bool_or(urgent OR batch IS NOT NULL) AS now_or_never FROM outbox
         WHERE sent_at IS NULL GROUP BY user_id) h, clock
 WHERE h.now_or_never
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
