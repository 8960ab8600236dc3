"""`citus_nodes="direct"`: the run path's take and finish calls, and the
reads across a node's shards (the due buckets of the take, the scheduler and
the dispatcher, the orphan scan), go straight to the worker node that holds
each bucket (citus_nodes.NodePools), so the coordinator neither plans nor relays
them; a finish that queues messages still goes
through the coordinator (the ids of its messages order them, and the
dispatchers hear its NOTIFY there). What each backend answered last is read
from pg_stat_activity on every node: our own connections are named by their
application, the coordinator's to a node are Citus's."""

import psycopg
import pytest

from agent_inbox import Inbox, Result, errors
from agent_inbox.backend.citus import nodes as citus_nodes
from agent_inbox.store import keys

APP = "agent-inbox-direct-test"


def last_calls(url: str) -> list[str]:
    """The last statement of each of our application's sessions on one node."""
    with psycopg.connect(url, autocommit=True) as conn:
        return [query for query, in conn.execute(
            "SELECT query FROM pg_stat_activity WHERE application_name = %s AND pid <>"
            " pg_backend_pid()", (APP,)).fetchall()]


def node_urls(url: str, cluster) -> list[str]:
    dbname = psycopg.conninfo.conninfo_to_dict(url)["dbname"]
    return [psycopg.conninfo.make_conninfo(node.url, dbname=dbname) for node in cluster.workers]


