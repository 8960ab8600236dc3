"""The console in a real browser (headless Chromium): log in, read, repair,
answer, and the protections: escaping, CSP, roles, CSRF."""

import psycopg
import pytest
from playwright.sync_api import expect

from tests.console.conftest import TOKENS
from tests.test_operator_cli import exhaust

T = 1_000_000
XSS = '<img src=x onerror=alert(1)> and <script>alert(2)</script>'


@pytest.fixture
def world(inbox):
    """alice: 2 dead events and one pending whose payload is hostile markup;
    bob: one event running under a live lease; carol: an approval request."""
    for key in ("a-dead-1", "a-dead-2"):
        inbox.ingest("alice", "chat", key, {"text": key})
    exhaust(inbox, "alice", T)
    inbox.ingest("alice", "chat", "a-xss", {"text": XSS, XSS: "key"})
    inbox.ingest("bob", "chat", "b-run", {"text": "hi"})
    gen = inbox.acquire("bob", "w-bob")
    assert inbox.claim_batch("bob", "w-bob", gen)
    inbox.request_approval("carol", "refund-881", expires_in=3600, action="refund order 881?")
    return inbox


def counts(url):
    with psycopg.connect(url) as conn:
        return dict(conn.execute("SELECT status, count(*) FROM events GROUP BY status").fetchall())


def test_login_sets_a_strict_httponly_session(login, console):
    page = login("ann")
    [cookie] = page.context.cookies()
    assert (cookie["httpOnly"], cookie["sameSite"]) == (True, "Strict")
    assert page.locator(".who").inner_text().startswith("ann")
    page.click("text=Log out")
    page.wait_for_url("**/login")
    page.goto(console.url + "/dead")
    assert "/login" in page.url


def test_a_wrong_token_is_refused(browser, console):
    page = browser.new_page()
    try:
        page.goto(console.url + "/login")
        page.fill("input[name=token]", "not-a-token-at-all-0000")
        page.click("button[type=submit]")
        assert page.locator(".notice.bad").inner_text() == "That token is not recognised."
        assert page.context.cookies() == []
    finally:
        page.close()


def test_overview_totals_equal_the_database(login, world, database_url):
    page = login("vic")
    by_status = counts(database_url)
    shown = {field: page.locator(f"[data-field={field}]").inner_text()
             for field in ("pending", "running", "dead", "outbox_held", "outbox_failed", "workers")}
    assert shown == {"pending": str(by_status.get("pending", 0)),
                     "running": str(by_status.get("running", 0)),
                     "dead": str(by_status.get("dead", 0)), "outbox_held": "0",
                     "outbox_failed": "0", "workers": "1"}
    assert by_status["dead"] == 2 and by_status["running"] == 1


def test_open_a_user_from_the_list(login, world, console):
    page = login("vic")
    page.click("nav >> text=Users")
    page.fill("input[name=q]", "al")
    page.click("text=Search")
    assert page.locator("#users tbody tr").count() == 1
    page.click("#users >> text=alice")
    assert page.locator("#user-id").inner_text() == "alice"
    assert page.locator("#events tbody tr").count() == 3
    assert page.locator("#events .badge.dead").count() == 2


def test_hostile_payload_renders_as_text_and_runs_nothing(login, world, console):
    page = login("ann")
    dialogs = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.goto(console.url + "/user?u=alice")
    row = page.locator("#events tbody tr", has_text="a-xss")
    row.locator("summary").click()
    text = row.locator("pre.payload").inner_text()
    assert "<img src=x onerror=alert(1)>" in text and "<script>alert(2)</script>" in text
    assert row.locator("pre.payload img, pre.payload script").count() == 0
    assert page.locator("img[src=x]").count() == 0
    page.reload()
    page.locator("#events summary").first.click()
    assert dialogs == []


def test_pages_carry_a_strict_content_security_policy(login, console):
    page = login("vic")
    answer = page.request.get(console.url + "/users")
    policy = answer.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert "unsafe-inline" not in policy
    assert answer.headers["x-frame-options"] == "DENY"
    assert answer.headers["referrer-policy"] == "no-referrer"


