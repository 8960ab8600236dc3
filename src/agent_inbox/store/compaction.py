"""Compaction: finding work and checking fences stay cheap while VACUUM
cannot keep up.

Two tables change on every run: `wakes` (a run's arrival, lease end and
release insert and delete them) and `leases` (every take and every release
update a user's row). A take reads the due wakes from the head of
`ix_wakes_at` (store/inbox.py, TAKE_WORK), right where the deleted ones are,
and every fence reads a user's lease row through the versions its updates
left. While a transaction held open anywhere in the database keeps VACUUM from
removing them (horizon.py), those versions pile up and every take walks them:
81,688 index tuples per take after four minutes at 800 events/s, against
~6,000 without the hold, and ~220 buffers per lease read after eight
(docs/operating/horizon.md).

`wakes` is rotated: its live wakes move to a clean partition, which needs no
lock a pg_dump holds (store/wake_rings.py; a look also truncates the
partitions earlier rotations retired). COMPACT rewrites `leases` with its live
rows only, the way PgQ rotates its event tables: under an ACCESS EXCLUSIVE
lock it copies the rows every snapshot from now on would see, TRUNCATEs the
table (new, empty files: no dead version or index entry is left, whatever the
horizon) and inserts the copies back, every column as it was (a lease's
holder, generation and expiry). The held transaction never sees the
difference (it never read the table, or the lock would not have been granted).

Invariant (a lost wake is an agent silently gone quiet; a changed lease is a
broken fence): compaction keeps every row a statement starting after it could
see, unchanged, and never waits for anyone. The lock conflicts with every
reader and writer of the table, so no transaction that changed a row (or
locks one: a run-path transaction holds its lease rows' locks to its end) is
in flight while the copy is taken: the copy is exactly the committed rows. A
statement that wants the table meanwhile waits for the commit and then sees
the copies (READ COMMITTED takes a statement's snapshot after its locks). The
lock is asked for with a short `lock_timeout` (callers queue behind a waiting
request: at most LOCK_TIMEOUT_MS of delay); when it is not granted (a pg_dump
holds ACCESS SHARE on every table it dumps, for as long as it runs), nothing
changes and compaction is tried again later. An advisory lock keeps two
compactors from queueing behind each other.

When: `compact` reads the table's dead and live tuples (pg_stat_user_tables,
about a second behind) and compacts once the dead are at least `min_dead` and
`ratio` times the live, so copying the live rows costs at most 1/ratio of a
row per dead one (a large backlog's wakes, a million users' leases, are not
copied again and again) and a read walks at most about ratio + 1 versions of
a row. `held_for` (seconds; None, the default: whatever the horizon) asks
for a held horizon as well (a session's transaction or snapshot, a prepared
transaction, a replication slot: what horizon.py reports). It is not the
default: without a hold, at a steady 800 events/s autovacuum (one pass a
minute at most) let ~95,000 dead wakes build up between its passes and lag
p50 rose from 27 to 55-107 ms (bench/results/soak_gate_baseline_partial.log,
against soak_compact_leases_800_10min.json's baseline), while a burst of
runs gains 8 % without compaction (bench/results/ab_30952a7.json).
"""


from typing import Any

import psycopg.errors

from agent_inbox.records import BUSY, COMPACTED, FEW_DEAD, NOT_GRANTED, NOT_HELD, Compaction
from agent_inbox.store import one, wake_rings

# Asked for the table lock: the most any take, finish or ingest waits behind it.
LOCK_TIMEOUT_MS = 50
# Compact once this many dead tuples ...
MIN_DEAD = 5000
# ... and at least this many times the live ones ...
RATIO = 2.0
# ... and, if set, while the horizon has been held back this many seconds.
HELD_FOR = None
# pg_try_advisory_xact_lock's key: one compactor at a time.
ADVISORY_KEY = 0x61676E7401  # "agnt" 1

# The tables compacted, in the order a look goes through them.
TABLES = ("wakes", "leases")

