"""Deterministic reproduction: TAKE_WORK re-claims events a concurrent run already finished.

    .venv/bin/python -m bench.repro.take_work_stale_snapshot [server-url]

TAKE_WORK is one statement, so its events are read from the snapshot taken when the
statement starts; the lease row is locked (FOR UPDATE SKIP LOCKED) later, and
PostgreSQL's EvalPlanQual re-checks only the locked lease row's quals (`until < now`)
and the UPDATE's own quals (`user_id`, `id`), not the events' status. If another
worker takes the user, runs and finishes (releasing the lease) between those two
moments, this statement takes the lease again and flips the already-done events back
to 'running' (attempts 2): the handler runs them a second time.

The window is normally a few hundred microseconds (the benchmark hits it on a loaded
2-core machine about once in five W1 runs of 3,000 events). Here it is widened to one
second by evaluating TAKE_WORK's `clock` CTE through pg_sleep: the SQL is otherwise
byte-for-byte agent_inbox.store.inbox.TAKE_WORK.

Exit status 1 if the double claim happens. Found by the benchmark against commit
52fe32b (W1, W1b and W2 each handled some events twice); agent-inbox 255804a
re-checks each row's status and attempts in the claim's UPDATE, and this script then
reports "not reproduced".
"""

import sys
import threading
import time

import psycopg

from agent_inbox import Inbox, Result
from agent_inbox.schema import migrate
from agent_inbox.dev import pgserver
from agent_inbox.store import inbox as store
from agent_inbox.store.clock import NOW


def main(server_url: str, take_work_sql: str | None = None) -> int:
    """`take_work_sql`: the statement worker B runs (default: the installed TAKE_WORK)."""
    url = pgserver.create_database(server_url, prefix="bench_repro")
    try:
        migrate.upgrade(url)
        with Inbox.connect(url, pool_size=2) as inbox:
            inbox.ingest("alice", "src", "1", {"n": 1})
            original = f"SELECT {NOW} AS now"
            sql_b = take_work_sql or store.TAKE_WORK
            assert original in sql_b
            slow = sql_b.replace(
                original, f"SELECT {NOW} AS now FROM (SELECT pg_sleep(1)) AS pause", 1)
            params = {"holder": "B", "ttl": 120, "now": None, "users": 1, **inbox.settings.claim.params(),
                      "ring_a": 0, "ring_b": 0}  # a new database's one live ring (wake_rings)
            box = {}

            def worker_b():
                with psycopg.connect(url, autocommit=True, application_name="repro-b") as conn:
                    box["rows"] = conn.execute(slow, params).fetchall()

            b = threading.Thread(target=worker_b)
            b.start()
            _wait_for_sleep(url, "repro-b")      # B's snapshot is taken; it sleeps in `clock`
            run = inbox.take_work("A")           # A takes alice, runs, finishes, releases
            assert run is not None and [e.id for e in run.events] == [1]
            assert inbox.finish_run(run, Result())
            print("A: took and finished event 1:", [(e.id, e.status) for e in inbox.events("alice")])
            b.join()
            print("B: TAKE_WORK rows:", box["rows"])
            events = inbox.events("alice")
            print("after B (id, status, attempts, claim_gen):",
                  [(e.id, e.status, e.attempts, e.claim_gen) for e in events])
            again = any(e.id == 1 and (e.status != "done" or e.attempts > 1) for e in events)
            print("RESULT:", "event 1 claimed again after it was done (bug reproduced)" if again
                  else "event 1 left done (not reproduced: TAKE_WORK re-checks the rows)")
            return 1 if again else 0
    finally:
        pgserver.drop_database(url)


def _wait_for_sleep(url: str, application_name: str, timeout: float = 30.0) -> None:
    """Until the named session is inside pg_sleep (PostgreSQL says so)."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(url, autocommit=True) as conn:
        while conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
                           " AND wait_event = 'PgSleep'", (application_name,)).fetchone()[0] == 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{application_name} never reached pg_sleep")
            time.sleep(0.01)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "postgresql://postgres@127.0.0.1:5432/postgres"))
