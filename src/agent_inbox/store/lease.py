"""The per-user lease: at most one run per user holds a valid lease at any instant.

A user's lease row moves through these states (now is the database clock):

    no row ──acquire(h)──────────────────────────▶ held(h, gen 1, until now+ttl)
    held(h, g, until ≥ now) ──acquire(h)─────────▶ held(h, g, now+ttl)       renewal
    held(h, g, until ≥ now) ──acquire(other)─────▶ unchanged, refused (None)
    held(h, g, until < now) ──acquire(anyone)────▶ held(x, g+1, now+ttl)     takeover
    held(h, g, until ≥ now) ──release(h, g)──────▶ held(h, g, now-1)         expired
    held(h, g, until ≥ now) ──cancel─────────────▶ held('', g+1, now-1)      fenced off

A paused lease (`paused_at` set, store/pauses.py) is never taken over and
never taken; a run holding it renews until it ends or is cancelled.

A takeover by the same holder also starts a new generation, and a released lease
keeps its generation: either way a stalled run's late finish in the old
generation is refused, because finish checks the generation, not just the name.

Every transaction on a run's path takes the lease row with SELECT ... FOR UPDATE
first (lock), so acquire, claim, renew, release and finish of one user are
serialised by PostgreSQL, as BEGIN IMMEDIATE serialised them in the single-host
design. A first acquire inserts the row as an expired generation-0 lease, so
every later step is an update of a row that exists.
"""

from typing import Any

import psycopg

from agent_inbox.records import Lease
from agent_inbox.store.clock import NOW
from agent_inbox.store.keys import user_key, users_key


def fenced(holder: str, gen: str, now: str, lease: str = "l") -> str:
    """Invariant 3's lease fence, written once for every statement that has
    one: the lease row `lease` is held by `holder` in generation `gen` and has
    not expired at `now` (each an SQL expression). A finish, a claim, a step
    record or a permit call behind it commits only while its run holds the
    lease it was taken under; a takeover bumps `gen`, so a stalled run's late
    write is refused even after it renewed nothing."""
    return f"{lease}.holder = {holder} AND {lease}.gen = {gen} AND {lease}.until >= {now}"


def claimed_by(gen: str, event: str = "e") -> str:
    """The fence's other half, on the events: `event` is running under the
    claim of generation `gen` (no finish, release or later claim since)."""
    return f"{event}.status = 'running' AND {event}.claim_gen = {gen}"

# Invariant 2: the lease row is the per-user mutex for every run-path transaction.
LOCK = ("SELECT holder, gen, until FROM leases WHERE bucket = %(bucket)s AND user_id = %(user)s"
        " FOR UPDATE")


def lock(conn: psycopg.Connection[Any], user: str) -> Lease | None:
    row = conn.execute(LOCK, user_key(user)).fetchone()
    return Lease(*row) if row else None


# Several users' leases in one statement, always in user order: transactions
# that lock overlapping sets wait for each other instead of deadlocking.
LOCK_MANY = """
SELECT user_id FROM leases
 WHERE bucket = ANY(%(buckets)s::int[]) AND user_id = ANY(%(users)s::text[])
 ORDER BY user_id FOR UPDATE
"""


# A user's first acquire: an expired gen-0 lease that the next step takes over.
CREATE_EXPIRED = """
INSERT INTO leases (bucket, user_id, holder, gen, until) VALUES (%(bucket)s, %(user)s, '', 0, -1)
ON CONFLICT ON CONSTRAINT pk_leases DO NOTHING
"""

# Invariant 2: renewal keeps gen, a takeover of an expired lease increments it.
ACQUIRE = f"""
WITH clock AS (SELECT {NOW} AS now)
UPDATE leases l
   SET holder = %(holder)s,
       gen = CASE WHEN l.until < clock.now THEN l.gen + 1 ELSE l.gen END,
       until = clock.now + %(ttl)s
  FROM clock
 WHERE l.bucket = %(bucket)s AND l.user_id = %(user)s
   AND (l.until < clock.now OR l.holder = %(holder)s)
   -- a paused user (store/pauses.py) is not taken over; a run holding it renews
   AND (l.paused_at IS NULL OR (l.holder = %(holder)s AND l.until >= clock.now))
RETURNING l.gen
"""


