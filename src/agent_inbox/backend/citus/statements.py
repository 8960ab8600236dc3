"""The Citus code path: every statement here is one router query (one shard,
one node, planned and run there in one piece, with one snapshot), and every
transaction it makes is on one node. The take's and the finish's statements
run inside functions on the bucket's node (backend/citus/functions.py: one call each);
the others are sent from the coordinator.

Citus runs a statement in one piece only if every distributed table it
touches is filtered by one bucket and it holds no INSERT ... SELECT (run in
steps through the coordinator, each step with a snapshot of its own) and no
UPDATE ... RETURNING read by later steps (which Citus 13.2 plans but fails to
execute). Where a plain statement is of that kind, the same rules are kept
here in separate statements, in an order that keeps the invariant under READ
COMMITTED (each statement sees at least what the one before it saw). Inserts
are single rows (`VALUES`). Which bucket a scan looks at is the caller's (the
buckets with due work, longest waiting first, found by a read of each node's
shards that locks nothing, citus_nodes.per_node). A worker node that does not
answer holds up only its own users: the reads skip it, and every transaction
here is about one bucket, on one node.

* **take** (one bucket, one transaction; TAKE_WORK; its steps after STALE
  are backend/citus/functions.py's): PICK locks, in wake order, the free leases of
  users with claimable work (SKIP LOCKED); STALE locks the leases of the users
  whose due wakes PICK read past and cannot take, and says when each is next
  due; then the picked leases are taken, exactly the wakes PICK and STALE read
  are deleted (by id: a wake inserted since, by an ingest or a release, is not
  theirs to delete), the next wakes are inserted, and each taken user's events
  are claimed.
* **finish** (one run, one transaction, its lease row locked first;
  backend/citus/functions.py's FINISH): the run's fence is checked and, if it holds,
  its events are closed, the lease released and the user's wakes deleted;
  then its messages, the delivery due time and its timers; then, in a later
  snapshot, a wake now if the run failed or other events are open.
  An ingest that commits between the two keeps its own wake (the deletion's
  snapshot did not show it) and one that committed before is seen by the
  later check, so no work is left without a wake.
* **release and give-back** (RELEASE, HAND_BACK): per user, in user order:
  the lease expired if this holder still holds it in that generation (the
  fence), then its events marked (release) or their claims undone
  (give-back), then a wake now.
* **dead events' repairs** (store/admin.py's REQUEUE, DISCARD): per user, the
  dead rows locked, changed, recorded.
* **delivery**: a dispatcher claims due users one bucket at a time
  (LOCK_DUE_IN_BUCKET; store/outbox.py's CLAIM is then about users of one
  bucket and routed as it is).
* **timers** (FIRE_DUE): a scheduler takes one bucket's due timers at a time
  (locked, SKIP LOCKED) and fires them one by one (store/timers.py's
  fire_each), then does the trigger's work for their users.
* **approvals**: the answer reads the request and its deadline, then inserts
  under the request's key: whichever of the answer and the expiry is inserted
  first still stands, by the key.
"""

import json
from typing import Any

import psycopg

from agent_inbox.backend.citus import nodes as citus_nodes
from agent_inbox import db, notify
from agent_inbox.db import Queries, Query
from agent_inbox.records import StepRecord
from agent_inbox.store import admin, approvals, inbox, lease, one, outbox, pauses, steps, timers
from agent_inbox.store.clock import DB_CLOCK, NOW
from agent_inbox.store.inbox import LOOK
from agent_inbox.store.keys import user_key

# An open event of the user `w.user_id` (in the bucket) is claimable now.
_CLAIMABLE = inbox.claimable("w.user_id", NOW, bucket="%(bucket)s")

# Buckets with a due wake, and their oldest; read per node (citus_nodes.per_node).
# Spans that node's shards; reads only, locks nothing. None while the fleet is
# paused (store/pauses.py; its reference table has a copy on every node): the
# take calls no bucket's function then. The functions cannot read it
# themselves (a delegated function's statements must each name its bucket),
# so a take whose DUE_BUCKETS read ran before the pause committed still takes.
DUE_BUCKETS = f"""
SELECT bucket, min(at) FROM wakes
 WHERE bucket = ANY(%(buckets)s) AND at <= greatest({NOW}, {DB_CLOCK})
   AND {pauses.FLEET_RUNS}
 GROUP BY bucket
"""

