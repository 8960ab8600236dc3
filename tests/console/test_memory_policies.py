"""A user's memory and permission rules in the console: what the user page
shows, who may change the rules (approvers; viewers get 403), bad input (400,
nothing changed), the audit rows, and one approver setting a rule in Chromium."""

import json
import os

import psycopg
import pytest

from agent_inbox import Result
from agent_inbox.agent.permits import PermitAsk
from agent_inbox.store import policies
from tests.console.conftest import TOKENS, ConsoleProcess

MEMORY = {"name": "Alice", "likes": ["<b>tea</b>", "trains"], "visits": 3}


@pytest.fixture
def world(inbox):
    """alice: a memory her run wrote, a rule of her own, a default beneath it,
    and two permit decisions; bob: nothing at all."""
    inbox.ingest("alice", "chat", "a-1", {"text": "hi"})
    run = inbox.take_work("w-1")
    assert inbox.finish_run(run, Result(memory=MEMORY))
    inbox.set_policy("send_email", "ask", user="alice", ask_expires_in=3600, actor="ops@host")
    inbox.set_policy("*", "deny", actor="ops@host")
    inbox.set_policy("search", "allow", actor="ops@host")
    gen = inbox.acquire("alice", "w-2")
    asks = [PermitAsk("alice", "w-2", gen, tool, policies.digest({"n": n}))
            for n, tool in enumerate(("search", "rm_rf"))]
    assert [d.answer for d in inbox.runs.decide_permits(asks)] == ["allow", "deny"]
    inbox.runs.release("alice", "w-2", gen)
    return inbox


def rows(url, sql):
    with psycopg.connect(url) as conn:
        return conn.execute(sql).fetchall()


def audit(url):
    return rows(url, "SELECT user_id, actor, action, detail FROM operator_actions "
                     "WHERE action LIKE 'policy%' ORDER BY id")


def all_rules(url):
    return (rows(url, "SELECT user_id, tool, answer, ask_expires_in, updated_by FROM policies "
                      "ORDER BY user_id, tool"),
            rows(url, "SELECT tool, answer, ask_expires_in, updated_by FROM default_policies "
                      "ORDER BY tool"))


def test_the_user_page_shows_memory_rules_defaults_and_decisions(world, console):
    status, page = console.get("/user?u=alice", token=TOKENS["vic"][1])
    assert status == 200
    memory = page[page.index('id="memory"'):page.index('id="permissions"')]
    assert "w-1" in memory  # the run that wrote it
    size = len(json.dumps(MEMORY, separators=(",", ":")).encode())
    assert f"{size} bytes" in memory and "(limit 262144)" in memory
    assert "&#34;&lt;b&gt;tea&lt;/b&gt;&#34;" in memory  # pretty JSON, escaped
    assert "<b>tea</b>" not in page
    rules = page[page.index('id="rules"'):page.index('id="default-rules"')]
    assert "send_email" in rules and "rule-ask" in rules and "1h" in rules
    assert "ops@host" in rules
    defaults = page[page.index('id="default-rules"'):page.index('id="decisions"')]
    assert "search" in defaults and "rule-allow" in defaults and "rule-deny" in defaults
    decisions = page[page.index('id="decisions"'):]
    assert "default:search" in decisions and "default:*" in decisions
    assert decisions.index("rm_rf") < decisions.index("default:search")  # newest first
    assert "/policies/set" not in page and "/policies/clear" not in page  # a viewer's page

    _, empty = console.get("/user?u=bob", token=TOKENS["vic"][1])
    assert "no memory stored" in empty and "no rules of this user&#39;s own" in empty
    assert "no decisions recorded" in empty


def test_memory_is_hidden_from_viewers_when_payloads_are(world, database_url):
    hiding = ConsoleProcess(database_url, "--hide-payloads-from-viewers")
    try:
        _, by_viewer = hiding.get("/user?u=alice", token=TOKENS["vic"][1])
        _, by_approver = hiding.get("/user?u=alice", token=TOKENS["bea"][1])
    finally:
        hiding.stop()
    assert 'id="memory-doc"' not in by_viewer and "document hidden" in by_viewer
    assert "Alice" not in by_viewer and "trains" not in by_viewer
    assert "w-1" in by_viewer  # who wrote it and its size are still shown
    assert 'id="memory-doc"' in by_approver and "trains" in by_approver


def test_an_approver_sets_and_clears_rules_audited(world, console, database_url):
    bea = console.session("bea")
    csrf = bea.csrf("/user?u=alice")
    assert 'action="/policies/set"' in bea.get("/user?u=alice")[1]
    status, _, location = bea.post("/policies/set", {
        "csrf": csrf, "scope": "user", "user": "alice", "tool": " refund ", "answer": "ask",
        "ask_expires_in": "90m"})
    assert (status, location) == (303, "/user?u=alice#permissions")
    status, _, _ = bea.post("/policies/set", {
        "csrf": csrf, "scope": "user", "user": "alice", "tool": "send_email", "answer": "allow",
        "ask_expires_in": ""})
    assert status == 303
    status, _, _ = bea.post("/policies/clear", {
        "csrf": csrf, "scope": "user", "user": "alice", "tool": "refund"})
    assert status == 303
    csrf = bea.csrf("/policies")
    status, _, location = bea.post("/policies/set", {
        "csrf": csrf, "scope": "default", "user": "ignored", "tool": "search", "answer": "deny",
        "ask_expires_in": "2h"})
    assert (status, location) == (303, "/policies")
    assert all_rules(database_url) == (
        [("alice", "send_email", "allow", 86400, "console:bea")],
        [("*", "deny", 86400, "ops@host"), ("search", "deny", 7200, "console:bea")])
    assert [(u, a, act, (d["tool"], d["previous"], d["answer"], d["ask_expires_in"]))
            for u, a, act, d in audit(database_url)][3:] == [
        ("alice", "console:bea", "policy_set", ("refund", None, "ask", 5400)),
        ("alice", "console:bea", "policy_set", ("send_email", "ask", "allow", None)),
        ("alice", "console:bea", "policy_clear", ("refund", "ask", None, None)),
        ("", "console:bea", "policy_set", ("search", "allow", "deny", None))]
    _, page = bea.get("/user?u=alice")
    assert "console:bea" in page[page.index('id="rules"'):page.index('id="default-rules"')]

    # a script with the token: no CSRF token needed (a browser never sends the header)
    status, _, _ = console.post("/policies/clear", {"scope": "default", "tool": "search"},
                                token=TOKENS["ann"][1])
    assert status == 303
    assert audit(database_url)[-1][1:3] == ("console:ann", "policy_clear")
    # a rule that is not there: 404, nothing recorded
    status, body, _ = console.post("/policies/clear", {"scope": "default", "tool": "search"},
                                   token=TOKENS["ann"][1])
    assert status == 404 and "no rule for tool 'search'" in body
    assert len(audit(database_url)) == 8