def acquire(conn: psycopg.Connection[Any], user: str, holder: str, ttl: int, now: int | None) -> int | None:
    """Take or renew the lease; the generation, or None if another holds it."""
    if lock(conn, user) is None:
        conn.execute(CREATE_EXPIRED, user_key(user))
        lock(conn, user)
    row = conn.execute(ACQUIRE, user_key(user, holder=holder, ttl=ttl, now=now)).fetchone()
    return row[0] if row else None


# The leases `holder` holds in the generations named (`users`/`gens`), unexpired,
# locked in user order like LOCK_MANY. RENEW and RELEASE follow it.
HELD = f"""
WITH clock AS (
    SELECT {NOW} AS now
), held AS (
    SELECT l.bucket, l.user_id, l.gen
      FROM leases l, clock, unnest(%(users)s::text[], %(gens)s::bigint[]) AS k(user_id, gen)
     WHERE l.bucket = ANY(%(buckets)s::int[]) AND l.user_id = k.user_id
       AND {fenced("%(holder)s", "k.gen", "clock.now")}
     ORDER BY l.user_id
       FOR UPDATE OF l
)"""

# Invariant 2: extend only leases this holder holds in these generations,
# unexpired; one statement for every run a worker has going. The leases renewed.
RENEW = HELD + """, renewed AS (
    UPDATE leases l SET until = clock.now + %(ttl)s
      FROM clock, held
     WHERE l.bucket = ANY(%(buckets)s::int[]) AND l.user_id = held.user_id
 RETURNING l.user_id, l.gen
)
SELECT user_id, gen FROM renewed
"""


def renew(conn: psycopg.Connection[Any], holder: str, keys: list[tuple[str, int]], ttl: int, now: int | None) -> set[tuple[str, int]]:
    """The (user, gen) of the leases extended; the others were lost."""
    params = users_key([u for u, _ in keys], holder=holder, gens=[g for _, g in keys],
                       ttl=ttl, now=now)
    return {tuple(row) for row in conn.execute(RENEW, params).fetchall()}


# Abandon runs whose handlers may have acted (shutdown, a run timed out, its
# quarantine process died, its worker process died): the lease is expired at
# once, keeping its generation, so the next worker takes over without waiting
# for the TTL and the releasing holder's late finish is refused. The events stay
# `running` under the old generation: the attempt stays counted, and the claim
# that retries them sees them unfinished (the worker runs that run in
# quarantine). `error`, if given, is recorded on them; `at_once` makes them
# claimable now rather than after their retry backoff. With `spare`, events on
# their first attempt go back `pending` instead (the attempt still counted): the
# run died beside another that was blamed for the crash, and its retry is an
# ordinary run, not an unfinished one (runs.release_holder). Each user released
# gets a wake now (store/inbox.py, TAKE_WORK), so a take looks at it again.
def released_events(at: str) -> str:
    """The SET list of a release's update of the run's events `e` (here, and
    per bucket in backend/citus/statements.py): `at` is the clock's now."""
    return f"""status = CASE WHEN %(spare)s AND e.attempts = 1 THEN 'pending' ELSE e.status END,
           available_at = CASE WHEN %(at_once)s THEN {at} ELSE e.available_at END,
           error = coalesce(%(error)s::text, e.error)"""


RELEASE = HELD + f""", released AS (
    UPDATE leases l SET until = clock.now - 1
      FROM clock, held
     WHERE l.bucket = ANY(%(buckets)s::int[]) AND l.user_id = held.user_id
 RETURNING l.bucket, l.user_id, l.gen
), marked AS (
    UPDATE events e
       SET {released_events("clock.now")}
      FROM clock, released r
     WHERE e.user_id = r.user_id AND {claimed_by("r.gen")}
), woke AS (
    INSERT INTO wakes (bucket, user_id, at) SELECT bucket, user_id, clock.now FROM released, clock
)
SELECT user_id FROM released
"""


