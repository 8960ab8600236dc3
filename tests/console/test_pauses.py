"""Stopping an agent from the console (issue 35; docs/operating/stopping.md): a
user's pause, resume and cancel (approver or operator; a viewer sees the state
and gets 403), the fleet's pause (operator only) and its banner on every page,
the audit rows, CSRF, and bad input (400, nothing changed)."""

import json

import psycopg
import pytest

from tests.console.conftest import TOKENS

PAGES = ("/", "/users", "/user?u=alice", "/dead", "/outbox", "/approvals", "/policies")


@pytest.fixture
def world(inbox):
    """alice: one pending event; bob: one event running under a live lease."""
    inbox.ingest("alice", "chat", "a-1", {"text": "hi"})
    inbox.ingest("bob", "chat", "b-1", {"text": "hi"})
    gen = inbox.acquire("bob", "w-bob")
    assert inbox.claim_batch("bob", "w-bob", gen)
    return inbox


def rows(url, sql):
    with psycopg.connect(url) as conn:
        return conn.execute(sql).fetchall()


def state(url):
    """Every pause, every operator action, and every event's status."""
    return (rows(url, "SELECT user_id, paused_at IS NOT NULL, paused_reason FROM leases "
                      "ORDER BY user_id"),
            rows(url, "SELECT paused_at, actor, reason FROM fleet_pause"),
            rows(url, "SELECT user_id, actor, action, detail FROM operator_actions ORDER BY id"),
            rows(url, "SELECT user_id, status FROM events ORDER BY id"))


def actions(url):
    return state(url)[2]


def paragraph(page: str, id: str) -> str:
    """The HTML of the paragraph with that id, from its id on."""
    start = page.index(f'id="{id}"')
    return page[start:page.index("</p>", start)].replace("&#39;", "'")


def test_a_viewer_sees_the_state_and_is_refused(world, console, database_url):
    world.pause("alice", actor="ops@host", reason="replies in a loop")
    before = state(database_url)
    vic = console.session("vic")
    _, page = vic.get("/user?u=alice")
    paused = paragraph(page, "paused")
    assert "ops@host" in paused and "replies in a loop" in paused
    assert "/user/pause" not in page and "/user/resume" not in page
    _, page = vic.get("/user?u=bob")
    assert 'id="running"' in page and "/user/cancel" not in page
    _, page = vic.get("/")
    assert "/fleet/pause" not in page and "alice" in page[page.index('id="paused"'):]
    csrf = vic.csrf("/user?u=alice")
    for path, form in (("/user/pause", {"user": "bob", "cancel": "yes"}),
                       ("/user/resume", {"user": "alice"}),
                       ("/user/cancel", {"user": "bob"}),
                       ("/fleet/pause", {"cancel": "yes"}),
                       ("/fleet/resume", {})):
        status, body, _ = vic.post(path, {**form, "csrf": csrf})
        assert status == 403 and "your role may not" in body, (path, body[-500:])
        assert console.post(path, form, token=TOKENS["vic"][1])[0] == 403, path
    assert state(database_url) == before


