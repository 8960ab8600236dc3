"""The outbox: a run's messages, sent paced per user, in batches with stable keys,
with no lock or connection held while a channel sends.

A user's delivery row (`deliveries`) says when a dispatcher should look next
(`due_at`: a finish that queues messages makes it now; the dispatchers' scan
reads only that index) and holds the pace (`last_sent_at`) and the batch being
sent. A send goes in three steps:

1. **claim** (one short transaction, the user's delivery row locked): a batch
   still written down goes again (its rows and key unchanged: a resend after a
   crash or a failed send); else, if the user's last send is at least `gap`
   seconds old or a held message is urgent, every held row is written down as a
   new batch (`batch` = its first row's id). The claim holds the batch until
   `sending_until` and bumps `send_token`; while the claim holds, no other
   dispatcher sends that user anything.
2. **send**, with nothing held in the database.
3. **mark sent** or **record the failure**, each fenced by the token: a
   dispatcher whose claim ran out and was taken over writes nothing. A failed
   batch is retried after an exponential, jittered backoff, and parked `failed`
   after `max_attempts` failed sends or a permanent refusal; the user's later
   messages go on behind it. A dispatcher that died mid-send leaves its batch
   written down: it goes again after `sending_until`, same rows, same key
   (at-least-once; at-most-once marks it sent before sending).

Every statement that decides from a user's outbox rows runs after that user's
delivery row is locked, in a statement of its own (a newer snapshot): a finish
that queues messages upserts the same row in its commit, so it either committed
before the decision saw its rows, or waits for the lock and makes the user due
again after it. So a held message is never left with no dispatcher due to look.
"""

import random
from collections.abc import Callable, Iterable
from typing import Any

import psycopg
from psycopg.rows import class_row, dict_row

from agent_inbox.records import Batch, Failure
from agent_inbox.records import OutboxMessage
from agent_inbox import notify
from agent_inbox.store import one, pauses
from agent_inbox.store.clock import NOW
from agent_inbox.store.keys import user_key, users_key

# The users a dispatcher claims: due ones, longest due first, skipping rows
# another dispatcher (or a finish) holds; none while the fleet is paused
# (store/pauses.py: its due rows stay due). LOCK_USER: one user, for the API's
# dispatch(user), which does not wait for due_at but never waits on a lock either.
LOCK_DUE = f"""
SELECT user_id FROM deliveries
 WHERE due_at <= {NOW} AND {pauses.FLEET_RUNS}
 ORDER BY due_at
 LIMIT %(users)s
   FOR UPDATE SKIP LOCKED
"""
LOCK_USER = """
SELECT user_id FROM deliveries WHERE bucket = %(bucket)s AND user_id = %(user)s
   FOR UPDATE SKIP LOCKED
"""

