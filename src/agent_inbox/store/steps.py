"""Durable steps (table `steps`): what a run's `ctx.step` calls returned.

Invariant (fence): a step is recorded only while its run's holder holds the
run's generation, unexpired. The record takes the lease row FOR SHARE, which
conflicts with every lease update (takeover, renewal, release, finish): a
takeover either commits first (the record then sees the new generation and is
refused) or waits for the record to commit (the new run then reads it). So a
step whose `ctx.step` returned is seen by every later attempt, and a stale
run's record is never stored.

Invariant (replay): a record belongs to the exact set of events its run
claimed (`event_ids`, ascending) and to its place in that run (`position`); a
later run reads the records of its own event set only, so a step is never
replayed into a run that claimed other events. A run's successful finish
deletes the records of every set that shares an event with it (FORGET, also
as a CTE of store/inbox.py's FINISH): none of those sets can be claimed whole
again.

On Citus every statement here names one user or one bucket's users; the
batched record and load are sent once per bucket (backend/citus/statements.py's rule:
one node's transaction each).
"""


from collections.abc import Iterable
from typing import Any

import psycopg

from agent_inbox.records import RecordedStep, StepRecord
from agent_inbox.store import lease
from agent_inbox.store.clock import NOW
from agent_inbox.store.keys import user_key, users_key


def events_key(event_ids: Iterable[int]) -> str:
    """An event set as the statements below take it: ascending ids, comma-joined."""
    return ",".join(str(i) for i in sorted(event_ids))


# Many runs' records in one statement: each stored only if its run's lease is
# held by its holder in its generation, unexpired (the lease rows taken FOR
# SHARE in user order, as LOCK_MANY takes them FOR UPDATE, so the two never
# deadlock). A record whose place is already taken is not stored (it cannot
# happen to a run that read its records first; refused rather than overwritten).
# The (user, gen, position) of each record stored.
RECORD = f"""
WITH clock AS (
    SELECT {NOW} AS now
), rec AS (
    SELECT * FROM unnest(%(users)s::text[], %(holders)s::text[], %(gens)s::bigint[],
                         %(events)s::text[], %(positions)s::int[], %(names)s::text[],
                         %(occurrences)s::int[], %(results)s::text[])
                  AS r(user_id, holder, gen, events, position, name, occurrence, result)
), held AS (
    SELECT l.bucket, l.user_id, l.gen FROM leases l, clock
     WHERE l.bucket = ANY(%(buckets)s::int[]) AND l.user_id = ANY(%(users)s::text[])
       AND EXISTS (SELECT 1 FROM rec
                    WHERE rec.user_id = l.user_id
                      AND {lease.fenced("rec.holder", "rec.gen", "clock.now")})
     ORDER BY l.user_id
       FOR SHARE OF l
)
INSERT INTO steps (bucket, user_id, event_ids, position, name, occurrence, result, holder, gen,
                   recorded_at)
SELECT h.bucket, r.user_id, string_to_array(r.events, ',')::bigint[], r.position, r.name,
       r.occurrence,
       r.result::jsonb, r.holder, r.gen, clock.now
  FROM rec r JOIN held h ON h.user_id = r.user_id AND h.gen = r.gen, clock
    ON CONFLICT ON CONSTRAINT uq_steps_user_id_event_ids_position DO NOTHING
RETURNING user_id, gen, position
"""


def record(conn: psycopg.Connection[Any], records: list[StepRecord], now: int | None) -> set[tuple[str, int, int]]:
    """The (user, gen, position) of the records stored; the others were refused."""
    params = {"users": [], "holders": [], "gens": [], "events": [], "positions": [],
              "names": [], "occurrences": [], "results": [], "now": now,
              "buckets": users_key(r.user for r in records)["buckets"]}
    for r in records:
        for key, value in (("users", r.user), ("holders", r.holder), ("gens", r.gen),
                           ("events", events_key(r.event_ids)), ("positions", r.position),
                           ("names", r.name), ("occurrences", r.occurrence),
                           ("results", r.result)):
            params[key].append(value)
    return {tuple(row) for row in conn.execute(RECORD, params).fetchall()}


# Many runs' recorded steps in one read: for each (user, event set), its
# records in order. Reads only.
RECORDED = """
SELECT k.n, s.position, s.name, s.occurrence, s.result
  FROM unnest(%(users)s::text[], %(events)s::text[]) WITH ORDINALITY AS k(user_id, events, n)
  JOIN steps s ON s.bucket = ANY(%(buckets)s::int[]) AND s.user_id = k.user_id
               AND s.event_ids = string_to_array(k.events, ',')::bigint[]
 ORDER BY k.n, s.position
"""


def recorded(conn: psycopg.Connection[Any], runs: list[tuple[str, tuple[int, ...]]]) -> list[list[RecordedStep]]:
    """For each (user, event ids), the steps recorded for exactly those events."""
    answers: list[list[RecordedStep]] = [[] for _ in runs]
    params = users_key([user for user, _ in runs], events=[events_key(ids) for _, ids in runs])
    for n, position, name, occurrence, result in conn.execute(RECORDED, params).fetchall():
        answers[n - 1].append(RecordedStep(position, name, occurrence, result))
    return answers


# A successful finish's cleanup, for one user: the records of every event set
# that shares an event with the run's (in the finish's transaction, after its
# fence said yes). store/inbox.py's FINISH does the same as a CTE.
FORGET = """
DELETE FROM steps s
 WHERE s.bucket = %(bucket)s AND s.user_id = %(user)s AND s.event_ids && %(ids)s::bigint[]
"""

# Operator view: one user's records, by event set and place (the first `limit`).
LIST = """
SELECT s.position, s.name, s.occurrence, s.result, s.event_ids, s.holder, s.gen, s.recorded_at
  FROM steps s
 WHERE s.bucket = %(bucket)s AND s.user_id = %(user)s
 ORDER BY s.event_ids, s.position
 LIMIT %(limit)s
"""


def list_steps(conn: psycopg.Connection[Any], user: str, limit: int = 1000) -> list[RecordedStep]:
    return [RecordedStep(position, name, occurrence, result, tuple(ids), holder, gen, at)
            for position, name, occurrence, result, ids, holder, gen, at
            in conn.execute(LIST, user_key(user, limit=limit)).fetchall()]
