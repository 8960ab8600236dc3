"""Timers: they feed the inbox and never start a run.

A due timer becomes an inbox event under the key ('timer', '<timer_id>@<at>') (or
the one-off's fixed key), and the timer advances in the same statement, so a
second scheduler pass finds nothing due and a replay of the same occurrence is a
duplicate in the inbox. Missed occurrences of a recurring timer coalesce into one
event for the latest of them; the next due time stays on the grid. Many
schedulers may run at once: due rows are taken with FOR UPDATE SKIP LOCKED.
"""


from agent_inbox.records import Timer
from agent_inbox.store import notify
from agent_inbox.store.clock import DB_CLOCK, NOW

# Replacing a timer re-arms it; due is `base + delay`, base defaulting to the
# database clock (request_approval's deadline is now + expires_in).
UPSERT = f"""
INSERT INTO timers (user_id, timer_id, due, every, payload, event_source, event_source_id)
VALUES (%(user)s, %(timer_id)s, coalesce(%(base)s::bigint, {DB_CLOCK}) + %(delay)s,
        %(every)s, %(payload)s::jsonb, %(event_source)s, %(event_source_id)s)
ON CONFLICT (user_id, timer_id) DO UPDATE
   SET due = excluded.due, every = excluded.every, payload = excluded.payload,
       event_source = excluded.event_source, event_source_id = excluded.event_source_id,
       done = false
RETURNING due, pg_notify('{notify.TIMERS}', '')
"""


def upsert(conn, user: str, timer_id: str, *, base: int | None, delay: int, every: int | None,
           payload_json: str, key: tuple[str, str] | None) -> int:
    """Create or replace a timer; returns its due time."""
    source, source_id = key if key else (None, None)
    params = {
        "user": user, "timer_id": timer_id, "base": base, "delay": delay, "every": every,
        "payload": payload_json, "event_source": source, "event_source_id": source_id,
    }
    return conn.execute(UPSERT, params).fetchone()[0]


# Spans users (the scheduler's scan). One batch of due timers, oldest first, each
# fired once: coalesced occurrence, event insert and advance in one statement.
FIRE_DUE = """
WITH clock AS (
    SELECT coalesce(%(now)s::bigint, {db_clock}) AS now
), ripe AS (
    SELECT t.user_id, t.timer_id, t.due, t.every, t.payload, t.event_source, t.event_source_id
      FROM timers t, clock
     WHERE NOT t.done AND t.due <= clock.now
     ORDER BY t.due
     LIMIT %(limit)s
       FOR UPDATE OF t SKIP LOCKED
), occurrence AS (
    SELECT r.*, clock.now, s.skipped, r.due + s.skipped * coalesce(r.every, 0) AS at
      FROM ripe r CROSS JOIN clock
     CROSS JOIN LATERAL (SELECT CASE WHEN r.every IS NULL THEN 0
                                     ELSE (clock.now - r.due) / r.every END AS skipped) s
), inserted AS (
    INSERT INTO events (user_id, source, source_id, payload)
    SELECT user_id,
           coalesce(event_source, 'timer'),
           coalesce(event_source_id, timer_id || '@' || at),
           payload || jsonb_build_object('scheduled_for', at, 'late_by', now - at,
                                         'skipped', skipped)
      FROM occurrence
     ORDER BY at, user_id, timer_id
        ON CONFLICT (user_id, source, source_id) DO NOTHING
), advanced AS (
    UPDATE timers t
       SET due = CASE WHEN o.every IS NULL THEN t.due ELSE o.at + o.every END,
           done = o.every IS NULL
      FROM occurrence o
     WHERE t.user_id = o.user_id AND t.timer_id = o.timer_id
)
SELECT count(*) FROM occurrence
""".format(db_clock=DB_CLOCK)


def fire_due(conn, now: int | None, limit: int) -> int:
    return conn.execute(FIRE_DUE, {"now": now, "limit": limit}).fetchone()[0]


# Spans users (the scheduler's sleep): seconds until the next timer is due.
NEXT_DUE = f"""
SELECT greatest(0, next_due - {NOW})
  FROM (SELECT min(due) AS next_due FROM timers WHERE NOT done) m
 WHERE next_due IS NOT NULL
"""


def seconds_to_next_due(conn, now: int | None) -> int | None:
    row = conn.execute(NEXT_DUE, {"now": now}).fetchone()
    return row[0] if row else None


LIST = """
SELECT timer_id, due, every, payload,
       CASE WHEN event_source IS NULL THEN NULL
            ELSE ARRAY[event_source, event_source_id] END AS key,
       done
  FROM timers WHERE user_id = %(user)s ORDER BY timer_id
"""


def list_timers(conn, user: str) -> list[Timer]:
    rows = conn.execute(LIST, {"user": user}).fetchall()
    return [Timer(t, due, every, payload, tuple(key) if key else None, done)
            for t, due, every, payload, key, done in rows]