# The claim for users whose delivery rows this transaction locked. Per user:
#   in_flight  another claim still holds a batch: look again when it runs out;
#   resend     a claimed batch is written down (a failed or interrupted send):
#              it goes again (its backoff keeps the user from being due before);
#              or a batch an operator retried, once the gap allows a send;
#   send       held rows, and the gap has passed or one is urgent: a new batch;
#   paced      held rows inside the gap: look again when it ends;
#   idle       nothing held: not due.
#   paused     the user is paused (store/pauses.py): nothing sent, not due
#              until resume makes it due; a batch being sent now (in_flight:
#              handed to the channel) is not recalled.
# (The fleet's pause is read before: LOCK_DUE, and the API's dispatch. Read
# here, it would make Citus plan the claim in steps over every shard.)
CLAIM = f"""
WITH clock AS (
    SELECT {NOW} AS now
), mine AS (
    SELECT d.*, clock.now,
           EXISTS (SELECT 1 FROM leases l
                    WHERE l.bucket = ANY(%(buckets)s::int[])  -- by constant: one shard on Citus
                      AND l.bucket = d.bucket AND l.user_id = d.user_id
                      AND NOT {pauses.NOT_PAUSED}) AS paused
      FROM deliveries d, clock
     WHERE d.bucket = ANY(%(buckets)s::int[]) AND d.user_id = ANY(%(users)s::text[])
), held AS (
    SELECT m.user_id, o.id, o.body, o.urgent, o.batch, o.traceparent
      FROM mine m CROSS JOIN LATERAL (
           SELECT o.id, o.body, o.urgent, o.batch, o.traceparent FROM outbox o
            WHERE o.bucket = ANY(%(buckets)s::int[]) AND o.user_id = m.user_id
              AND o.sent_at IS NULL AND o.failed_at IS NULL
           OFFSET 0) o
), looked AS (
    SELECT m.*,
           -- the batch written down: the claimed one, else one an operator
           -- retried (its rows keep their batch), if it still has held rows
           (SELECT min(h.batch) FROM held h WHERE h.user_id = m.user_id
               AND h.batch = coalesce(m.batch, h.batch)) AS written,
           (SELECT min(h.id) FROM held h WHERE h.user_id = m.user_id) AS first_held,
           EXISTS (SELECT 1 FROM held h WHERE h.user_id = m.user_id AND h.urgent) AS urgent
      FROM mine m
), verdict AS (
    SELECT l.*, CASE
           WHEN l.batch IS NOT NULL AND l.sending_until > l.now THEN 'in_flight'
           WHEN l.paused THEN 'paused'
           WHEN l.batch IS NOT NULL AND l.written IS NOT NULL THEN 'resend'
           WHEN l.first_held IS NULL THEN 'idle'
           WHEN NOT (l.urgent OR l.last_sent_at IS NULL OR l.now - l.last_sent_at >= %(gap)s)
           THEN 'paced'
           WHEN l.written IS NOT NULL THEN 'resend'
           ELSE 'send' END AS verdict
      FROM looked l
), written_down AS (
    UPDATE outbox o SET batch = v.first_held
      FROM verdict v JOIN held h ON h.user_id = v.user_id
     WHERE v.verdict = 'send'
       AND o.bucket = ANY(%(buckets)s::int[]) AND o.user_id = h.user_id AND o.id = h.id
), claimed AS (  -- searched CASEs: Citus deparses `CASE x WHEN ...` in an UPDATE wrongly
    UPDATE deliveries d
       SET batch = CASE WHEN v.verdict = 'send' THEN v.first_held
                        WHEN v.verdict = 'resend' THEN v.written
                        WHEN v.verdict IN ('in_flight', 'paused') THEN d.batch END,
           sending_until = CASE WHEN v.verdict IN ('in_flight', 'paused')
                                THEN d.sending_until
                                WHEN v.verdict IN ('send', 'resend')
                                THEN v.now + %(send_timeout)s END,
           send_token = d.send_token + (v.verdict IN ('send', 'resend'))::int,
           due_at = CASE WHEN v.verdict IN ('idle', 'paused') THEN NULL
                         WHEN v.verdict = 'paced' THEN d.last_sent_at + %(gap)s
                         WHEN v.verdict = 'in_flight' THEN d.sending_until
                         ELSE v.now + %(send_timeout)s END
      FROM verdict v
     WHERE d.bucket = ANY(%(buckets)s::int[]) AND d.user_id = v.user_id
 RETURNING d.user_id, d.batch, d.send_token, v.verdict
)
SELECT c.user_id, c.batch, c.send_token, h.id, h.body, h.traceparent
  FROM claimed c JOIN held h ON h.user_id = c.user_id
 WHERE c.verdict = 'send' OR (c.verdict = 'resend' AND h.batch = c.batch)
 ORDER BY c.user_id, h.id
"""


def claim(conn: psycopg.Connection[Any], users: list[str], *, gap: int, send_timeout: int, now: int | None) -> list[Batch]:
    """The batches to send now for `users`, whose delivery rows the caller's
    transaction has locked (lock_due or lock_user)."""
    params = users_key(users, gap=gap, send_timeout=send_timeout, now=now)
    batches: dict[str, Batch] = {}
    for user, batch, token, row_id, body, traceparent in conn.execute(CLAIM, params).fetchall():
        found = batches.setdefault(user, Batch(user, batch, token, [], []))
        found.ids.append(row_id)
        found.bodies.append(body)
        found.traceparents.append(traceparent)
    return list(batches.values())


def lock_due(conn: psycopg.Connection[Any], limit: int, now: int | None) -> list[str]:
    return [u for u, in conn.execute(LOCK_DUE, {"users": limit, "now": now}).fetchall()]


def lock_user(conn: psycopg.Connection[Any], user: str) -> list[str]:
    return [u for u, in conn.execute(LOCK_USER, user_key(user)).fetchall()]


