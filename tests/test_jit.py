"""JIT compilation is off on the pool's direct connections (db.open_pool): a
run-path statement whose estimated cost passes `jit_above_cost` would
otherwise compile itself on every execution (about a second, measured on a
take during the chaos test's backlog). Behind a transaction pooler no session
setting is made; the server's is kept (docs/operating/pgbouncer.md)."""

import psycopg
import pytest

from agent_inbox import Inbox, db
from agent_inbox.records import ClaimPolicy
from agent_inbox.store import inbox as store_inbox, wake_rings


def take_plan(inbox: Inbox) -> str:
    """The take's EXPLAIN ANALYZE on a pooled connection, with every plan past
    the JIT cost threshold (the transaction is rolled back)."""
    params = {"holder": "H", "ttl": 30, "now": None, "users": 4, **ClaimPolicy().params()}
    with db.connection(inbox.pool) as conn, conn.transaction(force_rollback=True):
        conn.execute("SET LOCAL jit_above_cost = 0")
        rows = conn.execute("EXPLAIN (ANALYZE) " + store_inbox.TAKE_WORK,
                            {**params, **wake_rings.Given().params(conn)}).fetchall()
    return "\n".join(line for line, in rows)


@pytest.fixture
def jit_available(database_url):
    with psycopg.connect(database_url) as conn:  # the server's own settings
        if not conn.execute("SELECT pg_jit_available()").fetchone()[0]:
            pytest.skip("this server has no JIT provider, or jit is off: nothing to turn off")


def test_a_take_is_never_jit_compiled_on_a_direct_connection(database_url, jit_available):
    with Inbox.connect(database_url, pool_size=1) as inbox:
        inbox.ingest("u", "chat", "1", {})
        assert "JIT:" not in take_plan(inbox)


def test_behind_a_pooler_the_servers_setting_is_kept(database_url, jit_available):
    with Inbox.connect(database_url, pool_size=1, pooler="transaction") as inbox:
        inbox.ingest("u", "chat", "1", {})
        assert "JIT:" in take_plan(inbox)           # what a take costs where jit is on
