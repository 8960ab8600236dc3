"""Durable steps through PgBouncer in transaction mode: a worker process behind
it whose runtime is SIGKILLed after step 3 resuming at step 4. (The Inbox API's
step tests run behind it too, from tests/contract/test_steps.py.)"""

import os
import subprocess
import sys

from tests.runtime.step_handlers import STEPS
from tests.runtime.support import ROOT, scalar, stop_all, wait_until


def test_a_killed_runtime_behind_pgbouncer_resumes_at_step_4(bounced_url, database_url, inbox,
                                                             tmp_path):
    calls = tmp_path / "calls"
    inbox.ingest("alice", "chat", "m1", {"log": str(calls), "after_3": "kill"})
    with open(tmp_path / "worker.log", "w") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "agent_inbox.cli", "worker", "--database-url", bounced_url,
             "--pooler", "transaction", "--handler", "tests.runtime.step_handlers:five_steps",
             "--concurrency", "4", "--retry-backoff", "0", "--poll-interval", "0.2"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
        try:
            wait_until(lambda: scalar(database_url, "SELECT count(*) FROM events"
                                                    " WHERE status = 'done'") == 1,
                       "the event to be done", timeout=90)
        finally:
            stop_all([worker])
    assert calls.read_text().split() == list(STEPS)
    assert scalar(database_url, "SELECT attempts FROM events") == 2
    assert scalar(database_url, "SELECT count(*) FROM steps") == 0
