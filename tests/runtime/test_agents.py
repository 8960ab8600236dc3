"""The worker runtime at agent scale, as users run it (`agent-inbox worker`
processes, a real PostgreSQL): many slow runs at once in one process on a fixed
few connections, runs bounded in time, lease loss seen by async handlers, and a
graceful shutdown with many runs in flight. Every wait is on database state,
a file a handler wrote, or a process exit; none is a sleep."""

import os
import signal
import threading

import psycopg
import pytest

from tests.runtime.support import scalar, wait_until, worker_args

WORKER_APPS = ("agent-inbox-worker", "agent-inbox-listener")


class ConnectionSampler(threading.Thread):
    """Samples pg_stat_activity every 20 ms: the most connections seen at once,
    per key (`group` is a SQL expression: application_name, usename...).
    `start()` returns once its connection is open (or has failed), so a test can
    start it before the processes that fill the server's connection slots."""

    def __init__(self, url, database, group="'all'", where="true"):
        super().__init__(daemon=True)
        self.url, self.database = url, database
        self.sql = (f"SELECT {group}, count(*) FROM pg_stat_activity WHERE datname = %s "
                    f"AND pid <> pg_backend_pid() AND {where} GROUP BY 1")
        self.peak: dict[str, int] = {}
        self.samples = 0
        self.done = threading.Event()
        self.connected = threading.Event()
        self.failure: Exception | None = None

    def start(self):
        super().start()
        self.connected.wait(timeout=30)

    def run(self):
        try:
            with psycopg.connect(self.url, autocommit=True) as conn:
                self.connected.set()
                while not self.done.wait(0.02):
                    for key, count in conn.execute(self.sql, (self.database,)).fetchall():
                        self.peak[key] = max(self.peak.get(key, 0), count)
                    self.samples += 1
        except Exception as exc:
            self.failure = exc
            self.connected.set()

    def stop(self):
        self.done.set()
        self.join(timeout=10)
        if self.failure is not None:
            raise AssertionError(f"the connection sampler failed: {self.failure}")


def database_of(url):
    return psycopg.conninfo.conninfo_to_dict(url)["dbname"]


def run_in_one_worker(database_url, inbox, spawn, handler, runs, *extra):
    inbox.ingest_many([(f"u{n:04}", "chat", "1", {}) for n in range(runs)])
    sampler = ConnectionSampler(database_url, database_of(database_url),
                                where="application_name IN ('agent-inbox-worker', "
                                      "'agent-inbox-listener')")
    sampler.start()
    spawn(*worker_args(database_url, handler, "--concurrency", str(runs), "--lease-ttl", "60",
                       "--log-level", "warning", *extra))
    try:
        wait_until(lambda: scalar(database_url, "SELECT count(*) FROM events WHERE status = 'done'")
                   == runs, f"{runs} runs to be done", timeout=120)
    finally:
        sampler.stop()
    return sampler


@pytest.mark.parametrize("handler, runs", [("async_all_at_once", 1000), ("all_at_once", 200)])
def test_many_runs_at_once_in_one_worker_on_four_connections(database_url, inbox, spawn,
                                                             monkeypatch, handler, runs):
    monkeypatch.setenv("AGENT_SCALE_RUNS", str(runs))   # no run returns before all are in
    sampler = run_in_one_worker(database_url, inbox, spawn, handler, runs)
    assert scalar(database_url, "SELECT count(*) FROM outbox") == runs
    assert scalar(database_url, "SELECT max(attempts) FROM events") == 1
    assert scalar(database_url, "SELECT count(DISTINCT split_part(body, ' ', 1)) FROM outbox") == 1
    assert sampler.samples > 0 and 0 < sum(sampler.peak.values()) <= 4, sampler.peak


