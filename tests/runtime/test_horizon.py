"""A transaction held open elsewhere is seen before it hurts (horizon.py): the
checker names its holder in a warning and the gauges show its age; after its
COMMIT the age drops. Each test holds its transaction on a throwaway cluster of
its own, never on the server other tests share (a held xmin there would slow
every other test's vacuum)."""

import logging
import os
import queue
import threading
import time
import urllib.request

import psycopg
import pytest

from agent_inbox.services.worker import horizon
from agent_inbox import metrics
from agent_inbox.schema import migrate, model as schema
from agent_inbox.dev import pgserver
from tests.runtime.support import wait_until, worker_args
from tests.runtime.test_metrics import sample


def test_the_checked_tables_are_the_inbox_tables():
    assert sorted(horizon.TABLES) == sorted(schema.metadata.tables)


@pytest.fixture(scope="module")
def cluster():
    with pgserver.TemporaryCluster(settings={"max_prepared_transactions": "4"}) as c:
        migrate.upgrade(c.url)
        yield c


def held_transaction(url: str, application: str) -> psycopg.Connection:
    """A session in a transaction with an xid, then idle: BEGIN; SELECT txid_current()."""
    conn = psycopg.connect(url, application_name=application)
    conn.execute("SELECT txid_current()")
    return conn


def age_of(url: str, pid: int) -> float:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute("SELECT extract(epoch FROM now() - xact_start)::float8 "
                            "FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()[0]


def test_the_checker_warns_naming_the_holder_and_the_age_drops_after_commit(cluster, caplog):
    caplog.set_level(logging.INFO, logger="agent_inbox.horizon")
    with psycopg.connect(cluster.url, autocommit=True) as conn:   # dead tuples to count
        conn.execute("INSERT INTO leases (user_id, holder, gen, until) SELECT 'u' || n, '', 0, 0 "
                     "FROM generate_series(1, 100) n")
    holder = held_transaction(cluster.url, "reporting-tool")
    pid = holder.info.backend_pid
    with psycopg.connect(cluster.url, autocommit=True) as conn:
        conn.execute("UPDATE leases SET gen = gen + 1")   # 100 dead versions it keeps
    stop = threading.Event()
    checker = horizon.Checker(lambda: psycopg.connect(cluster.url, autocommit=True), stop,
                              interval=0.2, warn_after=1.0)
    checker.start()
    try:
        record = wait_until(lambda: next((r for r in caplog.records
                                          if r.levelno == logging.WARNING
                                          and f"pid {pid}," in r.getMessage()), None),
                            "a warning naming the holder", timeout=30)
        message = record.getMessage()
        assert "'reporting-tool'" in message and "idle in transaction" in message
        assert "SELECT txid_current()" in message and "xact_start" in message
        assert metrics.HORIZON_AGE_SECONDS._value.get() >= 1.0
        assert metrics.HORIZON_AGE_XIDS._value.get() >= 1
        wait_until(lambda: metrics.DEAD_TUPLES.labels("leases")._value.get() >= 100,
                   "the leases' dead tuples in the gauge (the statistics come in async)")
        assert checker.last.oldest.pid == pid
        # once per holder: further checks, no second warning
        checks = checker.last
        wait_until(lambda: checker.last is not checks, "another check")
        assert sum(f"pid {pid}," in r.getMessage() for r in caplog.records
                   if r.levelno == logging.WARNING) == 1
        holder.commit()
        wait_until(lambda: metrics.HORIZON_AGE_SECONDS._value.get() < 1.0,
                   "the horizon's age to drop after the COMMIT")
        wait_until(lambda: any("no longer holds" in r.getMessage() for r in caplog.records),
                   "the holder's release logged")
    finally:
        stop.set()
        checker.join(10)
        holder.close()


def test_prepared_transactions_are_holders(cluster):
    with psycopg.connect(cluster.url, autocommit=True) as conn:
        conn.execute("BEGIN")
        conn.execute("SELECT txid_current()")
        conn.execute("PREPARE TRANSACTION 'forgotten'")
        try:
            with psycopg.connect(cluster.url, autocommit=True) as other:
                reading = horizon.read(other)
            (found,) = [h for h in reading.holders if h.kind == "prepared transaction"]
            assert found.name == "forgotten" and found.age_seconds >= 0
            assert "ROLLBACK PREPARED" in found.describe()
        finally:
            conn.execute("ROLLBACK PREPARED 'forgotten'")


def test_a_worker_process_warns_and_exposes_the_gauge(cluster, spawn, unused_port):
    holder = held_transaction(cluster.url, "forgotten-psql")
    pid = holder.info.backend_pid
    try:
        wait_until(lambda: age_of(cluster.url, pid) >= 1.5, "the held transaction to be 1.5 s old")
        os.environ["AGENT_INBOX_HORIZON_INTERVAL"] = "0.5"
        try:
            worker = spawn(*worker_args(cluster.url, "echo", "--horizon-warn", "1",
                                        "--metrics-port", str(unused_port)))
        finally:
            del os.environ["AGENT_INBOX_HORIZON_INTERVAL"]
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in worker.stdout],
                         daemon=True).start()
        deadline = time.monotonic() + 60
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if "WARNING agent_inbox.horizon" in line:
                break
        assert f"pid {pid}," in line and "'forgotten-psql'" in line, line

        def gauge():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{unused_port}/metrics",
                                            timeout=2) as r:
                    return sample(r.read().decode(), "agent_inbox_horizon_age_seconds")
            except OSError:
                return None

        assert wait_until(lambda: (g := gauge()) and g >= 1.0 and g, "the gauge past 1 s") >= 1.0
        holder.commit()
        wait_until(lambda: (g := gauge()) is not None and g < 1.0, "the gauge to drop")
    finally:
        holder.close()


@pytest.fixture
def unused_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
