"""Operator views and repairs (`agent-inbox status`, `events`, `dead`, `timers`).

Nothing here is on a run's path. Views that read more than one user's rows say
so. The repairs (requeue, discard) write only rows whose status is 'dead', and
no statement on a run's path reads or writes a dead row: a claim parks an event
as dead and never reads it again, and finish and release touch running rows
only. So a repair never races a running worker and takes no lease lock. Each
repair locks its rows in (user_id, id) order, so two operators repairing
overlapping ids never deadlock, and re-checks 'dead' once the row is locked.

Invariant 1 holds for stored keys only: discarding a dead event deletes its key,
so a redelivery of the same (user, source, source_id) is stored and run again.
"""

import json
from typing import Any

import psycopg
from psycopg.rows import dict_row

from agent_inbox import notify
from agent_inbox.store.clock import NOW
from agent_inbox.store.keys import user_key, users_key

# Spans users (operator view): every user with pending, running or dead events,
# held or failed outbox messages, a lease still valid or a pause, busiest first. The totals count
# every such user, not only the page shown; one row (user NULL) if there are none.
STATUS = f"""
WITH clock AS (
    SELECT {NOW} AS now
), counts AS (
    SELECT user_id,
           count(*) FILTER (WHERE status = 'pending') AS pending,
           count(*) FILTER (WHERE status = 'running') AS running,
           count(*) FILTER (WHERE status = 'dead') AS dead
      FROM events
     WHERE outcome IS NULL OR outcome = 'dead'  -- ix_events_open, ix_events_dead
     GROUP BY user_id
), held AS (
    SELECT user_id, count(*) FILTER (WHERE failed_at IS NULL) AS held,
           count(*) FILTER (WHERE failed_at IS NOT NULL) AS failed
      FROM outbox WHERE sent_at IS NULL GROUP BY user_id
), shown AS (
    SELECT user_id FROM counts
     UNION
    SELECT user_id FROM held
     UNION
    SELECT l.user_id FROM leases l, clock WHERE l.until >= clock.now
     UNION
    SELECT l.user_id FROM leases l WHERE l.paused_at IS NOT NULL  -- ix_leases_paused
), per_user AS (
    SELECT s.user_id,
           coalesce(c.pending, 0) AS pending, coalesce(c.running, 0) AS running,
           coalesce(c.dead, 0) AS dead, coalesce(h.held, 0) AS outbox_held,
           coalesce(h.failed, 0) AS outbox_failed,
           nullif(l.holder, '') AS holder, l.gen, l.until, l.paused_at, l.paused_reason
      FROM shown s
      LEFT JOIN counts c ON c.user_id = s.user_id
      LEFT JOIN held h ON h.user_id = s.user_id
      LEFT JOIN leases l ON l.user_id = s.user_id
), page AS (
    SELECT p.*,
           count(*) OVER () AS users_total,
           (sum(p.pending) OVER ())::bigint AS pending_total,
           (sum(p.running) OVER ())::bigint AS running_total,
           (sum(p.dead) OVER ())::bigint AS dead_total,
           (sum(p.outbox_held) OVER ())::bigint AS outbox_held_total,
           (sum(p.outbox_failed) OVER ())::bigint AS outbox_failed_total
      FROM per_user p
     ORDER BY p.pending DESC, p.running DESC, p.dead DESC, p.user_id
     LIMIT %(limit)s
)
SELECT clock.now, page.*
  FROM clock LEFT JOIN page ON true
 ORDER BY page.pending DESC, page.running DESC, page.dead DESC, page.user_id
"""

_TOTALS = ("users", "pending", "running", "dead", "outbox_held", "outbox_failed")


