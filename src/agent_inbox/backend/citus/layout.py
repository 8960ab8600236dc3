"""The same inbox on a Citus cluster: the distributed layout, and telling a
Citus database from a plain one.

**Distribution column: `bucket`**, a small integer derived from `user_id`
(`bucket(user)`: the first 28 bits of md5(user_id) modulo BUCKETS, the same in
Python and in SQL, `agent_inbox_bucket(text)`). Every user-keyed table gets the
column, first in its primary key and unique constraints (Citus requires the
distribution column in both), and all of them are distributed by it, co-located:
one user's events, lease, wakes, timers, outbox rows and delivery state live in
one shard, on one node. Why a bucket and not `user_id` itself: finding work
cannot name a user (it is how users are found), and Citus refuses row locks
(`FOR UPDATE`, `SKIP LOCKED`) in a statement spanning shards; a statement that
names one bucket is routed to one node and may lock, so a take walks one
bucket's wakes at a time. The column is a plain one written by the code (Citus
refuses to distribute by a generated column).

`distribute(url)` is what `agent-inbox migrate --citus` adds after the
ordinary migrations: on a coordinator database (extension created, worker
nodes added) it rebuilds the keys with the bucket column first, drops the
`fill_bucket` triggers, drops the
`events_inserted` trigger (on Citus the code that inserts events creates the
lease row and the wake itself, and the client session NOTIFYs on the
coordinator) and distributes every table. `run_stats`, keyed by worker process,
is distributed by `process`; `alembic_version` stays on the coordinator.

Routing: every statement about one user names the user's bucket with the
user (`bucket = %(bucket)s AND user_id = %(user)s`; several users: their
buckets, `bucket = ANY(%(buckets)s)`), in one text that plain PostgreSQL runs
too (migration 0012 gave its tables the column; store/keys.py makes the
parameters), and every join of two user-keyed tables joins on bucket as well:
Citus routes each to the one shard of its bucket as written.
tests/citus/test_router_plans.py EXPLAINs every statement of the run path and
fails on one that is not a single-task router plan.
"""

import logging
from typing import Any

import psycopg

from agent_inbox import db, errors
from agent_inbox.backend.citus import functions
from agent_inbox.store import one
from agent_inbox.store.keys import BUCKET_FUNCTION

log = logging.getLogger("agent_inbox.citus")

USER_TABLES = ("leases", "events", "wakes", "timers", "outbox", "deliveries", "operator_actions",
               "steps", "memory", "policies", "permit_decisions")
"""Every table keyed by user, distributed by bucket and co-located with leases."""

REFERENCE_TABLES = ("default_policies", "fleet_pause")
"""Small tables every node reads (a copy on each): read with a user's rows in
one statement, written rarely (by operators)."""

# The keys rebuilt with bucket first: (table, constraint, columns after bucket).
KEYS = (
    ("leases", "pk_leases", "PRIMARY KEY (bucket, user_id)"),
    ("events", "pk_events", "PRIMARY KEY (bucket, user_id, id)"),
    ("events", "uq_events_user_id_source_source_id", "UNIQUE (bucket, user_id, source, source_id)"),
    ("wakes", "pk_wakes", "PRIMARY KEY (bucket, user_id, id)"),
    ("timers", "pk_timers", "PRIMARY KEY (bucket, user_id, timer_id)"),
    ("outbox", "pk_outbox", "PRIMARY KEY (bucket, user_id, id)"),
    ("deliveries", "pk_deliveries", "PRIMARY KEY (bucket, user_id)"),
    ("operator_actions", "pk_operator_actions", "PRIMARY KEY (bucket, user_id, id)"),
    ("steps", "pk_steps", "PRIMARY KEY (bucket, user_id, id)"),
    ("steps", "uq_steps_user_id_event_ids_position",
     "UNIQUE (bucket, user_id, event_ids, position)"),
    ("memory", "pk_memory", "PRIMARY KEY (bucket, user_id)"),
    ("policies", "pk_policies", "PRIMARY KEY (bucket, user_id, tool)"),
    ("permit_decisions", "pk_permit_decisions", "PRIMARY KEY (bucket, user_id, id)"),
)


# A take reads one bucket's due wakes in order, a dispatcher one bucket's due
# deliveries (backend/citus/statements.py).
BUCKET_INDEXES = (
    "CREATE INDEX ix_wakes_bucket_at ON wakes (bucket, at, id)",
    "CREATE INDEX ix_deliveries_bucket_due_at ON deliveries (bucket, due_at)"
    " WHERE due_at IS NOT NULL",
)


