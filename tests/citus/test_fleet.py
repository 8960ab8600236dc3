"""A fleet of `agent-inbox worker` processes on the Citus cluster drains 200
users x 20 events exactly once while workers are killed (SIGKILL to the whole
process group: the supervisor, the runtime and its quarantine children, as a
host that loses power), each replaced by a new one. Every take goes one
bucket at a time and every finish is one node's transaction
(backend/citus/statements.py); a killed worker's users come back when their leases
(3 s) run out."""

import os
import signal
import subprocess
import sys

import psycopg

from tests.runtime.support import ROOT, stop_all, wait_until, worker_args

USERS, EVENTS, WORKERS, MAX_BATCH = 200, 20, 4, 5
KILL_AT = (1000, 2500)  # events done when a worker is killed


def start_worker(url):
    args = worker_args(url, "async_briefly", "--concurrency", "20", "--max-batch", str(MAX_BATCH),
                       "--poll-interval", "0.2", "--lease-ttl", "3", "--max-attempts", "5")
    return subprocess.Popen([sys.executable, "-m", "agent_inbox.cli", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)


def test_a_worker_fleet_drains_every_event_exactly_once_through_sigkills(database_url, inbox):
    inbox.ingest_many([(f"u{u:03}", "chat", str(n), {}) for u in range(USERS)
                       for n in range(EVENTS)])
    workers = [start_worker(database_url) for _ in range(WORKERS)]

    def done():
        with psycopg.connect(database_url, autocommit=True) as conn:
            return conn.execute("SELECT count(*) FROM events WHERE status = 'done'").fetchone()[0]

    try:
        for threshold in KILL_AT:
            wait_until(lambda: done() >= threshold, f"{threshold} events done", timeout=180)
            victim = workers.pop(0)
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait(timeout=30)
            workers.append(start_worker(database_url))
        wait_until(lambda: done() == USERS * EVENTS, "every event to be done", timeout=180)
    finally:
        stop_all(workers, kill=lambda worker: os.killpg(worker.pid, signal.SIGKILL))
    assert [w.returncode for w in workers] == [0] * WORKERS
    with psycopg.connect(database_url, autocommit=True) as conn:
        statuses = conn.execute("SELECT status, count(*) FROM events GROUP BY 1").fetchall()
        runs = {first for first, in conn.execute(
            "SELECT min(id) FROM events GROUP BY user_id, claim_gen").fetchall()}
        bodies = [body for body, in conn.execute("SELECT body FROM outbox").fetchall()]
        retried = conn.execute("SELECT count(*) FROM events WHERE attempts > 1").fetchone()[0]
    assert statuses == [("done", USERS * EVENTS)]
    firsts = [int(body.split()[1]) for body in bodies]    # "<holder> <first event id>"
    assert sorted(firsts) == sorted(runs)                 # one message per accepted run, no other
    assert retried > 0                                    # the kills did cut runs short