@pytest.mark.parametrize("handler", ["async_hang", "hang"])
def test_a_hung_run_is_stopped_at_the_timeout_then_retried_in_quarantine_until_dead(
        database_url, inbox, spawn, handler):
    inbox.ingest("stuck", "chat", "1", {})
    worker = spawn(*worker_args(database_url, handler, "--run-timeout", "1", "--max-attempts", "2",
                                "--retry-backoff", "1"))
    wait_until(lambda: inbox.events("stuck", status="dead"), "the hung event to be dead",
               timeout=60)
    [event] = inbox.events("stuck")
    assert (event.attempts, event.error) == (2, "too many attempts")
    worker.send_signal(signal.SIGTERM)
    output, _ = worker.communicate(timeout=60)
    # attempt 1 on the worker's loop or a thread, attempt 2 in a quarantine process
    assert output.count("run timed out after 1 s user=stuck") == 2, output[-3000:]
    assert output.count("run in quarantine user=stuck") == 1
    assert output.count("lease released user=stuck") == 2          # not left to expire
    assert "(the run timed out after 1 s)" in output


def test_an_async_run_whose_lease_is_lost_is_cancelled_and_commits_nothing(
        database_url, inbox, spawn, tmp_path):
    started, release = tmp_path / "started", tmp_path / "never"
    inbox.ingest("u", "chat", "1", {"started": str(started), "release": str(release)})
    worker = spawn(*worker_args(database_url, "async_hold", "--lease-ttl", "2"))
    wait_until(started.exists, "the handler to start")
    with psycopg.connect(database_url, autocommit=True) as conn:  # another worker takes over
        conn.execute("UPDATE leases SET holder = 'thief', gen = gen + 1, "
                     "until = extract(epoch FROM now())::bigint + 600 WHERE user_id = 'u'")
    wait_until(lambda: (tmp_path / "started.cancelled-True").exists(),
               "the task to be cancelled with ctx.lease_lost set")
    worker.send_signal(signal.SIGTERM)
    output, _ = worker.communicate(timeout=30)
    assert "lease lost user=u" in output and "renewal refused" in output
    assert inbox.outbox("u") == []
    assert [(e.status, e.claim_gen) for e in inbox.events("u")] == [("running", 1)]


def test_sigterm_with_many_runs_in_flight(database_url, inbox, spawn, tmp_path):
    """30 first attempts on the event loop (15 end within the grace, 15 never)
    and 3 unfinished retries for one quarantine process (1 running, 2 waiting):
    the waiting ones are given back untouched, the 15 that ended commit, the
    rest are released with their attempt counted; the worker exits 0."""
    def payload(name, ends):
        return {"started": str(tmp_path / name), "release": str(tmp_path / ("go" if ends else "never"))}

    for n in range(3):
        inbox.ingest(f"retry{n}", "chat", "1", payload(f"retry{n}", False))
        inbox.take_work("a-worker-that-died")
    with psycopg.connect(database_url, autocommit=True) as conn:   # its leases lapse
        conn.execute("UPDATE leases SET until = 0 WHERE holder = 'a-worker-that-died'")
        conn.execute("UPDATE events SET available_at = 0")
        conn.execute("UPDATE wakes SET at = 1")  # its take's wakes, at each lease's end, pass
    inbox.ingest_many([(f"fresh{n:02}", "chat", "1", payload(f"fresh{n:02}", n % 2 == 0))
                       for n in range(30)])
    worker = spawn(*worker_args(database_url, "async_hold", "--concurrency", "40",
                                "--quarantine", "1", "--grace", "2"))
    wait_until(lambda: len([p for p in os.listdir(tmp_path) if "." not in p]) == 31,
               "30 first attempts and one quarantine run to start")
    assert scalar(database_url, "SELECT count(*) FROM leases WHERE until > extract(epoch FROM now())") == 33
    worker.send_signal(signal.SIGTERM)
    (tmp_path / "go").touch()
    output, _ = worker.communicate(timeout=60)
    assert worker.returncode == 0, output[-3000:]

    fresh = {e.user: e for n in range(30) for e in inbox.events(f"fresh{n:02}")}
    assert sorted(u for u, e in fresh.items() if e.status == "done") == [
        f"fresh{n:02}" for n in range(0, 30, 2)]
    assert {(e.status, e.attempts) for u, e in fresh.items() if int(u[5:]) % 2} == {("running", 1)}
    retries = [inbox.events(f"retry{n}")[0] for n in range(3)]
    assert sorted((e.status, e.attempts) for e in retries) == [("running", 1), ("running", 1),
                                                               ("running", 2)]
    assert output.count("(never started)") == 2 and output.count("lease given back") == 2
    assert output.count("(stopped at shutdown)") == 16
    assert scalar(database_url, "SELECT count(*) FROM leases WHERE until > extract(epoch FROM now())") == 0