def status(conn: psycopg.Connection[Any], limit: int, now: int | None) -> dict[str, Any]:
    """{"now", "users": [per user, busiest first], "totals": over every user}."""
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(STATUS, {"limit": limit, "now": now}).fetchall()
    users = [{"user": r["user_id"], "pending": r["pending"], "running": r["running"],
              "dead": r["dead"], "outbox_held": r["outbox_held"],
              "outbox_failed": r["outbox_failed"], "lease_holder": r["holder"],
              "lease_gen": r["gen"], "lease_until": r["until"],
              "lease_expires_in": None if r["until"] is None else r["until"] - r["now"],
              "paused_at": r["paused_at"], "paused_reason": r["paused_reason"]}
             for r in rows if r["user_id"] is not None]
    first = rows[0]
    totals = {name: (first[f"{name}_total"] or 0) if users else 0 for name in _TOTALS}
    return {"now": first["now"], "users": users, "totals": totals}


# Whether a user's pending events are held by a pause (operator view).
USER_PAUSE = ("SELECT paused_at, paused_reason FROM leases"
              " WHERE bucket = %(bucket)s AND user_id = %(user)s AND paused_at IS NOT NULL")
FLEET_PAUSE = "SELECT paused_at, reason FROM fleet_pause"


def held_by_pause(conn: psycopg.Connection[Any], user: str) -> dict[str, Any]:
    """{"user": the user's (paused_at, reason) or None, "fleet": the fleet's or None}."""
    mine = conn.execute(USER_PAUSE, user_key(user)).fetchone()
    fleet = conn.execute(FLEET_PAUSE).fetchone()
    return {"user": None if mine is None else tuple(mine),
            "fleet": None if fleet is None else tuple(fleet)}


# One user's events (operator view), newest first, and how many match in all.
EVENTS = """
SELECT id, source, source_id, kind, status, attempts, error, claim_gen,
       created_at, available_at, claimed_at, count(*) OVER () AS total
  FROM events
 WHERE bucket = %(bucket)s AND user_id = %(user)s
   AND (%(status)s::text IS NULL OR status = %(status)s)
 ORDER BY id DESC
 LIMIT %(limit)s
"""


def events(conn: psycopg.Connection[Any], user: str, status: str | None, limit: int) -> tuple[list[dict[str, Any]], int]:
    """(events newest first, without payloads; how many match in all)."""
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(EVENTS, user_key(user, status=status, limit=limit)).fetchall()
    total = rows[0]["total"] if rows else 0
    return [_without(r, "total") for r in rows], total


# Spans users unless one is named (operator view): dead events, newest first, and
# how many there are in all, through ix_events_dead.
DEAD = """
SELECT user_id AS "user", id, source, source_id, attempts, error, created_at, claimed_at,
       count(*) OVER () AS total
  FROM events
 WHERE outcome = 'dead'
   AND (%(user)s::text IS NULL OR (bucket = %(bucket)s AND user_id = %(user)s))
 ORDER BY id DESC
 LIMIT %(limit)s
"""


def dead(conn: psycopg.Connection[Any], user: str | None, limit: int) -> tuple[list[dict[str, Any]], int]:
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(DEAD, user_key(user, limit=limit)).fetchall()
    total = rows[0]["total"] if rows else 0
    return [_without(r, "total") for r in rows], total


# Spans users unless one is named: which user each event id belongs to, and its
# status now. Event ids are unique across users but the primary key is
# (user_id, id), so without a user this reads the whole table (once, for all the
# ids given); the repairs then reach each row by its primary key.
RESOLVE = """
SELECT id, user_id, status FROM events
 WHERE id = ANY(%(ids)s::bigint[])
   AND (%(user)s::text IS NULL OR (bucket = %(bucket)s AND user_id = %(user)s))
"""


def resolve(conn: psycopg.Connection[Any], ids: list[int], user: str | None) -> dict[int, tuple[str, str]]:
    """{id: (user, status)} for the ids that exist (and are the user's, if named)."""
    rows = conn.execute(RESOLVE, user_key(user, ids=ids)).fetchall()
    return {event_id: (owner, state) for event_id, owner, state in rows}