def distributed() -> db.Queries[bool]:
    """Whether this database is a Citus coordinator with the events table
    distributed (by `distribute`)."""
    [(has_events,)] = yield db.Query(
        "SELECT to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL"
        " AND to_regclass('events') IS NOT NULL")
    if not has_events:
        return False
    is_it: bool
    [(is_it,)] = yield db.Query(
        "SELECT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = 'events'::regclass)")
    return is_it


def is_distributed(conn: psycopg.Connection[Any]) -> bool:
    """`distributed()` asked on `conn`."""
    return db.run(conn, distributed())


def _connect(url: str) -> psycopg.Connection:
    try:
        return psycopg.connect(url, autocommit=True, connect_timeout=10)
    except psycopg.OperationalError as exc:
        raise errors.DatabaseUnavailable(f"could not reach the database: {exc}") from None


def require_coordinator(url: str) -> None:
    """Raise InvalidInput unless `url` is a Citus coordinator with worker nodes."""
    with _connect(url) as conn:
        _require_coordinator(conn)


def _require_coordinator(conn: psycopg.Connection[Any]) -> None:
    has_extension = one(conn.execute(
        "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')"))[0]
    if not has_extension:
        raise errors.InvalidInput(
            "--citus", True, "needs a Citus coordinator: this database has no citus extension "
            "(CREATE EXTENSION citus, and add the worker nodes with citus_add_node)")
    workers = one(conn.execute(
        "SELECT count(*) FROM pg_dist_node WHERE noderole = 'primary' AND groupid <> 0"
    ))[0]
    if workers == 0:
        raise errors.InvalidInput(
            "--citus", True, "the coordinator has no worker nodes: add them with "
            "SELECT citus_add_node('host', port) first")


def distribute(url: str, *, shard_count: int = 32) -> bool:
    """Lay the migrated schema at `url` out over the Citus cluster (see the
    module's docstring). On a database already laid out, the tables a later
    migration added are laid out the same way (steps in 0006; memory, policies
    and permit_decisions in 0007, and default_policies as a reference table).
    `limits`, the fleet's rate budgets, stays a table of the coordinator's own.
    The run path's functions (functions.py) are installed after the
    tables, and replaced where this code's differ. False if there was nothing
    to do; True if this call distributed or installed something. Runs in
    autocommit, step by step: Citus distributes a table in a transaction of its
    own."""
    with _connect(url) as conn:
        _require_coordinator(conn)
        present = [t for t in USER_TABLES + REFERENCE_TABLES if _exists(conn, t)]
        user_tables = [t for t in USER_TABLES if t in present]
        if is_distributed(conn):
            added = [table for table in user_tables if not _is_distributed_table(conn, table)]
            shared = [table for table in REFERENCE_TABLES
                      if table in present and not _is_distributed_table(conn, table)]
            if added or shared:
                with conn.transaction():
                    _add_buckets(conn, added)
                for table in added:
                    _colocate(conn, table)
                for table in shared:
                    conn.execute("SELECT create_reference_table(%s)", (table,))
            return functions.install(conn) or bool(added or shared)
        with conn.transaction():
            conn.execute(BUCKET_FUNCTION)
            conn.execute("DROP TRIGGER IF EXISTS events_inserted ON events")
            _one_wakes_table(conn)
            _add_buckets(conn, user_tables)
            for statement in BUCKET_INDEXES:
                conn.execute(statement)
        conn.execute("SELECT create_distributed_table('leases', 'bucket', shard_count => %s)",
                     (shard_count,))
        for table in user_tables[1:]:
            _colocate(conn, table)
        conn.execute("SELECT create_distributed_table('run_stats', 'process', "
                     "shard_count => %s)", (shard_count,))
        for table in REFERENCE_TABLES:
            if table in present:
                conn.execute("SELECT create_reference_table(%s)", (table,))
        functions.install(conn)
    return True


