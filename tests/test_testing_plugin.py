"""agent_inbox.testing: the pytest plugin users get (its fixtures reach a test
file outside this project through the entry point) and run_agent, which runs
an app through the real take and fenced finish."""

import os
import subprocess
import sys
import textwrap

from agent_inbox import App, Result
from agent_inbox.testing import run_agent

OPENED = []


def open_client():
    OPENED.append("open")


async def close_client():
    OPENED.append("close")


async def remember(batch, ctx):
    seen = (ctx.memory or {}).get("seen", []) + [e.source_id for e in batch]
    if "boom" in seen:
        raise RuntimeError("the tool raised")
    return Result(messages=[f"{ctx.user} said {len(seen)} things"], memory={"seen": seen})


def test_run_agent_runs_an_app_through_the_take_and_the_finish(inbox):
    app = App(remember, on_startup=[open_client], on_shutdown=[close_client])
    runs = run_agent(inbox, app, [("alice", "chat", "m1", {}), ("bob", "chat", "b1", {})])
    assert sorted((r.user, r.committed, r.messages, r.memory) for r in runs) == [
        ("alice", True, ["alice said 1 things"], {"seen": ["m1"]}),
        ("bob", True, ["bob said 1 things"], {"seen": ["b1"]})]
    assert OPENED == ["open", "close"]
    [again] = run_agent(inbox, remember, [("alice", "chat", "m2", {})])  # a bare handler too
    assert again.memory == {"seen": ["m1", "m2"]} and again.messages[-1] == "alice said 2 things"


def test_a_failing_run_is_reported_and_retried_until_dead(make_inbox):
    inbox = make_inbox(max_attempts=2, retry_backoff=0)
    runs = run_agent(inbox, remember, [("carol", "chat", "boom", {})])
    assert [r.result.error is not None for r in runs] == [True, True, False]  # then parked dead
    assert runs[-1].events == [] and inbox.events("carol")[0].status == "dead"


def test_the_plugins_fixtures_reach_a_project_outside_this_one(tmp_path):
    (tmp_path / "test_agent.py").write_text(textwrap.dedent('''
        from agent_inbox import Result
        from agent_inbox.testing import run_agent

        def reply(batch, ctx):
            return Result(messages=[f"hello {ctx.user}"])

        def test_the_agent_replies(inbox):
            [ran] = run_agent(inbox, reply, [("alice", "chat", "m1", {"text": "hi"})])
            assert ran.committed and ran.messages == ["hello alice"]
    '''))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout
