"""A worker node that hangs (SIGSTOP: TCP connects, nothing answers) holds up
only its own users.

On a Citus cluster of its own (a node is stopped here: never the session's
cluster). What bounds a call: the pool's statement bound (db.BoundedConnection:
the coordinator waits for a hung node even to cancel a statement that timed
out, so the client gives up on the connection), the coordinator's
statement_timeout and citus.node_connection_timeout for a connection it opens
to the node, all from Inbox.connect's `statement_timeout` and
`connect_timeout`. A node that timed out is set aside for a while
(citus.NodeMap.hung): later calls about its users say so at once instead of
waiting out the timeout again, so a keeper's renewals and a completer's
finishes of the other node's users are not held up.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time

import psycopg
import pytest

from agent_inbox import Inbox, Result, errors
from agent_inbox.dev import pgserver
from agent_inbox.agent.permits import PermitAsk
from agent_inbox.store import policies
from agent_inbox.store.steps import StepRecord
from agent_inbox.store import keys
from tests.citus.support import started_cluster
from tests.citus.test_node_down import done_in, users_by_node
from tests.runtime.support import ROOT, stop_all, wait_until, worker_args

TIMEOUT = 2.0  # the statement bound these tests set: small, for short tests


def node_pids(node: pgserver.TemporaryCluster) -> list[int]:
    """The node's postmaster (from its data directory's postmaster.pid) and its children."""
    postmaster = int((node.data / "postmaster.pid").read_text().split()[0])
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(postmaster)],
                              capture_output=True, text=True, timeout=10).stdout.split()
    return [postmaster, *map(int, children)]


def signal_node(node, signum) -> None:
    for pid in node_pids(node):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


@contextlib.contextmanager
def hung(node):
    """The node's processes stopped (SIGSTOP) for the block, continued after,
    also when the block fails."""
    signal_node(node, signal.SIGSTOP)
    try:
        yield
    finally:
        signal_node(node, signal.SIGCONT)


@pytest.fixture(scope="module")
def citus_cluster():
    """This module's own cluster, in place of the session's: a test here stops a
    node's processes."""
    with started_cluster() as cluster:
        try:
            yield cluster
        finally:
            for node in cluster.workers:  # never leave a node stopped
                signal_node(node, signal.SIGCONT)


@pytest.fixture
def database_url(fresh_citus_database):
    """A database of each test's own on this module's cluster (the session's
    emptied one is on the session's cluster), as a node's processes are
    stopped while runs are in flight here: what that leaves (transactions
    prepared on a node, rows of runs cut short) stays with the test."""
    return fresh_citus_database


@pytest.fixture
def cluster(citus_cluster, database_url):
    yield citus_cluster
    for node in citus_cluster.workers:
        signal_node(node, signal.SIGCONT)


@pytest.fixture
def url(database_url, cluster):
    return database_url


def timed(call):
    began = time.monotonic()
    try:
        return call(), time.monotonic() - began
    except errors.PartlyDone as exc:
        return exc, time.monotonic() - began


def test_a_call_about_a_hung_node_fails_within_its_timeout(url, cluster):
    live, stuck, _ = users_by_node(url, cluster, 2)
    with Inbox.connect(url, lease_ttl=60, statement_timeout=TIMEOUT,
                       connect_timeout=TIMEOUT) as inbox:
        inbox.ingest_many([(user, "chat", "1", {}) for user in live + stuck])
        runs = inbox.runs.take_runs("holder", users=10)  # every pooled connection has met both nodes
        assert sorted(run.user for run in runs) == sorted(live + stuck)
        on_stuck = {run.key for run in runs if run.user in stuck}
        with hung(cluster.workers[1]):
            # A statement to the hung node over a connection the coordinator
            # already holds to it: the client's bound ends the wait.
            renewal, first = timed(lambda: inbox.runs.renew_runs(runs))
            assert isinstance(renewal, errors.PartlyDone), renewal
            assert first < 3 * TIMEOUT, first
            assert renewal.unknown == on_stuck
            # The node is set aside: the next calls do not wait for it.
            renewal, second = timed(lambda: inbox.runs.renew_runs(runs))
            assert renewal.done == {run.key for run in runs} - on_stuck
            assert renewal.unknown == on_stuck
            finish, third = timed(lambda: inbox.runs.finish_runs(
                [inbox.runs.outcome(run, Result()) for run in runs]))
            assert finish.done == [None if run.user in stuck else True for run in runs]
            assert second < 1 and third < 1, (second, third)
            # A fresh process: its coordinator connections open one to the
            # hung node (citus.node_connection_timeout, statement_timeout).
            with Inbox.connect(url, statement_timeout=TIMEOUT, connect_timeout=TIMEOUT) as fresh:
                inbox.ingest(live[0], "chat", "2", {})
                taken, fourth = timed(lambda: fresh.runs.take_runs("other", users=10))
                assert fourth < 3 * TIMEOUT, fourth
                assert [run.user for run in taken] == [live[0]]
                fresh.runs.finish_runs([fresh.runs.outcome(run, Result()) for run in taken])
        left = [run for run in runs if run.user in stuck]

        def finished():  # once the node is no longer set aside
            try:
                return inbox.runs.finish_runs([inbox.runs.outcome(run, Result()) for run in left])
            except errors.PartlyDone:
                return None

        assert wait_until(finished, "the hung node's finishes", timeout=60) == [True] * len(left)
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT status, attempts, count(*) FROM events GROUP BY 1, 2"
                            ).fetchall() == [("done", 1, 5)]


