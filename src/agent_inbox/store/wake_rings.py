"""The ring of `wakes` partitions: finding work stays cheap while a pg_dump
holds every table (migration 0011).

A take reads the due wakes from the head of `ix_wakes_at`, where the wakes
earlier takes deleted are. While a transaction holds the xmin horizon back,
VACUUM cannot remove them and every take walks them. Rewriting the table
(TRUNCATE) needs ACCESS EXCLUSIVE, which a pg_dump's ACCESS SHARE on every table
refuses for as long as it runs. So `wakes` is partitioned by `ring`, and the
live wakes are moved to a clean partition instead, as PgQ rotates its event
tables: nothing here conflicts with ACCESS SHARE, and a dump does not know
the partitions made after it began.

Invariant (a lost wake is an agent silently gone quiet): every live wake is in
a *live ring*: the one the table `wakes_ring` names (where the last rotation
moved the wakes) or the one the sequence `wakes_insert_ring` names (where new
wakes go: the column's default reads it, outside any snapshot). The run path
reads the live rings only (LIVE: runtime partition pruning), so a retired
ring's dead wakes cost it nothing.

`rotate`, in one transaction, under the compactors' advisory lock:

1. a clean partition that is not live is chosen (no pages: new, or
   truncated), or one is made (CREATE TABLE, ATTACH PARTITION: SHARE UPDATE
   EXCLUSIVE on `wakes`);
2. LOCK TABLE wakes IN EXCLUSIVE MODE, asked for with `lock_timeout`: every
   writer of wakes has ended and new ones wait for the commit; readers,
   a pg_dump among them, go on;
3. `wakes_insert_ring` is set to it: from then on every insert goes there,
   whatever its snapshot (one that waited for the lock, or a REPEATABLE READ
   transaction's older one);
4. the live wakes of the other live rings are moved there, ids unchanged;
5. `wakes_ring` names it;
6. that partition is analyzed (ANALYZE counts the rows its own transaction
   wrote), so its statistics become visible in the same commit as its wakes.

The run path's statements that waited for the lock plan anew once they have
it, with those statistics. Planned over a partition the planner knows only as
new or truncated (no pages), a finish's look at a user's wakes and a take's
look past held users are sequential scans of every live wake, for each user:
with the ANALYZE after the commit, a statement planned in between ran for
seconds (a finish of 255 runs 3.3 s, others to the 5 s statement timeout),
and W5 at 5,000 in flight started no run for 4.5 s after each rotation. Once
it has committed, `analyze` gives `wakes` (the parent) its statistics too.

A rotation that fails after step 3 leaves new wakes going to the new ring and
the others where they were: both rings are live, and the next rotation moves
both. A statement that waited for the lock takes its snapshot after the
commit (READ COMMITTED, at the top level: the run path's statements), so it
sees the moved wakes and the new `wakes_ring`.

`retire`: a partition that is not live holds only dead rows. It is truncated
(ACCESS EXCLUSIVE on that partition; a pg_dump that began before holds it
until it ends) and is clean again; clean partitions beyond SPARE are dropped
(ACCESS EXCLUSIVE on `wakes`). A long dump therefore adds partitions only
while those it holds are dirty: the ones made during it are truncated and
used again. Both locks are asked for without waiting (NOWAIT), again and
again for at most RETIRE_BUDGET_S per look: every statement of the run path
locks every partition (which rings are live is known only when it runs), so a
request that waited would hold up every take and finish queued behind it.
Each is asked for only when pg_locks shows no other session holding or
awaiting a lock on the table: a refused request is an ERROR in the server's
log, and a busy fleet would otherwise leave ten of them per look.
Only if that fails and no holder of the lock has been in its transaction for
HELD_LONG_S (the run path's transactions are short; a pg_dump's is not) is
the lock waited for, at most `lock_timeout`: a busy fleet, always holding
some partition locks, would otherwise never let a ring be retired.
"""

import time
from typing import Any

import psycopg.errors

from agent_inbox import errors
from agent_inbox.store import one

# The rings the run path reads (SQL, two initplans: pruned at run time).
LIVE = "(SELECT ring FROM wakes_ring), (SELECT last_value::smallint FROM wakes_insert_ring)"

# The rings a take reads (store/inbox.py, TAKE_WORK): the live rings as its
# caller last read them (Given), as parameters, so that the partitions it does
# not name are pruned before its plan runs (as the executor starts, for the
# cached plan the take runs with), where LIVE's are pruned only as it runs,
# a scan of each still set up. GIVEN_HOLD is true in the take's snapshot only if
# they are still every live ring: where it is not, the take takes nothing (its
# pick and its look-past stop at it, and all it writes follows from them) and
# its caller reads the rings again. A take writes `wakes`, so a rotation is
# wholly before its snapshot or wholly after it.
GIVEN = "%(ring_a)s::smallint, %(ring_b)s::smallint"
GIVEN_HOLD = (f"(SELECT ring FROM wakes_ring) IN ({GIVEN})"
              f" AND (SELECT last_value::smallint FROM wakes_insert_ring) IN ({GIVEN})")

