"""Permissions: ctx.permit decided by the rules as committed at the call,
recorded with the rule that answered; 'ask' turns the call into an approval
request whose answer comes back as an event; a stale run is refused.

A contract test module: each test runs on every backend (tests/contract/conftest.py).
"""

import json
import threading

import psycopg
import pytest

from agent_inbox import ApprovalNeeded, Permit, Result, errors
from agent_inbox.agent import handler
from tests.test_operator_cli import run_cli, run_json


def a_run(inbox, user="alice", holder="A", key="m1"):
    inbox.ingest(user, "chat", key, {})
    return inbox.take_work(holder)


def test_the_users_rule_then_the_default_then_deny(inbox):
    ctx = inbox.context(a_run(inbox))
    assert ctx.permit_sync("refund", {"order": 881}) == Permit.DENY  # no rule at all
    inbox.set_policy("*", "allow", actor="ops")
    assert ctx.permit_sync("refund", {"order": 881}) == "allow"
    inbox.set_policy("refund", "deny", actor="ops")
    assert ctx.permit_sync("refund", {"order": 881}) == "deny"
    assert ctx.permit_sync("search", {"q": "x"}) == "allow"
    inbox.set_policy("*", "deny", user="alice", actor="ops")
    assert ctx.permit_sync("search", {"q": "x"}) == "deny"  # the user's * beats the default's
    inbox.set_policy("search", "allow", user="alice", actor="ops")
    assert ctx.permit_sync("search", {"q": "x"}) == "allow"
    rules = [d["rule"] for d in reversed(inbox.permit_decisions("alice"))]
    assert rules == ["none", "default:*", "default:refund", "default:*", "user:*", "user:search"]
    [last] = inbox.permit_decisions("alice", limit=1)
    assert (last["tool"], last["answer"], last["gen"], last["holder"]) == (
        "search", "allow", 1, "A")


def test_ask_ends_the_run_with_an_approval_and_its_answer_decides_the_next_call(inbox):
    inbox.set_policy("refund", "ask", ask_expires_in=3600, actor="ops")
    run = a_run(inbox)
    ctx = inbox.context(run)

    def agent(batch, ctx):
        if ctx.permit_sync("refund", {"order": 881}) == "allow":
            return Result(messages=["refunded 881"])
        return Result(messages=["refund 881 refused"])

    result = handler.call(agent, run.events, ctx, await_on=None)
    [request] = result.approvals
    assert request.request_id.startswith("permit:refund:") and request.expires_in == 3600
    assert request.action == {"tool": "refund", "args": {"order": 881}, "rule": "default:refund"}
    assert inbox.finish_run(run, result)
    assert inbox.answer_approval("alice", request.request_id, "yes") == "yes"

    resumed = inbox.take_work("A")  # the answer came back as an event
    [event] = resumed.events
    assert (event.source, event.source_id, event.payload["answer"]) == (
        "approval", request.request_id, "yes")
    again = handler.call(agent, resumed.events, inbox.context(resumed), await_on=None)
    assert again.messages == ["refunded 881"]
    assert inbox.permit_decisions("alice", limit=1)[0]["rule"] == "default:refund answered yes"

    with pytest.raises(ApprovalNeeded):  # other arguments: another request
        inbox.context(resumed).permit_sync("refund", {"order": 990})


def test_a_refused_or_expired_ask_denies(inbox):
    inbox.set_policy("email", "ask", user="bob", ask_expires_in=60, actor="ops")
    run = a_run(inbox, "bob")
    with pytest.raises(ApprovalNeeded) as asked:
        inbox.context(run).permit_sync("email", {"to": "c@example.org"})
    request = asked.value.request
    assert inbox.finish_run(run, Result(approvals=[request]))
    assert inbox.answer_approval("bob", request.request_id, "no") == "no"
    ctx = inbox.context(inbox.take_work("A"))
    assert ctx.permit_sync("email", {"to": "c@example.org"}) == "deny"


def test_a_stale_run_is_refused_and_nothing_is_recorded(inbox):
    run = a_run(inbox, "carol")
    stale = inbox.context(run)
    assert inbox.runs.release_runs([run]) == ["carol"]
    inbox.take_work("B")
    with pytest.raises(errors.LeaseLost, match="lease is lost"):
        stale.permit_sync("refund", {})
    assert inbox.permit_decisions("carol") == []