# `wakes` as one table, as it was before migration 0011 partitioned it into
# rings: workers do not rotate it on Citus (store/wake_rings.py), and the
# statements that read it here name no ring.
ONE_WAKES_TABLE = (
    "ALTER TABLE wakes RENAME TO wakes_in_rings",
    "ALTER INDEX pk_wakes RENAME TO pk_wakes_in_rings",
    "ALTER INDEX ix_wakes_at RENAME TO ix_wakes_at_in_rings",
    """CREATE TABLE wakes (
           user_id text NOT NULL,
           id bigint GENERATED ALWAYS AS IDENTITY,
           at bigint NOT NULL,
           from_id bigint,
           bucket int NOT NULL,
           CONSTRAINT pk_wakes PRIMARY KEY (user_id, id))""",
    "CREATE INDEX ix_wakes_at ON wakes (at, id)",
    """INSERT INTO wakes (bucket, user_id, id, at, from_id) OVERRIDING SYSTEM VALUE
       SELECT bucket, user_id, id, at, from_id FROM wakes_in_rings""",
    """SELECT setval(pg_get_serial_sequence('wakes', 'id'),
                     coalesce((SELECT max(id) FROM wakes_in_rings), 0) + 1, false)""",
    "DROP TABLE wakes_in_rings, wakes_ring",
    "DROP SEQUENCE wakes_insert_ring",
)


def _one_wakes_table(conn: psycopg.Connection[Any]) -> None:
    """Lay a partitioned `wakes` (migration 0011) out as ONE_WAKES_TABLE."""
    partitioned = one(conn.execute(
        "SELECT EXISTS (SELECT 1 FROM pg_partitioned_table WHERE partrelid = 'wakes'::regclass)"
    ))[0]
    if partitioned:
        for statement in ONE_WAKES_TABLE:
            conn.execute(statement)


def _add_buckets(conn: psycopg.Connection[Any], tables: list[str]) -> None:
    """Give `tables` their keys rebuilt with `bucket` first, and no
    `fill_bucket` trigger (Citus refuses triggers on a distributed table: on
    Citus every insert names the bucket itself). Migration 0012 added the
    column; a table a later migration made on a database laid out before it
    (0012 leaves such a database alone) gets it here, filled."""
    for table in tables:
        has_bucket = one(conn.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(%s)"
            " AND attname = 'bucket' AND NOT attisdropped)", (table,)))[0]
        if not has_bucket:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN bucket int")
            conn.execute(f"UPDATE {table} SET bucket = agent_inbox_bucket(user_id)")
            conn.execute(f"ALTER TABLE {table} ALTER COLUMN bucket SET NOT NULL")
        conn.execute(f"DROP TRIGGER IF EXISTS fill_bucket ON {table}")
    for table, name, definition in KEYS:
        if table in tables:
            conn.execute(f"ALTER TABLE {table} DROP CONSTRAINT {name}")
            conn.execute(f"ALTER TABLE {table} ADD CONSTRAINT {name} {definition}")


def _colocate(conn: psycopg.Connection[Any], table: str) -> None:
    conn.execute("SELECT create_distributed_table(%s, 'bucket', colocate_with => 'leases')",
                 (table,))


def _exists(conn: psycopg.Connection[Any], table: str) -> bool:
    """Whether the migrations so far made `table` (a database laid out at an
    older revision lacks the later tables: they are laid out when they come)."""
    exists: bool = one(conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table,)))[0]
    return exists


def _is_distributed_table(conn: psycopg.Connection[Any], table: str) -> bool:
    distributed: bool = one(conn.execute("SELECT EXISTS (SELECT 1 FROM pg_dist_partition"
                                         " WHERE logicalrelid = to_regclass(%s))", (table,)))[0]
    return distributed


class Detector:
    """A pool's `configure` callback: its first connection asks whether the
    database is distributed (`distributed`, None until then); on Citus each
    connection of the pool then gets the coordinator's node connection timeout,
    if one is set."""

    def __init__(self, *, node_connection_timeout: float | None = None):
        self.distributed: bool | None = None
        # Seconds the coordinator may take to open a connection to a worker
        # node for this session (Citus's default is 30), if set: a session
        # setting, so not behind a transaction pooler.
        self.node_connection_timeout = node_connection_timeout

    def set_up(self) -> db.Queries[None]:
        """A new connection's statements (see the class)."""
        if self.distributed is None:
            self.distributed = yield from distributed()
        if self.distributed and self.node_connection_timeout:
            yield db.Query("SELECT set_config('citus.node_connection_timeout', %s, false)",
                           (f"{int(self.node_connection_timeout * 1000)}ms",))

    def __call__(self, conn: psycopg.Connection[Any]) -> None:
        db.run(conn, self.set_up())

    async def configure_async(self, conn: psycopg.AsyncConnection) -> None:
        """The callback of an asyncio pool (db.open_async_pool)."""
        await db.run_async(conn, self.set_up())
