"""Forcing interleavings: hold a lock, start the racers, wait until PostgreSQL
reports them all waiting on that lock, then let go.

The wait polls pg_stat_activity (on a Citus coordinator citus_stat_activity,
which shows the worker nodes' waits too: database state), never the wall clock alone;
it gives up with a clear failure after a bounded time.
"""

import threading
import time

import psycopg

WAITING_ON_LOCK = """
SELECT count(*) FROM pg_stat_activity
 WHERE datname = current_database() AND wait_event_type = 'Lock'
   AND application_name LIKE %(pattern)s
"""


# On a Citus coordinator a session's row locks are waited for on a worker node,
# by a backend of its own that carries the session's global pid.
WAITING_ON_LOCK_CITUS = """
WITH activity AS (SELECT * FROM citus_stat_activity WHERE datname = current_database())
SELECT count(*) FROM activity c
 WHERE NOT c.is_worker_query AND c.application_name LIKE %(pattern)s
   AND (c.wait_event_type = 'Lock'
        OR EXISTS (SELECT 1 FROM activity w WHERE w.is_worker_query
                      AND w.global_pid = c.global_pid AND w.wait_event_type = 'Lock'))
"""


def _lock_waiters(conn, application_name: str) -> int:
    on_citus = conn.execute("SELECT to_regclass('citus_stat_activity') IS NOT NULL").fetchone()[0]
    probe = WAITING_ON_LOCK_CITUS if on_citus else WAITING_ON_LOCK
    return conn.execute(probe, {"pattern": application_name}).fetchone()[0]


def lock_waiters(url: str, application_name: str = "%") -> int:
    """How many sessions (named like `application_name`) wait on a lock now."""
    with psycopg.connect(url, autocommit=True) as conn:
        return _lock_waiters(conn, application_name)


def wait_for_lock_waiters(url: str, count: int, *, application_name: str = "%",
                          timeout: float = 30.0) -> None:
    """Block until `count` sessions (named like `application_name`) wait on a lock."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(url, autocommit=True) as conn:
        while True:
            waiting = _lock_waiters(conn, application_name)
            if waiting >= count:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"only {waiting} of {count} sessions reached the lock wait")
            time.sleep(0.01)


class Racers:
    """Run callables in threads; collect results or exceptions in order."""

    def __init__(self, *calls):
        self.results = [None] * len(calls)
        self.errors = [None] * len(calls)
        self.threads = [threading.Thread(target=self._run, args=(i, c), daemon=True)
                        for i, c in enumerate(calls)]

    def _run(self, index, call):
        try:
            self.results[index] = call()
        except BaseException as exc:  # reported by join()
            self.errors[index] = exc

    def start(self) -> "Racers":
        for thread in self.threads:
            thread.start()
        return self

    def join(self, timeout: float = 60.0) -> list:
        for thread in self.threads:
            thread.join(timeout)
            assert not thread.is_alive(), "a racer did not finish in time"
        for error in self.errors:
            if error is not None:
                raise error
        return self.results
