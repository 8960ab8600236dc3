"""A worker node that is down holds up only its own users.

On a Citus cluster of its own (a node is stopped here: never the session's
cluster), with the second worker node stopped: a take finds and takes the
first node's users (the due-bucket read goes node by node and skips one that
does not answer); a batch of finishes commits the first node's runs and says
which it could not (PartlyDone); a renewal says which leases it could not
reach; and a worker process keeps serving the first node's users, new work
included, while runs of the stopped node wait for it, then commit under
their own leases once it is back: no event claimed twice.
"""

import os
import signal
import subprocess
import sys

import psycopg
import pytest

from agent_inbox import Inbox, Result, errors
from agent_inbox.backend.citus import nodes as citus_nodes
from agent_inbox.store import keys
from tests.citus.support import started_cluster
from tests.runtime.support import ROOT, stop_all, wait_until, worker_args

NODE_BUCKETS = f"""
SELECT n.nodeport, array_agg(b ORDER BY b)
  FROM generate_series(0, {keys.BUCKETS - 1}) b
  JOIN pg_dist_placement p ON p.shardid = get_shard_id_for_distribution_column('leases', b)
  JOIN pg_dist_node n ON n.groupid = p.groupid
 GROUP BY n.nodeport
"""


@pytest.fixture(scope="module")
def citus_cluster():
    """This module's own cluster, in place of the session's: a test here stops a
    node (conftest's `fresh_citus_database` lays its databases out on this one)."""
    with started_cluster() as cluster:
        yield cluster


@pytest.fixture
def database_url(fresh_citus_database):
    """A database of each test's own on this module's cluster (the session's
    emptied one is on the session's cluster), as a node is stopped while runs
    are in flight here: what that leaves (transactions prepared on a node,
    rows of runs cut short) stays with the test."""
    return fresh_citus_database


@pytest.fixture
def cluster(citus_cluster, database_url):
    yield citus_cluster
    for node in citus_cluster.workers:  # a test that failed half-way may leave one stopped
        if not node.running:
            node.start()


@pytest.fixture
def url(database_url, cluster):
    return database_url


def users_by_node(url, cluster, count):
    """`count` user names on the first worker node, and `count` on the second."""
    with psycopg.connect(url, autocommit=True) as conn:
        buckets = dict(conn.execute(NODE_BUCKETS).fetchall())
    first, second = (set(buckets[node.port]) for node in cluster.workers)
    names = (f"user-{n}" for n in range(10_000))
    live, down = [], []
    for name in names:
        group = live if keys.bucket(name) in first else down
        if len(group) < count:
            group.append(name)
        if len(live) == len(down) == count:
            return live, down, sorted(first)


def test_the_node_map_agrees_with_citus_on_every_bucket(url):
    with psycopg.connect(url, autocommit=True) as conn:
        by_citus = dict(conn.execute(
            f"""SELECT b, p.groupid FROM generate_series(0, {keys.BUCKETS - 1}) b
                  JOIN pg_dist_placement p
                    ON p.shardid = get_shard_id_for_distribution_column('leases', b)""").fetchall())
        groups = citus_nodes.NodeMap().groups(conn)
    assert sorted(b for group in groups for b in group) == list(range(keys.BUCKETS))
    assert len(groups) == 2
    for group in groups:
        assert len({by_citus[b] for b in group}) == 1, group


def done_in(url, buckets):
    """Done events in `buckets` (a read the stopped node need not answer)."""
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM events WHERE bucket = ANY(%s)"
                            " AND status = 'done'", (buckets,)).fetchone()[0]


@pytest.mark.parametrize("citus_nodes", citus_nodes.NODES)
def test_the_api_serves_the_nodes_that_answer_and_says_what_it_could_not(url, cluster,
                                                                         citus_nodes):
    """Through the coordinator, or with the take and finish calls sent straight
    to the nodes (the stopped node's pooled connections are then lost too)."""
    live, down, _ = users_by_node(url, cluster, 3)
    late = live.pop()                                        # its work arrives while a node is down
    with Inbox.connect(url, lease_ttl=60, citus_nodes=citus_nodes) as inbox:
        inbox.ingest_many([(user, "chat", "1", {}) for user in live + down])
        runs = inbox.runs.take_runs("holder", users=10)
        assert sorted(run.user for run in runs) == sorted(live + down)
        cluster.workers[1].stop(remove=False)
        inbox.ingest(late, "chat", "1", {})                  # one node's transaction
        [late_run] = inbox.runs.take_runs("holder", users=10)     # the down node's buckets skipped
        assert late_run.user == late
        runs.append(late_run)
        on_down = [run for run in runs if run.user in down]
        with pytest.raises(errors.PartlyDone) as renewal:
            inbox.runs.renew_runs(runs)
        assert renewal.value.unknown == {run.key for run in on_down}
        assert renewal.value.done == {run.key for run in runs if run.user not in down}
        with pytest.raises(errors.PartlyDone) as finish:
            inbox.runs.finish_runs([inbox.runs.outcome(run, Result()) for run in runs])
        assert finish.value.done == [None if run.user in down else True for run in runs]
        cluster.workers[1].start()
        assert inbox.runs.finish_runs([inbox.runs.outcome(run, Result()) for run in on_down]) \
            == [True] * len(on_down)                         # under the leases they had
        assert inbox.runs.take_runs("holder", users=10) == []     # none left behind, none twice
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT status, attempts, count(*) FROM events GROUP BY 1, 2"
                            ).fetchall() == [("done", 1, 6)]