# TAKE_WORK's pick, in one bucket: due wakes in order, each user's free lease
# locked if it has claimable work, skipping leases other takes hold.
PICK = f"""
SELECT w.user_id, w.at, w.id
  FROM wakes w
  CROSS JOIN LATERAL (
       SELECT 1 FROM leases l
        WHERE l.bucket = %(bucket)s AND l.user_id = w.user_id AND l.until < {NOW}
          AND {pauses.NOT_PAUSED} AND {_CLAIMABLE}
        LIMIT 1
          FOR UPDATE OF l SKIP LOCKED) l
 WHERE w.bucket = %(bucket)s AND w.at <= greatest({NOW}, {DB_CLOCK})
 ORDER BY w.at, w.id
 LIMIT %(users)s
"""

# TAKE_WORK's stale: among the first LOOK due wakes before `(at, id)` (how far
# PICK read), those whose user cannot be taken, each lease locked, and when the
# user is next due: a held lease at its end, else its next retry, parked if
# the user is paused (store/pauses.py; none: no open event, no wake).
STALE = f"""
SELECT w.user_id, w.id, l.next_at
  FROM (SELECT user_id, at, id FROM wakes
         WHERE bucket = %(bucket)s AND (at, id) < (%(at)s, %(id)s)
         ORDER BY at, id LIMIT {LOOK}) w
  CROSS JOIN LATERAL (
       SELECT CASE WHEN l.until >= {NOW} THEN l.until + 1
                   ELSE (SELECT {pauses.parked_or("min(e.available_at)", "l.paused_at")}
                           FROM events e
                          WHERE e.bucket = %(bucket)s AND e.user_id = w.user_id
                            AND {inbox.OPEN}) END AS next_at
         FROM leases l
        WHERE l.bucket = %(bucket)s AND l.user_id = w.user_id
          AND NOT (l.until < {NOW} AND {pauses.NOT_PAUSED} AND {_CLAIMABLE})
        LIMIT 1
          FOR UPDATE OF l SKIP LOCKED) l
"""

WAKE = "INSERT INTO wakes (bucket, user_id, at) VALUES (%(bucket)s, %(user)s, %(at)s)"

def _due(conn: psycopg.Connection[Any], nodes: citus_nodes.NodeMap, statement: str, now: int | None,
         pools: citus_nodes.NodePools | None = None) -> list[int]:
    """The buckets `statement` (bucket, its oldest due time) finds on every node
    that answers (asked through the coordinator, or with `pools` each node
    itself), the longest waiting first: a node that does not answer holds up
    its own users only."""
    rows = citus_nodes.per_node(conn, nodes, statement, {"now": now}, pools)
    return [b for b, _ in sorted(rows, key=lambda row: (row[1], row[0]))]


def due_buckets(conn: psycopg.Connection[Any], nodes: citus_nodes.NodeMap, now: int | None,
                pools: citus_nodes.NodePools | None = None) -> list[int]:
    return _due(conn, nodes, DUE_BUCKETS, now, pools)


QUEUE = f"""
INSERT INTO outbox (bucket, user_id, body, urgent, created, traceparent)
VALUES (%(bucket)s, %(user)s, %(body)s, %(urgent)s, {NOW}, %(traceparent)s)
"""

# FINISH's `paced`, for one user.
PACED = f"""
INSERT INTO deliveries AS d (bucket, user_id, due_at) VALUES (%(bucket)s, %(user)s, {NOW})
    {outbox.DUE_NOW}
"""

# --- delivery ------------------------------------------------------------------

# Buckets with a user whose delivery is due, and the oldest due time; read
# per node. Reads only, locks nothing.
DUE_DELIVERY_BUCKETS = f"""
SELECT bucket, min(due_at) FROM deliveries
 WHERE bucket = ANY(%(buckets)s) AND due_at <= {NOW} AND {pauses.FLEET_RUNS}
 GROUP BY bucket
"""