def test_steps_and_permit_calls_of_the_live_node_are_answered_while_the_other_hangs(url,
                                                                                     cluster):
    """A completer asks the durable steps and permit calls of every run in
    flight at once: a hung node fails only its own users' questions."""
    live, stuck, _ = users_by_node(url, cluster, 2)
    with Inbox.connect(url, lease_ttl=60, statement_timeout=TIMEOUT,
                       connect_timeout=TIMEOUT) as inbox:
        inbox.set_policy("search", "allow", actor="ops@host")
        inbox.ingest_many([(user, "chat", "1", {}) for user in live + stuck])
        runs = sorted(inbox.runs.take_runs("holder", users=10), key=lambda run: run.user)
        assert sorted(run.user for run in runs) == sorted(live + stuck)
        undone = {i for i, run in enumerate(runs) if run.user in stuck}
        records = [StepRecord(run.user, run.holder, run.gen, tuple(e.id for e in run.events), 1,
                              "fetch", 1, '"fetched"') for run in runs]
        asks = [PermitAsk(run.user, run.holder, run.gen, "search", policies.digest({}))
                for run in runs]
        with hung(cluster.workers[1]):
            with pytest.raises(errors.PartlyDone) as recorded:
                inbox.runs.record_steps(records)
            assert recorded.value.unknown == undone
            assert [flag for i, flag in enumerate(recorded.value.done) if i not in undone] \
                == [True] * len(live)
            with pytest.raises(errors.PartlyDone) as read:  # the node is set aside: at once
                inbox.runs.recorded_steps([(run.user, tuple(e.id for e in run.events))
                                      for run in runs])
            assert read.value.unknown == undone
            assert all(len(steps) == 1 for i, steps in enumerate(read.value.done)
                       if i not in undone)
            with pytest.raises(errors.PartlyDone) as decided:
                inbox.runs.decide_permits(asks)
            assert decided.value.unknown == undone
            assert [d.answer for i, d in enumerate(decided.value.done) if i not in undone] \
                == ["allow"] * len(live)

        def recorded_all():  # once the node is no longer set aside
            try:
                return inbox.runs.record_steps([records[i] for i in sorted(undone)])
            except errors.PartlyDone:
                return None

        assert wait_until(recorded_all, "the hung node's step records", timeout=60) \
            == [True] * len(stuck)
        assert inbox.runs.finish_runs([inbox.runs.outcome(run, Result()) for run in runs]) \
            == [True] * len(runs)


def start_worker(url, log_path):
    args = worker_args(url, "hold_until_released", "--concurrency", "10", "--poll-interval", "0.2",
                       "--lease-ttl", "40", "--statement-timeout", str(TIMEOUT))
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "agent_inbox.cli", *args], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


HANG = 12.0  # seconds the node hangs at least: the keeper renews (every TTL/4) meanwhile
BOUND = 20.0  # seconds the live node's users may wait for their work while it hangs


def test_a_worker_serves_the_live_node_while_the_other_hangs(url, cluster, tmp_path):
    live, stuck, live_buckets = users_by_node(url, cluster, 4)
    release = {user: str(tmp_path / f"{user}-1") for user in live + stuck}
    again = {user: str(tmp_path / f"{user}-2") for user in live}
    with Inbox.connect(url) as inbox:
        inbox.ingest_many([(user, "chat", "1", {"release_file": release[user]})
                           for user in live + stuck])
    worker = start_worker(url, tmp_path / "worker.log")
    try:
        wait_until(lambda: all(os.path.exists(path + ".started") for path in release.values()),
                   "every run in flight", timeout=60)
        with hung(cluster.workers[1]):
            began = time.monotonic()
            for path in release.values():
                open(path, "w").close()
            wait_until(lambda: done_in(url, live_buckets) == len(live),
                       "the live node's runs to commit", timeout=BOUND)
            # New work for the live node's users is taken while the other hangs.
            with Inbox.connect(url, statement_timeout=TIMEOUT) as inbox:
                for user in live:
                    open(again[user], "w").close()
                    inbox.ingest(user, "chat", "2", {"release_file": again[user]})
            wait_until(lambda: done_in(url, live_buckets) == 2 * len(live),
                       "the live node's new work to be done", timeout=BOUND)
            served = time.monotonic() - began
            time.sleep(max(0.0, HANG - served))
        wait_until(lambda: done_in(url, list(range(keys.BUCKETS))) == 2 * len(live) + len(stuck),
                   "the hung node's runs to commit once it answers", timeout=60)
    finally:
        stop_all([worker], kill=lambda process: os.killpg(process.pid, signal.SIGKILL))
    log = (tmp_path / "worker.log").read_text()
    assert worker.returncode == 0, log[-3000:]
    assert served < BOUND, served
    assert "(timed out)" in log and "statement timeout" in log, log[-3000:]
    assert "lease lost" not in log, log[-3000:]
    with psycopg.connect(url, autocommit=True) as conn:
        events = conn.execute("SELECT status, attempts, count(*) FROM events GROUP BY 1, 2"
                              ).fetchall()
        messages = conn.execute("SELECT body, count(*) FROM outbox GROUP BY 1").fetchall()
    assert events == [("done", 1, 2 * len(live) + len(stuck))]      # none claimed twice
    assert messages == [("released", 2 * len(live) + len(stuck))]   # one per run
