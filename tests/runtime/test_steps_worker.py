"""Durable steps in `agent-inbox worker` as users run it (a supervised runtime
process): a five-step run that fails after step 3 (its process SIGKILLed, past
its run timeout, its lease lost, or its handler raising) resumes on its next
attempt with steps 1-3 replayed, not called, and steps 4-5 called once. Calls
are counted in a file outside every process; every wait is on database state
or on that file, bounded."""

import os
import subprocess
import sys

import psycopg
import pytest

from tests.runtime.step_handlers import STEPS
from tests.runtime.support import ROOT, scalar, stop_all, wait_until

HANDLERS = "tests.runtime.step_handlers"


@pytest.fixture
def worker(database_url, tmp_path):
    """Start one supervised worker (its log in tmp_path); stopped at teardown."""
    started = []

    def start(handler, *extra):
        log = open(tmp_path / f"worker-{len(started)}.log", "w")
        process = subprocess.Popen(
            [sys.executable, "-m", "agent_inbox.cli", "worker", "--database-url", database_url,
             "--handler", f"{HANDLERS}:{handler}", "--log-level", "info", "--concurrency", "4",
             "--retry-backoff", "0", "--quarantine", "1", "--poll-interval", "0.2", *extra],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
        started.append((process, log))
        return process

    yield start
    stop_all([process for process, _ in started])
    for _, log in started:
        log.close()


def calls(path) -> list[str]:
    return path.read_text().split() if path.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("handler, how, extra", [
    ("five_steps", "kill", ()),
    ("five_steps_plain", "kill", ()),
    ("five_steps", "hang", ("--run-timeout", "2")),
    ("five_steps", "lose", ("--lease-ttl", "4")),
    ("five_steps", "raise", ()),
    ("five_steps_plain", "raise", ()),
])
def test_a_run_that_failed_after_step_3_resumes_at_step_4(database_url, inbox, worker, tmp_path,
                                                           handler, how, extra):
    log = tmp_path / "calls"
    inbox.ingest("alice", "chat", "m1", {"log": str(log), "after_3": how})
    worker(handler, *extra)
    if how == "lose":  # another worker takes the lease over while step 3's run waits
        wait_until(lambda: os.path.exists(f"{log}.waiting"), "the run to wait after step 3",
                   timeout=60)
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("UPDATE leases SET until = 0 WHERE user_id = 'alice'")
    wait_until(lambda: inbox.events("alice", status="done"), "the event to be done", timeout=90)

    assert calls(log) == list(STEPS)  # 1-3 in the first attempt, 4-5 in the second, once each
    [event] = inbox.events("alice")
    assert event.attempts == 2
    assert [m.body for m in inbox.outbox("alice")] == [
        " ".join(f"{name}-result" for name in STEPS)]  # steps 1-3 as recorded
    assert scalar(database_url, "SELECT count(*) FROM steps") == 0  # gone with the finish


@pytest.mark.slow
def test_runs_in_flight_record_their_steps_together(database_url, inbox, worker, tmp_path):
    """Forty five-step runs at once: every run's steps called once, every
    event done, no record left."""
    logs = [tmp_path / f"calls-{n}" for n in range(40)]
    inbox.ingest_many([(f"u{n:02}", "chat", "m1", {"log": str(path), "after_3": "none"})
                       for n, path in enumerate(logs)])
    worker("five_steps", "--concurrency", "40")
    wait_until(lambda: scalar(database_url,
                              "SELECT count(*) FROM events WHERE status = 'done'") == 40,
               "every event to be done", timeout=90)
    assert all(calls(path) == list(STEPS) for path in logs)
    assert scalar(database_url, "SELECT count(*) FROM steps") == 0
