"""A fleet of `agent-inbox worker` processes through PgBouncer in transaction
mode, with far fewer server connections (4) than the workers hold client
connections (6 workers x 3 pooled), drains 60 users x 50 events exactly once.
Half the workers LISTEN on a direct --listen-url, half have none and poll.

Each run claims at most 5 events, so every worker connection runs the take and
the finish many more times than psycopg's prepare threshold (5): without
pooler="transaction" a statement prepared on one server connection is executed
on another (`prepared statement "_pg3_0" does not exist`) and the fleet fails.
"""

import signal

import psycopg

from tests.runtime.support import wait_until, worker_args

USERS, EVENTS, WORKERS, MAX_BATCH = 60, 50, 6, 5
POOL_SIZE = 4


def test_a_worker_fleet_through_pgbouncer_drains_every_event_exactly_once(
        database_url, bounced_url, inbox, spawn):
    inbox.ingest_many([(f"u{u:02}", "chat", str(n), {}) for u in range(USERS)
                       for n in range(EVENTS)])
    workers = [spawn(*worker_args(bounced_url, "async_briefly", "--pooler", "transaction",
                                  "--concurrency", "20", "--max-batch", str(MAX_BATCH),
                                  "--poll-interval", "0.2",
                                  *(["--listen-url", database_url] if n % 2 else [])))
               for n in range(WORKERS)]

    def done():
        with psycopg.connect(database_url, autocommit=True) as conn:
            return conn.execute("SELECT count(*) FROM events WHERE status = 'done'").fetchone()[0]

    try:
        wait_until(lambda: done() == USERS * EVENTS, "every event to be done", timeout=120)
    except AssertionError:
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        logs = [worker.communicate(timeout=60)[0][-3000:] for worker in workers]
        raise AssertionError(f"{done()} of {USERS * EVENTS} events done; the workers' logs "
                             f"end: {logs}") from None
    for worker in workers:
        worker.send_signal(signal.SIGTERM)
    logs = [worker.communicate(timeout=60)[0] for worker in workers]
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
