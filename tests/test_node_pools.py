"""citus.NodePools, the connections kept to each Citus worker node for the
calls sent straight to it (`citus_nodes="direct"`), on one plain server
standing for a node: a connection is kept for the next call, one closed under
it while idle (the node restarted) is found by the check before use and
replaced, and one left in a transaction or broken is not kept; a call beyond
`size` connections waits for one given back, and fails as the node's if none
is within `wait`. (On a real
cluster: tests/citus/test_direct.py and test_node_down.py.)"""

import threading

import psycopg
import pytest

from agent_inbox.backend.citus import nodes as citus_nodes
from agent_inbox import Inbox, db


class OneNode:
    """A node map that puts every bucket on the test server."""

    def __init__(self, url: str):
        info = psycopg.conninfo.conninfo_to_dict(url)
        self._address = (info.get("host", "127.0.0.1"), int(info.get("port", 5432)))

    def address(self, bucket: int):
        return self._address

    def failed(self, buckets, exc, seconds):
        pass

    def answered(self, buckets):
        pass


@pytest.fixture
def pools(agent_inbox_database):
    kept = citus_nodes.NodePools(agent_inbox_database, OneNode(agent_inbox_database),
                           lambda url: db.connect(url, name="node-pools-test"), size=2)
    yield kept
    kept.close()


def backend(pools) -> int:
    with pools.connection(0) as conn:
        return conn.info.backend_pid


def test_a_connection_is_kept_for_the_next_call(pools):
    assert backend(pools) == backend(pools)


def test_one_closed_while_idle_is_checked_and_replaced(pools, agent_inbox_database, monkeypatch):
    first = backend(pools)
    with psycopg.connect(agent_inbox_database, autocommit=True) as admin:
        # returns once the backend has ended (up to 10 s)
        assert admin.execute("SELECT pg_terminate_backend(%s, 10000)", (first,)).fetchone()[0]
    monkeypatch.setattr(citus_nodes, "IDLE_CHECK_S", 0.0)     # every kept one idle long enough
    with pools.connection(0) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        assert conn.info.backend_pid != first


def test_unchecked_a_connection_closed_while_idle_fails_the_call(pools, agent_inbox_database,
                                                               monkeypatch):
    """What the check is for: without it the call goes out on the closed one."""
    first = backend(pools)
    with psycopg.connect(agent_inbox_database, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s, 10000)", (first,))
    monkeypatch.setattr(citus_nodes, "IDLE_CHECK_S", 3600.0)
    with pytest.raises(psycopg.OperationalError), pools.connection(0) as conn:
        conn.execute("SELECT 1")
    assert backend(pools) != first                       # the broken one was not kept


def test_one_left_in_a_transaction_is_not_kept(pools):
    with pools.connection(0) as conn:
        conn.execute("BEGIN")
        left = conn.info.backend_pid
    assert backend(pools) != left


def waiting(pools) -> int:
    """How many calls wait for a connection to come back."""
    return len(pools._returned._waiters)


def test_a_call_beyond_size_waits_for_a_connection_given_back_and_opens_none(pools):
    """size=2: with both connections in use, a third call waits for one of
    them (a connection opened for one call would cost the node a backend's
    start and its plans each time); it gets the first one given back."""
    got = {}
    with pools.connection(0) as first, pools.connection(0) as second:
        assert first.info.backend_pid != second.info.backend_pid

        def third():
            with pools.connection(0) as conn:
                got["pid"] = conn.info.backend_pid

        caller = threading.Thread(target=third)
        caller.start()
        for _ in range(500):  # until the third call waits (or, wrongly, got one)
            if waiting(pools) or got:
                break
            threading.Event().wait(0.01)
        assert not got and waiting(pools) == 1
        first_pid = first.info.backend_pid
    caller.join(10)
    assert got["pid"] in (first_pid, second.info.backend_pid)
    with psycopg.connect(pools._url, autocommit=True) as conn:
        [opened] = conn.execute("SELECT count(*) FROM pg_stat_activity"
                                " WHERE application_name = 'node-pools-test'").fetchone()
    assert opened == 2


def test_a_call_that_finds_no_connection_free_within_wait_fails_as_the_nodes(
        agent_inbox_database):
    pools = citus_nodes.NodePools(agent_inbox_database, OneNode(agent_inbox_database),
                            lambda url: db.connect(url, name="node-pools-test"), size=1, wait=0.2)
    try:
        with pools.connection(0):
            failures = []
            assert pools.call([0], failures, lambda conn: 1) is None
        [failure] = failures
        assert isinstance(failure, psycopg.OperationalError) and "came free" in str(failure)
        assert pools.call([0], [], lambda conn: 1) == 1   # given back: free again
    finally:
        pools.close()


def test_on_plain_postgresql_the_default_auto_asks_no_node(agent_inbox_database):
    with Inbox.connect(agent_inbox_database) as inbox:
        assert inbox.citus_nodes == "none"