def test_a_poison_event_that_kills_the_runtime_costs_the_runs_in_flight_one_attempt(
        database_url, inbox, spawn, tmp_path):
    """The supervisor starts another runtime, which releases the dead one's
    leases at once (the TTL is 600 s): the runs that died are retried after
    their backoff, each alone in quarantine, and the poison event is dead after
    max_attempts without taking the worker down again."""
    def payload(user, **more):
        return {"started": str(tmp_path / user), "release": str(tmp_path / "go"), **more}

    inbox.ingest_many([(f"healthy{n}", "chat", "1", payload(f"healthy{n}")) for n in range(5)])
    worker = spawn(*worker_args(database_url, "poison_or_hold", "--concurrency", "10",
                                "--lease-ttl", "600", "--retry-backoff", "1"))
    wait_until(lambda: all((tmp_path / f"healthy{n}.1").exists() for n in range(5)),
               "five first attempts in flight")
    inbox.ingest("poison", "chat", "1", payload("poison", poison=True))
    wait_until(lambda: scalar(database_url, "SELECT count(*) FROM leases WHERE gen >= 2") == 6,
               "the next runtime to take the six users over (released, not left to the TTL)")
    (tmp_path / "go").touch()
    wait_until(lambda: inbox.events("poison", status="dead"), "the poison event to be dead",
               timeout=60)
    wait_until(lambda: all(inbox.events(f"healthy{n}", status="done") for n in range(5)),
               "the runs that died with the runtime to be done", timeout=60)
    assert {inbox.events(f"healthy{n}")[0].attempts for n in range(5)} == {2}
    assert [(e.attempts, e.error) for e in inbox.events("poison")] == [(3, "too many attempts")]
    quarantined = {m.body for n in range(5) for m in inbox.outbox(f"healthy{n}")}
    worker.send_signal(signal.SIGTERM)
    output, _ = worker.communicate(timeout=60)
    assert worker.returncode == 0
    assert output.count("agent-inbox worker: the runtime") == 1       # died once, not thrice
    assert "was killed by SIGKILL" in output and "released its 6 leases" in output
    assert output.count("quarantine run crashed user=poison") == 2
    assert str(worker.pid) not in quarantined


@pytest.mark.parametrize("handler, code", [("exits_cleanly", 0), ("exits_2", 2)])
def test_a_runtime_that_exits_unasked_is_started_again(database_url, inbox, spawn, handler,
                                                       code):
    """Even with 0 or 2 (the code of bad input): the runtime says a refused
    configuration with a code of its own."""
    inbox.ingest("u", "chat", "1", {})
    worker = spawn(*worker_args(database_url, handler, "--retry-backoff", "1"))
    wait_until(lambda: inbox.events("u", status="dead"), "the event to be dead", timeout=60)
    worker.send_signal(signal.SIGTERM)
    output, _ = worker.communicate(timeout=60)
    assert worker.returncode == 0
    assert "the runtime" in output and f"exited with code {code} " in output
    assert output.count("quarantine run crashed user=u") == 2