COUNTS = """
SELECT pg_try_advisory_xact_lock(%(key)s),
       coalesce((SELECT sum(n_dead_tup) FROM pg_stat_user_tables
                  WHERE relid = ANY(%(relations)s::regclass[])), 0)::bigint,
       coalesce((SELECT sum(n_live_tup) FROM pg_stat_user_tables
                  WHERE relid = ANY(%(relations)s::regclass[])), 0)::bigint,
       %(held_for)s::float8 IS NULL
       OR EXISTS (SELECT 1 FROM pg_stat_activity a  -- this database's sessions (horizon.py)
                   WHERE (a.backend_xid IS NOT NULL OR a.backend_xmin IS NOT NULL)
                     AND a.pid <> pg_backend_pid()
                     AND a.backend_type IS DISTINCT FROM 'autovacuum worker'
                     AND (a.datname = current_database() OR a.datname IS NULL)
                     AND a.xact_start < now() - make_interval(secs => %(held_for)s))
       OR EXISTS (SELECT 1 FROM pg_prepared_xacts p
                   WHERE p.database = current_database()
                     AND p.prepared < now() - make_interval(secs => %(held_for)s))
       OR EXISTS (SELECT 1 FROM pg_replication_slots s  -- no age: held while it has one
                   WHERE s.xmin IS NOT NULL
                     AND (s.database IS NULL OR s.database = current_database()))
"""

# One round trip: the lock is held from LOCK to COMMIT only. Every column goes
# back as it was (OVERRIDING SYSTEM VALUE: a wake's id is GENERATED ALWAYS; its
# sequence is left as it is).
COMPACT = """
DO $compact$
DECLARE
    kept {table}[];
BEGIN
    LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE;
    SELECT coalesce(array_agg(t), '{{}}') INTO kept FROM {table} t;
    TRUNCATE {table};
    INSERT INTO {table} OVERRIDING SYSTEM VALUE SELECT * FROM unnest(kept);
END
$compact$
"""


def compact(conn: psycopg.Connection[Any], table: str, *, min_dead: int = MIN_DEAD, ratio: float = RATIO,
            held_for: float | None = HELD_FOR,
            lock_timeout_ms: int = LOCK_TIMEOUT_MS) -> Compaction:
    """Compact `table` (one of TABLES) if its dead tuples call for it and the
    horizon has been held for `held_for` seconds (None: whatever the horizon;
    see the module); `conn` is outside a transaction. A lock not granted in
    time is an outcome, not an error; any other failure raises, and nothing
    is changed."""
    if table not in TABLES:
        raise ValueError(f"compaction is for {', '.join(TABLES)}, not {table!r}")
    lock_timeout = f"{int(lock_timeout_ms)}ms"
    if table == "wakes":  # what earlier rotations retired, whatever this look finds;
        with conn.transaction():  # committed at once: it holds the locks it had
            if one(conn.execute("SELECT pg_try_advisory_xact_lock(%s)",
                                (ADVISORY_KEY,)))[0]:
                conn.execute("SELECT set_config('lock_timeout', %s, true)", (lock_timeout,))
                wake_rings.retire(conn)
    with conn.transaction():
        # wakes: the partitions of its live rings (store/wake_rings.py)
        relations = wake_rings.relations(conn) if table == "wakes" else [table]
        acquired, dead, live, held = one(conn.execute(COUNTS, {
            "key": ADVISORY_KEY, "relations": relations, "held_for": held_for}))
        if not acquired:
            return Compaction(table, BUSY, dead, live)
        conn.execute("SELECT set_config('lock_timeout', %s, true)", (lock_timeout,))
        if dead < max(min_dead, ratio * live):
            return Compaction(table, FEW_DEAD, dead, live)
        if not held:
            return Compaction(table, NOT_HELD, dead, live)
        try:
            with conn.transaction():  # a savepoint: a lock not granted ends only it
                if table == "wakes":
                    kept = wake_rings.rotate(conn)
                else:
                    conn.execute(COMPACT.format(table=table))
                    kept = one(conn.execute(f"SELECT count(*) FROM {table}"))[0]
        except psycopg.errors.LockNotAvailable:
            return Compaction(table, NOT_GRANTED, dead, live)
    if table == "wakes":
        try:
            with conn.transaction():
                conn.execute("SELECT set_config('lock_timeout', %s, true)", (lock_timeout,))
                wake_rings.analyze(conn)
        except psycopg.errors.LockNotAvailable:
            pass  # another ANALYZE (autovacuum's) has it
    return Compaction(table, COMPACTED, dead, live, kept)