def test_a_rule_changed_while_a_run_is_in_flight_applies_to_calls_after_the_commit(
        inbox, database_url):
    """The change is held open (uncommitted) while the run asks: the run is
    not held up and gets the rule as committed; once the change commits, the
    run's next call gets the new rule."""
    inbox.set_policy("refund", "allow", user="dave", actor="ops")
    ctx = inbox.context(a_run(inbox, "dave"))
    answers = []
    with psycopg.connect(database_url) as change:
        change.execute("UPDATE policies SET answer = 'deny' WHERE user_id = 'dave'"
                       " AND tool = 'refund'")
        asking = threading.Thread(target=lambda: answers.append(ctx.permit_sync("refund", {})))
        asking.start()
        asking.join(timeout=30)
        assert answers == ["allow"]
        change.commit()
    assert ctx.permit_sync("refund", {}) == "deny"


async def _permit_async(ctx):
    return await ctx.permit("search", {"q": 1})


def test_the_async_permit(inbox):
    import asyncio

    inbox.set_policy("search", "allow", actor="ops")
    assert asyncio.run(_permit_async(inbox.context(a_run(inbox, "erin")))) == "allow"


def test_bad_input_changes_nothing(inbox):
    with pytest.raises(errors.InvalidInput, match="answer must be one of allow, deny, ask"):
        inbox.set_policy("refund", "maybe", actor="ops")
    with pytest.raises(errors.InvalidInput, match="tool must not be empty"):
        inbox.set_policy("", "allow", actor="ops")
    with pytest.raises(errors.InvalidInput, match="ask_expires_in must be"):
        inbox.set_policy("refund", "ask", ask_expires_in=0, actor="ops")
    assert inbox.policies() == []
    ctx = inbox.context(a_run(inbox, "fay"))
    with pytest.raises(errors.InvalidInput, match="args must be JSON-serialisable"):
        ctx.permit_sync("refund", {"when": object()})
    assert inbox.permit_decisions("fay") == []


def test_the_policy_cli_and_its_audit(capsys, database_url, inbox):
    code, out, _ = run_cli(capsys, database_url, "policy", "set", "--default", "--tool",
                           "refund", "ask", "--ask-expires-in", "2h")
    assert code == 0 and out == "the default: refund -> ask\n"
    assert run_cli(capsys, database_url, "policy", "set", "--user", "gus", "--tool", "*",
                   "deny")[0] == 0
    listed = run_json(capsys, database_url, "policy", "list", "--default")["rules"]
    assert [(r["tool"], r["answer"], r["ask_expires_in"]) for r in listed] == [
        ("refund", "ask", 7200)]
    code, _, err = run_cli(capsys, database_url, "policy", "set", "--default", "--tool", "x",
                           "perhaps")
    assert code == 2 and "invalid choice: 'perhaps'" in err
    assert run_cli(capsys, database_url, "policy", "clear", "--user", "gus", "--tool", "*")[0] == 0
    assert run_cli(capsys, database_url, "policy", "clear", "--user", "gus", "--tool", "*")[0] == 1
    assert inbox.policies("gus") == []
    with psycopg.connect(database_url, autocommit=True) as conn:
        audit = conn.execute("SELECT user_id, action, detail FROM operator_actions"
                             " ORDER BY id").fetchall()
    assert [(user, action, detail["tool"], detail["answer"]) for user, action, detail in audit] == [
        ("", "policy_set", "refund", "ask"), ("gus", "policy_set", "*", "deny"),
        ("gus", "policy_clear", "*", None)]
    ctx = inbox.context(a_run(inbox, "gus"))
    with pytest.raises(ApprovalNeeded):
        ctx.permit_sync("refund", {"order": 1})
    decisions = run_json(capsys, database_url, "policy", "decisions", "--user", "gus")
    assert [d["answer"] for d in decisions["decisions"]] == ["ask"]
    assert json.loads(json.dumps(decisions))["user"] == "gus"


def test_a_permit_racing_a_takeover_waits_for_it_and_is_refused(database_url, inbox, make_inbox):
    """The decision takes the lease row FOR SHARE: behind a takeover not yet
    committed it waits, then sees the new generation: LeaseLost, nothing
    recorded."""
    from tests.contract.test_concurrency import race_behind

    inbox.set_policy("refund", "allow", actor="ops")
    racer = make_inbox(application_name="racer-permit")
    ctx = racer.context(a_run(racer, "ivy"))
    takeover = "UPDATE leases SET holder = 'B', gen = gen + 1 WHERE user_id = %(user)s"

    def ask():
        try:
            return ctx.permit_sync("refund", {"order": 1})
        except errors.LeaseLost as exc:
            return exc

    [answer] = race_behind(database_url, takeover, {"user": "ivy"}, [ask], commit=True)
    assert isinstance(answer, errors.LeaseLost)
    assert inbox.permit_decisions("ivy") == []
