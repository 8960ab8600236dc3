"""The inbox (table `events`): each source key stored once, claimed in batches.

Invariant 1: `(user_id, source, source_id)` is unique, so every redelivery of an
event is a no-op. Invariant 4: attempts are counted when an event is claimed (a
worker that crashes never records a failure, yet its event still runs out of
attempts), a retried event is claimed alone, and after max_attempts claims an
event is parked as 'dead', where operators can see it.
"""

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import class_row

from agent_inbox.db import Queries, Query
from agent_inbox.records import ClaimPolicy, Event
from agent_inbox import notify
from agent_inbox.store import lease, pauses, steps, wake_rings
from agent_inbox.store.memory import REPLACES as MEMORY_REPLACES
from agent_inbox.store.outbox import DUE_NOW as DELIVERY_DUE_NOW
from agent_inbox.store.clock import DB_CLOCK, NOW
from agent_inbox.store.keys import user_key

EVENT_COLUMNS = (
    'id, user_id AS "user", source, source_id, payload, status, attempts, error, claim_gen,'
    ' created_at, available_at, claimed_at, kind, traceparent'
)

# Invariant 1: ON CONFLICT turns a redelivery into a no-op.
INSERT = """
INSERT INTO events (bucket, user_id, source, source_id, payload, kind, traceparent)
VALUES (%(bucket)s, %(user)s, %(source)s, %(source_id)s, %(payload)s::jsonb, %(kind)s,
        %(traceparent)s)
ON CONFLICT ON CONSTRAINT uq_events_user_id_source_source_id DO NOTHING
RETURNING id
"""


def insert(user: str, source: str, source_id: str, payload_json: str,
           kind: str | None = None, traceparent: str | None = None) -> Queries[bool]:
    """True if stored (False: a duplicate)."""
    params = user_key(user, source=source, source_id=source_id, payload=payload_json, kind=kind,
                      traceparent=traceparent)
    return bool((yield Query(INSERT, params)))


# Invariant 1 for a batch: one statement for many events; a key repeated inside
# the batch is stored once (its first occurrence), like any redelivery. Rows go
# in user order, each user's in arrival order (what its runs see): concurrent
# batches over the same users take their key locks in one order, so they wait
# for each other rather than deadlock (unless one user's keys arrive in opposite
# orders, which the caller retries).
INSERT_MANY = """
INSERT INTO events (bucket, user_id, source, source_id, payload, kind, traceparent)
SELECT agent_inbox_bucket(b.user_id), b.user_id, b.source, b.source_id, b.payload::jsonb, b.kind,
       b.traceparent
  FROM unnest(%(users)s::text[], %(sources)s::text[], %(source_ids)s::text[], %(payloads)s::text[],
              %(kinds)s::text[], %(traceparents)s::text[])
       WITH ORDINALITY AS b(user_id, source, source_id, payload, kind, traceparent, n)
 ORDER BY b.user_id, b.n
    ON CONFLICT ON CONSTRAINT uq_events_user_id_source_source_id DO NOTHING
RETURNING user_id, source, source_id
"""


def insert_many(rows: list[tuple[Any, ...]]) -> Queries[list[bool]]:
    """rows are (user, source, source_id, payload_json, kind[, traceparent]);
    True where stored."""
    rows = [(*row, None)[:6] for row in rows]
    columns = list(zip(*rows)) if rows else [()] * 6
    params = dict(zip(("users", "sources", "source_ids", "payloads", "kinds", "traceparents"),
                      map(list, columns)))
    stored = {tuple(r) for r in (yield Query(INSERT_MANY, params))}
    result = []
    for user, source, source_id, *_ in rows:
        key = (user, source, source_id)
        result.append(key in stored)
        stored.discard(key)  # a repeat inside the batch is a duplicate
    return result


# An event not yet handled: pending, or running under a claim whose run has not
# finished (ix_events_open's predicate, schema/model.py: its `outcome` is NULL).
OPEN = "e.outcome IS NULL"


def carried(user: str, rings: str | None = wake_rings.LIVE, bucket: str | None = None) -> str:
    """The lowest `from_id` among the wakes of `user` this statement's snapshot
    shows (SQL; NULL if none names an event): what a statement that deletes
    those wakes carries into the wake or the mark it leaves. Read in the
    `rings` (SQL: the live rings, store/wake_rings.py), or in every row if
    None: a statement sent on Citus too, where `wakes` is one table, and
    names the user's `bucket` (SQL)."""
    live = f" AND x.ring IN ({rings})" if rings else ""
    in_bucket = f"x.bucket = {bucket} AND " if bucket else ""
    return f"(SELECT min(x.from_id) FROM wakes x WHERE {in_bucket}x.user_id = {user}{live})"