def test_an_approver_pauses_with_cancel_and_resumes(world, console, database_url):
    [(gen,)] = rows(database_url, "SELECT gen FROM leases WHERE user_id = 'bob'")
    bea = console.session("bea")
    _, page = bea.get("/user?u=bob")
    assert 'action="/user/pause"' in page and 'action="/user/cancel"' in page
    status, page, _ = bea.post("/user/pause", {"csrf": bea.csrf("/user?u=bob"), "user": "bob",
                                               "reason": " replies in a loop ", "cancel": "yes"})
    assert status == 200, page[-800:]
    notice = paragraph(page, "stopped")
    assert notice.startswith('id="stopped">User \'bob\' is paused: no run of it starts')
    assert f"the run in flight (generation {gen}) is cancelled" in notice
    assert "its 1 events are pending again" in notice
    paused = paragraph(page, "paused")
    assert "by <span class=\"mono\">console:bea</span>" in paused
    assert "reason: replies in a loop" in paused
    assert 'action="/user/resume"' in page and 'action="/user/pause"' not in page
    leases, fleet, recorded, events = state(database_url)
    assert ("bob", True, "replies in a loop") in leases and fleet == []
    assert recorded == [("bob", "console:bea", "pause", {
        "reason": "replies in a loop", "already": False,
        "cancelled": {"gen": gen, "events": [world.events("bob")[0].id]}})]
    assert ("bob", "pending") in events
    assert "console:bea" in page[page.index('id="actions"'):]

    # the users' list on the overview, and a second pause keeps the first
    _, overview = bea.get("/")
    assert "replies in a loop" in overview[overview.index('id="paused"'):]
    status, page, _ = bea.post("/user/pause", {"csrf": bea.csrf("/user?u=bob"), "user": "bob",
                                               "reason": "another"})
    assert status == 200 and "was already paused" in page
    assert len(actions(database_url)) == 1

    status, page, _ = bea.post("/user/resume", {"csrf": bea.csrf("/user?u=bob"), "user": "bob"})
    assert status == 200
    assert "is resumed: its events run and its held messages are sent" in page
    assert 'id="running"' in page and 'action="/user/pause"' in page
    [_, resumed] = actions(database_url)
    assert resumed[:3] == ("bob", "console:bea", "resume")
    assert resumed[3]["reason"] == "replies in a loop"
    assert ("bob", False, None) in state(database_url)[0]
    status, page, _ = bea.post("/user/resume", {"csrf": bea.csrf("/user?u=bob"), "user": "bob"})
    assert status == 200 and "was not paused: nothing changed" in page
    assert len(actions(database_url)) == 2


def test_an_operator_cancels_a_run_without_pausing(world, console, database_url):
    ann = console.session("ann")
    status, page, _ = ann.post("/user/cancel", {"csrf": ann.csrf("/user?u=bob"), "user": "bob",
                                                "reason": "stuck on a tool"})
    assert status == 200 and "is cancelled: nothing it would commit commits" in page
    assert 'id="running"' in page  # not paused
    [(user, actor, action, detail)] = actions(database_url)
    assert (user, actor, action, detail["reason"]) == ("bob", "console:ann", "cancel",
                                                       "stuck on a tool")
    assert [e.status for e in world.events("bob")] == ["pending"]
    status, page, _ = ann.post("/user/cancel", {"csrf": ann.csrf("/user?u=bob"), "user": "bob"})
    assert status == 200 and "no run was in flight, nothing was cancelled" in page
    assert len(actions(database_url)) == 1
    # a script with the operator's token: no CSRF token
    status, page, _ = console.post("/user/pause", {"user": "alice"}, token=TOKENS["ann"][1])
    assert status == 200 and actions(database_url)[-1][:3] == ("alice", "console:ann", "pause")