# store/outbox.py's LOCK_DUE in one bucket.
LOCK_DUE_IN_BUCKET = f"""
SELECT user_id FROM deliveries
 WHERE bucket = %(bucket)s AND due_at <= {NOW} AND {pauses.FLEET_RUNS}
 ORDER BY due_at
 LIMIT %(users)s
   FOR UPDATE SKIP LOCKED
"""


def due_delivery_buckets(conn: psycopg.Connection[Any], nodes: citus_nodes.NodeMap, now: int | None,
                         pools: citus_nodes.NodePools | None = None) -> list[int]:
    return _due(conn, nodes, DUE_DELIVERY_BUCKETS, now, pools)


def lock_due_deliveries(conn: psycopg.Connection[Any], bucket: int, limit: int, now: int | None) -> list[str]:
    params = {"bucket": bucket, "users": limit, "now": now}
    return [u for u, in conn.execute(LOCK_DUE_IN_BUCKET, params).fetchall()]


# --- timers --------------------------------------------------------------------

# Buckets with a due timer, and the oldest due time; read per node. Reads only.
DUE_TIMER_BUCKETS = f"""
SELECT bucket, min(due) FROM timers
 WHERE bucket = ANY(%(buckets)s) AND NOT done AND due <= {NOW}
 GROUP BY bucket
"""

# One bucket's due timers, oldest first, locked, skipping those another
# scheduler holds.
RIPE_IN_BUCKET = f"""
WITH clock AS (SELECT {NOW} AS now)
SELECT {timers.RIPE_COLUMNS}
  FROM timers t, clock
 WHERE t.bucket = %(bucket)s AND NOT t.done AND t.due <= clock.now
 ORDER BY t.due LIMIT %(limit)s
   FOR UPDATE OF t SKIP LOCKED
"""


def due_timer_buckets(conn: psycopg.Connection[Any], nodes: citus_nodes.NodeMap, now: int | None,
                      pools: citus_nodes.NodePools | None = None) -> list[int]:
    return _due(conn, nodes, DUE_TIMER_BUCKETS, now, pools)


def fire_timers(conn: psycopg.Connection[Any], bucket: int, now: int | None, limit: int) -> timers.Batch:
    """One batch of a bucket's due timers, in the caller's transaction; the
    users whose timers fired get their lease rows and wakes (events_inserted)."""
    ripe = conn.execute(RIPE_IN_BUCKET, {"bucket": bucket, "now": now, "limit": limit}).fetchall()
    batch = timers.fire_each(conn, now, ripe)
    parked = {(user, timer_id) for user, timer_id, _ in batch.parked}
    db.run(conn, events_inserted([row[0] for row in ripe if (row[0], row[1]) not in parked]))
    return batch


# --- approvals -----------------------------------------------------------------

REQUEST = f"""
SELECT {NOW} >= due, payload FROM timers
 WHERE bucket = %(bucket)s AND user_id = %(user)s AND timer_id = %(timer_id)s
"""


def answer(user: str, request_id: str, answer: str, now: int | None) -> Queries[str]:
    """store/approvals.py's answer, in steps: the request and whether its
    deadline has passed, then the answer (or the expiry) under its key."""
    timer_id = approvals.expiry_timer_id(request_id)
    while True:
        request = yield Query(REQUEST, user_key(user, timer_id=timer_id, now=now))
        if not request:
            return "unknown"
        [(expired, expiry)] = request
        payload = expiry if expired else {"approval": request_id, "answer": answer}
        if (yield from inbox.insert(user, "approval", request_id, json.dumps(payload))):
            yield from events_inserted([user])
        standing = yield from approvals.standing_answer(user, request_id)
        if standing is not None:  # else an operator deleted it in between: store again
            return standing


# --- release and give-back -------------------------------------------------------

# store/lease.py's HELD_BY, read per node.
HELD_BY = f"""
SELECT l.user_id, l.gen FROM leases l
 WHERE l.bucket = ANY(%(buckets)s) AND l.holder = %(holder)s AND l.until >= {NOW}
"""


def held_by(conn: psycopg.Connection[Any], nodes: citus_nodes.NodeMap, holder: str, now: int | None,
            pools: citus_nodes.NodePools | None = None) -> list[tuple[str, int]]:
    """The (user, gen) of the leases `holder` holds, on every node that answers."""
    params = {"holder": holder, "now": now}
    return [tuple(row) for row in citus_nodes.per_node(conn, nodes, HELD_BY, params, pools)]