def users_on_every_node(url: str, per_node: int) -> list[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        groups = citus_nodes.NodeMap().groups(conn)
    users = []
    for group in groups:
        users += [u for u in (f"u{n}" for n in range(5000)) if keys.bucket(u) in group][:per_node]
    return users


@pytest.mark.parametrize("citus_nodes", ["direct", "auto"])  # auto: the default, every node up
def test_takes_and_finishes_go_to_the_buckets_node_and_not_through_the_coordinator(
        database_url, citus_cluster, caplog, citus_nodes):
    users = users_on_every_node(database_url, 2)
    with caplog.at_level("INFO", logger="agent_inbox.citus"), \
            Inbox.connect(database_url, pool_size=1, application_name=APP,
                          citus_nodes=citus_nodes) as inbox:
        assert inbox.citus_nodes == "direct"
        if citus_nodes == "auto":
            [said] = [r.getMessage() for r in caplog.records if "go straight to" in r.getMessage()]
            assert all(f":{node.port}" in said for node in citus_cluster.workers), said
        inbox.ingest_many([(user, "chat", "1", {}) for user in users])
        runs = inbox.runs.take_runs("w", users=10)
        assert sorted(run.user for run in runs) == sorted(users)
        assert all("agent_inbox_take(" not in q for q in last_calls(database_url))
        for node in node_urls(database_url, citus_cluster):
            assert [q for q in last_calls(node) if "agent_inbox_take(" in q], node
        assert inbox.runs.finish_runs([inbox.runs.outcome(run, Result()) for run in runs]) \
            == [True] * len(runs)
        assert all("agent_inbox_finish(" not in q for q in last_calls(database_url))
        for node in node_urls(database_url, citus_cluster):
            assert [q for q in last_calls(node) if "agent_inbox_finish(" in q], node
        # Messages: through the coordinator, in order, with the dispatchers' NOTIFY.
        inbox.ingest(users[0], "chat", "2", {})
        [run] = inbox.runs.take_runs("w", users=1)
        with psycopg.connect(database_url, autocommit=True) as listener:
            listener.execute("LISTEN agent_inbox_outbox")
            assert inbox.runs.finish_runs([inbox.runs.outcome(run, Result(messages=["a", "b"]))]) == [True]
            assert [n.channel for n in listener.notifies(timeout=5, stop_after=1)] \
                == ["agent_inbox_outbox"]
        assert [m.body for m in inbox.outbox(users[0])] == ["a", "b"]
    with psycopg.connect(database_url, autocommit=True) as conn:
        # from the coordinator's sequence: a node's own draws from (its group id) << 48
        ids = [i for i, in conn.execute("SELECT id FROM outbox ORDER BY id").fetchall()]
        assert len(ids) == 2 and ids[-1] < 2 ** 48, ids
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert conn.execute("SELECT status, count(*) FROM events GROUP BY 1").fetchall() \
            == [("done", len(users) + 1)]


def test_the_scheduler_dispatcher_and_orphan_scan_read_each_node_on_the_node(
        database_url, citus_cluster, monkeypatch):
    """Each read of due timers, due deliveries and a holder's leases is made
    on a connection to every worker node, none on the coordinator's (seen at
    citus_nodes.per_node's read, by the port each ran on); what they found is
    acted on as through the coordinator."""
    users = users_on_every_node(database_url, 1)
    worker_ports = sorted(node.port for node in citus_cluster.workers)
    read_at: list[tuple[int, str]] = []
    one_connection = citus_nodes._one_connection

    def seen(conn, statement, params):
        read_at.append((conn.info.port, statement))
        return one_connection(conn, statement, params)

    monkeypatch.setattr(citus_nodes, "_one_connection", seen)

    def read_on_every_node(fragment: str) -> None:
        ports = sorted(port for port, statement in read_at if fragment in statement)
        assert ports == worker_ports, (fragment, ports, worker_ports)
        read_at.clear()

    with Inbox.connect(database_url, pool_size=1, citus_nodes="direct") as inbox:
        for user in users:
            inbox.add_timer(user, "t", 1_000, {"n": 1})
        read_at.clear()
        assert inbox.run_scheduler(now=2_000) == len(users)
        read_on_every_node("FROM timers")
        runs = inbox.runs.take_runs("w", users=10, now=2_000)
        assert sorted(run.user for run in runs) == sorted(users)
        assert inbox.runs.finish_runs([inbox.runs.outcome(run, Result(messages=["hi"])) for run in runs],
                                 now=2_000) == [True] * len(users)
        read_at.clear()
        looked, batches = inbox.delivery.claim_due(10, now=2_000)
        assert looked == len(users) and sorted(b.user for b in batches) == sorted(users)
        read_on_every_node("FROM deliveries")
        for user in users:
            inbox.ingest(user, "chat", "orphan", {})
        orphans = inbox.runs.take_runs("w2", users=10, now=3_000)
        read_at.clear()
        assert sorted(inbox.runs.hand_back_orphans("w2", now=3_000)) \
            == sorted(run.user for run in orphans) == sorted(users)
        read_on_every_node("l.holder = ")


def test_a_stale_finish_sent_straight_to_the_node_is_refused(database_url):
    """The fence is the function's, wherever it is called from."""
    [user] = users_on_every_node(database_url, 1)[:1]
    with Inbox.connect(database_url, citus_nodes="direct", lease_ttl=30) as inbox:
        inbox.ingest(user, "chat", "1", {})
        [stale] = inbox.runs.take_runs("w1", users=1, now=1_000_000)
        [fresh] = inbox.runs.take_runs("w2", users=1, now=1_000_100)   # the lease expired: taken over
        assert inbox.runs.finish_runs([inbox.runs.outcome(stale, Result())], now=1_000_100) == [False]
        assert inbox.runs.finish_runs([inbox.runs.outcome(fresh, Result())], now=1_000_100) == [True]


def test_auto_behind_a_transaction_pooler_goes_through_the_coordinator_and_says_why(
        database_url, caplog):
    with caplog.at_level("INFO", logger="agent_inbox.citus"), \
            Inbox.connect(database_url, pooler="transaction") as inbox:
        assert inbox.citus_nodes == "coordinator"
        inbox.ingest("u1", "chat", "1", {})
        [run] = inbox.runs.take_runs("w", users=10)
        assert inbox.runs.finish_runs([inbox.runs.outcome(run, Result())]) == [True]
    assert any("behind a transaction pooler" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("bad, why", [("nodes", "must be one of auto, coordinator, direct"),
                                      ("direct", "not a pooler's")])
def test_bad_citus_nodes_are_refused_before_connecting(bad, why):
    pooler = "transaction" if bad == "direct" else "none"
    with pytest.raises(errors.InvalidInput, match=why):
        Inbox.connect("postgresql://nobody@127.0.0.1:1/none", citus_nodes=bad, pooler=pooler)