def low_water(user: str, lease: str = "l", rings: str | None = wake_rings.LIVE,
              bucket: str | None = None) -> str:
    """The low-water mark of `user` (SQL, `lease` its lease row): no open event
    of the user has a lower id (migration 0010). The lease's `open_from`,
    raised only by a finish that releases the lease, or lower where a wake
    names an event below it (one inserted, or requeued, after the finish
    raised it; a mark carried over from wakes a take deleted). A wake commits
    with the events it names, so a statement that does not see the wake does
    not see the events either. Every scan of a user's open events on the
    set-based run path starts here, past the dead row versions of the user's
    finished events that a held xmin horizon keeps in ix_events_open.
    `rings`, `bucket`: as carried's."""
    return f"least({lease}.open_from, {carried(user, rings, bucket)})"


# Invariant 4, as CTEs that follow a CTE `run(user_id, gen, now, from_id)`
# naming the users whose leases the caller holds (locked), the generation
# claiming each and where its open events start (its `low_water`; one row per
# user; each user's claim is made on its own):
#   rows left running by an older generation count as pending (and are left
#   running until claimed, so the claim that retries them sees them unfinished);
#   open rows with attempts >= max_attempts become dead;
#   the oldest due retry (attempts > 0, available_at <= now) is claimed alone,
#   else the oldest max_batch fresh events (attempts = 0), the rest wait for the
#   next run; retries still backing off wait;
#   attempts + 1, claim_gen, claimed_at and the next retry's available_at
#   (exponential backoff from this claim, capped, with jitter drawn in `plan`:
#   Citus refuses a volatile function in an UPDATE) are stamped at claim.
# A claimed row that was still running (its last run ended without a finish: a
# crash, a hang, a lost lease) is `unfinished`: the worker runs such a run in
# quarantine. Rows whose state does not change are not written. TAKE_WORK locks the lease in
# the same statement, after its snapshot was taken: the UPDATE re-checks each row
# against the snapshot's (status, attempts), so a stale row is never claimed.
#
# The claim's shared parts, one spelling for this statement and for the Citus
# take (backend/citus/functions.py), which reads a user's open rows and writes their
# new states in separate single-table statements:
# open_to_claim: the rows a claim in generation `gen` looks at (an event's
# alias `e`); CLAIM_RANKS: what `plan` needs of each (beside `run.now`);
# CLAIM_PLAN: each row's new status, over `open(version, user_id, id, status,
# attempts, gen, now, exhausted, due, fresh_rank)`; claim_set: the columns a
# claim writes, from a row's new status and the claim's generation, time and
# jitter (SQL expressions).


def open_to_claim(gen: str) -> str:
    """The event `e` is one a claim in generation `gen` (an SQL expression)
    looks at: pending, or left running by an older generation."""
    return f"(e.status = 'pending' OR (e.status = 'running' AND e.claim_gen < {gen}))"


CLAIM_RANKS = """e.attempts >= %(max_attempts)s AS exhausted, e.available_at <= run.now AS due,
           row_number() OVER (PARTITION BY e.user_id ORDER BY e.attempts > 0, e.id) AS fresh_rank"""
CLAIM_PLAN = """retry AS (
    SELECT user_id, min(id) AS id FROM open
     WHERE NOT exhausted AND attempts > 0 AND due
     GROUP BY user_id
), plan AS (
    SELECT o.version, o.user_id, o.id, o.gen, o.now, o.status AS old_status,
           o.attempts AS old_attempts, 0.5 + random() / 2 AS jitter,
           CASE WHEN o.exhausted THEN 'dead'
                WHEN r.id IS NOT NULL AND o.id = r.id THEN 'running'
                WHEN r.id IS NULL AND o.attempts = 0 AND o.fresh_rank <= %(max_batch)s
                THEN 'running'
                ELSE 'pending' END AS status
      FROM open o LEFT JOIN retry r ON r.user_id = o.user_id
)"""


def claim_set(status: str, gen: str, now: str, jitter: str) -> str:
    """The SET list of a claim's UPDATE of an event `e` whose new status is
    `status` (see CLAIM_PLAN)."""
    return f"""status = {status},
           attempts = e.attempts + ({status} = 'running')::int,
           claim_gen = CASE WHEN {status} = 'running' THEN {gen} ELSE e.claim_gen END,
           claimed_at = CASE WHEN {status} = 'running' THEN {now} ELSE e.claimed_at END,
           available_at = CASE WHEN {status} = 'running'
                               THEN {now} + floor(least(%(backoff_cap)s::float8,
                                                          %(backoff_base)s * 2 ^ e.attempts)
                                                    * {jitter})::bigint
                               ELSE e.available_at END,
           error = CASE WHEN {status} = 'dead' THEN 'too many attempts' ELSE e.error END"""


