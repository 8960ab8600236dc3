"""The services as users run them: separate processes, real signals, a real
PostgreSQL. Every wait is on database state (or a process exit), bounded."""

import os
import signal

import psycopg

from agent_inbox import Inbox
from agent_inbox.schema import migrate
from agent_inbox.dev import pgserver

from tests.runtime.support import H, read_until, scalar, wait_until, worker_args


def started(release_file) -> bool:
    """hold_until_released marks its start beside its release file."""
    return os.path.exists(f"{release_file}.started")


def test_services_refuse_a_schema_not_at_head(empty_database_url, spawn):
    for args in (worker_args(empty_database_url, "echo"),
                 ["scheduler", "--database-url", empty_database_url],
                 ["dispatcher", "--database-url", empty_database_url, "--channel", f"{H}:echo"]):
        process = spawn(*args)
        assert process.wait(timeout=60) == 2
        assert "run `agent-inbox migrate` first" in process.stdout.read()


def test_a_notification_wakes_an_idle_worker_long_before_its_poll(database_url, inbox, spawn):
    spawn(*worker_args(database_url, "echo", "--poll-interval", "600"))
    wait_until(lambda: scalar(database_url, "SELECT count(*) FROM pg_stat_activity WHERE "
                              "application_name = 'agent-inbox-listener' AND query LIKE 'LISTEN%%'"),
               "the worker to listen")
    inbox.ingest("u", "chat", "1", {})
    wait_until(lambda: inbox.events("u", status="done"), "the event to be handled", timeout=30)


def test_a_long_run_keeps_its_lease_by_renewal(database_url, inbox, spawn, tmp_path):
    release = tmp_path / "release"
    inbox.ingest("u", "chat", "1", {"release_file": str(release)})
    spawn(*worker_args(database_url, "hold_until_released", "--lease-ttl", "2"))
    wait_until(lambda: started(release), "the handler to start")
    first = scalar(database_url, "SELECT until FROM leases WHERE user_id = 'u'")
    wait_until(lambda: scalar(database_url, "SELECT until FROM leases WHERE user_id = 'u'") >= first + 3,
               "the lease to be renewed past its first TTL")
    release.touch()
    wait_until(lambda: inbox.events("u", status="done"), "the run to finish")
    assert [m.body for m in inbox.outbox("u")] == ["released"]
    assert scalar(database_url, "SELECT gen FROM leases WHERE user_id = 'u'") == 1


def test_a_run_that_loses_its_lease_commits_nothing(database_url, inbox, spawn, tmp_path):
    inbox.ingest("u", "chat", "1", {"release_file": str(tmp_path / "never")})
    worker = spawn(*worker_args(database_url, "hold_until_released", "--lease-ttl", "2"))
    wait_until(lambda: started(tmp_path / "never"), "the handler to start")
    with psycopg.connect(database_url, autocommit=True) as conn:  # another worker takes over
        conn.execute("UPDATE leases SET holder = 'thief', gen = gen + 1, "
                     "until = extract(epoch FROM now())::bigint + 600 WHERE user_id = 'u'")
    worker.send_signal(signal.SIGTERM)
    output, _ = worker.communicate(timeout=30)
    assert "lease lost user=u" in output
    assert inbox.outbox("u") == []
    assert [(e.status, e.claim_gen) for e in inbox.events("u")] == [("running", 1)]


def test_sigterm_after_the_grace_period_releases_the_lease_for_an_immediate_takeover(
        database_url, inbox, spawn, tmp_path):
    inbox.ingest("u", "chat", "1", {"release_file": str(tmp_path / "never")})
    worker = spawn(*worker_args(database_url, "hold_until_released", "--grace", "1"))
    wait_until(lambda: started(tmp_path / "never"), "the handler to start")
    holder = scalar(database_url, "SELECT holder FROM leases WHERE user_id = 'u'")
    worker.send_signal(signal.SIGTERM)
    output, _ = worker.communicate(timeout=60)
    assert worker.returncode == 0, output
    assert "lease released user=u" in output and "(stopped at shutdown)" in output
    run = inbox.take_work("next-worker")           # lease_ttl is 120: no wait for expiry
    assert (run.user, run.gen, [e.attempts for e in run.events]) == ("u", 2, [2])
    [event_id] = [e.id for e in run.events]
    assert inbox.finish("u", holder, 1, [event_id]) is False   # the released lease fences


