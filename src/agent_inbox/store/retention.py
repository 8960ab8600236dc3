"""Retention: finished events are deleted, but a key stays while it may come back.

Invariant 1 holds within the dedup window: an event younger than the window keeps
its row (so a redelivery is still a duplicate) and only loses its payload; an
event older than both the retention age and the window is deleted. Dead events
are kept unless asked for: they are what alerting reads. Work goes user by user
(every statement names its users), a chunk of users per transaction.
"""

from agent_inbox.store.clock import NOW

# Spans users (an operator's scan): the next chunk of users, in order.
USERS_AFTER = """
SELECT user_id FROM leases WHERE user_id > %(after)s ORDER BY user_id LIMIT %(limit)s
"""

# Older than the retention age and the dedup window: gone, key and all.
DELETE_OLD = f"""
DELETE FROM events
 WHERE user_id = ANY(%(users)s::text[]) AND status = ANY(%(statuses)s::text[])
   AND created_at < {NOW} - greatest(%(older_than)s, %(window)s)
"""

# Older than the retention age, still inside the dedup window: the key stays.
COMPACT = f"""
UPDATE events SET payload = '{{"pruned": true}}'::jsonb
 WHERE user_id = ANY(%(users)s::text[]) AND status = ANY(%(statuses)s::text[])
   AND created_at < {NOW} - %(older_than)s
   AND source <> 'approval'  -- the answer that stands is read from its payload
   AND payload <> '{{"pruned": true}}'::jsonb
"""


def users_after(conn, after: str, limit: int) -> list[str]:
    return [r[0] for r in conn.execute(USERS_AFTER, {"after": after, "limit": limit}).fetchall()]


def prune_users(conn, users: list[str], *, older_than: int, window: int, statuses: list[str],
                now: int | None) -> tuple[int, int]:
    """(deleted, compacted) for these users, in the caller's transaction."""
    params = {"users": users, "statuses": statuses, "older_than": older_than, "window": window,
              "now": now}
    deleted = conn.execute(DELETE_OLD, params).rowcount
    compacted = conn.execute(COMPACT, params).rowcount
    return deleted, compacted
