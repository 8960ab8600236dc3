"""The inbox (table `events`): each source key stored once, claimed in batches.

Invariant 1: `(user_id, source, source_id)` is unique, so every redelivery of an
event is a no-op. Invariant 4: attempts are counted when an event is claimed (a
worker that crashes never records a failure, yet its event still runs out of
attempts), a retried event is claimed alone, and after max_attempts claims an
event is parked as 'dead', where operators can see it.
"""

from psycopg.rows import class_row

from agent_inbox.records import Event
from agent_inbox.store import lease
from agent_inbox.store.clock import NOW

EVENT_COLUMNS = (
    'id, user_id AS "user", source, source_id, payload, status, attempts, error, claim_gen, created_at'
)

# Invariant 1: ON CONFLICT turns a redelivery into a no-op.
INSERT = """
INSERT INTO events (user_id, source, source_id, payload)
VALUES (%(user)s, %(source)s, %(source_id)s, %(payload)s::jsonb)
ON CONFLICT (user_id, source, source_id) DO NOTHING
RETURNING id
"""


def insert(conn, user: str, source: str, source_id: str, payload_json: str) -> bool:
    params = {"user": user, "source": source, "source_id": source_id, "payload": payload_json}
    return conn.execute(INSERT, params).fetchone() is not None


# Invariant 4, in one statement, for a caller holding the lease row lock:
#   rows left running by an older generation count as pending again;
#   open rows with attempts >= max_attempts become dead;
#   the oldest retry (attempts > 0) is claimed alone, else every pending row;
#   attempts + 1 and claim_gen are stamped at claim.
# Rows whose state does not change are not written.
CLAIM = f"""
WITH open AS (
    SELECT id, status, attempts, attempts >= %(max_attempts)s AS exhausted
      FROM events
     WHERE user_id = %(user)s
       AND (status = 'pending' OR (status = 'running' AND claim_gen < %(gen)s))
       AND {lease.FENCE}
), retry AS (
    SELECT min(id) AS id FROM open WHERE NOT exhausted AND attempts > 0
), plan AS (
    SELECT o.id, o.status AS old_status,
           CASE WHEN o.exhausted THEN 'dead'
                WHEN r.id IS NULL OR o.id = r.id THEN 'running'
                ELSE 'pending' END AS status
      FROM open o CROSS JOIN retry r
), changed AS (
    UPDATE events e
       SET status = p.status,
           attempts = e.attempts + (p.status = 'running')::int,
           claim_gen = CASE WHEN p.status = 'running' THEN %(gen)s ELSE e.claim_gen END,
           error = CASE WHEN p.status = 'dead' THEN 'too many attempts' ELSE e.error END
      FROM plan p
     WHERE e.user_id = %(user)s AND e.id = p.id
       AND (p.status <> 'pending' OR p.old_status <> 'pending')
 RETURNING e.*
)
SELECT {EVENT_COLUMNS} FROM changed WHERE status = 'running' ORDER BY id
"""


def claim(conn, user: str, holder: str, gen: int, max_attempts: int, now: int | None) -> list[Event]:
    params = {"user": user, "holder": holder, "gen": gen, "max_attempts": max_attempts, "now": now}
    with conn.cursor(row_factory=class_row(Event)) as cur:
        return cur.execute(CLAIM, params).fetchall()


# Invariant 3: the outcome is written only if the fence holds and every event
# named is still running under this generation; otherwise nothing is written.
# Messages are queued by the same statement, so they commit with the outcome.
FINISH = f"""
WITH mine AS (
    SELECT id FROM events
     WHERE user_id = %(user)s AND id = ANY(%(ids)s::bigint[])
       AND status = 'running' AND claim_gen = %(gen)s
), verdict AS (
    SELECT {lease.FENCE} AND (SELECT count(*) FROM mine) = cardinality(%(ids)s::bigint[]) AS ok
), closed AS (
    UPDATE events e SET status = %(status)s, error = %(error)s
      FROM mine, verdict
     WHERE verdict.ok AND e.user_id = %(user)s AND e.id = mine.id
), queued AS (
    INSERT INTO outbox (user_id, body, created)
    SELECT %(user)s, m.body, {NOW}
      FROM unnest(%(messages)s::text[]) WITH ORDINALITY AS m(body, n), verdict
     WHERE verdict.ok
     ORDER BY m.n
)
SELECT ok FROM verdict
"""


def finish(conn, user: str, holder: str, gen: int, ids: list[int], messages: list[str],
           error: str | None, now: int | None) -> bool:
    params = {
        "user": user, "holder": holder, "gen": gen, "ids": ids, "now": now,
        "status": "pending" if error is not None else "done", "error": error,
        "messages": [] if error is not None else messages,
    }
    return conn.execute(FINISH, params).fetchone()[0]


# Operator view of one user's events.
LIST = f"""
SELECT {EVENT_COLUMNS} FROM events
 WHERE user_id = %(user)s AND (%(status)s::text IS NULL OR status = %(status)s)
 ORDER BY id
"""


def list_events(conn, user: str, status: str | None) -> list[Event]:
    with conn.cursor(row_factory=class_row(Event)) as cur:
        return cur.execute(LIST, {"user": user, "status": status}).fetchall()
