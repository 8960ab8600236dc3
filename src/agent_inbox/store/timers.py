"""Timers: they feed the inbox and never start a run.

A due timer becomes an inbox event under the key ('timer', '<timer_id>@<at>') (or
the one-off's fixed key), and the timer advances in the same transaction, so a
second scheduler pass finds nothing due and a replay of the same occurrence is a
duplicate in the inbox. Missed occurrences of a recurring timer coalesce into one
event for the latest of them ('coalesce', the default), or become one event each
('catch_up', at most catch_up_limit per firing, the overflow reported); the next
due time stays on the schedule. Many schedulers may run at once: due rows are
taken with FOR UPDATE SKIP LOCKED.

A timer whose firing raises because of its own row (a time zone this host
cannot load, a next due time past a bigint) is parked: `done`, `parked_at` and
`error` are set in the batch's transaction and the batch's other timers fire.
Being done, it is in no scan (ix_timers_due holds only rows not done) until the
timer is replaced (UPSERT re-arms it and clears both).
"""

import json
from collections import deque
from typing import Any, NamedTuple

import psycopg

from agent_inbox import cron, db, errors
from agent_inbox.records import Timer
from agent_inbox import notify
from agent_inbox.store import inbox, one
from agent_inbox.store.clock import DB_CLOCK, NOW
from agent_inbox.store.keys import user_key

# Replacing a timer re-arms it; due is `base + delay`, base defaulting to the
# database clock (request_approval's deadline is now + expires_in).
UPSERT = f"""
INSERT INTO timers (bucket, user_id, timer_id, due, every, cron, timezone, missed, catch_up_limit,
                    payload, event_source, event_source_id)
VALUES (%(bucket)s, %(user)s, %(timer_id)s, coalesce(%(base)s::bigint, {DB_CLOCK}) + %(delay)s,
        %(every)s, %(cron)s, %(timezone)s, %(missed)s, %(catch_up_limit)s,
        %(payload)s::jsonb, %(event_source)s, %(event_source_id)s)
ON CONFLICT ON CONSTRAINT pk_timers DO UPDATE
   SET due = excluded.due, every = excluded.every, cron = excluded.cron,
       timezone = excluded.timezone, missed = excluded.missed,
       catch_up_limit = excluded.catch_up_limit, payload = excluded.payload,
       event_source = excluded.event_source, event_source_id = excluded.event_source_id,
       done = false, parked_at = NULL, error = NULL
RETURNING due
"""
# Wakes the schedulers (sent by the client's own session: on Citus a NOTIFY
# raised on a worker node reaches no listener).
TIMER_CHANGED = f"SELECT pg_notify('{notify.TIMERS}', '')"


def upsert(conn: psycopg.Connection[Any], user: str, timer_id: str, *, base: int | None, delay: int, every: int | None,
           payload_json: str, key: tuple[str, str] | None, cron: str | None = None,
           timezone: str | None = None, missed: str = "coalesce", catch_up_limit: int = 100) -> int:
    """Create or replace a timer; returns its due time."""
    source, source_id = key if key else (None, None)
    params = user_key(
        user, timer_id=timer_id, base=base, delay=delay, every=every, cron=cron,
        timezone=timezone, missed=missed, catch_up_limit=catch_up_limit, payload=payload_json,
        event_source=source, event_source_id=source_id)
    due: int = one(conn.execute(UPSERT, params))[0]
    conn.execute(TIMER_CHANGED)
    return due


class Batch(NamedTuple):
    """One scheduler transaction's work: timers fired, occurrences skipped
    (coalesced or over the catch-up limit), timers parked as (user, timer_id, error)."""

    fired: int
    skipped: int
    parked: list[tuple[str, str, str]]


# Errors a statement raises because of one row's data (a bigint overflow, a
# payload that cannot be built): that row is parked. Any other database error
# (connection, lock or statement timeout, serialization) fails the pass.
ROW_ERRORS = (psycopg.DataError, psycopg.IntegrityError)

# A scan's batch: the oldest due first.
_OLDEST = "ORDER BY t.due LIMIT %(limit)s"


