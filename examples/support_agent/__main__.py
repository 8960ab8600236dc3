"""Run the support agent end to end, in one command:

    .venv/bin/python -m examples.support_agent [--database-url URL]

On a throwaway PostgreSQL (started from the local binaries) unless a URL is
given (then in a scratch database created and dropped on that server): a fake
LLM server, two customers' messages, a real `agent-inbox worker --app` process,
a person approving one refund; then the transcript, what memory holds, the
permission decisions and how many LLM calls were paid.
"""

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time

from agent_inbox import Inbox
from agent_inbox.schema import migrate
from agent_inbox.dev import pgserver
from examples.support_agent.fake_llm import FakeLLM

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MESSAGES = [("ann", "chat", "a1", {"text": "Hello there"}),
            ("ben", "chat", "b1", {"text": "Please refund order 881"})]


@contextlib.contextmanager
def scratch_database(url: str | None):
    with contextlib.ExitStack() as stack:
        server = url or stack.enter_context(pgserver.TemporaryCluster()).url
        database = pgserver.create_database(server, prefix="support_agent")
        stack.callback(pgserver.drop_database, database)
        migrate.upgrade(database)
        yield database


def wait_for(condition, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise SystemExit(f"support agent: timed out waiting for {what}")
        time.sleep(0.1)
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.support_agent")
    parser.add_argument("--database-url", default=os.environ.get("AGENT_INBOX_DATABASE_URL"))
    args = parser.parse_args(argv)
    with scratch_database(args.database_url) as url, FakeLLM() as llm, \
            Inbox.connect(url, pool_size=2) as inbox:
        env = {**os.environ, "SUPPORT_AGENT_LLM_URL": llm.url,
               "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
        worker = subprocess.Popen(
            [sys.executable, "-m", "agent_inbox.cli", "worker", "--database-url", url,
             "--app", "examples.support_agent.agent:app", "--concurrency", "16",
             "--poll-interval", "0.2", "--log-level", "warning"], cwd=ROOT, env=env)
        try:
            inbox.ingest_many(MESSAGES)
            done = lambda: all(e.status == "done" for user in ("ann", "ben")  # noqa: E731
                               for e in inbox.events(user))
            wait_for(done, "the first replies")
            [request] = [t.timer_id.removeprefix("expire:") for t in inbox.timers("ben")
                         if t.timer_id.startswith("expire:permit:refund:")]
            print(f"a person approves {request}: {inbox.answer_approval('ben', request, 'yes')}")
            wait_for(lambda: done() and len(inbox.events("ben")) == 2, "the refund")
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=60)
        for user in ("ann", "ben"):
            print(f"\n{user}:")
            for turn in inbox.memory(user)["transcript"]:
                print(f"  {turn['from']:>8}: {turn['text']}")
            for message in inbox.outbox(user):
                print(f"  outbox  : {message.body}")
            for decision in inbox.permit_decisions(user):
                print(f"  permit  : {decision['tool']} -> {decision['answer']} "
                      f"({decision['rule']})")
        print(f"\nLLM calls paid: {llm.calls}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