# The fence of a release or a give-back: the lease expired now if `holder`
# still holds it in `gen`, unexpired; the clock if it did.
EXPIRE = f"""
WITH clock AS (SELECT {NOW} AS now)
UPDATE leases l SET until = clock.now - 1
  FROM clock
 WHERE l.bucket = %(bucket)s AND l.user_id = %(user)s
   AND {lease.fenced("%(holder)s", "%(gen)s", "clock.now")}
RETURNING clock.now
"""

# store/lease.py's RELEASE `marked`, for one user.
MARK_RELEASED = f"""
UPDATE events e
   SET {lease.released_events("%(at)s")}
 WHERE e.bucket = %(bucket)s AND e.user_id = %(user)s AND {lease.claimed_by("%(gen)s")}
"""

# HAND_BACK's UNDO_CLAIMS, for one user.
UNDO_CLAIM = f"""
UPDATE events e
   SET {lease.undone_claims("%(unfinished)s")}
 WHERE e.bucket = %(bucket)s AND e.user_id = %(user)s AND {lease.claimed_by("%(gen)s")}
"""


def _expire(conn: psycopg.Connection[Any], user: str, holder: str, gen: int, now: int | None) -> dict[str, Any] | None:
    params = user_key(user, holder=holder, gen=gen, now=now)
    row = conn.execute(EXPIRE, params).fetchone()
    return None if row is None else {**params, "at": row[0]}


def release(conn: psycopg.Connection[Any], holder: str, keys: list[tuple[str, int]], now: int | None, *,
            error: str | None = None, at_once: bool = True, spare: bool = False) -> list[str]:
    """store/lease.py's release, in the caller's transaction; the users released."""
    released = []
    for user, gen in sorted(keys):
        params = _expire(conn, user, holder, gen, now)
        if params is not None:
            conn.execute(MARK_RELEASED, {**params, "error": error, "at_once": at_once,
                                         "spare": spare})
            conn.execute(WAKE, params)
            released.append(user)
    return released


def hand_back(conn: psycopg.Connection[Any], runs: list[tuple[str, str, int, bool]], now: int | None) -> list[str]:
    """store/lease.py's HAND_BACK for (user, holder, gen, unfinished) runs, in
    the caller's transaction; the users given back."""
    given = []
    for user, holder, gen, unfinished in sorted(runs):
        params = _expire(conn, user, holder, gen, now)
        if params is not None:
            conn.execute(UNDO_CLAIM, {**params, "unfinished": unfinished})
            conn.execute(WAKE, params)
            given.append(user)
    return given


# --- dead events' repairs --------------------------------------------------------

# The named rows of one user that are dead, locked in id order (a row that
# stopped being dead before the lock was granted drops out on the re-check).
DEAD_ROWS = """
SELECT e.id, e.source, e.source_id, e.attempts, e.error, e.payload FROM events e
 WHERE e.bucket = %(bucket)s AND e.user_id = %(user)s AND e.id = ANY(%(ids)s::bigint[])
   AND e.status = 'dead'
 ORDER BY e.id
   FOR UPDATE
"""

REQUEUE_ROWS = f"""
WITH clock AS (SELECT {NOW} AS now)
UPDATE events e SET status = 'pending', attempts = 0, error = NULL, available_at = clock.now
  FROM clock
 WHERE e.bucket = %(bucket)s AND e.user_id = %(user)s AND e.id = ANY(%(ids)s::bigint[])
RETURNING clock.now
"""

DISCARD_ROWS = """
DELETE FROM events e
 WHERE e.bucket = %(bucket)s AND e.user_id = %(user)s AND e.id = ANY(%(ids)s::bigint[])
"""

RECORD_REPAIR = f"""
INSERT INTO operator_actions (bucket, user_id, at, actor, action, event_id, detail)
VALUES (%(bucket)s, %(user)s, coalesce(%(at)s::bigint, {DB_CLOCK}), %(actor)s, %(action)s,
        %(event_id)s, %(detail)s::jsonb)
"""


