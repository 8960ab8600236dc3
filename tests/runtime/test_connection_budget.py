"""Connections are a budget, not a crash: ten workers at concurrency 300 each
against a throwaway PostgreSQL with max_connections=20, which lets ordinary
roles have 17 connections: fewer than the 20 the workers hold at the least
(LISTEN and one pooled each), far fewer than their budgets (3 pooled + 1 LISTEN
= 40), so connections are refused whatever the timing. They drain every event
exactly once; no worker ever holds more than its 4 connections (each worker
logs in as a role of its own, so pg_stat_activity tells them apart), the
refused connections are ridden out with backoff, and every worker stops
cleanly at the end."""

import signal

import psycopg

from agent_inbox import Inbox
from agent_inbox.schema import migrate
from agent_inbox.dev import pgserver
from tests.runtime.support import wait_until, worker_args
from tests.runtime.test_agents import ConnectionSampler

WORKERS, CONCURRENCY, USERS = 10, 300, 4000
# max_connections 20 less superuser_reserved_connections 3; every session takes
# an ordinary slot while one is free, the test's own three superuser ones too.
ORDINARY_SLOTS = 17


def test_workers_over_the_servers_connection_limit_all_finish_exactly_once(spawn):
    with pgserver.TemporaryCluster(settings={"max_connections": "20"}) as cluster:
        url = pgserver.create_database(cluster.url)
        migrate.upgrade(url)
        database = psycopg.conninfo.conninfo_to_dict(url)["dbname"]
        with psycopg.connect(url, autocommit=True) as conn:
            for n in range(WORKERS):
                conn.execute(f"CREATE ROLE budget{n} LOGIN")
                conn.execute(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO budget{n}")
                conn.execute(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO budget{n}")
        # The test's own sessions are all open before the workers start and kept
        # to the end: a new connection made while ten workers hammer the server
        # can be refused too, even a superuser's (a refused attempt holds its
        # process slot until it is turned away, so all 20 can be taken at once).
        sampler = ConnectionSampler(url, database, group="usename", where="usename LIKE 'budget%%'")
        sampler.start()
        with psycopg.connect(url, autocommit=True) as observer, \
                Inbox.connect(url, pool_size=1) as inbox:
            def count(sql):
                return observer.execute(sql).fetchone()[0]

            workers = [spawn(*worker_args(pgserver.conninfo.make_conninfo(url, user=f"budget{n}"),
                                          "async_briefly", "--concurrency", str(CONCURRENCY),
                                          "--poll-interval", "0.5", "--log-level", "warning"))
                       for n in range(WORKERS)]
            # The work arrives once the workers hold every ordinary slot left: the
            # ones still short of their connections are being refused, whatever the
            # timing (a drain of a few seconds could otherwise end before the last
            # started).
            wait_until(lambda: count("SELECT count(*) FROM pg_stat_activity "
                                     "WHERE backend_type = 'client backend'") >= ORDINARY_SLOTS,
                       "the workers to fill the server's ordinary connection slots", timeout=120)
            inbox.ingest_many([(f"u{n:05}", "chat", "1", {}) for n in range(USERS)])
            try:
                wait_until(lambda: count("SELECT count(*) FROM events WHERE status = 'done'") == USERS,
                           "every event to be done", timeout=240)
            finally:
                sampler.stop()
            bodies = [body for body, in observer.execute("SELECT body FROM outbox").fetchall()]
        event_ids = [body.split()[1] for body in bodies]
        assert len(event_ids) == USERS and len(set(event_ids)) == USERS   # each accepted once
        assert sampler.samples > 0
        assert max(sampler.peak.values()) <= 4, sampler.peak
        assert all(w.poll() is None for w in workers)                   # none gave up
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        logs = [worker.communicate(timeout=60)[0] for worker in workers]
        assert [w.returncode for w in workers] == [0] * WORKERS, logs
        refused = sum(log.count("too many clients") + log.count("remaining connection slots")
                      for log in logs)
        assert refused > 0, "the workers together never hit the server's limit"
