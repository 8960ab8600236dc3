"""The durable tool loop (agent/tool_loop.py) with the Anthropic adapter
(agent/anthropic_loop.py): the official SDK against a fake Messages API
(fake_messages.py), runs made as a worker makes them (agent_inbox.testing's
run_agent, and a real worker process for the kill), on a real PostgreSQL.
Model calls are counted at the fake server, tool calls in a file outside
every process; every wait is on real state, bounded."""

import os
import re
import signal
import subprocess
import sys
import threading
import types

import anthropic
import pytest

from agent_inbox import App
from agent_inbox.testing import run_agent
from tests.agent import handlers
from tests.agent.fake_messages import DROP, FakeMessagesAPI, error, reply, text, tool_use
from tests.chaos.fleet import signal_sessions
from tests.runtime.support import ROOT, scalar, stop_all, wait_until

QUESTION = ("alice", "chat", "m1", {"text": "Where is my order A1?"})
PAGE = os.path.join(ROOT, "docs", "an-llm-agent-with-tools.md")


@pytest.fixture
def tool_log(tmp_path, monkeypatch):
    path = tmp_path / "tool-calls"
    monkeypatch.setenv("TOOL_LOG", str(path))
    return path


def calls(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def serve(script, monkeypatch) -> FakeMessagesAPI:
    api = FakeMessagesAPI(script)
    monkeypatch.setenv("FAKE_ANTHROPIC_URL", api.url)
    return api


def tool_results(body) -> list[dict]:
    """The tool_result blocks of a request's last message."""
    content = body["messages"][-1]["content"]
    return [block for block in content if block.get("type") == "tool_result"]


def allow(inbox, *tools):
    for tool in tools:
        inbox.set_policy(tool, "allow", actor="test")


def test_a_two_tool_conversation_ends_with_the_final_text(database_url, inbox, tool_log,
                                                          monkeypatch):
    def script(turn, body, nth):
        return {1: reply(text("Let me look."), tool_use("toolu_1", "lookup_order", {"order": "A1"})),
                2: reply(tool_use("toolu_2", "refund", {"order": "A1"})),
                3: reply(text("A1 has shipped, and is refunded."))}[turn]

    allow(inbox, "lookup_order", "refund")
    with serve(script, monkeypatch) as api:
        [ran] = run_agent(inbox, handlers.app, [QUESTION])

    assert ran.committed and ran.result.error is None
    assert ran.messages == ["A1 has shipped, and is refunded."]
    assert calls(tool_log) == ["lookup_order A1", "refund A1"]
    assert api.received == api.answered == {1: 1, 2: 1, 3: 1}
    [first] = api.bodies(1)
    assert first["model"] == "claude-fake" and first["system"] == "You help."
    assert first["messages"] == [{"role": "user", "content": "Where is my order A1?"}]
    assert [t["name"] for t in first["tools"]] == ["lookup_order", "refund"]
    [second] = api.bodies(2)
    assert tool_results(second) == [{"type": "tool_result", "tool_use_id": "toolu_1",
                                     "content": '{"order": "A1", "status": "shipped"}'}]
    [third] = api.bodies(3)
    assert tool_results(third) == [{"type": "tool_result", "tool_use_id": "toolu_2",
                                    "content": "refunded A1"}]
    conversation = ran.memory["tool_loop"]
    assert conversation["pending"] is None and len(conversation["messages"]) == 6
    assert scalar(database_url, "SELECT count(*) FROM permit_decisions") == 2


@pytest.mark.parametrize("status", [529, 500])
def test_the_sdks_own_retries_make_one_step(inbox, tool_log, monkeypatch, status):
    """The fake answers `status`, then 200: the SDK retries inside the step, so
    one model-turn step is recorded and the turn is paid once."""
    recorded = []

    async def handle_and_look(batch, ctx):
        result = await handlers.handle(batch, ctx)
        recorded.extend(inbox.steps(ctx.user))  # before the finish takes them away
        return result

    def script(turn, body, nth):
        return error(status) if nth == 1 else reply(text("Hello."))

    app = App(handle_and_look, on_startup=[handlers.open_client],
              on_shutdown=[handlers.close_client])
    with serve(script, monkeypatch) as api:
        [ran] = run_agent(inbox, app, [QUESTION])

    assert ran.messages == ["Hello."]
    assert api.received == {1: 2} and api.answered == {1: 1}
    assert [(step.name, step.occurrence) for step in recorded] == [("model-turn", 1)]
    assert recorded[0].result["content"] == [{"type": "text", "text": "Hello."}]


def test_a_denied_tool_is_an_error_result_to_the_model(inbox, tool_log, monkeypatch):
    def script(turn, body, nth):
        return {1: reply(tool_use("toolu_1", "refund", {"order": "A1"})),
                2: reply(text("I may not refund that."))}[turn]

    inbox.set_policy("refund", "deny", actor="test")
    with serve(script, monkeypatch) as api:
        [ran] = run_agent(inbox, handlers.app, [QUESTION])

    assert ran.messages == ["I may not refund that."]
    assert calls(tool_log) == []
    [second] = api.bodies(2)
    [result] = tool_results(second)
    assert result["tool_use_id"] == "toolu_1" and result["is_error"] is True
    assert "not permitted" in result["content"]


def test_an_ask_ends_the_run_with_an_approval_and_its_answer_resumes_it(inbox, tool_log,
                                                                        monkeypatch):
    def script(turn, body, nth):
        return {1: reply(text("One moment."), tool_use("toolu_1", "lookup_order", {"order": "A1"}),
                         tool_use("toolu_2", "refund", {"order": "A1"})),
                2: reply(text("Refunded, as agreed."))}[turn]

    allow(inbox, "lookup_order")
    inbox.set_policy("refund", "ask", actor="test")
    with serve(script, monkeypatch) as api:
        [asked] = run_agent(inbox, handlers.app, [QUESTION])
        [request] = asked.result.approvals
        assert asked.committed and asked.messages == []
        assert request.request_id.startswith("permit:refund:")
        assert request.action["args"] == {"order": "A1"}
        assert calls(tool_log) == ["lookup_order A1"]  # the call before the ask ran
        assert [a.request_id for a in inbox.approvals("alice")] == [request.request_id]

        # The customer writes again while the approval waits: it waits too.
        [waiting] = run_agent(inbox, handlers.app, [("alice", "chat", "m2", {"text": "Hello?"})])
        assert waiting.result.approvals == () and waiting.messages == []
        assert api.received == {1: 1}

        assert inbox.answer_approval("alice", request.request_id, "yes") == "yes"
        [resumed] = run_agent(inbox, handlers.app, [])

    assert resumed.committed and resumed.messages == ["Refunded, as agreed."]
    assert [e.source for e in resumed.events] == ["approval"]
    assert calls(tool_log) == ["lookup_order A1", "refund A1"]  # each exactly once
    assert api.received == api.answered == {1: 1, 2: 1}
    [second] = api.bodies(2)
    results = [block for block in second["messages"][2]["content"]]
    assert [(r["tool_use_id"], r.get("is_error", False)) for r in results] == [
        ("toolu_1", False), ("toolu_2", False)]
    assert second["messages"][3:] == [{"role": "user", "content": "Hello?"}]
    assert resumed.memory["tool_loop"]["pending"] is None


def test_history_keeps_the_exchanges_asked_for(inbox, tool_log, monkeypatch):
    async def open_short() -> None:
        handlers.loops["agent"] = handlers.make_loop(anthropic.AsyncAnthropic(
            base_url=os.environ["FAKE_ANTHROPIC_URL"], api_key="test-key"), history=0)

    def script(turn, body, nth):
        return reply(text(f"Answer to {body['messages'][0]['content']}"))

    app = App(handlers.handle, on_startup=[open_short], on_shutdown=[handlers.close_client])
    with serve(script, monkeypatch) as api:
        run_agent(inbox, app, [("alice", "chat", "m1", {"text": "one"})])
        [ran] = run_agent(inbox, app, [("alice", "chat", "m2", {"text": "two"})])
    assert ran.result.messages == ("Answer to two",)
    assert [body["messages"] for body in api.bodies(1)][1] == [{"role": "user", "content": "two"}]
    assert ran.memory["tool_loop"]["starts"] == [0]


def test_importing_agent_inbox_does_not_import_anthropic():
    done = subprocess.run(
        [sys.executable, "-c", "import sys, agent_inbox, agent_inbox.agent.tool_loop, "
         "agent_inbox.agent.anthropic_loop; agent_inbox.App; "
         "assert 'anthropic' not in sys.modules, 'anthropic imported'"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def page_agent() -> types.ModuleType:
    """The agent of docs/an-llm-agent-with-tools.md, its first Python block, as a module."""
    with open(PAGE) as page:
        source = re.search(r"```python\n(.*?)```", page.read(), re.S).group(1)
    module = types.ModuleType("shop_agent")
    exec(compile(source, PAGE, "exec"), module.__dict__)
    return module


def test_the_docs_agent_runs_as_written(inbox, monkeypatch):
    """The page's agent, against the fake: a ToolError and an ask answered yes."""
    def script(turn, body, nth):
        return {1: reply(tool_use("toolu_1", "lookup_order", {"order": "Z9"})),
                2: reply(tool_use("toolu_2", "refund", {"order": "A1"})),
                3: reply(text("A1 is refunded."))}[turn]

    shop = page_agent()
    inbox.declare_policies(dict(shop.app.policies))
    with FakeMessagesAPI(script) as api:
        monkeypatch.setenv("ANTHROPIC_BASE_URL", api.url)
        monkeypatch.setenv("ANTHROPIC_API_KEY", "test-key")
        [asked] = run_agent(inbox, shop.app, [QUESTION])
        [request] = asked.result.approvals
        inbox.answer_approval("alice", request.request_id, "yes")
        [answered] = run_agent(inbox, shop.app, [])

    assert answered.messages == ["A1 is refunded."]
    [missing] = tool_results(api.bodies(2)[0])
    assert missing["is_error"] is True and missing["content"] == "there is no order Z9"
    [refunded] = tool_results(api.bodies(3)[0])
    assert refunded == {"type": "tool_result", "tool_use_id": "toolu_2",
                        "content": "order A1 is refunded"}
    assert api.answered == {1: 1, 2: 1, 3: 1}


@pytest.fixture
def workers(database_url, tmp_path):
    """`agent-inbox worker --app tests.agent.handlers:app` processes, each in a
    session of its own (a supervisor and its runtime process); stopped at teardown."""
    started = []

    def start(env):
        log = open(tmp_path / f"worker-{len(started)}.log", "w")
        process = subprocess.Popen(
            [sys.executable, "-m", "agent_inbox.cli", "worker", "--database-url", database_url,
             "--app", "tests.agent.handlers:app", "--log-level", "info", "--lease-ttl", "3",
             "--retry-backoff", "0", "--poll-interval", "0.2"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        started.append((process, log))
        return process

    yield start
    stop_all([process for process, _ in started],
             kill=lambda process: signal_sessions({process.pid}))
    for process, log in started:
        signal_sessions({process.pid})  # whatever the worker left behind
        log.close()


@pytest.mark.slow
def test_a_kill_between_a_tool_call_and_the_next_turn_repeats_nothing(
        database_url, inbox, workers, tool_log, monkeypatch):
    """The worker is SIGKILLed once the tool's step is recorded and the next
    model call is on its way (the fake holds it unanswered until the kill);
    a second worker finishes the run: every model turn answered once, the
    tool called once, across the two processes."""
    turn_2_asked, killed = threading.Event(), threading.Event()

    def script(turn, body, nth):
        if turn == 1:
            return reply(tool_use("toolu_k1", "lookup_order", {"order": "A1"}))
        if nth == 1:  # the killed worker's call: held until it is dead, then dropped
            turn_2_asked.set()
            killed.wait(60)
            return DROP
        return reply(text("A1 has shipped."))

    allow(inbox, "lookup_order")
    with serve(script, monkeypatch) as api:
        env = dict(os.environ)
        first = workers(env)
        inbox.ingest(*QUESTION)
        wait_until(turn_2_asked.is_set, "the second model call", timeout=60)
        assert scalar(database_url, "SELECT array_agg(name ORDER BY position) FROM steps") == [
            "model-turn", "permit:toolu_k1", "tool:toolu_k1"]
        assert calls(tool_log) == ["lookup_order A1"]

        assert signal_sessions({first.pid}) >= 1
        assert first.wait(timeout=30) == -signal.SIGKILL
        killed.set()

        workers(env)
        wait_until(lambda: inbox.events("alice", status="done"), "the event to be done",
                   timeout=90)

    assert [m.body for m in inbox.outbox("alice")] == ["A1 has shipped."]
    assert calls(tool_log) == ["lookup_order A1"]
    assert api.answered == {1: 1, 2: 1}
    assert api.received == {1: 1, 2: 2}  # the killed worker's turn-2 call never answered
    [event] = inbox.events("alice")
    assert event.attempts == 2
    assert scalar(database_url, "SELECT count(*) FROM steps") == 0