# Batches sent: their rows marked, the pace restarted, fenced by the claim's
# token. The next look is after the gap, or now if an urgent message waits
# (queued before this statement, or by a finish that updated the row since).
MARK_SENT = f"""
WITH clock AS (
    SELECT {NOW} AS now
), sent AS (
    SELECT * FROM unnest(%(users)s::text[], %(batches)s::bigint[], %(tokens)s::bigint[])
                  AS k(user_id, batch, token)
), marked AS (
    UPDATE deliveries d
       SET batch = NULL, sending_until = NULL, attempts = 0, last_error = NULL,
           last_sent_at = clock.now,
           due_at = CASE WHEN d.due_at < d.sending_until
                           OR EXISTS (SELECT 1 FROM outbox o
                                       WHERE o.bucket = ANY(%(buckets)s::int[])
                                         AND o.user_id = d.user_id
                                         AND o.sent_at IS NULL
                                         AND o.failed_at IS NULL AND o.urgent
                                         AND o.batch IS DISTINCT FROM k.batch)
                         THEN clock.now ELSE clock.now + %(gap)s END
      FROM sent k, clock
     WHERE d.bucket = ANY(%(buckets)s::int[]) AND d.user_id = k.user_id AND d.batch = k.batch
       AND d.send_token = k.token
 RETURNING d.user_id, k.batch
), rows_sent AS (
    UPDATE outbox o SET sent_at = clock.now
      FROM marked m, clock
     WHERE o.bucket = ANY(%(buckets)s::int[]) AND o.user_id = m.user_id AND o.batch = m.batch
       AND o.sent_at IS NULL
)
SELECT user_id, batch FROM marked
"""

# Failed sends, fenced like MARK_SENT: the batch is retried after a backoff
# (base * 2^(failures - 1), capped, scaled by a random factor in [0.5, 1] drawn
# per failure by the caller: Citus refuses random() in an UPDATE), or
# parked `failed` once it has failed max_attempts times or the channel said it
# never can succeed; then the user's later messages are due now.
_PARKS = "(k.permanent OR d.attempts + 1 >= %(max_attempts)s)"
RECORD_FAILED = f"""
WITH clock AS (
    SELECT {NOW} AS now
), failed AS (
    SELECT * FROM unnest(%(users)s::text[], %(batches)s::bigint[], %(tokens)s::bigint[],
                         %(errors)s::text[], %(permanent)s::boolean[], %(jitters)s::float8[])
                  AS k(user_id, batch, token, error, permanent, jitter)
), recorded AS (
    UPDATE deliveries d
       SET attempts = CASE WHEN {_PARKS} THEN 0 ELSE d.attempts + 1 END,
           batch = CASE WHEN {_PARKS} THEN NULL ELSE d.batch END,
           due_at = CASE WHEN {_PARKS} THEN clock.now
                         ELSE clock.now + floor(least(%(backoff_cap)s::float8,
                                                      %(backoff_base)s * 2 ^ d.attempts)
                                                * k.jitter)::bigint END,
           sending_until = NULL, last_error = k.error
      FROM failed k, clock
     WHERE d.bucket = ANY(%(buckets)s::int[]) AND d.user_id = k.user_id AND d.batch = k.batch
       AND d.send_token = k.token
 RETURNING d.user_id, k.batch, k.error, d.batch IS NULL AS parked
), parked_rows AS (
    UPDATE outbox o SET failed_at = clock.now, error = r.error
      FROM recorded r, clock
     WHERE r.parked
       AND o.bucket = ANY(%(buckets)s::int[]) AND o.user_id = r.user_id AND o.batch = r.batch
       AND o.sent_at IS NULL
)
SELECT user_id, batch, parked FROM recorded
"""


def _keys(batches: list[Batch]) -> dict[str, Any]:
    return users_key([b.user for b in batches], batches=[b.batch for b in batches],
                     tokens=[b.token for b in batches])


# Outcomes lock their users' delivery rows in user order first, as a finish
# queueing messages for several users does: sends end in any order, and two
# transactions locking the same rows in different orders can deadlock.
LOCK_USERS = """
SELECT user_id FROM deliveries
 WHERE bucket = ANY(%(buckets)s::int[]) AND user_id = ANY(%(users)s::text[])
 ORDER BY user_id FOR UPDATE
"""


