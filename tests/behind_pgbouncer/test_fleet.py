"""A fleet of `agent-inbox worker` processes through PgBouncer in transaction
mode, with far fewer server connections (4) than the workers hold client
connections (6 workers x 3 pooled), drains 60 users x 50 events exactly once.
Half the workers LISTEN on a direct --listen-url, half have none and poll.

Each run claims at most 5 events, so every worker connection runs the take and
the finish many more times than psycopg's prepare threshold (5): without
pooler="transaction" a statement prepared on one server connection is executed
on another (`prepared statement "_pg3_0" does not exist`) and the fleet fails.
"""

import subprocess
import sys

import psycopg

from tests.runtime.support import ROOT, stop_all, wait_until, worker_args

USERS, EVENTS, WORKERS, MAX_BATCH = 60, 50, 6, 5
POOL_SIZE = 4


def start_worker(url, log_path, *extra):
    """A worker logging to a file: a pipe nobody reads during the drain fills
    (64 KiB of INFO lines) and blocks the worker's next log line."""
    args = worker_args(url, "async_briefly", "--pooler", "transaction", "--concurrency", "20",
                       "--max-batch", str(MAX_BATCH), "--poll-interval", "0.2", *extra)
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "agent_inbox.cli", *args], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT)


def test_a_worker_fleet_through_pgbouncer_drains_every_event_exactly_once(
        database_url, bounced_url, inbox, tmp_path):
    inbox.ingest_many([(f"u{u:02}", "chat", str(n), {}) for u in range(USERS)
                       for n in range(EVENTS)])
    paths = [tmp_path / f"worker-{n}.log" for n in range(WORKERS)]
    workers = [start_worker(bounced_url, path, *(["--listen-url", database_url] if n % 2 else []))
               for n, path in enumerate(paths)]

    def done():
        with psycopg.connect(database_url, autocommit=True) as conn:
            return conn.execute("SELECT count(*) FROM events WHERE status = 'done'").fetchone()[0]

    try:
        wait_until(lambda: done() == USERS * EVENTS, "every event to be done", timeout=120)
    finally:
        stop_all(workers)
    logs = [path.read_text() for path in paths]
    assert [w.returncode for w in workers] == [0] * WORKERS, logs
    with psycopg.connect(database_url, autocommit=True) as conn:
        attempts = conn.execute("SELECT attempts, count(*) FROM events GROUP BY 1").fetchall()
        runs = {first for first, in conn.execute(
            "SELECT min(id) FROM events GROUP BY user_id, claim_gen").fetchall()}
        bodies = [body for body, in conn.execute("SELECT body FROM outbox").fetchall()]
    assert attempts == [(1, USERS * EVENTS)]                   # each event claimed once
    assert len(runs) >= USERS * EVENTS // MAX_BATCH            # runs of at most 5 events
    firsts = [int(body.split()[1]) for body in bodies]         # "<holder> <first event id>"
    assert sorted(firsts) == sorted(runs)                      # one message per accepted run
    polling = [log for log in logs if "no LISTEN, polling every 0.2 s" in log]
    assert len(polling) == WORKERS // 2, logs
    assert not any("Traceback" in log for log in logs), logs