def test_auto_goes_through_the_coordinator_when_a_node_is_down_at_start_and_says_why(
        url, cluster, caplog):
    """The default, `citus_nodes="auto"`, asks every node when the Inbox
    opens: with the second node stopped, the calls go through the
    coordinator (which serves the first node's users), and a warning names
    the node; with both up again, a new Inbox goes straight to the nodes."""
    live, down, _ = users_by_node(url, cluster, 1)
    cluster.workers[1].stop(remove=False)
    with caplog.at_level("INFO", logger="agent_inbox.citus"):
        with Inbox.connect(url, lease_ttl=60) as inbox:
            assert inbox.citus_nodes == "coordinator"
            inbox.ingest(live[0], "chat", "1", {})
            [run] = inbox.runs.take_runs("holder", users=10)
            assert run.user == live[0]
            assert inbox.runs.finish_runs([inbox.runs.outcome(run, Result())]) == [True]
    [warning] = [r.getMessage() for r in caplog.records
                 if r.levelname == "WARNING" and "from here" in r.getMessage()]
    assert f":{cluster.workers[1].port} does not answer from here" in warning
    assert "go through the coordinator" in warning
    cluster.workers[1].start()
    caplog.clear()
    with caplog.at_level("INFO", logger="agent_inbox.citus"):
        with Inbox.connect(url) as inbox:
            assert inbox.citus_nodes == "direct"
    assert any("go straight to the 2 worker nodes" in r.getMessage() for r in caplog.records)


def start_worker(url, log_path):
    args = worker_args(url, "hold_until_released", "--concurrency", "10", "--poll-interval", "0.2",
                       "--lease-ttl", "30")
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "agent_inbox.cli", *args], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def test_a_worker_serves_the_live_node_while_the_other_is_down(url, cluster, tmp_path):
    live, down, live_buckets = users_by_node(url, cluster, 4)
    release = {user: str(tmp_path / f"{user}-1") for user in live + down}
    with Inbox.connect(url) as inbox:
        inbox.ingest_many([(user, "chat", "1", {"release_file": release[user]})
                           for user in live + down])
    worker = start_worker(url, tmp_path / "worker.log")
    try:
        wait_until(lambda: all(os.path.exists(path + ".started") for path in release.values()),
                   "every run in flight", timeout=60)
        cluster.workers[1].stop(remove=False)
        for path in release.values():
            open(path, "w").close()
        wait_until(lambda: done_in(url, live_buckets) == len(live),
                   "the live node's runs to commit", timeout=60)
        # New work for the live node's users is taken while the other is down.
        with Inbox.connect(url) as inbox:
            for user in live:
                again = str(tmp_path / f"{user}-2")
                open(again, "w").close()
                inbox.ingest(user, "chat", "2", {"release_file": again})
        wait_until(lambda: done_in(url, live_buckets) == 2 * len(live),
                   "the live node's new work to be done", timeout=60)
        cluster.workers[1].start()
        wait_until(lambda: done_in(url, list(range(keys.BUCKETS))) == 2 * len(live) + len(down),
                   "the stopped node's runs to commit once it is back", timeout=60)
    finally:
        stop_all([worker], kill=lambda process: os.killpg(process.pid, signal.SIGKILL))
    log = (tmp_path / "worker.log").read_text()
    assert worker.returncode == 0, log[-3000:]
    assert "did not answer" in log
    with psycopg.connect(url, autocommit=True) as conn:
        events = conn.execute("SELECT status, attempts, count(*) FROM events GROUP BY 1, 2"
                              ).fetchall()
        messages = conn.execute("SELECT body, count(*) FROM outbox GROUP BY 1").fetchall()
    assert events == [("done", 1, 2 * len(live) + len(down))]      # none claimed twice
    assert messages == [("released", 2 * len(live) + len(down))]   # one per run