def _ripe(columns: str, kind: str, pick: str = _OLDEST) -> str:
    """Due timers (`kind`: 'NULL' for one-off and `every` timers, 'NOT NULL'
    for cron), locked, skipping those another scheduler holds."""
    return f"""SELECT {columns}
      FROM timers t, clock
     WHERE NOT t.done AND t.due <= clock.now AND t.cron IS {kind}
     {pick}
       FOR UPDATE OF t SKIP LOCKED"""


def _fire_sql(pick: str) -> str:
    """Fire the due one-off and `every` timers `pick` selects, each once, in one
    statement: the occurrences to emit (the latest, or with catch_up the latest
    catch_up_limit), their event inserts, and the timer's advance to the next
    time on its grid."""
    ripe = _ripe("t.bucket, t.user_id, t.timer_id, t.due, t.every, t.missed, t.catch_up_limit,"
                 " t.payload, t.event_source, t.event_source_id", "NULL", pick)
    return f"""
WITH clock AS (
    SELECT {NOW} AS now
), ripe AS (
    {ripe}
), latest AS (
    SELECT r.*, clock.now,
           CASE WHEN r.every IS NULL THEN 0 ELSE (clock.now - r.due) / r.every END AS skipped
      FROM ripe r CROSS JOIN clock
), occurrence AS (
    SELECT l.*, l.due + (l.skipped - k) * coalesce(l.every, 0) AS at
      FROM latest l
     CROSS JOIN LATERAL generate_series(
           0, CASE WHEN l.missed = 'catch_up' THEN least(l.skipped, l.catch_up_limit - 1)
                   ELSE 0 END) AS k
), inserted AS (
    INSERT INTO events (bucket, user_id, source, source_id, payload)
    SELECT bucket, user_id,
           coalesce(event_source, 'timer'),
           coalesce(event_source_id, timer_id || '@' || at),
           payload || CASE WHEN missed = 'coalesce'
                           THEN jsonb_build_object('scheduled_for', at, 'late_by', now - at,
                                                   'skipped', skipped)
                           ELSE jsonb_build_object('scheduled_for', at, 'late_by', now - at,
                                                   'skipped', 0, 'overflow',
                                                   greatest(0, skipped + 1 - catch_up_limit))
                      END
      FROM occurrence
     ORDER BY user_id, at, timer_id
        ON CONFLICT ON CONSTRAINT uq_events_user_id_source_source_id DO NOTHING
), advanced AS (
    UPDATE timers t
       SET due = CASE WHEN l.every IS NULL THEN t.due ELSE l.due + (l.skipped + 1) * l.every END,
           done = l.every IS NULL
      FROM latest l
     WHERE t.bucket = l.bucket AND t.user_id = l.user_id AND t.timer_id = l.timer_id
)
SELECT count(*),
       coalesce(sum(CASE WHEN missed = 'coalesce' THEN skipped
                         ELSE greatest(0, skipped + 1 - catch_up_limit) END), 0)
  FROM latest
"""


# Spans users (the scheduler's scan): one batch of due one-off and `every`
# timers, oldest first, set-based.
FIRE_DUE = _fire_sql(_OLDEST)
# The same for one timer: a batch whose FIRE_DUE failed goes again row by row.
FIRE_ONE = _fire_sql("AND t.bucket = %(bucket)s AND t.user_id = %(user)s"
                     " AND t.timer_id = %(timer_id)s")
# Spans users: the timers FIRE_DUE would take, locked.
RIPE_ONE_OFF = f"WITH clock AS (SELECT {NOW} AS now)\n" + _ripe("t.user_id, t.timer_id", "NULL")

PARK = f"""
WITH clock AS (SELECT {NOW} AS now)
UPDATE timers SET done = true, parked_at = clock.now, error = %(error)s
  FROM clock
 WHERE bucket = %(bucket)s AND user_id = %(user)s AND timer_id = %(timer_id)s
"""


def park(conn: psycopg.Connection[Any], now: int | None, user: str, timer_id: str, exc: Exception) -> tuple[str, str, str]:
    """Park a timer the caller holds locked, with what `exc` says."""
    error = f"{type(exc).__name__}: {exc}"
    conn.execute(PARK, user_key(user, now=now, timer_id=timer_id, error=error))
    return user, timer_id, error