def test_a_viewer_is_refused_and_a_session_needs_its_csrf_token(world, console, database_url):
    before = all_rules(database_url), audit(database_url)
    vic = console.session("vic")
    csrf = vic.csrf("/user?u=alice")
    for path, form in (("/policies/set", {"scope": "user", "user": "alice", "tool": "x",
                                          "answer": "allow"}),
                       ("/policies/clear", {"scope": "user", "user": "alice",
                                            "tool": "send_email"}),
                       ("/policies/set", {"scope": "default", "tool": "x", "answer": "allow"})):
        status, body, _ = vic.post(path, {**form, "csrf": csrf})
        assert status == 403 and "your role may not set or clear permission rules" in body
        status, _, _ = console.post(path, form, token=TOKENS["vic"][1])
        assert status == 403
    _, page = vic.get("/policies")
    assert "/policies/set" not in page and "Clear</button>" not in page
    bea = console.session("bea")
    for csrf in (None, "forged", vic.csrf("/policies")):  # none, made up, another session's
        form = {"scope": "user", "user": "alice", "tool": "x", "answer": "allow"}
        status, body, _ = bea.post("/policies/set", form if csrf is None else {**form,
                                                                               "csrf": csrf})
        assert status == 403 and "CSRF" in body
    assert (all_rules(database_url), audit(database_url)) == before


@pytest.mark.parametrize("change, message", [
    ({"answer": "maybe"}, "answer must be one of allow, deny, ask (got 'maybe')"),
    ({"answer": ""}, "answer must be one of allow, deny, ask"),
    ({"answer": None}, "answer must be one of allow, deny, ask (got None)"),
    ({"tool": ""}, "tool must not be empty"),
    ({"tool": "   "}, "tool must not be empty"),
    ({"tool": None}, "tool must not be empty"),
    ({"tool": "t" * 201}, "tool is 201 bytes in UTF-8, over the limit of 200"),
    ({"ask_expires_in": "0"}, "ask_expires_in must be a positive duration"),
    ({"ask_expires_in": "-5"}, "ask_expires_in must be a positive duration"),
    ({"ask_expires_in": "1.5h"}, "ask_expires_in must be a positive duration"),
    ({"ask_expires_in": "soon"}, "ask_expires_in must be a positive duration"),
    ({"ask_expires_in": "999999999999d"}, "ask_expires_in is too large"),
    ({"scope": "everyone"}, "scope must be one of user, default"),
    ({"user": ""}, "user must not be empty"),
])
def test_bad_input_is_refused_and_changes_nothing(world, console, database_url, change,
                                                  message):
    before = all_rules(database_url), audit(database_url)
    form = {"scope": "user", "user": "alice", "tool": "refund", "answer": "ask",
            "ask_expires_in": "1h", **change}
    form = {k: v for k, v in form.items() if v is not None}
    bea = console.session("bea")
    status, body, _ = bea.post("/policies/set", {**form, "csrf": bea.csrf("/user?u=alice")})
    assert status == 400 and message in body.replace("&#39;", "'"), body[-800:]
    status, body, _ = console.post("/policies/set", form, token=TOKENS["bea"][1])
    assert status == 400 and message in json.loads(body)["error"]
    assert (all_rules(database_url), audit(database_url)) == before


def test_an_approver_sets_a_rule_in_the_browser(login, world, console, database_url):
    page = login("bea")
    page.goto(console.url + "/user?u=alice")
    assert page.locator("#rules tbody tr").count() == 1
    form = page.locator("#set-rule")
    form.locator("input[name=tool]").fill("refund")
    form.locator("select[name=answer]").select_option("ask")
    form.locator("input[name=ask_expires_in]").fill("2h")
    form.locator("button[type=submit]").click()
    page.wait_for_url("**/user?u=alice#permissions")
    row = page.locator("#rules tbody tr", has_text="refund")
    assert row.locator("td").nth(1).inner_text() == "ask"
    assert row.locator("td").nth(2).inner_text() == "2h"
    assert "console:bea" in row.inner_text()
    if os.environ.get("AGENT_INBOX_SCREENSHOTS_DIR"):
        page.screenshot(path=os.path.join(os.environ["AGENT_INBOX_SCREENSHOTS_DIR"],
                                          "console-user-rules.png"), full_page=True)
    row.locator("button.danger").click()
    page.wait_for_url("**/user?u=alice#permissions")
    assert page.locator("#rules tbody tr", has_text="refund").count() == 0
    assert [a[2] for a in audit(database_url)][-2:] == ["policy_set", "policy_clear"]
