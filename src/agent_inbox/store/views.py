"""The console's reads: what each page shows, in a few indexed statements.

Invariants: every statement here is a plain SELECT (no FOR UPDATE, no FOR
SHARE), so a page never waits on, nor holds, a lease row lock or any other row
lock a worker takes; each reads a bounded number of rows through an index
(open events through ix_events_open, held messages through ix_outbox_held,
dead events through ix_events_dead, a user's rows through the primary keys),
except `workers running a run` (distinct holders of live leases: an idle
worker holds none), which reads the leases table (one row per user).

Where the CLI's views already answer (store/admin.py, store/outbox.py), the
console calls them; what is here are the views the CLI has no twin for.
"""

from typing import Any

import psycopg
from psycopg.rows import dict_row

from agent_inbox.db import Queries, Query
from agent_inbox.store import one
from agent_inbox.store.clock import NOW
from agent_inbox.store.keys import user_key

PAGE = 50

# Spans users: totals by status over the open events (ix_events_open holds only
# those), the dead ones (ix_events_dead), the unsent outbox (ix_outbox_held),
# the oldest pending event's age, and the distinct holders of live leases.
OVERVIEW = f"""
WITH clock AS (
    SELECT {NOW} AS now
), open_events AS (
    SELECT count(*) FILTER (WHERE status = 'pending') AS pending,
           count(*) FILTER (WHERE status = 'running') AS running,
           min(created_at) FILTER (WHERE status = 'pending') AS oldest_pending
      FROM events WHERE outcome IS NULL
), dead AS (
    SELECT count(*) AS dead FROM events WHERE outcome = 'dead'
), unsent AS (
    SELECT count(*) FILTER (WHERE failed_at IS NULL) AS outbox_held,
           count(*) FILTER (WHERE failed_at IS NOT NULL) AS outbox_failed
      FROM outbox WHERE sent_at IS NULL
), workers AS (
    SELECT count(DISTINCT holder) AS workers
      FROM leases, clock WHERE until >= clock.now AND holder <> ''
)
SELECT clock.now, o.pending, o.running, d.dead, u.outbox_held, u.outbox_failed,
       w.workers, clock.now - o.oldest_pending AS oldest_pending_age
  FROM clock, open_events o, dead d, unsent u, workers w
"""


def overview(conn: psycopg.Connection[Any], now: int | None = None) -> dict[str, Any]:
    with conn.cursor(row_factory=dict_row) as cur:
        return one(cur.execute(OVERVIEW, {"now": now}))


# Spans users (keyset page): users from the leases table (every user with an
# event has a lease row), in user_id order after `after`, whose id starts with
# `prefix`, with their open, dead and held counts read through indexes. The
# prefix is a filter on the primary key's order, not a range, so it is right in
# any collation; a prefix that matches few users walks the keys past `after`.
USERS = """
SELECT l.user_id AS "user", nullif(l.holder, '') AS holder, l.gen, l.until
  FROM leases l
 WHERE l.user_id > %(after)s AND starts_with(l.user_id, %(prefix)s)
 ORDER BY l.user_id
 LIMIT %(limit)s
"""

# The page's counts, each a lookup per user on an index of its own (open
# events, dead events, held messages), and no join: on Citus each is one read
# across shards (the page's users are `page`, not `users`: no routing).
PAGE_OPEN = """
SELECT e.user_id, count(*) FILTER (WHERE e.status = 'pending'),
       count(*) FILTER (WHERE e.status = 'running')
  FROM events e
 WHERE e.user_id = ANY(%(page)s::text[]) AND e.outcome IS NULL
 GROUP BY e.user_id
"""
PAGE_DEAD = """
SELECT e.user_id, count(*) FROM events e
 WHERE e.user_id = ANY(%(page)s::text[]) AND e.outcome = 'dead'
 GROUP BY e.user_id
"""
PAGE_HELD = """
SELECT m.user_id, count(*) FROM outbox m
 WHERE m.user_id = ANY(%(page)s::text[]) AND m.sent_at IS NULL AND m.failed_at IS NULL
 GROUP BY m.user_id
"""


def users(conn: psycopg.Connection[Any], prefix: str, after: str, limit: int = PAGE,
          now: int | None = None) -> tuple[list[dict[str, Any]], int]:
    """(a page of users after `after`, the clock)."""
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(USERS, {"prefix": prefix, "after": after, "limit": limit}).fetchall()
        clock = one(cur.execute(f"SELECT {NOW} AS now", {"now": now}))["now"]
    page = {"page": [row["user"] for row in rows]}
    open_counts = {u: (p, r) for u, p, r in conn.execute(PAGE_OPEN, page).fetchall()}
    dead = dict(conn.execute(PAGE_DEAD, page).fetchall())
    held = dict(conn.execute(PAGE_HELD, page).fetchall())
    for row in rows:
        user, until = row["user"], row["until"]
        row["expires_in"] = until - clock if until >= clock else None
        row["pending"], row["running"] = open_counts.get(user, (0, 0))
        row["dead"], row["outbox_held"] = dead.get(user, 0), held.get(user, 0)
    return rows, clock


