"""The demo and the operator CLI through PgBouncer in transaction mode, and the
switch itself: behind it, no statement is left prepared on a server connection.

One server connection per database (POOL_SIZE = 1), so what the code left on
its server session is what the next client sees there.
"""

import os
import subprocess
import sys

import psycopg
import pytest

from agent_inbox import Inbox
from agent_inbox.dev import demo
from tests.runtime.support import ROOT

POOL_SIZE = 1
EXPECTED = os.path.join(ROOT, "tests", "data", "expected_demo_output.txt")


def agent_inbox(*args, env=None):
    done = subprocess.run([sys.executable, "-m", "agent_inbox.cli", *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={**os.environ, **(env or {})})
    return done.returncode, done.stdout, done.stderr


def test_the_demo_through_pgbouncer_prints_the_reference_lines(bouncer, server_url):
    code, out, err = agent_inbox("demo", "--database-url", bouncer.url(server_url),
                                 "--pooler", "transaction")
    assert code == 0, err
    assert out.splitlines() == open(EXPECTED).read().splitlines()


@pytest.mark.parametrize("pooler, prepared", [("none", True), ("transaction", False)])
def test_behind_a_transaction_pooler_no_statement_is_left_prepared(bounced_url, pooler,
                                                                   prepared):
    """pooler="none" is the control: the same calls leave psycopg's statements
    prepared on the server connection, which the next transaction's client may
    not know (or may name again)."""
    with Inbox.connect(bounced_url, pool_size=1, pooler=pooler) as inbox:
        demo.scenarios(inbox, say=lambda *words: None)
        with inbox.pool.connection() as conn:
            names = [name for name, in conn.execute(
                "SELECT name FROM pg_prepared_statements").fetchall()]
    assert bool(names) is prepared, names


def test_operator_commands_through_pgbouncer_leave_no_statement_prepared(inbox, bounced_url):
    """`prune` runs its two statements once per 200 users: over 1,200 users,
    more often than psycopg's prepare threshold on its one connection. The
    server connection outlives the command in PgBouncer's pool, so what it left
    prepared there is what the next client sees."""
    inbox.ingest_many([(f"u{n:04}", "chat", "1", {}) for n in range(1400)])
    env = {"AGENT_INBOX_POOLER": "transaction"}
    code, out, err = agent_inbox("status", "--database-url", bounced_url, env=env)
    assert code == 0, err
    assert "total: 1400 users, 1400 pending, 0 running, 0 dead" in out
    code, out, err = agent_inbox("prune", "--older-than", "0", "--database-url", bounced_url,
                                 env=env)
    assert code == 0 and "prune: 1400 users" in err, err
    with psycopg.connect(bounced_url, prepare_threshold=None) as conn:
        assert conn.execute("SELECT name FROM pg_prepared_statements").fetchall() == []
