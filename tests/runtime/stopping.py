"""What the stopping tests share (tests/runtime/test_stopping.py, and the same
scenario behind PgBouncer and on Citus): service processes whose output is
read as it comes, the command line, and the scenario of a cancelled run."""

import os
import subprocess
import sys
import threading
import time


from tests.runtime.support import ROOT, scalar, stop_all, wait_until

HANDLERS = "tests.runtime.stopping_handlers"


class Service:
    """An `agent-inbox ...` process whose output lines are collected as they come."""

    def __init__(self, *args, env=None):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "agent_inbox.cli", *args], cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line)

    def count(self, text: str) -> int:
        return sum(text in line for line in list(self.lines))

    def said(self, text: str) -> bool:
        return self.count(text) > 0


def services_fixture():
    """The `services` fixture's body: `services(*args, env=None)` starts one; every
    one left is stopped at teardown."""
    started: list[Service] = []

    def start(*args, env=None):
        service = Service(*args, env=env)
        started.append(service)
        return service

    yield start
    stop_all([s.process for s in started if s.process.poll() is None])
    for service in started:
        service.process.stdout.close()


def worker(url, handler, *extra):
    return ["worker", "--database-url", url, "--handler", f"{HANDLERS}:{handler}",
            "--poll-interval", "0.2", *extra]


def cli(url, *args):
    done = subprocess.run([sys.executable, "-m", "agent_inbox.cli", *args, "--database-url", url],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout + done.stderr


def statuses(inbox, user):
    return [e.status for e in inbox.events(user)]


def a_cancelled_sleeper_stops_and_resume_runs_the_rest(database_url, inbox, services, tmp_path,
                                                      worker_url=None, *options):
    """A run sleeping 30 s is stopped within 5 s of `pause --cancel` and never
    finishes; the user's next events are stored and not run while another
    user's run; `resume` runs them, with one message. The worker on
    `worker_url` (default: database_url) with `options`."""
    woken = tmp_path / "woken"
    running = services(*worker(worker_url or database_url, "sleeps_unless", "--log-level",
                               "info", *options))
    inbox.ingest("alice", "chat", "a-1", {"sleep_unless": str(woken)})
    wait_until(lambda: statuses(inbox, "alice") == ["running"], "alice's run to start", 60)

    code, out = cli(database_url, "pause", "--user", "alice", "--cancel", "--reason", "a loop")
    assert code == 0, out
    assert "is paused" in out and "cancelled" in out
    cancelled_at = time.monotonic()
    wait_until(lambda: running.said("run cancelled by an operator user=alice"),
               "the worker to stop the cancelled run", timeout=5)
    assert time.monotonic() - cancelled_at < 5  # the run slept 30 s: it was stopped, not ended
    assert [(e.status, e.attempts) for e in inbox.events("alice")] == [("pending", 0)]

    # stored while paused, not run, while another user runs
    assert inbox.ingest("alice", "chat", "a-2", {}) is True
    inbox.ingest("bob", "chat", "b-1", {})
    wait_until(lambda: statuses(inbox, "bob") == ["done"], "bob's run")
    assert statuses(inbox, "alice") == ["pending", "pending"]
    code, out = cli(database_url, "events", "--user", "alice")
    assert code == 0 and "held by the user's pause" in out and "a loop" in out
    code, out = cli(database_url, "status")
    assert code == 0 and "paused: 1 users" in out

    woken.touch()  # the next run of a-1 does not sleep
    code, out = cli(database_url, "resume", "--user", "alice")
    assert code == 0 and "is resumed" in out
    wait_until(lambda: statuses(inbox, "alice") == ["done", "done"], "alice's runs after resume")
    # the cancelled run never finished: one message only, from the run after resume
    assert [m.body for m in inbox.outbox("alice")] == ["alice: ran a-1,a-2"]
    assert scalar(database_url, "SELECT string_agg(action, ',' ORDER BY id) FROM operator_actions"
                                " WHERE user_id = 'alice'") == "pause,resume"