# Clean partitions kept beyond those in use; more are dropped when they can be.
SPARE = 2

# Seconds a look keeps asking for the locks `retire` needs (each at least
# once), and the pause between two asks.
RETIRE_BUDGET_S = 0.05
RETIRE_PAUSE_S = 0.005
# A lock's holder in its transaction this long is not waited for (a dump).
HELD_LONG_S = 1.0

# Anyone else holding or awaiting a lock on the table (a prepared
# transaction's have no pid).
LOCKED_BY_OTHERS = """
SELECT EXISTS (SELECT 1 FROM pg_locks
                WHERE relation = %(table)s::regclass AND pid IS DISTINCT FROM pg_backend_pid())
"""

HELD_LONG = """
SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                WHERE l.relation = %(table)s::regclass AND l.granted
                  AND l.pid <> pg_backend_pid()
                  AND a.xact_start < clock_timestamp() - make_interval(secs => %(long)s))
"""

PARTITIONS = """
SELECT substr(c.relname, length('wakes_') + 1)::int AS ring, pg_relation_size(c.oid) = 0
  FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
 WHERE i.inhparent = 'wakes'::regclass
 ORDER BY 1
"""

LIVE_RINGS = ("SELECT ring FROM wakes_ring"
              " UNION SELECT last_value::smallint FROM wakes_insert_ring")

# The pointer row (one at most: its primary key), naming an attached partition of `wakes`.
POINTER = """
SELECT count(*), min(r.ring), bool_and(EXISTS (
           SELECT 1 FROM pg_inherits i WHERE i.inhparent = 'wakes'::regclass
              AND i.inhrelid = to_regclass('wakes_' || r.ring)))
  FROM wakes_ring r
"""

REPAIR_HINT = "run `agent-inbox migrate` to repair it (store/wake_rings.py, repair)"


def damaged(conn: psycopg.Connection[Any]) -> str | None:
    """What is wrong with the `wakes_ring` pointer row, None if nothing: with
    it missing the takes find no live ring and take nothing, silently (a
    TRUNCATE of every table empties it)."""
    rows, ring, attached = one(conn.execute(POINTER))
    if rows == 0:
        return f"the table wakes_ring is empty (it must hold one row): {REPAIR_HINT}"
    if not attached:
        return (f"the table wakes_ring names ring {ring}, which is no partition of wakes: "
                f"{REPAIR_HINT}")
    return None


def checked_live(conn: psycopg.Connection[Any]) -> list[int]:
    """`live`, or RunPathDamaged if the pointer row is damaged."""
    problem = damaged(conn)
    if problem is not None:
        raise errors.RunPathDamaged(problem)
    return live(conn)


def repair(conn: psycopg.Connection[Any]) -> int | None:
    """In the caller's transaction: if the pointer row is damaged, make it
    name the ring new wakes go to and move every wake there (whatever ring
    it is in: none is lost); the wakes moved, or None if nothing was wrong."""
    if damaged(conn) is None:
        return None
    conn.execute("LOCK TABLE wakes IN EXCLUSIVE MODE")
    [target] = one(conn.execute("SELECT last_value::smallint FROM wakes_insert_ring"))
    if one(conn.execute("SELECT to_regclass(%s) IS NULL", (f"wakes_{target}",)))[0]:
        conn.execute(f"CREATE TABLE wakes_{target} (LIKE wakes INCLUDING DEFAULTS)")
        conn.execute(f"ALTER TABLE wakes ATTACH PARTITION wakes_{target}"
                     f" FOR VALUES IN ({target})")
    conn.execute("DELETE FROM wakes_ring")
    conn.execute("INSERT INTO wakes_ring (ring) VALUES (%s)", (target,))
    rings = [ring for ring, in conn.execute("SELECT DISTINCT ring FROM wakes").fetchall()]
    return conn.execute(MOVE, {"from": rings, "to": target}).rowcount if rings else 0

MOVE = """
WITH moved AS (
    DELETE FROM wakes WHERE ring = ANY(%(from)s) AND ring <> %(to)s
    RETURNING bucket, user_id, id, at, from_id
)
INSERT INTO wakes (bucket, user_id, id, at, from_id, ring)
SELECT bucket, user_id, id, at, from_id, %(to)s FROM moved
"""


def partitions(conn: psycopg.Connection[Any]) -> dict[int, bool]:
    """Every ring's partition: whether it is clean (no pages)."""
    return dict(conn.execute(PARTITIONS).fetchall())