def fire_due(conn: psycopg.Connection[Any], now: int | None, limit: int) -> tuple[int, int]:
    """(timers fired, occurrences skipped) by one FIRE_DUE; raises if any row fails."""
    fired, skipped = one(conn.execute(FIRE_DUE, {"now": now, "limit": limit}))
    return fired, int(skipped)


def fire_due_batch(conn: psycopg.Connection[Any], now: int | None, limit: int) -> Batch:
    """One batch of due one-off and `every` timers, in the caller's transaction:
    fire_due, or if a row's data makes it fail, the batch one timer at a time
    under savepoints, parking the timers that fail."""
    try:
        with conn.transaction():
            return Batch(*fire_due(conn, now, limit), [])
    except ROW_ERRORS:
        pass  # a row's data failed the statement: the batch again, one timer at a time
    fired = skipped = 0
    parked = []
    for user, timer_id in conn.execute(RIPE_ONE_OFF, {"now": now, "limit": limit}).fetchall():
        params = user_key(user, now=now, timer_id=timer_id)
        try:
            with conn.transaction():
                one_fired, one_skipped = one(conn.execute(FIRE_ONE, params))
        except ROW_ERRORS as exc:
            parked.append(park(conn, now, user, timer_id, exc))
        else:
            fired += one_fired
            skipped += int(one_skipped)
    return Batch(fired, skipped, parked)


# The columns fire_each reads of a locked due timer, then the clock.
RIPE_COLUMNS = ("t.user_id, t.timer_id, t.due, t.every, t.cron, t.timezone, t.missed,"
                " t.catch_up_limit, t.payload, t.event_source, t.event_source_id, clock.now")

# Spans users (the scheduler's scan): due cron timers, taken as FIRE_DUE takes
# its timers; their occurrences are computed in Python (cron.py).
RIPE_CRON = f"WITH clock AS (SELECT {NOW} AS now)\n" + _ripe(RIPE_COLUMNS, "NOT NULL")

ADVANCE_CRON = """
UPDATE timers SET due = %(due)s
 WHERE bucket = %(bucket)s AND user_id = %(user)s AND timer_id = %(timer_id)s
"""
ADVANCE = """
UPDATE timers SET due = %(due)s, done = %(done)s
 WHERE bucket = %(bucket)s AND user_id = %(user)s AND timer_id = %(timer_id)s
"""


# Occurrences counted one by one at most this far; beyond it a firing reports
# "at least" this many skipped (a minutely cron after a three-month outage).
_MAX_COUNTED = 100_000


def _occurrences(schedule: cron.Schedule, first: int, until: int, keep: int) -> tuple[list[int], int]:
    """The last `keep` occurrences from `first` (itself one) up to `until`, and how
    many there were (counting stops at _MAX_COUNTED)."""
    kept, total, at = deque([first], maxlen=keep), 1, first
    while total < _MAX_COUNTED:
        at = schedule.next_after(at)
        if at > until:
            break
        kept.append(at)
        total += 1
    return list(kept), total


def fire_cron(conn: psycopg.Connection[Any], user: str, timer_id: str, due: int, expression: str,
              zone: str, missed: str, cap: int, payload: Any, now_db: int) -> int:
    """Fire one locked cron timer and advance it; the occurrences skipped."""
    if not isinstance(payload, dict):
        raise errors.InvalidTimer("payload", payload, "must be a JSON object")
    schedule = cron.parse(expression, zone)
    emitted, total = _occurrences(schedule, due, now_db, 1 if missed == "coalesce" else cap)
    rows = []
    for at in emitted:
        body = dict(payload, scheduled_for=at, late_by=now_db - at)
        if missed == "coalesce":
            body["skipped"] = total - 1
        else:
            body.update(skipped=0, overflow=total - len(emitted))
        rows.append((user, "timer", f"{timer_id}@{at}", json.dumps(body), None))
    db.run(conn, inbox.insert_many(rows))
    conn.execute(ADVANCE_CRON, user_key(user, timer_id=timer_id, due=schedule.next_after(now_db)))
    return total - len(emitted)


