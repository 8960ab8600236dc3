"""The App as `agent-inbox worker --app` runs it: hooks once per runtime and
per quarantine process, the declared defaults (an operator's rule wins), the
context a handler gets (memory, attempt, deadline, permit, limit, step)."""

import os
import signal
import subprocess
import sys

from tests.runtime.support import ROOT, scalar, wait_until


def start(database_url, tmp_path, app, *extra):
    log = open(tmp_path / "worker.log", "w")
    env = {**os.environ, "APP_HOOKS_LOG": str(tmp_path / "hooks")}
    return subprocess.Popen(
        [sys.executable, "-m", "agent_inbox.cli", "worker", "--database-url", database_url,
         "--app", f"tests.runtime.app_handlers:{app}", "--concurrency", "8",
         "--retry-backoff", "0", "--poll-interval", "0.2", *extra],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env), log


def hooks(tmp_path) -> list[tuple[int, str]]:
    path = tmp_path / "hooks"
    return [(int(pid), what) for pid, what in
            (line.split() for line in path.read_text().splitlines())] if path.exists() else []


def test_an_app_runs_with_its_hooks_defaults_and_context(database_url, inbox, tmp_path):
    inbox.set_policy("refund", "deny", actor="ops")  # an operator's rule: the app's ask loses
    worker, log = start(database_url, tmp_path, "app")
    try:
        inbox.ingest_many([(f"u{n}", "chat", "m1", {}) for n in range(5)])
        wait_until(lambda: scalar(database_url, "SELECT count(*) FROM events"
                                                " WHERE status = 'done'") == 5,
                   "every event to be done", timeout=60)
        inbox.ingest("u0", "chat", "m2", {})
        wait_until(lambda: len(inbox.events("u0", status="done")) == 2, "u0's second run",
                   timeout=60)
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0
        log.close()
    assert [m.body for m in inbox.outbox("u1")] == [
        "hello u1 (allow, attempt 1, deadline True)"]
    assert inbox.memory("u0") == {"runs": 2}
    rules = {r["tool"]: (r["answer"], r["updated_by"]) for r in inbox.policies()}
    assert rules == {"send_email": ("allow", "app"), "refund": ("deny", "ops")}
    assert scalar(database_url, "SELECT rate FROM limits WHERE name = 'llm'") == 50
    assert [d["answer"] for d in inbox.permit_decisions("u0")] == ["allow", "allow"]
    [(startup_pid, first), *rest] = hooks(tmp_path)
    assert first == "startup" and rest == [(startup_pid, "shutdown")]  # once, in one process
    assert "user=u0 gen=" in (tmp_path / "worker.log").read_text()  # ctx.log names the run


def test_a_quarantine_process_runs_the_apps_hooks_too(database_url, inbox, tmp_path):
    worker, log = start(database_url, tmp_path, "app", "--quarantine", "1")
    try:
        inbox.ingest("crasher", "chat", "m1", {"crash": True})
        wait_until(lambda: inbox.events("crasher", status="done"), "the retry in quarantine",
                   timeout=90)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)
        log.close()
    assert [m.body for m in inbox.outbox("crasher")] == [
        "hello crasher (allow, attempt 2, deadline True)"]
    pids = {pid for pid, what in hooks(tmp_path) if what == "startup"}
    assert len(pids) == 3  # the first runtime, the next one, and its quarantine process
    stopped = {pid for pid, what in hooks(tmp_path) if what == "shutdown"}
    assert len(stopped) == 2  # the second runtime and its quarantine process (the first died)


def test_a_startup_hook_that_raises_stops_the_worker_as_bad_configuration(database_url,
                                                                           tmp_path):
    worker, log = start(database_url, tmp_path, "broken")
    assert worker.wait(timeout=60) == 2
    log.close()
    assert "startup hook failed: RuntimeError: the LLM key is missing" in (
        tmp_path / "worker.log").read_text()
