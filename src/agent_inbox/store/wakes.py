"""Compacting `wakes`: finding work stays cheap while VACUUM cannot keep up.

Every run inserts and deletes wakes (its arrival's, its lease end's, its
release's), and a take reads the due ones from the head of `ix_wakes_at`
(store/inbox.py, TAKE_WORK), right where the deleted ones are. While a
transaction held open anywhere in the database keeps VACUUM from removing
them (horizon.py), their row versions and index entries pile up there and every
take walks all of them: 81,688 index tuples per take after four minutes at 800
events/s, against ~6,000 without the hold (docs/operating/horizon.md).

COMPACT rewrites the table with its live rows only, the way PgQ rotates its
event tables: under an ACCESS EXCLUSIVE lock it copies the rows every snapshot
from now on would see, TRUNCATEs the table (new, empty files: no dead version
or index entry is left, whatever the horizon) and inserts the copies back with
their ids and times. The held transaction never sees the difference (it never
read `wakes`, or the lock would not have been granted).

Invariant (a lost wake is an agent silently gone quiet): compaction keeps every
wake a statement starting after it could see, unchanged (user, at, id), and
never waits for anyone. The lock conflicts with every reader and writer of
`wakes`, so no transaction that inserted or deleted a wake is in flight while
the copy is taken: the copy is exactly the committed rows. A statement that
wants `wakes` meanwhile waits for the commit and then sees the rows (READ
COMMITTED takes a statement's snapshot after its locks). The lock is asked for
with a short `lock_timeout` (callers' queue behind a waiting request: at most
LOCK_TIMEOUT_MS of delay); when it is not granted (a pg_dump holds ACCESS SHARE
on every table it dumps, for as long as it runs), nothing changes and
compaction is tried again later. An advisory lock keeps two compactors from
queueing behind each other.

When: `compact` reads the table's dead and live tuples (pg_stat_user_tables,
about a second behind) and compacts once the dead are at least `min_dead` and
`ratio` times the live, so copying the live rows costs at most 1/ratio of a
row per dead one (a large backlog's wakes are not copied again and again).
Worth it with or without a hold: autovacuum lets a few thousand dead wakes
build up between its passes under load too.
"""

import dataclasses

import psycopg.errors

# Asked for the table lock: the most any take, finish or ingest waits behind it.
LOCK_TIMEOUT_MS = 50
# Compact once this many dead tuples ...
MIN_DEAD = 5000
# ... and at least this many times the live ones.
RATIO = 2.0
# pg_try_advisory_xact_lock's key: one compactor at a time.
ADVISORY_KEY = 0x61676E7401  # "agnt" 1

COUNTS = """
SELECT pg_try_advisory_xact_lock(%(key)s),
       coalesce((SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = 'wakes'::regclass), 0),
       coalesce((SELECT n_live_tup FROM pg_stat_user_tables WHERE relid = 'wakes'::regclass), 0)
"""

# One round trip: the lock is held from LOCK to COMMIT only. Ids are inserted as
# they were (the identity is GENERATED ALWAYS; its sequence is left as it is).
COMPACT = """
DO $compact$
DECLARE
    kept wakes[];
BEGIN
    LOCK TABLE wakes IN ACCESS EXCLUSIVE MODE;
    SELECT coalesce(array_agg(w), '{}') INTO kept FROM wakes w;
    TRUNCATE wakes;
    INSERT INTO wakes (user_id, id, at) OVERRIDING SYSTEM VALUE
    SELECT k.user_id, k.id, k.at FROM unnest(kept) k ORDER BY k.at, k.id;
END
$compact$
"""


# What a look at the table came to (Compaction.outcome).
COMPACTED = "compacted"
FEW_DEAD = "few dead tuples"
BUSY = "another compactor is at work"
NOT_GRANTED = "the table lock was not granted in time"


@dataclasses.dataclass(frozen=True)
class Compaction:
    """What one look at `wakes` found and did."""

    outcome: str     # COMPACTED, FEW_DEAD, BUSY or NOT_GRANTED
    dead: int        # dead tuples before (statistics: about a second behind)
    live: int        # live tuples before (statistics)
    kept: int | None = None  # the wakes kept (counted), when compacted


def compact(conn, *, min_dead: int = MIN_DEAD, ratio: float = RATIO,
            lock_timeout_ms: int = LOCK_TIMEOUT_MS) -> Compaction:
    """Compact `wakes` if its dead tuples call for it (see the module); `conn`
    is outside a transaction. A lock not granted in time is an outcome, not an
    error; any other failure raises, and nothing is changed."""
    with conn.transaction():
        acquired, dead, live = conn.execute(COUNTS, {"key": ADVISORY_KEY}).fetchone()
        if not acquired:
            return Compaction(BUSY, dead, live)
        if dead < max(min_dead, ratio * live):
            return Compaction(FEW_DEAD, dead, live)
        conn.execute("SELECT set_config('lock_timeout', %s, true)", (f"{int(lock_timeout_ms)}ms",))
        try:
            with conn.transaction():  # a savepoint: a lock not granted ends only it
                conn.execute(COMPACT)
        except psycopg.errors.LockNotAvailable:
            return Compaction(NOT_GRANTED, dead, live)
        kept = conn.execute("SELECT count(*) FROM wakes").fetchone()[0]
    return Compaction(COMPACTED, dead, live, kept)