def claim_steps(bucket: str | None = None) -> str:
    """The claim's CTEs (see above). Each row the plan read is written again
    by its TID, or, given the users' `bucket` (SQL; a statement about one user
    that Citus runs too, which plans no lookup by TID as a router query), by
    its bucket and key."""
    in_bucket = f"e.bucket = {bucket} AND " if bucket else ""
    again = (f"{in_bucket}e.user_id = p.user_id AND e.id = p.id" if bucket
             else "e.ctid = p.version  -- the row the plan read (found by a TID scan)")
    return f"""
open AS (
    SELECT e.version, e.user_id, e.id, e.status, e.attempts, run.gen, run.now,
           {CLAIM_RANKS}
      FROM run CROSS JOIN LATERAL (  -- each user's open events by index, never a scan of
                                     -- all (OFFSET 0: not flattened into a join)
           SELECT e.ctid AS version, e.* FROM events e
            WHERE {in_bucket}e.user_id = run.user_id AND e.id >= run.from_id
              AND {open_to_claim('run.gen')}
           OFFSET 0) e
), {CLAIM_PLAN}, changed AS (
    UPDATE events e
       SET {claim_set("p.status", "p.gen", "p.now", "p.jitter")}
      FROM plan p
     WHERE {again}
       -- a row left running by an older generation and not claimed now stays as
       -- it is (the claim reads it as pending): it stays `unfinished`
       AND p.status <> 'pending'
       -- re-checked on the newest row version: a row another run changed since
       -- this statement's snapshot (every claim and finish changes its status
       -- or attempts) is left alone, never claimed again
       AND e.status = p.old_status AND e.attempts = p.old_attempts
 RETURNING e.*, p.old_status
), claimed AS (
    SELECT {EVENT_COLUMNS} FROM changed WHERE status = 'running'
)"""


CLAIM_STEPS = claim_steps()

# For a holder that already holds the lease (claim_batch): the fence, then claim,
# nothing while the user or the fleet is paused (store/pauses.py: a holder that
# kept its lease across a pause claims nothing new). Sent on Citus too (routed
# to the user's bucket).
CLAIM = f"""
WITH run AS (
    SELECT l.user_id, l.gen, clock.now,
           {low_water("l.user_id", rings=None, bucket="%(bucket)s")} AS from_id
      FROM leases l, (SELECT {NOW} AS now) clock
     WHERE l.bucket = %(bucket)s AND l.user_id = %(user)s
       AND {lease.fenced("%(holder)s", "%(gen)s", "clock.now")}
       AND {pauses.NOT_PAUSED} AND {pauses.FLEET_RUNS}
), {claim_steps(bucket="%(bucket)s")}
SELECT * FROM claimed ORDER BY id
"""


def send_claim(conn: psycopg.Connection[Any], user: str, holder: str, gen: int, policy: ClaimPolicy,
               now: int | None) -> psycopg.Cursor[Event]:
    """Send CLAIM without reading the events (pipeline mode): `.fetchall()`."""
    params = user_key(user, holder=holder, gen=gen, now=now, **policy.params())
    return conn.cursor(row_factory=class_row(Event)).execute(CLAIM, params)


def claimable(user: str, now: str, *, bucket: str | None = None,
              from_id: str | None = None) -> str:
    """The claim's rule as finding work applies it, written once for both run
    paths: the user `user` has an open event claimable at `now`, a fresh one
    at once, a retry once its backoff is due (SQL expressions; `bucket` names
    the user's bucket where rows are found by it: backend/citus/statements.py; `from_id`
    the user's `low_water` where the run path keeps one: a bound of the index
    scan, so the EXISTS is kept a subplan (OFFSET 0), never made a semi-join
    that filters on it row by row)."""
    in_bucket = f"e.bucket = {bucket} AND " if bucket else ""
    from_mark, subplan = (f" AND e.id >= {from_id}", " OFFSET 0") if from_id else ("", "")
    return (f"EXISTS (SELECT 1 FROM events e WHERE {in_bucket}e.user_id = {user}{from_mark}"
            f" AND {OPEN} AND (e.attempts = 0 OR e.available_at <= {now}){subplan})")


# Where finding work applies it, beside the user's lease row `l`: the user's
# `low_water` is read only for a lease that is free (it reads the user's wakes,
# in the rings the take names).
CLAIMABLE = claimable("w.user_id", "clock.now",
                      from_id=low_water("w.user_id", rings=wake_rings.GIVEN))
# A take takes the user of a wake `w` whose lease row is `l`: free, not paused, with work.
TAKEABLE = f"l.until < clock.now AND {pauses.NOT_PAUSED} AND {CLAIMABLE}"

# How many wakes a take looks at beyond the users it takes (see TAKE_WORK).
LOOK = 1000

# Spans users (finding work), then their claims, in one statement and one round
# trip: up to %(users)s users whose lease is free or expired and who have a
# claimable event, in the order of their wakes (table `wakes`, "look at this
# user at `at`"): the user who has waited longest to be looked at comes first.
# A wake is inserted when a user gets new events (at their arrival), when its
# lease is released or given back (then) and, by the take itself, for the time
# the state it saw next calls for: a taken user's lease end (a crashed worker's
# user comes back when its lease expires), a held lease's end, a retry's due
# time. So the order is today's "oldest claimable first" for new work and
# retries, and a user whose run ended with work left waits behind the users
# already waiting rather than in front of them (round robin between users with
# backlogs). Only due wakes are read (ix_wakes_at), never the open events of
# users whose lease is held: their wake is at their lease's end.
#
# Lease rows other workers are taking are skipped, never waited on; the scan
# locks as it goes, so it never comes back empty while a free user with work has
# a due wake; a user with several due wakes may fill several of the `users` rows,
# giving fewer users, never none.
#
# Due wakes the pick read past whose user it cannot take (lease held, or no
# claimable event: a stale wake) are looked at in the same statement (at most
# LOOK; the rest by the next takes), so the scan does not degrade: each such
# user gets the wake its state calls for, then its wakes are deleted.
#
# Invariant (a lost wake is an agent silently gone quiet): a user that can be
# taken at time t has a wake at or before t. A take deletes only wakes its own
# snapshot shows, of users whose lease row it has locked, in the statement that
# inserts their next wake; whatever made a user takeable sooner after that
# snapshot (new events, a release, a requeue) inserted its own wake, which this
# take cannot see and so does not delete. Wakes are only inserted and deleted:
# no writer ever waits for another on a wake. `due` is at least the database's
# clock, because the trigger's wakes are on it while callers may pass `now`.
#
# The LIMIT is a sub-select, unknown to every plan alike: psycopg prepares the
# statement after 5 uses, and PostgreSQL keeps re-planning it (about 2 ms, more
# than the take) while the generic plan's estimate is well above a custom plan's,
# which a known LIMIT made the case as soon as there were many wakes (W4b). Rows
# are reached by key or TID (ANY(ARRAY(...))), so plans stay per-row whatever the
# estimates.
TAKE_WORK = f"""
WITH clock AS (
    SELECT {NOW} AS now, greatest({NOW}, {DB_CLOCK}) AS due,
           {wake_rings.GIVEN_HOLD} AS rings_hold,  -- store/wake_rings.py: else nothing is taken
           {pauses.FLEET_RUNS} AS fleet_runs  -- store/pauses.py: else nothing is taken
), pick AS (  -- due wakes in order, each user's lease by key (LIMIT: never a join)
    SELECT w.user_id, l.lease, w.at, w.id
      FROM wakes w
      CROSS JOIN LATERAL (
           SELECT l.ctid AS lease FROM leases l, clock
            WHERE l.user_id = w.user_id AND {TAKEABLE}
            LIMIT 1
              FOR UPDATE OF l SKIP LOCKED) l
     WHERE w.at <= (SELECT due FROM clock)  -- a bound of the index scan
       AND w.ring IN ({wake_rings.GIVEN}) AND (SELECT rings_hold AND fleet_runs FROM clock)
     ORDER BY w.at, w.id
     LIMIT (SELECT %(users)s::int)  -- see "The LIMIT" above
), reach AS (  -- how far pick read: to its last wake if it took `users`, else every due wake
    SELECT coalesce(last.at, clock.due) AS at, coalesce(last.id, 9223372036854775807) AS id
      FROM clock LEFT JOIN (SELECT at, id FROM pick ORDER BY at DESC, id DESC LIMIT 1) last
        ON (SELECT count(*) FROM pick) >= %(users)s
), stale AS (  -- among the first LOOK wakes pick read past, those whose user it cannot take
    SELECT w.user_id, l.until, l.open_from, l.paused_at, clock.now
      FROM clock, (SELECT user_id, at, id FROM wakes
                    WHERE (at, id) < ((SELECT at FROM reach), (SELECT id FROM reach))
                      AND ring IN ({wake_rings.GIVEN})
                      AND (SELECT rings_hold AND fleet_runs FROM clock)
                    ORDER BY at, id LIMIT {LOOK}) w
      CROSS JOIN LATERAL (  -- each lease by key (LIMIT: never turned into a join)
           SELECT l.until, l.open_from, l.paused_at FROM leases l
            WHERE l.user_id = w.user_id AND NOT ({TAKEABLE})
            LIMIT 1
              FOR UPDATE OF l SKIP LOCKED) l
), looked AS (  -- a held lease: its end; else the next retry, or if paused the
               -- parked wake (store/pauses.py); no open event: no wake
    SELECT s.user_id,
           CASE WHEN s.until >= s.now THEN s.until + 1
                ELSE (SELECT {pauses.parked_or("min(e.available_at)", "s.paused_at")}
                        FROM events e
                       WHERE e.user_id = s.user_id
                         AND e.id >= {low_water("s.user_id", "s", wake_rings.GIVEN)}
                         AND {OPEN})
                END AS next_at
      FROM (SELECT DISTINCT user_id, until, open_from, paused_at, now FROM stale) s
), picked AS (
    SELECT user_id, lease, min(at) AS waiting_since, min(id) AS first_wake
      FROM pick GROUP BY user_id, lease
), took AS (
    UPDATE leases l
       SET holder = %(holder)s, gen = l.gen + 1, until = clock.now + %(ttl)s
      FROM clock
     WHERE l.ctid = ANY(ARRAY(SELECT lease FROM picked))  -- the rows pick locked, by TID
 RETURNING l.user_id, l.gen, l.until, l.open_from
), woke AS (  -- each carrying the marks of the wakes `slept` deletes (see low_water)
    INSERT INTO wakes (bucket, user_id, at, from_id)
    SELECT agent_inbox_bucket(user_id), user_id, until + 1,
           {carried("took.user_id", wake_rings.GIVEN)} FROM took
     UNION ALL
    SELECT agent_inbox_bucket(user_id), user_id, next_at,
           {carried("looked.user_id", wake_rings.GIVEN)} FROM looked
     WHERE next_at IS NOT NULL
), slept AS (  -- the wakes this snapshot shows of the users taken or looked at
    DELETE FROM wakes w
     WHERE w.user_id = ANY(ARRAY(SELECT user_id FROM took UNION ALL SELECT user_id FROM looked))
       AND w.ring IN ({wake_rings.GIVEN})
), run AS (  -- the lease's mark as locked: one a finish raised after this snapshot
               -- passes only events that finish closed (the claim's re-check
               -- would refuse them anyway)
    SELECT took.user_id, took.gen, clock.now,
           {low_water("took.user_id", "took", wake_rings.GIVEN)} AS from_id
      FROM took, clock
), {CLAIM_STEPS}, tally AS (
    SELECT user_id, count(*) FILTER (WHERE status = 'dead') AS died,
           count(*) FILTER (WHERE status = 'running' AND old_status = 'running') AS unfinished
      FROM changed GROUP BY user_id
)
SELECT took.user_id, took.gen, clock.now, coalesce(tally.died, 0), coalesce(tally.unfinished, 0),
       CASE WHEN row_number() OVER (PARTITION BY took.user_id ORDER BY claimed.id) = 1
            THEN m.doc END,  -- the user's memory (store/memory.py), on its first row only
       claimed.*
  FROM took JOIN picked ON picked.user_id = took.user_id CROSS JOIN clock
       LEFT JOIN tally ON tally.user_id = took.user_id
       LEFT JOIN claimed ON claimed."user" = took.user_id
       LEFT JOIN memory m ON m.user_id = took.user_id
 ORDER BY picked.waiting_since, picked.first_wake, claimed.id
"""


# Sent first in a take's or a finish's transaction on the set-based path: the
# statement's cached (generic) plan is used, never one planned anew for its
# parameters. Both reach rows by key or TID, so their plans do not depend on
# the parameters, while PostgreSQL's choice between the two plans does, on
# estimates: it kept planning FINISH anew every time (1.8 ms a finish of one
# run against 0.9 with the cached plan), and the take from a rotation of the
# wakes on (2.4 ms against 0.9: W1b lost a third of its runs/s), as soon as
# the generic plan's estimate came out above the custom plans' average.
# Behind a transaction pooler no statement is prepared: it changes nothing.
#
# TAKE_WORK and FINISH, sent with it, are prepared at a connection's first use
# of them (prepare=True), not after psycopg's default 5 uses: until then each
# call is planned anew, and planning the take (15-25 ms) costs more than
# running it, so a fresh worker's first calls, most of a short burst's, were
# planned each time (W1: 37 takes in all, 544 ms planning against 2,110 ms
# running). Where the connection prepares nothing (prepare_threshold None,
# db.connect_options) prepare=True changes nothing either.
GENERIC_PLAN = "SELECT set_config('plan_cache_mode', 'force_generic_plan', true)"


def take_work(conn: psycopg.Connection[Any], holder: str, ttl: int, policy: ClaimPolicy, now: int | None,
              rings: wake_rings.Given, users: int = 1,
              pipelined: Callable[[psycopg.Connection[Any]], AbstractContextManager[None]] | None = None
              ) -> list[tuple[Any, ...]]:
    """TAKE_WORK in the rings `rings` names; read_taken's rows. A take that
    took nothing reads the rings again, and, if they changed (a rotation since
    they were read), takes again. With `pipelined` (db.pipelined_transaction),
    each take is its own transaction, with GENERIC_PLAN, in one round trip."""
    params = {"holder": holder, "ttl": ttl, "now": now, "users": users, **policy.params()}

    def take() -> list[tuple[Any, ...]]:
        given = {**params, **rings.params(conn)}
        if pipelined is None:
            return read_taken(conn.execute(TAKE_WORK, given))
        with pipelined(conn):
            conn.execute(GENERIC_PLAN)
            cursor = conn.execute(TAKE_WORK, given, prepare=True)
        return read_taken(cursor)

    taken = take()
    if not taken and rings.read_again(conn):
        taken = take()
    return taken


def read_taken(cursor: psycopg.Cursor[Any]) -> list[tuple[Any, ...]]:
    """One (user, gen, claimed_at, died, unfinished, memory, events) per user
    taken, longest waiting first; empty if no user with claimable work has a
    free lease. `died` counts the events this claim parked as dead,
    `unfinished` the events claimed again after a run that ended without a
    finish; `memory` is the user's memory document (None if it has none)."""
    taken: dict[str, tuple[Any, ...]] = {}
    for row in cursor.fetchall():
        user, gen, claimed_at, died, unfinished, memory = row[:6]
        events = taken.setdefault(user, (user, gen, claimed_at, died, unfinished, memory, []))[6]
        if row[6] is not None:
            events.append(Event(*row[6:]))
    return list(taken.values())


# Invariant 3, for several runs in one statement, each behind its own fence: a
# run's outcome is written only if its holder holds its generation, unexpired,
# and every event it names is still running under that generation; a run that
# fails its fence writes nothing, the others are written. Runs are numbered
# (`n`, from 1, in the order given); events and messages name their run by
# number (and carry the run's user and generation, so that no step joins runs
# to runs). Rows are found one by one through their keys (LATERAL, fenced by
# LIMIT so the planner cannot turn it back into a join) and written
# by the row version found (ctid): plans that stay per-row however stale the
# statistics of a table whose statuses change all the time; the caller's lease
# locks keep those rows from changing meanwhile. Messages are queued in the same
# statement (in the order given, for a run without an error), so they commit with
# the outcome, and their user's delivery is due now (deliveries); with `release` each
# accepted run's lease is expired at once in the same commit, its user's wakes
# replaced by one due now if it has work left, and its low-water mark raised to
# the user's first event left open (see low_water: this statement reads with a
# snapshot taken once the lease was locked, so only events committed after it
# can be missed, and their wakes, which it does not delete, name them). Callers
# lock the runs' lease rows first (LOCK_MANY). One verdict per run, in order.
FINISH = f"""
WITH clock AS (
    SELECT {NOW} AS now
), run AS (
    SELECT * FROM unnest(%(users)s::text[], %(holders)s::text[], %(gens)s::bigint[],
                         %(counts)s::int[], %(errors)s::text[], %(forgets)s::boolean[],
                         %(keys)s::text[], %(traceparents)s::text[])
                  WITH ORDINALITY AS r(user_id, holder, gen, named, error, forget, events,
                                       traceparent, n)
), mine AS (
    SELECT c.n, c.gen, c.user_id, c.id, e.version
      FROM unnest(%(event_runs)s::bigint[], %(event_users)s::text[], %(event_gens)s::bigint[],
                  %(event_ids)s::bigint[]) AS c(n, user_id, gen, id)
      CROSS JOIN LATERAL (SELECT e.ctid AS version FROM events e
                           WHERE e.user_id = c.user_id AND e.id = c.id
                             AND {lease.claimed_by("c.gen")}
                           LIMIT 1) e
), found AS (
    SELECT n, count(*) AS events FROM mine GROUP BY n
), verdict AS (
    SELECT run.n, run.user_id, run.error, run.named, run.forget, run.events, run.traceparent,
           l.version AS lease, l.from_id,
           l.version IS NOT NULL AND coalesce(found.events, 0) = run.named AS ok
      FROM run CROSS JOIN clock
      LEFT JOIN LATERAL (SELECT l.ctid AS version, {low_water("l.user_id")} AS from_id
                           FROM leases l
                          WHERE l.user_id = run.user_id
                            AND {lease.fenced("run.holder", "run.gen", "clock.now")}
                          LIMIT 1) l ON true
      LEFT JOIN found ON found.n = run.n
), closed AS (
    UPDATE events e
       SET status = CASE WHEN verdict.error IS NULL THEN 'done' ELSE 'pending' END,
           error = verdict.error
      FROM mine JOIN verdict ON verdict.n = mine.n
     WHERE verdict.ok AND e.ctid = mine.version
       -- rechecked on the row as written: PostgreSQL 15 does not recheck a
       -- ctid when a concurrent change makes it re-read the row. A CASE, so
       -- that the rows are reached by TID only: a plain `e.status = 'running'`
       -- implies ix_events_open's predicate, and a cached plan that had found
       -- that index tiny read it whole (every open row version of every user)
       -- for each finish, ~40,000 pages once a held horizon kept them all
       AND CASE WHEN e.status = 'running' THEN e.claim_gen = mine.gen ELSE false END
), forgot AS (  -- a successful run's durable steps go with it (store/steps.py, FORGET)
    DELETE FROM steps s USING verdict
     WHERE verdict.ok AND verdict.forget AND verdict.error IS NULL
       AND s.user_id = verdict.user_id
       AND s.event_ids && string_to_array(verdict.events, ',')::bigint[]
), recalled AS (  -- the memory a successful run leaves (store/memory.py): a document
                  -- replaces the user's, a NULL one deletes it
    SELECT verdict.user_id, mm.doc, run.holder, run.gen
      FROM unnest(%(memory_runs)s::bigint[], %(memory_docs)s::text[]) AS mm(n, doc)
      JOIN verdict ON verdict.n = mm.n JOIN run ON run.n = mm.n
     WHERE verdict.ok AND verdict.error IS NULL
), remembered AS (
    INSERT INTO memory AS m (bucket, user_id, doc, updated_at, updated_by, gen)
    SELECT agent_inbox_bucket(r.user_id), r.user_id, r.doc::jsonb, clock.now, r.holder, r.gen
      FROM recalled r, clock
     WHERE r.doc IS NOT NULL
     ORDER BY r.user_id
    {MEMORY_REPLACES}
), forgotten AS (
    DELETE FROM memory m USING recalled r WHERE r.doc IS NULL AND m.user_id = r.user_id
), queued AS (
    INSERT INTO outbox (bucket, user_id, body, urgent, created, traceparent)
    SELECT agent_inbox_bucket(verdict.user_id), verdict.user_id, m.body, m.urgent, clock.now,
           verdict.traceparent
      FROM unnest(%(message_runs)s::bigint[], %(bodies)s::text[], %(urgent)s::boolean[])
           WITH ORDINALITY AS m(n, body, urgent, k)
      JOIN verdict ON verdict.n = m.n, clock
     WHERE verdict.ok AND verdict.error IS NULL
     ORDER BY m.k
 RETURNING user_id
), paced AS (  -- a dispatcher looks at the user now (store/outbox.py paces the send),
                -- unless a failed batch is backing off: it goes first, at its time
    INSERT INTO deliveries AS d (bucket, user_id, due_at)
    SELECT DISTINCT agent_inbox_bucket(user_id), user_id, clock.now FROM queued, clock
     ORDER BY user_id
    {DELIVERY_DUE_NOW}
), left_open AS (  -- each released run's user: its first event open after this finish
    SELECT verdict.n,
           (SELECT min(e.id) FROM events e
             WHERE e.user_id = verdict.user_id AND e.id >= verdict.from_id AND {OPEN}
               AND (verdict.error IS NOT NULL  -- the run's own events go back
                    OR NOT EXISTS (SELECT 1 FROM mine WHERE mine.n = verdict.n
                                                        AND mine.id = e.id))) AS first,
           (SELECT max(mine.id) + 1 FROM mine WHERE mine.n = verdict.n) AS past_own
      FROM verdict
     WHERE verdict.ok AND %(release)s
), released AS (
    UPDATE leases l
       SET until = clock.now - 1,
           open_from = coalesce(left_open.first, left_open.past_own, verdict.from_id)
      FROM clock, verdict JOIN left_open ON left_open.n = verdict.n
     WHERE l.ctid = verdict.lease
), rested AS (  -- a released user's wakes, as this snapshot shows them, give way to
                -- one wake now if it has work left (see TAKE_WORK's invariant)
    DELETE FROM wakes w USING verdict
     WHERE verdict.ok AND %(release)s AND w.user_id = verdict.user_id
       AND w.ring IN ({wake_rings.LIVE})
), woke AS (
    INSERT INTO wakes (bucket, user_id, at)
    SELECT agent_inbox_bucket(verdict.user_id), verdict.user_id, clock.now
      FROM verdict JOIN left_open ON left_open.n = verdict.n, clock
     WHERE left_open.first IS NOT NULL
)
SELECT ok, CASE WHEN n = 1 AND EXISTS (SELECT 1 FROM queued)
                THEN pg_notify('{notify.OUTBOX}', '') END
  FROM verdict ORDER BY n
"""