def _lock_in_order(conn: psycopg.Connection[Any], batches: list[Batch]) -> None:
    conn.execute(LOCK_USERS, users_key(b.user for b in batches))


def mark_sent(conn: psycopg.Connection[Any], batches: list[Batch], *, gap: int, now: int | None) -> set[tuple[str, int]]:
    """The (user, batch) marked sent; a batch missing was taken over (its claim
    ran out and another dispatcher claimed it again)."""
    _lock_in_order(conn, batches)
    params = {**_keys(batches), "gap": gap, "now": now}
    return {tuple(row) for row in conn.execute(MARK_SENT, params).fetchall()}


def record_failed(conn: psycopg.Connection[Any], failures: list[Failure], *, max_attempts: int, backoff_base: float,
                  backoff_cap: float, now: int | None) -> dict[tuple[str, int], bool]:
    """{(user, batch): parked} for the failures recorded (the others were taken over)."""
    _lock_in_order(conn, [f.batch for f in failures])
    params = {**_keys([f.batch for f in failures]), "errors": [f.error for f in failures],
              "permanent": [f.permanent for f in failures],
              "jitters": [random.uniform(0.5, 1.0) for _ in failures], "max_attempts": max_attempts,
              "backoff_base": backoff_base, "backoff_cap": backoff_cap, "now": now}
    return {(user, batch): parked
            for user, batch, parked in conn.execute(RECORD_FAILED, params).fetchall()}


# Spans users (the dispatcher's sleep): seconds until the next user is due.
NEXT_DUE = f"""
SELECT greatest(0, min(due_at) - {NOW}) FROM deliveries WHERE due_at IS NOT NULL
"""


def seconds_to_next_due(conn: psycopg.Connection[Any], now: int | None) -> int | None:
    seconds: int | None = one(conn.execute(NEXT_DUE, {"now": now}))[0]
    return seconds


# How new messages make a user's delivery due now: a dispatcher looks at the
# user at once (claim paces the send), unless a failed batch is backing off:
# it goes first, at its time. The ON CONFLICT of a finish's `paced`
# (store/inbox.py) and of its per-bucket form (backend/citus/statements.py).
DUE_NOW = """ON CONFLICT ON CONSTRAINT pk_deliveries DO UPDATE
   SET due_at = CASE WHEN d.batch IS NOT NULL AND d.sending_until IS NULL
                      AND d.due_at IS NOT NULL THEN d.due_at
                     ELSE least(d.due_at, excluded.due_at) END"""


# Spans users (a dispatcher, once a minute): users holding messages that no
# delivery row makes due, as rows queued by a worker older than the delivery
# table leave them (a rolling upgrade). Reads every held row: for that rare pass.
ADOPT_HELD = f"""
INSERT INTO deliveries AS d (bucket, user_id, due_at)
SELECT DISTINCT o.bucket, o.user_id, {NOW} FROM outbox o
 WHERE o.sent_at IS NULL AND o.failed_at IS NULL
   AND NOT EXISTS (SELECT 1 FROM deliveries x WHERE x.bucket = o.bucket AND x.user_id = o.user_id
                                                AND x.due_at IS NOT NULL)
 ORDER BY 2
    ON CONFLICT ON CONSTRAINT pk_deliveries DO UPDATE SET due_at = least(d.due_at, excluded.due_at)
"""


def adopt_held(conn: psycopg.Connection[Any], now: int | None) -> int:
    return conn.execute(ADOPT_HELD, {"now": now}).rowcount


# A dispatcher's gap applied to users already paced (a dispatcher, at start and
# once a minute): a user paced by a longer gap (`due_at` = last send + that gap,
# written by CLAIM or MARK_SENT of a dispatcher with an older setting) is due
# at last send + this gap instead, so lowering --outbox-gap releases messages
# already held. Only ever makes a due time earlier, never before the last send
# + this gap; CLAIM still decides whether a send may go. Reads the future part
# of the due index; STALE_PACE_USERS (a read, no lock) finds them, at most
# %(limit)s a time, and REPACE locks them in user order, skipping rows another
# transaction holds (a claim or a finish: it decides their due time itself).
_STALE_PACE = """due_at > %(now)s AND batch IS NULL AND last_sent_at IS NOT NULL
   AND due_at > last_sent_at + %(gap)s"""
