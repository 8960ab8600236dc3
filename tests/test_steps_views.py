"""Durable steps where operators look: `agent-inbox events --user U` and a
user's page in the console show the steps of a run in flight."""

from tests.console.conftest import TOKENS, ConsoleProcess
from tests.test_operator_cli import run_cli, run_json


def a_run_in_flight_with_steps(inbox):
    inbox.ingest("alice", "chat", "m1", {})
    run = inbox.take_work("worker-1")
    ctx = inbox.context(run)
    ctx.step_sync("search", lambda: {"hits": 3})
    ctx.step_sync("search", lambda: {"hits": 0})
    return run


def test_events_shows_the_steps_of_a_run_in_flight(capsys, database_url, inbox):
    run = a_run_in_flight_with_steps(inbox)
    report = run_json(capsys, database_url, "events", "--user", "alice")
    assert [(s["event_ids"], s["name"], s["occurrence"], s["gen"], s["holder"], s["result"])
            for s in report["steps"]] == [
        ([run.events[0].id], "search", 1, 1, "worker-1", {"hits": 3}),
        ([run.events[0].id], "search", 2, 1, "worker-1", {"hits": 0})]
    code, out, _ = run_cli(capsys, database_url, "events", "--user", "alice")
    assert code == 0
    table = out.split("durable steps recorded:\n")[1].splitlines()
    assert table[0].split() == ["events", "step", "gen", "holder", "recorded", "result"]
    assert [line.split()[:4] for line in table[2:]] == [
        [str(run.events[0].id), "search", "1", "worker-1"],
        [str(run.events[0].id), "search#2", "1", "worker-1"]]
    assert run_json(capsys, database_url, "events", "--user", "bob")["steps"] == []


def test_a_users_page_shows_its_steps(database_url, inbox):
    a_run_in_flight_with_steps(inbox)
    console = ConsoleProcess(database_url, "--hide-payloads-from-viewers")
    try:
        status, page = console.get("/user?u=alice", token=TOKENS["ann"][1])
        _, seen_by_viewer = console.get("/user?u=alice", token=TOKENS["vic"][1])
    finally:
        console.stop()
    assert status == 200
    steps = page.split('<table id="steps">')[1].split("</table>")[0]
    assert steps.count("<tr>") == 3  # the header and two steps
    assert "search#2" in steps and "worker-1" in steps and "&#34;hits&#34;: 3" in steps
    viewer_steps = seen_by_viewer.split('<table id="steps">')[1].split("</table>")[0]
    assert "hits" not in viewer_steps and "hidden" in viewer_steps