def repair_dead(conn: psycopg.Connection[Any], pairs: list[tuple[str, int]], *, requeue: bool, actor: str,
                now: int | None) -> list[dict[str, Any]]:
    """store/admin.py's requeue (or discard) of the dead events among (user, id)
    pairs, in the caller's transaction, with the same records and answers."""
    ids_of: dict[str, list[int]] = {}
    for user, event_id in pairs:
        ids_of.setdefault(user, []).append(event_id)
    done = []
    for user in sorted(ids_of):
        params = user_key(user, ids=ids_of[user])
        dead = conn.execute(DEAD_ROWS, params).fetchall()
        if not dead:
            continue
        params["ids"] = [row[0] for row in dead]
        at = None
        if requeue:
            at = one(conn.execute(REQUEUE_ROWS, {**params, "now": now}))[0]
            conn.execute(WAKE, {**params, "at": at})
        else:
            conn.execute(DISCARD_ROWS, params)
        conn.execute(steps.FORGET, params)  # a requeued event starts with no steps
        shape = admin.REQUEUE_DETAIL if requeue else admin.DISCARD_DETAIL
        for event_id, source, source_id, attempts, error, payload in dead:
            columns = {"source": source, "source_id": source_id, "attempts": attempts,
                       "error": error, "payload": payload}
            detail = {key: columns[column] for key, column in shape.items()}
            row = {"user": user, "id": event_id,
                   **{key: value for key, value in detail.items() if key != "payload"}}
            conn.execute(RECORD_REPAIR, {**params, "at": at, "actor": actor,
                                         "action": "requeue" if requeue else "discard",
                                         "event_id": event_id, "detail": json.dumps(detail)})
            done.append(row)
    if done and requeue:
        conn.execute(admin.WAKE_WORKERS)
    return done


# --- durable steps -----------------------------------------------------------

# store/steps.py's RECORD for one record, in one bucket's transaction: the
# run's lease row FOR SHARE if this holder holds it in this generation,
# unexpired (the fence), then the record.
STEP_FENCE = f"""
SELECT 1 FROM leases l
 WHERE l.bucket = %(bucket)s AND l.user_id = %(user)s
   AND {lease.fenced("%(holder)s", "%(gen)s", NOW)}
   FOR SHARE
"""

STEP_INSERT = """
INSERT INTO steps (bucket, user_id, event_ids, position, name, occurrence, result, holder, gen)
VALUES (%(bucket)s, %(user)s, %(event_ids)s::bigint[], %(position)s, %(name)s, %(occurrence)s,
        %(result)s::jsonb, %(holder)s, %(gen)s)
    ON CONFLICT ON CONSTRAINT uq_steps_user_id_event_ids_position DO NOTHING
RETURNING 1
"""


def record_steps(conn: psycopg.Connection[Any], records: list[StepRecord], now: int | None) -> list[bool]:
    """Each record stored (True) or refused by its fence, in the caller's
    transaction; the records are one bucket's, in user order (lease locks)."""
    stored = []
    for r in records:
        params = user_key(r.user, holder=r.holder, gen=r.gen, now=now,
                          event_ids=list(r.event_ids), position=r.position, name=r.name,
                          occurrence=r.occurrence, result=r.result)
        held = conn.execute(STEP_FENCE, params).fetchone() is not None
        stored.append(held and conn.execute(STEP_INSERT, params).fetchone() is not None)
    return stored


# What the events_inserted trigger does on plain PostgreSQL, done on Citus by
# the code that inserted events for one user, in the same transaction (one
# node): the user's lease row (an expired generation 0, if none yet) and a wake
# at the arrival; then the notification, sent by the client's own session on
# the coordinator (a NOTIFY on a worker node reaches no listener).
EVENTS_INSERTED = (lease.CREATE_EXPIRED, f"""
INSERT INTO wakes (bucket, user_id, at) VALUES (%(bucket)s, %(user)s, {DB_CLOCK})
""")


def events_inserted(users: list[str]) -> Queries[None]:
    """The trigger's work for `users` (each one routed), then the NOTIFY."""
    lease_row, wake = EVENTS_INSERTED
    for user in sorted(set(users)):
        yield Query(lease_row, user_key(user))
        yield Query(wake, user_key(user))
    if users:
        yield Query("SELECT pg_notify(%s, '')", (notify.WORK,))
