"""Citus clusters for the tests of this folder: started from the local
binaries, skipped (saying why) only where the extension is not installed;
and the databases the tests run on."""

import contextlib
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from agent_inbox.backend.citus import layout as citus
from agent_inbox.schema import migrate
from agent_inbox.dev import pgserver

EMPTYING_LOCK_TIMEOUT = "10s"
"""How long emptying waits for the lock on a table before it fails, naming
the sessions still in the database (a session holding a lock then is one a
test left running: a worker, a service, a connection in a transaction)."""


@contextlib.contextmanager
def started_cluster() -> Iterator[pgserver.CitusCluster]:
    """A coordinator and two worker nodes for the block."""
    if not pgserver.citus_installed():
        pytest.skip("the Citus extension is not installed for the local PostgreSQL "
                    "(tests/setup-deps.sh, which ./dev test runs, installs it from "
                    "../shared/citus/ when run as root)")
    with pgserver.CitusCluster(workers=2) as cluster:
        yield cluster


def distributed_database(cluster: pgserver.CitusCluster) -> str:
    """A fresh database on every node, migrated and laid out as `migrate
    --citus` does (the ordinary migrations, then citus.distribute); its URL."""
    url = cluster.create_database()
    migrate.upgrade(url)
    citus.distribute(url)
    return url


def migrated_tables(conn: psycopg.Connection) -> list[str]:
    """The tables the migrations made (every table of the public schema but
    alembic_version; a Citus shard is not one, nor is it listed here)."""
    return [name for name, in conn.execute(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p')"
        "   AND c.relname <> 'alembic_version'"
        "   AND NOT EXISTS (SELECT 1 FROM pg_dist_shard s"
        "                    WHERE shard_name(s.logicalrelid, s.shardid) = c.relname)"
        " ORDER BY 1").fetchall()]


def require_empty(url: str) -> None:
    """Fails unless every migrated table at `url` is empty: what empty() restores
    (a migration that seeds rows would need empty() to put them back)."""
    with psycopg.connect(url, autocommit=True) as conn:
        counts = {table: conn.execute(sql.SQL("SELECT count(*) FROM {}").format(
            sql.Identifier(table))).fetchone()[0] for table in migrated_tables(conn)}
    seeded = {table: count for table, count in counts.items() if count}
    if seeded:
        pytest.fail(f"the migrations left rows in {seeded}: emptying between tests "
                    "(tests/citus/support.py, empty) would delete them", pytrace=False)


def empty(url: str) -> None:
    """Bring the database at `url`, made by distributed_database(), back to the
    state distributed_database() returned it in: every migrated table emptied
    (the migrations seed none: require_empty) and every identity restarting at
    1; alembic_version, the schema and the Citus layout kept. Prepared
    transactions a killed client left on the worker nodes are settled first
    (as Citus's maintenance daemon would within a minute), so that they hold
    no lock. Fails, naming the sessions in the database, where a lock on a
    table is not had within EMPTYING_LOCK_TIMEOUT: never waits on them."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT recover_prepared_transactions()")
        tables = migrated_tables(conn)
        try:
            with conn.transaction():
                # the SET LOCAL after this one holds on the worker nodes' shards too
                conn.execute("SET LOCAL citus.propagate_set_commands = 'local'")
                conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(
                    sql.Literal(EMPTYING_LOCK_TIMEOUT)))
                conn.execute(sql.SQL("TRUNCATE {} RESTART IDENTITY").format(
                    sql.SQL(", ").join(map(sql.Identifier, tables))))
        except psycopg.errors.LockNotAvailable as exc:
            sessions = conn.execute(
                "SELECT pid, application_name, state, left(query, 200) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                "   AND backend_type = 'client backend'"
                "   AND application_name NOT LIKE 'citus\\_internal%'").fetchall()
            listed = "".join(f"\n  pid {pid} {name!r}, {state}: {query}"
                             for pid, name, state, query in sessions) or " none left"
            pytest.fail(f"emptying the session's Citus test database waited over "
                        f"{EMPTYING_LOCK_TIMEOUT} for a lock on its tables "
                        f"({' '.join(str(exc).split())}): a previous test left a session "
                        f"in it, in a transaction (a worker, a service, a connection not "
                        f"closed). Its client sessions now:{listed}", pytrace=False)