# One user's lease (by primary key).
LEASE = f"""
SELECT nullif(holder, '') AS holder, gen, until,
       CASE WHEN until >= {NOW} THEN until - {NOW} END AS expires_in, {NOW} AS now
  FROM leases WHERE bucket = %(bucket)s AND user_id = %(user)s
"""


def lease(conn: psycopg.Connection[Any], user: str, now: int | None = None) -> dict[str, Any] | None:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(LEASE, user_key(user, now=now)).fetchone()


# One user's events with payloads, newest first, a keyset page before `before`
# (the primary key (user_id, id), read backwards).
TIMELINE = """
SELECT id, source, source_id, kind, status, attempts, error, claim_gen, created_at,
       claimed_at, payload
  FROM events
 WHERE bucket = %(bucket)s AND user_id = %(user)s AND id < %(before)s
 ORDER BY id DESC
 LIMIT %(limit)s
"""


def timeline(conn: psycopg.Connection[Any], user: str, before: int, limit: int = PAGE) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(TIMELINE, user_key(user, before=before, limit=limit)).fetchall()


# One user's runs, as the events record them: each claim generation's events
# by status, newest generation first (an event shows only its last claim).
RUNS = """
SELECT claim_gen AS gen, min(claimed_at) AS claimed_at, count(*) AS events,
       count(*) FILTER (WHERE status = 'done') AS done,
       count(*) FILTER (WHERE status = 'running') AS running,
       count(*) FILTER (WHERE status = 'pending') AS pending,
       count(*) FILTER (WHERE status = 'dead') AS dead,
       max(attempts) AS attempts
  FROM events
 WHERE bucket = %(bucket)s AND user_id = %(user)s AND claim_gen IS NOT NULL
 GROUP BY claim_gen
 ORDER BY claim_gen DESC
 LIMIT %(limit)s
"""


def runs(conn: psycopg.Connection[Any], user: str, limit: int = PAGE) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(RUNS, user_key(user, limit=limit)).fetchall()


# One user's newest outbox messages (primary key, read backwards).
MESSAGES = """
SELECT id, body, created, sent_at, failed_at, error, batch, urgent
  FROM outbox
 WHERE bucket = %(bucket)s AND user_id = %(user)s
 ORDER BY id DESC
 LIMIT %(limit)s
"""


def messages(conn: psycopg.Connection[Any], user: str, limit: int = PAGE) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(MESSAGES, user_key(user, limit=limit)).fetchall()


# Approval requests (store/approvals.py: a timer 'expire:<id>' keyed
# ('approval', <id>)) and the answer that stands, if one does: an event under
# that key. `unanswered`: spans users, the requests with no answer yet, soonest
# deadline first, read through ix_timers_due (timers not done); one user's:
# every request, by primary key.
_APPROVAL_COLUMNS = f"""
SELECT t.user_id AS "user", substr(t.timer_id, 8) AS request, t.due AS deadline,
       t.due - {NOW} AS deadline_in, t.payload->'action' AS action,
       a.payload->>'answer' AS answer, a.created_at AS answered_at
  FROM timers t
  LEFT JOIN events a ON a.bucket = t.bucket AND a.user_id = t.user_id AND a.source = 'approval'
                    AND a.source_id = substr(t.timer_id, 8)
"""

UNANSWERED = _APPROVAL_COLUMNS + """
 WHERE NOT t.done AND t.timer_id LIKE 'expire:%%' AND a.id IS NULL
 ORDER BY t.due, t.user_id, t.timer_id
 LIMIT %(limit)s
"""

USER_APPROVALS = _APPROVAL_COLUMNS + """
 WHERE t.bucket = %(bucket)s AND t.user_id = %(user)s AND t.timer_id LIKE 'expire:%%'
 ORDER BY t.due DESC, t.timer_id
 LIMIT %(limit)s
"""


def unanswered(conn: psycopg.Connection[Any], limit: int = PAGE * 2, now: int | None = None) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(UNANSWERED, {"limit": limit, "now": now}).fetchall()


def user_approvals(user: str, limit: int = PAGE, now: int | None = None) -> Queries[list[dict[str, Any]]]:
    """One user's approval requests, latest deadline first, each with the
    answer that stands (None: none yet)."""
    return (yield Query(USER_APPROVALS, user_key(user, limit=limit, now=now), dict_row))


# Dead events named by (user, id) pairs, by primary key: what a confirmation
# page lists before a repair (`owners`, not `users`: on Citus a read across
# shards, not a statement routed to one bucket).
DEAD_NAMED = """
SELECT e.user_id AS "user", e.id, e.source, e.source_id, e.attempts, e.error
  FROM events e
  JOIN unnest(%(owners)s::text[], %(ids)s::bigint[]) AS t(user_id, id)
    ON e.user_id = t.user_id AND e.id = t.id
 WHERE e.status = 'dead'
 ORDER BY e.user_id, e.id
"""


def dead_named(conn: psycopg.Connection[Any], pairs: list[tuple[str, int]]) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(DEAD_NAMED, {"owners": [u for u, _ in pairs],
                                        "ids": [i for _, i in pairs]}).fetchall()