# The named (user, id) rows that are dead, locked in key order; a row that
# stopped being dead before the lock was granted drops out on the re-check.
DEAD_TARGETS = """
    SELECT e.bucket, e.user_id, e.id, e.attempts, e.error
      FROM events e
      JOIN unnest(%(users)s::text[], %(ids)s::bigint[]) AS t(user_id, id)
        ON e.bucket = ANY(%(buckets)s::int[]) AND e.user_id = t.user_id AND e.id = t.id
     WHERE e.status = 'dead'
     ORDER BY e.user_id, e.id
       FOR UPDATE OF e"""


# What a repair of a dead event records in operator_actions' detail: each key
# and the column of the event row, as it was, that it holds (here, and per
# bucket in backend/citus/statements.py).
REQUEUE_DETAIL = {"source": "source", "source_id": "source_id",
                  "previous_attempts": "attempts", "previous_error": "error"}
DISCARD_DETAIL = {"source": "source", "source_id": "source_id", "attempts": "attempts",
                  "error": "error", "payload": "payload"}


def detail_object(detail: dict[str, str]) -> str:
    """The jsonb_build_object(...) of `detail` over a row's columns."""
    return "jsonb_build_object(" + ", ".join(f"'{key}', {column}"
                                             for key, column in detail.items()) + ")"


# Repair (the named users' rows, by primary key): dead events become fresh
# pending ones (attempts 0, error cleared, claimable now). Only rows still dead
# once locked change, so a row a worker may hold is never written.
REQUEUE = f"""
WITH clock AS (
    SELECT {NOW} AS now
), target AS (
{DEAD_TARGETS}
), requeued AS (
    UPDATE events e
       SET status = 'pending', attempts = 0, error = NULL, available_at = clock.now
      FROM target t, clock
     WHERE e.user_id = t.user_id AND e.id = t.id
 RETURNING e.bucket, e.user_id, e.id, e.source, e.source_id, t.attempts, t.error
), woke AS (  -- a take looks at the user (store/inbox.py, TAKE_WORK), from the first
               -- event requeued, which may be below its low-water mark (inbox.low_water)
    INSERT INTO wakes (bucket, user_id, at, from_id)
    SELECT bucket, user_id, clock.now, min(id) FROM requeued, clock
     GROUP BY bucket, user_id, clock.now ORDER BY user_id
), unstepped AS (  -- a requeued event starts with no durable steps (store/steps.py)
    DELETE FROM steps s USING requeued r
     WHERE s.user_id = r.user_id AND r.id = ANY(s.event_ids)
), recorded AS (
    INSERT INTO operator_actions (bucket, user_id, at, actor, action, event_id, detail)
    SELECT bucket, user_id, clock.now, %(actor)s, 'requeue', id,
           {detail_object(REQUEUE_DETAIL)}
      FROM requeued, clock
)
SELECT user_id AS "user", id, source, source_id, attempts AS previous_attempts,
       error AS previous_error
  FROM requeued
 ORDER BY user_id, id
"""

# Wake waiting workers on commit (a hint; they also poll).
WAKE_WORKERS = f"SELECT pg_notify('{notify.WORK}', '')"


def requeue(conn: psycopg.Connection[Any], pairs: list[tuple[str, int]], now: int | None, actor: str) -> list[dict[str, Any]]:
    """Requeue the dead events among (user, id) pairs, record it, and wake the
    workers; the rows requeued, with the attempts and error they had."""
    users, ids = _columns(pairs)
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(REQUEUE, users_key(users, ids=ids, now=now, actor=actor)).fetchall()
    if rows:
        conn.execute(WAKE_WORKERS)
    return rows


