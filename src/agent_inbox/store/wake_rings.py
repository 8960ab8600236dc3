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
5. `wakes_ring` names it.

A rotation that fails after step 3 leaves new wakes going to the new ring and
the others where they were: both rings are live, and the next rotation moves
both. A statement that waited for the lock takes its snapshot after the
commit (READ COMMITTED, at the top level: the run path's statements), so it
sees the moved wakes and the new `wakes_ring`.

`retire`: a partition that is not live holds only dead rows. It is truncated
(ACCESS EXCLUSIVE on that partition alone, asked with `lock_timeout`; a
pg_dump that began before holds it until it ends) and is clean again; clean
partitions beyond SPARE are dropped (ACCESS EXCLUSIVE on `wakes`, same
timeout). A long dump therefore adds partitions only while those it holds
are dirty: the ones made during it are truncated and used again.

Only on one PostgreSQL server: on Citus `wakes` is one distributed table
(citus.distribute) and workers do not rotate it.
"""

import psycopg.errors

# The rings the run path reads (SQL, two initplans: pruned at run time).
LIVE = "(SELECT ring FROM wakes_ring), (SELECT last_value::smallint FROM wakes_insert_ring)"

# Clean partitions kept beyond those in use; more are dropped when they can be.
SPARE = 2

PARTITIONS = """
SELECT substr(c.relname, length('wakes_') + 1)::int AS ring, pg_relation_size(c.oid) = 0
  FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
 WHERE i.inhparent = 'wakes'::regclass
 ORDER BY 1
"""

LIVE_RINGS = ("SELECT ring FROM wakes_ring"
              " UNION SELECT last_value::smallint FROM wakes_insert_ring")

MOVE = """
WITH moved AS (
    DELETE FROM wakes WHERE ring = ANY(%(from)s) AND ring <> %(to)s
    RETURNING user_id, id, at, from_id
)
INSERT INTO wakes (user_id, id, at, from_id, ring)
SELECT user_id, id, at, from_id, %(to)s FROM moved
"""


def partitions(conn) -> dict[int, bool]:
    """Every ring's partition: whether it is clean (no pages)."""
    return dict(conn.execute(PARTITIONS).fetchall())


def live(conn) -> list[int]:
    """The live rings, as this statement sees them."""
    return sorted(ring for ring, in conn.execute(LIVE_RINGS).fetchall())


def relations(conn) -> list[str]:
    """The partitions of the live rings: whose dead tuples call for a rotation."""
    return [f"wakes_{ring}" for ring in live(conn)]


def rotate(conn) -> int:
    """Move the live wakes to a clean ring (steps 1-5 above), in the caller's
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
    return moved


def retire(conn) -> None:
    """Truncate the dirty partitions that are not live and drop the clean
    ones beyond SPARE, each in a savepoint of the caller's transaction (which
    holds the compactors' advisory lock and set `lock_timeout`): a lock not
    granted leaves that partition for a later look."""
    rings, current = partitions(conn), live(conn)
    for ring, empty in rings.items():
        if ring not in current and not empty and _try(conn, f"TRUNCATE wakes_{ring}"):
            rings[ring] = True
    spare = sorted((ring for ring, empty in rings.items() if empty and ring not in current),
                   reverse=True)
    for ring in spare[:max(0, len(spare) - SPARE)]:
        _try(conn, f"DROP TABLE wakes_{ring}")


def _try(conn, statement: str) -> bool:
    """Run `statement` in a savepoint; False if a lock it needs was not granted."""
    try:
        with conn.transaction():
            conn.execute(statement)
        return True
    except psycopg.errors.LockNotAvailable:
        return False