def test_requeue_a_dead_event(login, world, database_url):
    page = login("ann")
    page.click("nav >> text=Dead events")
    [first, _] = world.events("alice", status="dead")
    page.check(f"input[name=pick][value='{first.id}:alice']")
    page.click("#requeue")
    assert page.locator("h1").inner_text() == "Requeue 1 dead event?"
    page.click("#confirm")
    assert "1 dead events requeued" in page.locator("#result").inner_text()
    event = next(e for e in world.events("alice") if e.id == first.id)
    assert (event.status, event.attempts, event.error) == ("pending", 0, None)
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT actor, action, event_id FROM operator_actions").fetchall() \
            == [("console:ann", "requeue", first.id)]


def test_discard_many_dead_events_at_once(login, world, database_url):
    page = login("ann")
    page.goto(page.url + "dead")
    for box in page.locator("input[name=pick]").all():
        box.check()
    page.click("#discard")
    assert page.locator("h1").inner_text() == "Discard 2 dead events?"
    page.click("#confirm")
    assert world.events("alice", status="dead") == []
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT actor, action FROM operator_actions").fetchall() \
            == [("console:ann", "discard")] * 2


def test_a_viewer_has_no_repair_buttons_and_a_forged_post_is_refused(login, world, console):
    page = login("vic")
    page.goto(console.url + "/dead")
    assert page.locator("#dead tbody tr").count() == 2
    assert page.locator("#requeue, #discard, input[name=pick]").count() == 0
    page.goto(console.url + "/approvals")
    assert page.locator("button.approve").count() == 0
    csrf = page.locator("input[name=csrf]").first.input_value()  # the viewer's own session
    [dead, _] = world.events("alice", status="dead")
    answer = page.request.post(console.url + "/dead/apply", form={
        "csrf": csrf, "action": "requeue", "pick": f"{dead.id}:alice"})
    assert answer.status == 403
    answer = page.request.post(console.url + "/approvals/answer", form={
        "csrf": csrf, "user": "carol", "request": "refund-881", "answer": "yes"})
    assert answer.status == 403
    assert len(world.events("alice", status="dead")) == 2
    assert [e for e in world.events("carol") if e.source == "approval"] == []


def test_a_post_without_the_csrf_token_is_refused(login, world, console):
    page = login("ann")
    [dead, _] = world.events("alice", status="dead")
    for form in ({"action": "requeue", "pick": f"{dead.id}:alice"},
                 {"action": "requeue", "pick": f"{dead.id}:alice", "csrf": "forged"}):
        answer = page.request.post(console.url + "/dead/apply", form=form)
        assert answer.status == 403, form
        assert "CSRF" in answer.text()
    assert len(world.events("alice", status="dead")) == 2


def test_approve_shows_the_answer_that_stands(login, world, database_url):
    page = login("bea")
    page.click("nav >> text=Approvals")
    row = page.locator("#requests tbody tr", has_text="refund-881")
    assert "refund order 881?" in row.inner_text()
    row.locator("button.approve").click()
    assert page.locator("#standing").inner_text() == "yes: the answer 'yes' stands"
    with psycopg.connect(database_url) as conn:
        stored = conn.execute("SELECT status, payload->>'answer' FROM events WHERE "
                              "user_id = 'carol' AND source = 'approval' "
                              "AND source_id = 'refund-881'").fetchall()
    assert stored == [("pending", "yes")]  # the answer, in carol's inbox for her next run
    assert page.locator("#requests tbody tr", has_text="refund-881").count() == 0


def test_a_late_second_approver_is_told_the_answer_that_stands(login, world):
    first, second = login("bea"), login("ann")
    for page in (first, second):
        page.click("nav >> text=Approvals")
    first.locator("#requests tr", has_text="refund-881").locator("button.approve").click()
    second.locator("#requests tr", has_text="refund-881").locator("button.danger").click()
    assert second.locator("#standing").inner_text() == \
        "yes: the answer 'yes' already stood; 'no' was not stored"


def test_every_page_needs_authentication(console, world):
    for path in ("/", "/users", "/user?u=alice", "/dead", "/outbox", "/approvals", "/policies",
                 "/overview/chart.svg"):
        status, _ = console.get(path)
        assert status == 303, path  # to the login form
        assert console.get(path, token="wrong-token-0123456789")[0] == 401, path
        assert console.get(path, token=TOKENS["vic"][1])[0] == 200, path
    assert console.get("/api/overview")[0] == 401