# Repair (the named users' rows, by primary key): delete dead events, and with
# them their keys (see the module's note on invariant 1). Only rows still dead
# once locked are deleted.
DISCARD = f"""
WITH target AS (
{DEAD_TARGETS}
), discarded AS (
    DELETE FROM events e
     USING target t
     WHERE e.user_id = t.user_id AND e.id = t.id
 RETURNING e.bucket, e.user_id, e.id, e.source, e.source_id, e.attempts, e.error, e.payload
), unstepped AS (  -- and its durable steps (store/steps.py)
    DELETE FROM steps s USING discarded d
     WHERE s.user_id = d.user_id AND d.id = ANY(s.event_ids)
), recorded AS (
    INSERT INTO operator_actions (bucket, user_id, actor, action, event_id, detail)
    SELECT bucket, user_id, %(actor)s, 'discard', id,
           {detail_object(DISCARD_DETAIL)}
      FROM discarded
)
SELECT user_id AS "user", id, source, source_id, attempts, error
  FROM discarded
 ORDER BY user_id, id
"""


def discard(conn: psycopg.Connection[Any], pairs: list[tuple[str, int]], actor: str) -> list[dict[str, Any]]:
    """Delete the dead events among (user, id) pairs, recording each (with its
    payload); the rows deleted."""
    users, ids = _columns(pairs)
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(DISCARD, users_key(users, ids=ids, actor=actor)).fetchall()


# Operator view: the recorded repairs, newest first (one user's, or all users').
ACTIONS = """
SELECT user_id AS "user", id, at, actor, action, event_id, detail
  FROM operator_actions
 WHERE %(user)s::text IS NULL OR (bucket = %(bucket)s AND user_id = %(user)s)
 ORDER BY at DESC, id DESC
 LIMIT %(limit)s
"""


def actions(conn: psycopg.Connection[Any], user: str | None, limit: int) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(ACTIONS, user_key(user, limit=limit)).fetchall()


# One user's timers (operator view): those still to fire first, soonest first
# (a parked timer among them, under the due time it failed at).
TIMERS = f"""
WITH clock AS (
    SELECT {NOW} AS now
)
SELECT t.timer_id, t.due, t.every, t.cron, t.timezone, t.missed, t.catch_up_limit,
       t.event_source, t.event_source_id, t.done, t.payload,
       CASE WHEN t.parked_at IS NOT NULL THEN 'parked' WHEN t.done THEN 'done'
            ELSE 'waiting' END AS state,
       t.parked_at, t.error,
       t.due - clock.now AS due_in, count(*) OVER () AS total
  FROM timers t, clock
 WHERE t.bucket = %(bucket)s AND t.user_id = %(user)s
 ORDER BY t.done AND t.parked_at IS NULL, t.due, t.timer_id
 LIMIT %(limit)s
"""


def timers(conn: psycopg.Connection[Any], user: str, limit: int, now: int | None) -> tuple[list[dict[str, Any]], int]:
    """(timers, how many the user has). `key` is the fixed (source, source_id) of
    a one-off, else None (each occurrence is keyed ('timer', '<id>@<at>'));
    `state` is 'waiting', 'done' or 'parked' (with `parked_at` and `error`)."""
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(TIMERS, user_key(user, limit=limit, now=now)).fetchall()
    total = rows[0]["total"] if rows else 0
    result = []
    for r in rows:
        source, source_id = r.pop("event_source"), r.pop("event_source_id")
        r["key"] = None if source is None else [source, source_id]
        result.append(_without(r, "total"))
    return result, total


def _columns(pairs: list[tuple[str, int]]) -> tuple[list[str], list[int]]:
    return [user for user, _ in pairs], [event_id for _, event_id in pairs]


def _without(row: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k != key}


# An operator's change of a user's memory (store/memory.py), recorded in the
# transaction that made it, with the document it replaced.
RECORD_MEMORY = f"""
INSERT INTO operator_actions (bucket, user_id, at, actor, action, detail)
VALUES (%(bucket)s, %(user)s, {NOW}, %(actor)s, %(action)s, %(detail)s::jsonb)
"""


def record_memory_change(conn: psycopg.Connection[Any], user: str, actor: str, previous: object, doc: object,
                         now: int | None) -> None:
    conn.execute(RECORD_MEMORY, user_key(
        user, actor=actor, now=now, action="memory_clear" if doc is None else "memory_set",
        detail=json.dumps({"previous": previous, "memory": doc})))