STALE_PACE_USERS = f"""
SELECT user_id FROM deliveries WHERE {_STALE_PACE} ORDER BY user_id LIMIT %(limit)s
"""
REPACE = f"""
WITH stale AS (
    SELECT user_id FROM deliveries
     WHERE bucket = ANY(%(buckets)s::int[]) AND user_id = ANY(%(users)s::text[]) AND {_STALE_PACE}
     ORDER BY user_id
       FOR UPDATE SKIP LOCKED
)
UPDATE deliveries d SET due_at = d.last_sent_at + %(gap)s
  FROM stale WHERE d.bucket = ANY(%(buckets)s::int[]) AND d.user_id = stale.user_id
"""
REPACE_LIMIT = 10_000


def stale_pace_users(conn: psycopg.Connection[Any], gap: int, now: int | None) -> list[str]:
    now = now if now is not None else one(conn.execute(f"SELECT {NOW}", {"now": None}))[0]
    params = {"gap": gap, "now": now, "limit": REPACE_LIMIT}
    return [u for u, in conn.execute(STALE_PACE_USERS, params).fetchall()]


def repace(conn: psycopg.Connection[Any], users: list[str], gap: int, now: int | None) -> int:
    """Users among `users` paced by a longer gap made due at last send + `gap`."""
    now = now if now is not None else one(conn.execute(f"SELECT {NOW}", {"now": None}))[0]
    return conn.execute(REPACE, users_key(users, gap=gap, now=now)).rowcount


# Operator repairs of parked batches, by batch id (its first row's id, unique
# across users). Their users are found (a read, no lock), then, per bucket on
# Citus, the users' delivery rows are locked in user order (as every
# dispatcher path locks them before a user's rows); only batches still failed
# once locked change, and each repair is recorded in operator_actions.
# Finding a batch by id reads the held rows' index: for operators, not the run path.
FAILED_USERS = """
SELECT DISTINCT o.user_id FROM outbox o
 WHERE o.batch = ANY(%(batches)s::bigint[]) AND o.sent_at IS NULL AND o.failed_at IS NOT NULL
 ORDER BY 1
"""

_FAILED_BATCHES = """target AS (
    SELECT o.bucket, o.user_id, o.batch, count(*) AS messages, min(o.error) AS error,
           min(o.failed_at) AS failed_at
      FROM outbox o
     WHERE o.batch = ANY(%(batches)s::bigint[])
       AND o.bucket = ANY(%(buckets)s::int[]) AND o.user_id = ANY(%(users)s::text[])
       AND o.sent_at IS NULL AND o.failed_at IS NOT NULL
     GROUP BY o.bucket, o.user_id, o.batch
)"""

# Both repairs end here, after a CTE `extra(user_id, batch, detail)` of what
# the record keeps beyond the batch's size, error and time.
_RECORD_REPAIR = """recorded AS (
    INSERT INTO operator_actions (bucket, user_id, actor, action, outbox_batch, detail)
    SELECT t.bucket, t.user_id, %(actor)s, %(action)s, t.batch,
           jsonb_build_object('messages', t.messages, 'error', t.error,
                              'failed_at', t.failed_at) || x.detail
      FROM target t JOIN extra x ON x.user_id = t.user_id AND x.batch = t.batch
)
SELECT user_id AS "user", batch, messages, error, failed_at FROM target ORDER BY user_id, batch
"""

# Retry: the batch is held again under its id and key; the user's delivery is
# due now, and the batch goes before the user's newer messages.
RETRY_FAILED = f"""
WITH clock AS (
    SELECT {NOW} AS now
), {_FAILED_BATCHES}, unparked AS (
    UPDATE outbox o SET failed_at = NULL, error = NULL
      FROM target t
     WHERE o.bucket = ANY(%(buckets)s::int[]) AND o.user_id = t.user_id AND o.batch = t.batch
       AND o.sent_at IS NULL
), due AS (
    UPDATE deliveries d SET due_at = least(d.due_at, clock.now)
      FROM clock
     WHERE d.bucket = ANY(%(buckets)s::int[]) AND d.user_id IN (SELECT user_id FROM target)
), extra AS (
    SELECT user_id, batch, '{{}}'::jsonb AS detail FROM target
), {_RECORD_REPAIR}"""