def fire_every(conn: psycopg.Connection[Any], user: str, timer_id: str, due: int, every: int | None,
               missed: str, cap: int, payload: dict[str, Any], event_source: str | None,
               event_source_id: str | None, now_db: int) -> int:
    """Fire one locked one-off or `every` timer and advance it, by FIRE_DUE's
    rules for one row (the occurrences, their keys and payloads, the next due
    time), with Python doing the arithmetic; the occurrences skipped. For Citus,
    which cannot run FIRE_DUE as one statement (backend/citus/statements.py)."""
    skipped = 0 if every is None else (now_db - due) // every
    emitted = range(min(skipped, cap - 1) if missed == "catch_up" else 0, -1, -1)
    rows = []
    for at in (due + (skipped - k) * (every or 0) for k in emitted):
        body = dict(payload, scheduled_for=at, late_by=now_db - at)
        if missed == "coalesce":
            body["skipped"] = skipped
        else:
            body.update(skipped=0, overflow=max(0, skipped + 1 - cap))
        rows.append((user, event_source or "timer", event_source_id or f"{timer_id}@{at}",
                     json.dumps(body), None))
    db.run(conn, inbox.insert_many(rows))
    conn.execute(ADVANCE, user_key(user, timer_id=timer_id, done=every is None,
                                   due=due if every is None else due + (skipped + 1) * every))
    return skipped if missed == "coalesce" else max(0, skipped + 1 - cap)


def fire_each(conn: psycopg.Connection[Any], now: int | None, ripe: list[tuple[Any, ...]]) -> Batch:
    """Fire locked due timers (rows of RIPE_COLUMNS) one by one, in the caller's
    transaction, each under a savepoint: one that raises because of its row (a
    time zone or cron this host cannot evaluate, a payload that is not an
    object, a next due time past a bigint) is parked, the others fire."""
    skipped = 0
    parked = []
    for user, timer_id, due, every, expression, zone, missed, cap, payload, source, source_id, \
            now_db in ripe:
        try:
            with conn.transaction():
                if expression is not None:
                    skipped += fire_cron(conn, user, timer_id, due, expression, zone, missed, cap,
                                         payload, now_db)
                else:
                    skipped += fire_every(conn, user, timer_id, due, every, missed, cap, payload,
                                          source, source_id, now_db)
        except Exception as exc:
            if isinstance(exc, psycopg.Error) and not isinstance(exc, ROW_ERRORS):
                raise
            parked.append(park(conn, now, user, timer_id, exc))
    return Batch(len(ripe) - len(parked), skipped, parked)


def fire_due_cron(conn: psycopg.Connection[Any], now: int | None, limit: int) -> Batch:
    """One batch of due cron timers, in the caller's transaction (fire_each)."""
    return fire_each(conn, now, conn.execute(RIPE_CRON, {"now": now, "limit": limit}).fetchall())


# Spans users (the scheduler's sleep): whether a due timer is left at `at`
# (after a pass that took every timer it could: one another scheduler holds, or
# one that fell due since), and the next due time after it. Two lookups on
# ix_timers_due, uncorrelated (so Citus runs each as a read across shards).
NEXT_DUE = """
SELECT EXISTS (SELECT 1 FROM timers t WHERE NOT t.done AND t.due <= %(at)s),
       (SELECT min(t.due) FROM timers t WHERE NOT t.done AND t.due > %(at)s)
"""


def next_due(conn: psycopg.Connection[Any], now: int | None) -> tuple[bool, int | None]:
    """(a due timer is left, seconds until the next later one: None if none)."""
    at = now if now is not None else one(conn.execute(f"SELECT {DB_CLOCK}"))[0]
    left, later = one(conn.execute(NEXT_DUE, {"at": at}))
    return left, None if later is None else later - at


LIST = """
SELECT timer_id, due, every, payload,
       CASE WHEN event_source IS NULL THEN NULL
            ELSE ARRAY[event_source, event_source_id] END AS key,
       done, cron, timezone, missed, catch_up_limit, parked_at, error
  FROM timers WHERE user_id = %(user)s ORDER BY timer_id
"""


def list_timers(conn: psycopg.Connection[Any], user: str) -> list[Timer]:
    rows = conn.execute(LIST, {"user": user}).fetchall()
    return [Timer(t, due, every, payload, tuple(key) if key else None, *rest)
            for t, due, every, payload, key, *rest in rows]