def test_the_fleet_banner_is_on_every_page_while_paused(world, console, database_url):
    ann, vic, bea = console.session("ann"), console.session("vic"), console.session("bea")
    for path in PAGES:
        assert 'id="fleet-paused"' not in ann.get(path)[1], path
    assert 'action="/fleet/pause"' in ann.get("/")[1]
    assert 'action="/fleet/pause"' not in bea.get("/")[1]  # an approver: a user's only
    status, body, _ = bea.post("/fleet/pause", {"csrf": bea.csrf("/")})
    assert status == 403 and "your role may not pause or resume the fleet" in body

    status, page, _ = ann.post("/fleet/pause", {"csrf": ann.csrf("/"), "reason": "bad deploy",
                                                "cancel": "yes"})
    assert status == 200, page[-800:]
    assert "The fleet is paused" in page and "1 runs in flight cancelled" in page
    assert 'action="/fleet/resume"' in page
    [(_, actor, reason)] = state(database_url)[1]
    assert (actor, reason) == ("console:ann", "bad deploy")
    assert [(u, a, act, d.get("reason")) for u, a, act, d in actions(database_url)] == [
        ("", "console:ann", "fleet_pause", "bad deploy"),
        ("bob", "console:ann", "cancel", "bad deploy")]
    for session in (ann, vic, bea):
        for path in PAGES:
            status, page = session.get(path)
            assert status == 200, path
            banner = paragraph(page, "fleet-paused")
            assert "The fleet is paused since" in banner, path
            assert "console:ann" in banner and "reason: bad deploy" in banner, path
    status, page, _ = vic.post("/fleet/resume", {"csrf": vic.csrf("/")})
    assert status == 403 and 'id="fleet-paused"' in page  # the error page has it too

    status, page, _ = ann.post("/fleet/resume", {"csrf": ann.csrf("/")})
    assert status == 200 and "The fleet is resumed" in page
    assert 'id="fleet-paused"' not in page and 'action="/fleet/pause"' in page
    for path in PAGES:
        assert 'id="fleet-paused"' not in vic.get(path)[1], path
    assert state(database_url)[1] == []
    assert actions(database_url)[-1][:3] == ("", "console:ann", "fleet_resume")
    status, page, _ = ann.post("/fleet/resume", {"csrf": ann.csrf("/")})
    assert status == 200 and "The fleet was not paused: nothing changed" in page
    assert len(actions(database_url)) == 3


def test_a_session_needs_its_csrf_token(world, console, database_url):
    before = state(database_url)
    ann, vic = console.session("ann"), console.session("vic")
    for path, form in (("/user/pause", {"user": "bob", "cancel": "yes"}),
                       ("/user/cancel", {"user": "bob"}),
                       ("/fleet/pause", {"cancel": "yes"})):
        for csrf in (None, "forged", vic.csrf("/")):  # none, made up, another session's
            status, body, _ = ann.post(path, form if csrf is None else {**form, "csrf": csrf})
            assert status == 403 and "CSRF" in body, (path, csrf)
    assert state(database_url) == before


@pytest.mark.parametrize("path, form, message", [
    ("/user/pause", {"user": "alice", "reason": "x" * 1001},
     "reason must be at most 1000 bytes"),
    ("/user/pause", {"user": "alice", "reason": "é" * 501},  # 501 characters, 1002 bytes
     "reason must be at most 1000 bytes"),
    ("/user/pause", {"user": "alice", "reason": "a\x00b"}, "reason must not contain NUL"),
    ("/user/pause", {"user": "nobody"}, "user is not a known user (it has no events)"),
    ("/user/pause", {"user": ""}, "user must not be empty"),
    ("/user/pause", {}, "user must not be empty"),
    ("/user/pause", {"user": "bob", "cancel": "maybe"}, "cancel must be 'yes' or absent"),
    ("/user/cancel", {"user": "bob", "reason": "x" * 1001},
     "reason must be at most 1000 bytes"),
    ("/user/cancel", {"user": "nobody"}, "user is not a known user (it has no events)"),
    ("/user/resume", {"user": "nobody"}, "user is not a known user (it has no events)"),
    ("/fleet/pause", {"reason": "x" * 1001}, "reason must be at most 1000 bytes"),
    ("/fleet/pause", {"cancel": "1"}, "cancel must be 'yes' or absent"),
])
def test_bad_input_is_400_and_changes_nothing(world, console, database_url, path, form,
                                              message):
    before = state(database_url)
    ann = console.session("ann")
    status, body, _ = ann.post(path, {**form, "csrf": ann.csrf("/")})
    assert status == 400, body[-800:]
    shown = paragraph(body, "error")
    assert message in shown, shown
    status, body, _ = console.post(path, form, token=TOKENS["ann"][1])
    assert status == 400 and message in json.loads(body)["error"]
    assert state(database_url) == before