# Discard: the batch's rows are deleted, their bodies kept in the record.
DISCARD_FAILED = f"""
WITH {_FAILED_BATCHES}, deleted AS (
    DELETE FROM outbox o USING target t
     WHERE o.bucket = ANY(%(buckets)s::int[]) AND o.user_id = t.user_id AND o.batch = t.batch
       AND o.sent_at IS NULL
 RETURNING o.user_id, o.batch, o.id, o.body
), extra AS (
    SELECT user_id, batch, jsonb_build_object('bodies', jsonb_agg(body ORDER BY id)) AS detail
      FROM deleted GROUP BY user_id, batch
), {_RECORD_REPAIR}"""


def repair_failed(conn: psycopg.Connection[Any], batches: list[int], *, retry: bool, actor: str, now: int | None,
                  groups: Callable[[list[str], Callable[[str], str]], Iterable[list[str]]]
                  ) -> list[dict[str, Any]]:
    """Retry (or discard) the failed batches among `batches`, in the caller's
    transaction, their users locked and repaired in `groups(users, user_of)`
    (Inbox._by_bucket: on Citus one statement per bucket); the batches
    repaired, as they were."""
    users = [u for u, in conn.execute(FAILED_USERS, {"batches": batches}).fetchall()]
    rows = []
    for group in groups(users, lambda user: user):
        conn.execute(LOCK_USERS, users_key(group))
        params = users_key(group, batches=batches, actor=actor, now=now,
                           action="outbox_retry" if retry else "outbox_discard")
        with conn.cursor(row_factory=dict_row) as cur:
            rows += cur.execute(RETRY_FAILED if retry else DISCARD_FAILED, params).fetchall()
    if rows and retry:
        conn.execute(f"SELECT pg_notify('{notify.OUTBOX}', '')")
    return sorted(rows, key=lambda row: (row["user"], row["batch"]))


# Operator view: what the named batches are now (sent, held or failed).
BATCH_STATES = """
SELECT batch, CASE WHEN bool_and(sent_at IS NOT NULL) THEN 'sent'
                   WHEN bool_or(failed_at IS NOT NULL) THEN 'failed' ELSE 'held' END
  FROM outbox WHERE batch = ANY(%(batches)s::bigint[]) GROUP BY batch
"""


def batch_states(conn: psycopg.Connection[Any], batches: list[int]) -> dict[int, str]:
    return dict(conn.execute(BATCH_STATES, {"batches": batches}).fetchall())


# Operator view (spans users unless one is named): parked batches, newest first.
FAILED = """
SELECT o.user_id AS "user", o.batch, count(*) AS messages, min(o.failed_at) AS failed_at,
       min(o.error) AS error, count(*) OVER () AS total
  FROM outbox o
 WHERE o.sent_at IS NULL AND o.failed_at IS NOT NULL
   AND (%(user)s::text IS NULL OR (o.bucket = %(bucket)s AND o.user_id = %(user)s))
 GROUP BY o.user_id, o.batch
 ORDER BY min(o.failed_at) DESC, o.batch DESC
 LIMIT %(limit)s
"""


def failed_batches(conn: psycopg.Connection[Any], user: str | None, limit: int) -> tuple[list[dict[str, Any]], int]:
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(FAILED, user_key(user, limit=limit)).fetchall()
    total = rows[0].pop("total") if rows else 0
    for row in rows[1:]:
        row.pop("total")
    return rows, total


# A user's messages; a held row in a batch that is being retried shows the
# batch's last error.
LIST = """
SELECT o.id, o.body, o.created, o.sent_at, o.failed_at,
       coalesce(o.error, CASE WHEN o.sent_at IS NULL AND o.batch = d.batch
                              THEN d.last_error END) AS error,
       o.batch
  FROM outbox o LEFT JOIN deliveries d ON d.bucket = %(bucket)s AND d.user_id = o.user_id
 WHERE o.bucket = %(bucket)s AND o.user_id = %(user)s ORDER BY o.id
"""


def list_messages(conn: psycopg.Connection[Any], user: str) -> list[OutboxMessage]:
    with conn.cursor(row_factory=class_row(OutboxMessage)) as cur:
        return cur.execute(LIST, user_key(user)).fetchall()
