"""Retention: finished events are deleted, but a key stays while it may come back.

Invariant 1 holds within the dedup window: an event younger than the window keeps
its row (so a redelivery is still a duplicate) and only loses its payload; an
event older than both the retention age and the window is deleted. Dead events
are kept unless asked for: they are what alerting reads. Work goes user by user
(every statement names its users), a chunk of users per transaction.
"""

from typing import Any

import psycopg

from agent_inbox.store.clock import NOW
from agent_inbox.store.keys import users_key

# Spans users (an operator's scan): the next chunk of users, in order.
USERS_AFTER = """
SELECT user_id FROM leases WHERE user_id > %(after)s ORDER BY user_id LIMIT %(limit)s
"""

# Older than the retention age and the dedup window: gone, key and all. (The
# clock in a CTE of its own: Citus refuses a volatile function in the WHERE of
# a distributed modification, and evaluates the CTE on the coordinator.)
DELETE_OLD = f"""
WITH clock AS (SELECT {NOW} AS now)
DELETE FROM events e USING clock
 WHERE e.bucket = ANY(%(buckets)s::int[]) AND e.user_id = ANY(%(users)s::text[])
   AND e.status = ANY(%(statuses)s::text[])
   AND e.created_at < clock.now - greatest(%(older_than)s, %(window)s)
"""

# Older than the retention age, still inside the dedup window: the key stays.
COMPACT = f"""
WITH clock AS (SELECT {NOW} AS now)
UPDATE events e SET payload = '{{"pruned": true}}'::jsonb
  FROM clock
 WHERE e.bucket = ANY(%(buckets)s::int[]) AND e.user_id = ANY(%(users)s::text[])
   AND e.status = ANY(%(statuses)s::text[])
   AND e.created_at < clock.now - %(older_than)s
   AND e.source <> 'approval'  -- the answer that stands is read from its payload
   AND e.payload <> '{{"pruned": true}}'::jsonb
"""


# Durable steps older than the retention age: those of runs that never
# finished successfully (their events died, or were left dead), which no finish
# deletes (store/steps.py). A run in flight records its steps within its run
# timeout, far inside any retention age.
DELETE_OLD_STEPS = f"""
WITH clock AS (SELECT {NOW} AS now)
DELETE FROM steps s USING clock
 WHERE s.bucket = ANY(%(buckets)s::int[]) AND s.user_id = ANY(%(users)s::text[])
   AND s.recorded_at < clock.now - %(older_than)s
"""


def users_after(conn: psycopg.Connection[Any], after: str, limit: int) -> list[str]:
    return [r[0] for r in conn.execute(USERS_AFTER, {"after": after, "limit": limit}).fetchall()]


def prune_users(conn: psycopg.Connection[Any], users: list[str], *, older_than: int, window: int, statuses: list[str],
                now: int | None) -> tuple[int, int]:
    """(deleted, compacted) for these users (on Citus, of one bucket), in the
    caller's transaction."""
    params = users_key(users, statuses=statuses, older_than=older_than, window=window, now=now)
    deleted = conn.execute(DELETE_OLD, params).rowcount
    compacted = conn.execute(COMPACT, params).rowcount
    conn.execute(DELETE_OLD_STEPS, params)
    return deleted, compacted
