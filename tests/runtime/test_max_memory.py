"""`agent-inbox worker --max-memory`: a runtime whose memory grows past it stops
taking work, lets its runs end, exits, and the supervisor starts a fresh one at
once; nothing is lost or run twice. Real processes, a real PostgreSQL; each
runtime's memory is bounded by the limit plus a few runs' leak."""

import os
import signal
import subprocess
import sys

from tests.runtime.support import ROOT, stop_all, wait_until, worker_args

USERS = 24
LEAK_MIB = 16
LIMIT_MIB = 150


def test_a_leaking_handler_is_recycled_with_nothing_lost(database_url, inbox, spawn, tmp_path):
    inbox.ingest_many([(f"u{n:02}", "chat", "1", {"leak_mib": LEAK_MIB, "dir": str(tmp_path)})
                       for n in range(USERS)])
    worker = spawn(*worker_args(database_url, "leak", "--concurrency", "2",
                                "--max-memory", str(LIMIT_MIB)))
    wait_until(lambda: len(os.listdir(tmp_path)) >= USERS
               and all(e.status == "done" for n in range(USERS) for e in inbox.events(f"u{n:02}")),
               "every event to be done", timeout=120)
    stop_all([worker])
    output = worker.stdout.read()
    assert worker.returncode == 0, output

    events = [e for n in range(USERS) for e in inbox.events(f"u{n:02}")]
    marks = [name.split(".") for name in os.listdir(tmp_path)]
    assert sorted(int(event_id) for event_id, _, _ in marks) == sorted(e.id for e in events)
    assert {(e.status, e.attempts) for e in events} == {("done", 1)}  # each run once, none retried
    runtimes = {pid for _, pid, _ in marks}
    assert len(runtimes) >= 2, output                    # the runs were spread over fresh runtimes
    recycles = output.count("was recycled past --max-memory after")
    assert recycles >= len(runtimes) - 1 and recycles >= 1, output
    assert "past --max-memory 150 MiB: recycling it" in output
    assert "run in quarantine" not in output and "released" not in output.replace(
        "released its 0 leases", "")                     # no run treated as crashed
    assert sorted(m.body for n in range(USERS) for m in inbox.outbox(f"u{n:02}")) == \
        sorted(f"u{n:02}:1" for n in range(USERS))


def test_a_bad_max_memory_is_refused(database_url):
    for value, message in (("0", "max_memory must be a positive integer"),
                           ("1", "--max-memory must be above the runtime's memory at start"),
                           ("lots", "argument --max-memory: invalid int value")):
        done = subprocess.run([sys.executable, "-m", "agent_inbox.cli",
                               *worker_args(database_url, "echo", "--max-memory", value)],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (value, done.stderr)
        assert message in done.stderr, (value, done.stderr)


def test_a_signal_during_a_recycle_is_the_graceful_first_one():
    """A recycle sets the stop event without a signal: the supervisor's SIGTERM
    that follows must not count as the second signal (which exits at once)."""
    from agent_inbox.services.service import Stop

    stop = Stop()
    stop.event.set()                                     # as a recycle does
    stop._on_signal(signal.SIGTERM, None)                # would os._exit if counted as second
    assert stop.signalled and stop.is_set()