@dataclass(frozen=True)
class Finish:
    """One run's outcome as FINISH takes it; `messages` are (body, urgent),
    queued only when `error` is None."""

    user: str
    holder: str
    gen: int
    ids: list[int]
    messages: list[tuple[str, bool]]
    error: str | None
    # Delete the durable steps of event sets that share an event with this run
    # if it succeeds; False only where none can exist (a first attempt that
    # recorded none).
    forget_steps: bool = True
    # The user's memory as the run leaves it, if it succeeds: (json,) replaces
    # it, (None,) deletes it, None keeps it.
    memory: tuple[str | None] | None = None
    # What its messages store: the run span's traceparent (tracing.py).
    traceparent: str | None = None


def send_finish(conn: psycopg.Connection[Any], finishes: list[Finish], now: int | None, *,
                release: bool = False) -> psycopg.Cursor[Any]:
    """Send FINISH without reading the verdicts (pipeline mode): read_verdicts."""
    params: dict[str, Any] = {
        "users": [], "holders": [], "gens": [], "counts": [], "errors": [], "forgets": [],
        "keys": [], "traceparents": [], "event_runs": [], "event_users": [],
        "event_gens": [], "event_ids": [], "message_runs": [], "bodies": [], "urgent": [],
        "memory_runs": [], "memory_docs": [], "now": now, "release": release}
    for n, f in enumerate(finishes, 1):
        for key, value in (("users", f.user), ("holders", f.holder), ("gens", f.gen),
                           ("counts", len(f.ids)), ("errors", f.error),
                           ("forgets", f.forget_steps), ("keys", steps.events_key(f.ids)),
                           ("traceparents", f.traceparent)):
            params[key].append(value)
        params["event_runs"] += [n] * len(f.ids)
        params["event_users"] += [f.user] * len(f.ids)
        params["event_gens"] += [f.gen] * len(f.ids)
        params["event_ids"] += f.ids
        if f.error is None and f.memory is not None:
            params["memory_runs"].append(n)
            params["memory_docs"].append(f.memory[0])
        if f.error is None:
            params["message_runs"] += [n] * len(f.messages)
            params["bodies"] += [body for body, _ in f.messages]
            params["urgent"] += [urgent for _, urgent in f.messages]
    return conn.execute(FINISH, params, prepare=True)


def read_verdicts(cursor: psycopg.Cursor[Any]) -> list[bool]:
    return [ok for ok, _ in cursor.fetchall()]


def finish(conn: psycopg.Connection[Any], finishes: list[Finish], now: int | None, *, release: bool = False) -> list[bool]:
    """The fenced finishes (see FINISH); accepted flags, in order."""
    return read_verdicts(send_finish(conn, finishes, now, release=release))


# Operator view of one user's events.
LIST = f"""
SELECT {EVENT_COLUMNS} FROM events
 WHERE bucket = %(bucket)s AND user_id = %(user)s
   AND (%(status)s::text IS NULL OR status = %(status)s)
 ORDER BY id
"""


def list_events(user: str, status: str | None) -> Queries[list[Event]]:
    return (yield Query(LIST, user_key(user, status=status), class_row(Event)))
