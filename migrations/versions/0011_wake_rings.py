"""`wakes` in a ring of partitions, so that a pg_dump does not slow finding
work (issue 21).

A take walks `ix_wakes_at` from its head, where the wakes earlier takes deleted
are. While a transaction holds the xmin horizon back VACUUM cannot remove
them, and workers used to rewrite the table without them (TRUNCATE under an
ACCESS EXCLUSIVE lock: store/compaction.py). A pg_dump holds ACCESS SHARE on
every table it dumps for as long as it runs, so that rewrite was refused and a
take walked 76,117 index tuples after four minutes at 800 events/s.

Here `wakes` is partitioned by LIST (`ring`), as PgQ rotates its event
tables. New wakes go to the ring the sequence `wakes_insert_ring` names (its
value is read outside any snapshot: a transaction that waited for a rotation,
or whose snapshot is older than it, still inserts where readers look);
`wakes_ring` names the ring the last rotation moved the live wakes to. The run
path reads those two rings only (partition pruning at run time), so the dead
wakes of a retired ring cost a take nothing, and rotating needs only locks a
pg_dump's ACCESS SHARE does not conflict with (store/wake_rings.py). A retired
ring is truncated once no session holds it, and used again.

The rows are copied into the partitioned table with their ids; `id` is now
filled from the sequence `wakes_ids` (PostgreSQL 15 has no identity column
on a partitioned table). Older code runs unchanged on the new table: it
inserts without `ring` (the default routes the row), and its reads and deletes
see every ring.

On a database `migrate --citus` laid out, nothing changes: Citus's `wakes`
stays one distributed table (workers do not rotate there), and `distribute`
lays a partitioned `wakes` out as that same table.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04
"""

from alembic import context, op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

RINGS = 3  # made at first; a rotation makes another when none is clean

UPGRADE = [
    "ALTER TABLE wakes RENAME TO wakes_0010",
    "ALTER INDEX pk_wakes RENAME TO pk_wakes_0010",
    "ALTER INDEX ix_wakes_at RENAME TO ix_wakes_at_0010",
    "CREATE SEQUENCE wakes_insert_ring AS smallint MINVALUE 0 START 0",
    "SELECT setval('wakes_insert_ring', 0)",  # called: pg_sequence_last_value reads 0, not NULL
    "CREATE SEQUENCE wakes_ids AS bigint",
    """CREATE TABLE wakes (
           user_id text NOT NULL,
           id bigint NOT NULL DEFAULT nextval('wakes_ids'),
           at bigint NOT NULL,
           from_id bigint,
           ring smallint NOT NULL
                DEFAULT pg_sequence_last_value('wakes_insert_ring'::regclass)::smallint,
           CONSTRAINT pk_wakes PRIMARY KEY (user_id, id, ring)
       ) PARTITION BY LIST (ring)""",
    "ALTER SEQUENCE wakes_ids OWNED BY wakes.id",
    "CREATE INDEX ix_wakes_at ON wakes (at, id)",
    *[f"CREATE TABLE wakes_{n} PARTITION OF wakes FOR VALUES IN ({n})" for n in range(RINGS)],
    """CREATE TABLE wakes_ring (
           ring smallint NOT NULL,
           one boolean NOT NULL DEFAULT true,
           CONSTRAINT pk_wakes_ring PRIMARY KEY (one),
           CONSTRAINT ck_wakes_ring_one CHECK (one)
       )""",
    "INSERT INTO wakes_ring (ring) VALUES (0)",
    """INSERT INTO wakes (user_id, id, at, from_id, ring)
       SELECT user_id, id, at, from_id, 0 FROM wakes_0010""",
    "SELECT setval('wakes_ids', coalesce((SELECT max(id) FROM wakes_0010), 0) + 1, false)",
    "DROP TABLE wakes_0010",
]

DOWNGRADE = [
    "ALTER TABLE wakes RENAME TO wakes_0011",
    "ALTER INDEX pk_wakes RENAME TO pk_wakes_0011",
    "ALTER INDEX ix_wakes_at RENAME TO ix_wakes_at_0011",
    """CREATE TABLE wakes (
           user_id text NOT NULL,
           id bigint GENERATED ALWAYS AS IDENTITY,
           at bigint NOT NULL,
           from_id bigint,
           CONSTRAINT pk_wakes PRIMARY KEY (user_id, id)
       )""",
    "CREATE INDEX ix_wakes_at ON wakes (at, id)",
    """INSERT INTO wakes (user_id, id, at, from_id) OVERRIDING SYSTEM VALUE
       SELECT user_id, id, at, from_id FROM wakes_0011""",
    """SELECT setval(pg_get_serial_sequence('wakes', 'id'),
                     coalesce((SELECT max(id) FROM wakes_0011), 0) + 1, false)""",
    "DROP TABLE wakes_0011",
    "DROP TABLE wakes_ring",
    "DROP SEQUENCE wakes_insert_ring",
]


def _distributed() -> bool:
    """A database `migrate --citus` laid out (as 0010 asks it); offline, a plain one."""
    if context.is_offline_mode():
        return False
    bind = op.get_bind()
    if not bind.exec_driver_sql("SELECT 1 FROM pg_extension WHERE extname = 'citus'").first():
        return False
    return bind.exec_driver_sql("SELECT 1 FROM pg_dist_partition"
                                " WHERE logicalrelid = 'events'::regclass").first() is not None


def upgrade() -> None:
    if not _distributed():
        for statement in UPGRADE:
            op.execute(statement)


def downgrade() -> None:
    if not _distributed():
        for statement in DOWNGRADE:
            op.execute(statement)