def live(conn: psycopg.Connection[Any]) -> list[int]:
    """The live rings, as this statement sees them."""
    return sorted(ring for ring, in conn.execute(LIVE_RINGS).fetchall())


class Given:
    """The live rings one process's takes name (GIVEN): read when first
    needed, and again when a take took nothing (`read_again`)."""

    def __init__(self) -> None:
        self._rings: list[int] | None = None

    def params(self, conn: psycopg.Connection[Any]) -> dict[str, Any]:
        rings = self._rings
        if rings is None:
            rings = self._rings = checked_live(conn)
        return {"ring_a": rings[0], "ring_b": rings[-1]}

    def read_again(self, conn: psycopg.Connection[Any]) -> bool:
        """Read the live rings again: whether they changed."""
        before, self._rings = self._rings, checked_live(conn)
        return self._rings != before


def relations(conn: psycopg.Connection[Any]) -> list[str]:
    """The partitions of the live rings: whose dead tuples call for a rotation."""
    return [f"wakes_{ring}" for ring in live(conn)]


def rotate(conn: psycopg.Connection[Any]) -> int:
    """Move the live wakes to a clean ring (steps 1-6 above), in the caller's
    transaction, which holds the compactors' advisory lock and set
    `lock_timeout`; the number of wakes moved. LockNotAvailable goes up."""
    rings, current = partitions(conn), live(conn)
    clean = [ring for ring, empty in rings.items() if empty and ring not in current]
    target = clean[0] if clean else max(rings) + 1
    if not clean:
        conn.execute(f"CREATE TABLE wakes_{target} (LIKE wakes INCLUDING DEFAULTS)")
        conn.execute(f"ALTER TABLE wakes ATTACH PARTITION wakes_{target}"
                     f" FOR VALUES IN ({target})")
    conn.execute("LOCK TABLE wakes IN EXCLUSIVE MODE")
    conn.execute("SELECT setval('wakes_insert_ring', %s)", (target,))
    moved = conn.execute(MOVE, {"from": current, "to": target}).rowcount
    conn.execute("UPDATE wakes_ring SET ring = %s", (target,))
    conn.execute(f"ANALYZE wakes_{target}")  # its statistics commit with the move (step 6)
    return moved


def analyze(conn: psycopg.Connection[Any]) -> None:
    """ANALYZE `wakes`, every partition (after a rotation, in its own
    transaction: ANALYZE holds SHARE UPDATE EXCLUSIVE, which no statement of
    the run path conflicts with). The parent gets the statistics of the rows
    its live ring now holds, the ring they left its emptiness (see the module)."""
    conn.execute("ANALYZE wakes")


def retire(conn: psycopg.Connection[Any], budget_s: float = RETIRE_BUDGET_S, held_long_s: float = HELD_LONG_S) -> None:
    """Truncate the dirty partitions that are not live and drop the clean
    ones beyond SPARE, each in a savepoint of the caller's transaction (which
    holds the compactors' advisory lock and set `lock_timeout`), its lock
    asked for as the module says: a lock not had leaves that partition for a
    later look. The caller commits soon: the locks had are held until then."""
    rings, current = partitions(conn), live(conn)
    deadline = time.monotonic() + budget_s
    for ring, empty in rings.items():
        if (ring not in current and not empty
                and _try(conn, f"wakes_{ring}", f"TRUNCATE wakes_{ring}", deadline, held_long_s)):
            rings[ring] = True
    spare = sorted((ring for ring, empty in rings.items() if empty and ring not in current),
                   reverse=True)
    for ring in spare[:max(0, len(spare) - SPARE)]:
        _try(conn, "wakes", f"DROP TABLE wakes_{ring}", deadline, held_long_s)


def _try(conn: psycopg.Connection[Any], table: str, statement: str, deadline: float, held_long_s: float) -> bool:
    """Run `statement` in a savepoint once `table`'s ACCESS EXCLUSIVE lock is
    had: asked for without waiting, while no other session is seen locking
    `table`, until `deadline` (looked at at least once), then
    waited for (`lock_timeout`) unless a holder has held it `held_long_s`;
    False if it was not had."""
    while True:
        if (not one(conn.execute(LOCKED_BY_OTHERS, {"table": table}))[0]
                and _locked(conn, table, "NOWAIT", statement)):
            return True
        if time.monotonic() >= deadline:
            break
        time.sleep(RETIRE_PAUSE_S)
    if one(conn.execute(HELD_LONG, {"table": table, "long": held_long_s}))[0]:
        return False
    return _locked(conn, table, "", statement)


def _locked(conn: psycopg.Connection[Any], table: str, nowait: str, statement: str) -> bool:
    try:
        with conn.transaction():
            conn.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE {nowait}")
            conn.execute(statement)
        return True
    except psycopg.errors.LockNotAvailable:
        return False