def test_sigterm_lets_a_running_handler_finish_within_the_grace(database_url, inbox, spawn, tmp_path):
    release = tmp_path / "release"
    inbox.ingest("u", "chat", "1", {"release_file": str(release)})
    worker = spawn(*worker_args(database_url, "hold_until_released", "--grace", "60"))
    wait_until(lambda: started(release), "the handler to start")
    worker.send_signal(signal.SIGTERM)
    release.touch()
    worker.communicate(timeout=60)
    assert worker.returncode == 0
    assert [e.status for e in inbox.events("u")] == ["done"]
    assert [m.body for m in inbox.outbox("u")] == ["released"]


def test_a_second_signal_exits_at_once(database_url, inbox, spawn, tmp_path):
    inbox.ingest("u", "chat", "1", {"release_file": str(tmp_path / "never")})
    worker = spawn(*worker_args(database_url, "hold_until_released", "--grace", "600"))
    wait_until(lambda: started(tmp_path / "never"), "the handler to start")
    worker.send_signal(signal.SIGTERM)
    read_until(worker, "SIGTERM: stopping")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 128 + signal.SIGTERM


def test_the_worker_rides_out_a_postgres_restart(spawn):
    with pgserver.TemporaryCluster() as cluster:
        url = pgserver.create_database(cluster.url)
        migrate.upgrade(url)
        spawn(*worker_args(url, "echo", "--poll-interval", "0.2"))
        with Inbox.connect(url) as inbox:
            inbox.ingest("u", "chat", "before", {})
            wait_until(lambda: inbox.events("u", status="done"), "the first event")
        cluster.restart()
        with Inbox.connect(url) as inbox:
            inbox.ingest("u", "chat", "after", {})
            wait_until(lambda: len(inbox.events("u", status="done")) == 2,
                       "the event ingested after the restart", timeout=60)
            assert [m.body for m in inbox.outbox("u")] == ["u:before", "u:after"]


def test_a_worker_killed_outright_leaves_no_handler_process_behind(database_url, inbox, spawn,
                                                                      tmp_path):
    inbox.ingest("u", "chat", "1", {"release_file": str(tmp_path / "never")})
    worker = spawn(*worker_args(database_url, "hold_until_released"))
    wait_until(lambda: started(tmp_path / "never"), "the handler to start")
    children = _children(worker.pid)
    assert children, "the run should be in a handler process"
    worker.kill()
    worker.wait(timeout=30)
    wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in children),
               "the orphaned handler process to exit", timeout=10)


def _children(pid):
    """Child processes of every thread of `pid` (slots start theirs from their own threads)."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as listing:
            children += [int(child) for child in listing.read().split()]
    return children


def test_a_signal_sent_to_the_runtime_directly_is_ignored_the_supervisors_is_taken(
        database_url, inbox, spawn, tmp_path):
    """As systemd's default KillMode signals every process of the service: the
    runtime takes signals from its supervisor only, so the graceful stop holds."""
    release = tmp_path / "release"
    inbox.ingest("u", "chat", "1", {"release_file": str(release)})
    worker = spawn(*worker_args(database_url, "hold_until_released", "--grace", "60"))
    wait_until(lambda: started(release), "the handler to start")
    [runtime] = _children(worker.pid)
    os.kill(runtime, signal.SIGTERM)                     # as if from a process manager
    read_until(worker, f"SIGTERM from pid {os.getpid()} ignored")
    worker.send_signal(signal.SIGTERM)                   # the supervisor passes it on
    read_until(worker, "SIGTERM: stopping")
    release.touch()                                      # the run ends within the grace
    worker.communicate(timeout=60)
    assert worker.returncode == 0
    assert [m.body for m in inbox.outbox("u")] == ["released"]