def release(conn: psycopg.Connection[Any], holder: str, keys: list[tuple[str, int]], now: int | None, *,
            error: str | None = None, at_once: bool = True, spare: bool = False) -> list[str]:
    """The users whose leases were released (those this holder still held)."""
    params = users_key([u for u, _ in keys], holder=holder, gens=[g for _, g in keys],
                       now=now, error=error, at_once=at_once, spare=spare)
    return [user for user, in conn.execute(RELEASE, params).fetchall()]


# A holder's unexpired leases (a worker process that died: its successor
# releases what it held). Reads leases by holder (no index): for that rare path.
HELD_BY = f"""
SELECT l.user_id, l.gen FROM leases l WHERE l.holder = %(holder)s AND l.until >= {NOW}
"""


def held_by(conn: psycopg.Connection[Any], holder: str, now: int | None) -> list[tuple[str, int]]:
    return [tuple(row) for row in conn.execute(HELD_BY, {"holder": holder, "now": now}).fetchall()]


# Give back runs whose handlers never started (not yet started at shutdown, or
# taken by a statement whose answer was lost): the lease is expired at once and
# the claim undone, attempts included, as if the take had not happened, so a run
# that never ran costs its events nothing and keeps its place in the queue (a
# fresh event is due from its creation again, a retry from when it was
# claimed). A retry whose last run ended without a finish stays `running` under
# the given-back generation, so the claim that takes it again still sees it
# unfinished. Fenced like a finish: only leases this holder still holds in those
# generations. Both statements follow a CTE `returned(user_id, gen, unfinished)`
# of the leases given back and answer their users; each user given back gets a
# wake now (store/inbox.py, TAKE_WORK).
def undone_claims(unfinished: str) -> str:
    """The SET list of a give-back's update of the run's events `e` (here, and
    per bucket in backend/citus/statements.py): `unfinished` says whether the
    run's retry was unfinished."""
    return f"""status = CASE WHEN {unfinished} AND e.attempts > 1 THEN 'running' ELSE 'pending' END,
           attempts = e.attempts - 1,
           available_at = CASE WHEN e.attempts = 1 THEN e.created_at ELSE e.claimed_at END"""


UNDO_CLAIMS = f"""unclaimed AS (
    UPDATE events e
       SET {undone_claims("r.unfinished")}
      FROM returned r
     WHERE e.user_id = r.user_id AND {claimed_by("r.gen")}
), woke AS (
    INSERT INTO wakes (bucket, user_id, at) SELECT bucket, user_id, clock.now FROM returned, clock
)"""

HAND_BACK = f"""
WITH clock AS (
    SELECT {NOW} AS now
), returned AS (
    UPDATE leases l SET until = clock.now - 1
      FROM clock, unnest(%(users)s::text[], %(gens)s::bigint[], %(unfinished)s::boolean[])
                  AS given(user_id, gen, unfinished)
     WHERE l.user_id = given.user_id AND {fenced("%(holder)s", "given.gen", "clock.now")}
 RETURNING l.bucket, l.user_id, l.gen, given.unfinished
), {UNDO_CLAIMS}
SELECT user_id FROM returned
"""

# A holder's unexpired leases other than the runs it knows of (`users`/`gens`):
# after a connection was lost around a commit that also took work, the take may
# have committed unseen; the holder gives those runs back before it goes on.
# Whether their retries were unfinished is not known: they are taken to be (the
# safe side: quarantine). Locked in user order like LOCK_MANY; reads leases by
# holder (no index): for that rare path only.
HAND_BACK_ORPHANS = f"""
WITH clock AS (
    SELECT {NOW} AS now
), orphans AS (
    SELECT l.user_id FROM leases l, clock
     WHERE l.holder = %(holder)s AND l.until >= clock.now
       AND NOT EXISTS (SELECT 1 FROM unnest(%(users)s::text[], %(gens)s::bigint[]) AS k(user_id, gen)
                        WHERE k.user_id = l.user_id AND k.gen = l.gen)
     ORDER BY l.user_id
       FOR UPDATE OF l
), returned AS (
    UPDATE leases l SET until = clock.now - 1
      FROM clock, orphans o
     WHERE l.user_id = o.user_id AND l.holder = %(holder)s AND l.until >= clock.now
 RETURNING l.bucket, l.user_id, l.gen, true AS unfinished
), {UNDO_CLAIMS}
SELECT user_id FROM returned
"""