def test_the_overview_updates_live(login, world):
    page = login("vic")
    pending = page.locator("[data-field=pending]")
    before = int(pending.inner_text())
    world.ingest("dora", "chat", "d-1", {"text": "new"})
    # the page polls every 5 s (no eval in the page: its CSP forbids it)
    expect(pending).to_have_text(str(before + 1), timeout=12_000)
    assert page.locator("#updated").inner_text().startswith("Last update:")


def test_an_answer_after_the_deadline_is_told_it_expired(login, world, database_url):
    world.request_approval("erin", "late-1", expires_in=0, action="too late?")
    page = login("bea")
    page.click("nav >> text=Approvals")
    page.locator("#requests tr", has_text="late-1").locator("button.approve").click()
    assert page.locator("#standing").inner_text() == \
        "expired: the request's deadline passed; 'yes' was not stored"
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT payload->>'answer' FROM events WHERE user_id = 'erin' "
                            "AND source = 'approval'").fetchall() == [("expired",)]


def test_retry_a_failed_outbox_batch(login, world, database_url):
    with psycopg.connect(database_url) as conn:
        [(batch,)] = conn.execute(
            "INSERT INTO outbox (user_id, body, created, batch, failed_at, error) "
            "VALUES ('alice', 'hello', 1, NULL, 2, 'HTTP 410') RETURNING id").fetchall()
        conn.execute("UPDATE outbox SET batch = id WHERE id = %s", [batch])
        conn.execute("INSERT INTO deliveries (user_id, batch) VALUES ('alice', NULL)")
    page = login("ann")
    page.click("nav >> text=Failed batches")
    page.check(f"input[name=pick][value='{batch}']")
    page.click("#retry")
    assert page.locator("h1").inner_text() == "Retry 1 failed batch?"
    page.click("#confirm")
    assert "1 failed batches retried" in page.locator("#result").inner_text()
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT failed_at, error FROM outbox").fetchall() == [(None, None)]
        assert conn.execute("SELECT actor, action, outbox_batch FROM operator_actions"
                            ).fetchall() == [("console:ann", "outbox_retry", batch)]


def test_pause_and_resume_a_user(login, world, console, database_url):
    page = login("bea")
    page.goto(console.url + "/user?u=bob")
    expect(page.locator("#running")).to_have_text("Not paused: its events run as they come.")
    form = page.locator("#pause-user")
    form.locator("input[name=reason]").fill("replies in a loop")
    form.locator("input[name=cancel]").check()
    form.locator("button[type=submit]").click()
    expect(page.locator("#stopped")).to_contain_text("User 'bob' is paused")
    expect(page.locator("#stopped")).to_contain_text("is cancelled")
    paused = page.locator("#paused")
    expect(paused).to_contain_text("by console:bea, reason: replies in a loop")
    assert page.locator("#pause-user, #cancel-run").count() == 0  # the run is gone
    assert [e.status for e in world.events("bob")] == ["pending"]
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT paused_reason FROM leases WHERE user_id = 'bob'"
                            ).fetchall() == [("replies in a loop",)]
    page.locator("#resume button").click()
    expect(page.locator("#stopped")).to_contain_text("User 'bob' is resumed")
    expect(page.locator("#running")).to_be_visible()
    assert page.locator("#paused").count() == 0
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT actor, action FROM operator_actions ORDER BY id"
                            ).fetchall() == [("console:bea", "pause"), ("console:bea", "resume")]
    assert [r.locator("td").nth(2).inner_text() for r in page.locator("#actions tbody tr").all()
            ] == ["resume", "pause"]


def test_the_fleet_banner_in_the_browser(login, world, console):
    page = login("ann")
    assert page.locator("#fleet-paused").count() == 0
    page.locator("#pause-fleet input[name=reason]").fill("bad deploy")
    page.locator("#pause-fleet button").click()
    expect(page.locator("#fleet-paused")).to_contain_text(
        "The fleet is paused since")
    expect(page.locator("#fleet-paused")).to_contain_text("by console:ann, reason: bad deploy")
    page.click("nav >> text=Users")
    expect(page.locator("#fleet-paused")).to_contain_text("bad deploy")
    page.click("nav >> text=Overview")
    page.locator("#resume-fleet button").click()
    expect(page.locator("#stopped")).to_contain_text("The fleet is resumed")
    assert page.locator("#fleet-paused").count() == 0
