"""Damaged run-path state is loud (issue 35, item 5): emptying the one-row
`wakes_ring` table (as a TRUNCATE of "all the tables" between test runs does)
used to leave every worker idle forever, pending events and all, with no word
in any log. Now every service refuses to start on it, naming what is wrong and
how to repair it; a worker running when it happens logs an error, sets
agent_inbox_run_path_damaged and takes nothing; `agent-inbox migrate`
repairs it with no wake lost, and the worker goes on by itself."""

import logging
import threading

import psycopg

from agent_inbox import metrics
from agent_inbox.schema import migrate
from agent_inbox.services.worker import Worker
from agent_inbox.store import wake_rings

from tests.runtime.support import H, scalar, wait_until, worker_args


def empty_the_pointer(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE wakes_ring")


def test_services_refuse_to_start_on_an_emptied_wakes_ring(database_url, make_inbox, spawn):
    make_inbox().ingest("u", "chat", "1", {})
    empty_the_pointer(database_url)
    for args in (worker_args(database_url, "echo"),
                 ["scheduler", "--database-url", database_url],
                 ["dispatcher", "--database-url", database_url, "--channel", f"{H}:echo"]):
        process = spawn(*args)
        assert process.wait(timeout=60) == 2
        out = process.stdout.read()
        assert "the table wakes_ring is empty" in out and "agent-inbox migrate" in out
        assert "Traceback" not in out
    assert scalar(database_url, "SELECT status FROM events") == "pending"   # nothing was run


def test_a_running_worker_says_so_takes_nothing_and_goes_on_once_repaired(
        database_url, make_inbox, caplog):
    inbox = make_inbox(pool_size=4)
    inbox.ingest("u", "chat", "before", {})
    worker = Worker(inbox, f"{H}:echo", concurrency=4, poll_interval=0.2)
    serving = threading.Thread(target=worker.serve, args=(database_url,), daemon=True)
    caplog.set_level(logging.ERROR, logger="agent_inbox")
    serving.start()
    try:
        wait_until(lambda: [e.status for e in inbox.events("u")] == ["done"], "the first run")
        empty_the_pointer(database_url)
        inbox.ingest("u", "chat", "during", {})           # its wake is kept, in its ring
        inbox.ingest("v", "chat", "during", {})
        wait_until(lambda: "the table wakes_ring is empty" in caplog.text,
                   "the worker to log the damage")
        assert metrics.RUN_PATH_DAMAGED._value.get() == 1
        assert [e.status for e in inbox.events("v")] == ["pending"]
        assert scalar(database_url, "SELECT count(*) FROM wakes") == 2
        migrate.upgrade(database_url)                       # the repair
        assert scalar(database_url, "SELECT count(*) FROM wakes_ring") == 1
        wait_until(lambda: all(e.status == "done" for user in ("u", "v")
                               for e in inbox.events(user)), "the events to be run")
        assert metrics.RUN_PATH_DAMAGED._value.get() == 0
        assert [m.body for m in inbox.outbox("v")] == ["v:during"]   # each run once
    finally:
        worker.stop.event.set()
        serving.join(timeout=30)
        worker.close()


def test_the_repair_moves_every_wake_and_leaves_a_sound_pointer_alone(database_url, make_inbox):
    inbox = make_inbox()
    inbox.ingest_many([(f"u{n}", "chat", "1", {}) for n in range(5)])
    assert migrate.upgrade(database_url) is None          # nothing wrong: nothing done
    empty_the_pointer(database_url)
    with psycopg.connect(database_url) as conn:
        assert wake_rings.repair(conn) == 0                   # already in the insert ring
        conn.rollback()
    with psycopg.connect(database_url, autocommit=True) as conn:   # wakes in another ring
        [(old,)] = conn.execute("SELECT DISTINCT ring FROM wakes").fetchall()
        conn.execute("SELECT setval('wakes_insert_ring', %s)", (old + 7,))
    with psycopg.connect(database_url) as conn:
        assert wake_rings.repair(conn) == 5                   # its partition made, too
        conn.commit()
    assert scalar(database_url, "SELECT ring FROM wakes_ring") == old + 7
    assert scalar(database_url, "SELECT count(*) FROM wakes WHERE ring = %s", old + 7) == 5
    run = inbox.take_work("w")
    assert run is not None and run.user.startswith("u")   # found through the repaired ring
