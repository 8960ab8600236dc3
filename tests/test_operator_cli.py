"""The operator commands, run in-process through argparse against data made with
the Inbox API: every command in table and --json form."""

import argparse
import json

import psycopg
import pytest

from agent_inbox.api import admin as admin_views
from agent_inbox.cli import operator
from tests import races

T = 1_000_000
TTL = 120  # Inbox's default lease_ttl


def parse(url, *argv):
    parser = argparse.ArgumentParser(prog="agent-inbox")
    operator.add_parsers(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args([*argv] + (["--database-url", url] if url else []))


def run_cli(capsys, url, *argv):
    """(exit code, stdout, stderr) of `agent-inbox <argv> --database-url url`."""
    capsys.readouterr()
    try:
        args = parse(url, *argv)
        code = args.run(args)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, url, *argv, expect=0):
    code, out, err = run_cli(capsys, url, *argv, "--json")
    assert code == expect, err
    return json.loads(out)


def exhaust(inbox, user, now):
    """Crashed runs (claims never finished) until none of the user's events is
    open: every open event ends dead after max_attempts claims. The next now."""
    for _ in range(100):
        if not any(e.status in ("pending", "running") for e in inbox.events(user)):
            return now
        holder = f"crashed-{now}"
        gen = inbox.acquire(user, holder, now=now)
        inbox.claim_batch(user, holder, gen, now=now)
        now += TTL + 1
    raise AssertionError("events never died")


def ingest(inbox, user, *source_ids, source="chat"):
    for source_id in source_ids:
        assert inbox.ingest(user, source, source_id, {"text": source_id})


def ids_of(inbox, user, status):
    return [e.id for e in inbox.events(user, status=status)]


def snapshot(url):
    with psycopg.connect(url) as conn:
        return {table: conn.execute(f"SELECT * FROM {table} ORDER BY 1, 2").fetchall()
                for table in ("events", "leases", "timers", "outbox")}


@pytest.fixture
def world(inbox):
    """alice: 2 dead, 3 pending; bob: 1 running under w-bob's lease (taken at T),
    1 pending; carol: 1 done, 1 held message; dave: done only; erin: 1 dead."""
    ingest(inbox, "alice", "a-dead-1", "a-dead-2")
    exhaust(inbox, "alice", T)
    ingest(inbox, "alice", "a-1", "a-2", "a-3")
    ingest(inbox, "erin", "e-dead")
    exhaust(inbox, "erin", T)
    ingest(inbox, "bob", "b-run")
    gen = inbox.acquire("bob", "w-bob", now=T)
    assert len(inbox.claim_batch("bob", "w-bob", gen, now=T)) == 1
    ingest(inbox, "bob", "b-wait")
    for user in ("carol", "dave"):
        ingest(inbox, user, f"{user[0]}-done")
        gen = inbox.acquire(user, "w", now=T)
        ids = [e.id for e in inbox.claim_batch(user, "w", gen, now=T)]
        messages = ["hello carol"] if user == "carol" else []
        assert inbox.finish(user, "w", gen, ids, messages=messages, now=T)
        assert inbox.runs.release(user, "w", gen, now=T)
    return inbox


def test_status_counts_match_the_inbox(capsys, database_url, world):
    report = run_json(capsys, database_url, "status", "--now", str(T + 10))
    shown = [u["user"] for u in report["users"]]
    assert shown == ["alice", "bob", "erin", "carol"]  # pending desc; dave has only done work
    for user in report["users"]:
        events = world.events(user["user"])
        for state in ("pending", "running", "dead"):
            assert user[state] == sum(e.status == state for e in events), (user, state)
        assert user["outbox_held"] == sum(m.sent_at is None for m in world.outbox(user["user"]))
    bob = report["users"][1]
    assert (bob["lease_holder"], bob["lease_gen"], bob["lease_until"], bob["lease_expires_in"]) \
        == ("w-bob", 1, T + TTL, TTL - 10)
    assert report["now"] == T + 10
    assert report["totals"] == {"users": 4, "pending": 4, "running": 1, "dead": 3,
                                "outbox_held": 1, "outbox_failed": 0}

    limited = run_json(capsys, database_url, "status", "--limit", "2")
    assert [u["user"] for u in limited["users"]] == ["alice", "bob"]
    assert limited["totals"] == report["totals"]  # totals cover every user, not the page

    code, out, err = run_cli(capsys, database_url, "status", "--now", str(T + 10))
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["user", "pending", "running", "dead", "outbox", "held", "outbox",
                                "failed", "lease", "holder", "gen", "lease", "expires", "paused"]
    assert lines[3].split()[:8] == ["bob", "1", "1", "0", "0", "0", "w-bob", "1"]
    assert "in 1m 50s (1970-01-12T13:48:40Z)" in lines[3]
    assert lines[-1] == "total: 4 users, 4 pending, 1 running, 3 dead, 1 outbox held, 0 outbox failed"
    code, out, _ = run_cli(capsys, database_url, "status", "--limit", "1")
    assert "(showing the 1 busiest of 4 users: --limit)" in out


def test_status_of_an_empty_database(capsys, database_url):
    assert run_json(capsys, database_url, "status")["users"] == []
    code, out, _ = run_cli(capsys, database_url, "status")
    assert code == 0 and "total: 0 users, 0 pending" in out


def test_events_lists_a_users_events_newest_first(capsys, database_url, world):
    report = run_json(capsys, database_url, "events", "--user", "alice")
    assert [e["id"] for e in report["events"]] == [e.id for e in reversed(world.events("alice"))]
    assert report["total"] == 5
    dead = run_json(capsys, database_url, "events", "--user", "alice", "--status", "dead")
    assert [(e["source_id"], e["attempts"], e["error"]) for e in dead["events"]] == [
        ("a-dead-2", 3, "too many attempts"), ("a-dead-1", 3, "too many attempts")]
    limited = run_json(capsys, database_url, "events", "--user", "alice", "--limit", "2")
    assert [e["source_id"] for e in limited["events"]] == ["a-3", "a-2"]
    assert limited["total"] == 5

    code, out, _ = run_cli(capsys, database_url, "events", "--user", "alice", "--limit", "2")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["id", "source", "source_id", "kind", "status",
                                              "attempts", "error", "created"]
    assert lines[2].split()[1:7] == ["chat", "a-3", "-", "pending", "0", "-"]
    assert lines[-1] == "(showing the newest 2 of 5 events: --limit)"
    code, out, _ = run_cli(capsys, database_url, "events", "--user", "nobody")
    assert (code, out) == (0, "user 'nobody' has no events\n")


def test_tables_escape_control_characters(capsys, database_url, inbox):
    ingest(inbox, "u", "evil\x1b[2J\nid")
    code, out, _ = run_cli(capsys, database_url, "events", "--user", "u")
    assert code == 0 and "\x1b" not in out and "evil\\x1b[2J\\nid" in out
    report = run_json(capsys, database_url, "events", "--user", "u")
    assert report["events"][0]["source_id"] == "evil\x1b[2J\nid"  # JSON keeps it exact


SPOOFS = "ok\u202egnp.exe\u2066x\u2069\u200e\u200f\x9b2J\x85\x7f\u2028"


def test_json_escapes_c1_and_bidi_characters_and_stays_exact(capsys, database_url, inbox):
    """A terminal cannot be spoofed through --json: C1 controls, DEL, bidi marks,
    overrides and isolates and line separators come out as \\uXXXX escapes."""
    ingest(inbox, "u", SPOOFS)
    inbox.ingest("u", "chat", "payload", {"text": SPOOFS}, kind="k\u202e")
    outputs = {}
    for argv in (("events", "--user", "u"), ("status",)):
        code, outputs[argv[0]], _ = run_cli(capsys, database_url, *argv, "--json")
        assert code == 0
        assert not any(0x7f <= ord(c) <= 0x9f or c in "\u200e\u200f\u2028\u2029\u061c"
                       or 0x202a <= ord(c) <= 0x202e or 0x2066 <= ord(c) <= 0x2069
                       for c in outputs[argv[0]])
    assert "ok\\u202egnp.exe\\u2066x\\u2069\\u200e\\u200f\\u009b2J" in outputs["events"]
    report = run_json(capsys, database_url, "events", "--user", "u")
    assert {e["source_id"] for e in report["events"]} == {SPOOFS, "payload"}  # exact
    code, out, _ = run_cli(capsys, database_url, "events", "--user", "u")
    assert code == 0 and "\u202e" not in out and "\x9b" not in out and "\\u202e" in out


def test_dead_list_across_users(capsys, database_url, world):
    report = run_json(capsys, database_url, "dead", "list")
    expected = sorted(((u, i) for u in ("alice", "erin") for i in ids_of(world, u, "dead")),
                      key=lambda pair: -pair[1])
    assert [(e["user"], e["id"]) for e in report["events"]] == expected
    assert {(e["attempts"], e["error"]) for e in report["events"]} == {(3, "too many attempts")}
    assert report["total"] == 3
    only_erin = run_json(capsys, database_url, "dead", "list", "--user", "erin")
    assert [e["source_id"] for e in only_erin["events"]] == ["e-dead"]
    assert run_json(capsys, database_url, "dead", "list", "--limit", "1")["total"] == 3

    code, out, _ = run_cli(capsys, database_url, "dead", "list", "--limit", "2")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["user", "id", "source", "source_id", "attempts",
                                              "error"]
    assert len(lines) == 5 and lines[-1] == "(showing the newest 2 of 3 dead events: --limit)"
    assert "too many attempts" in lines[2]
    code, out, _ = run_cli(capsys, database_url, "dead", "list", "--user", "bob")
    assert out == "no dead events for user 'bob'\n"


def test_requeue_makes_dead_events_claimable_and_leaves_others_alone(capsys, database_url,
                                                                   world):
    dead1, dead2 = ids_of(world, "alice", "dead")
    pending = ids_of(world, "alice", "pending")[0]
    running = ids_of(world, "bob", "running")[0]
    untouched = {e.id: e for u in ("alice", "bob") for e in world.events(u)
                 if e.id in (dead2, pending, running)}
    with psycopg.connect(database_url, autocommit=True) as listener:
        listener.execute("LISTEN agent_inbox_work")
        code, out, err = run_cli(capsys, database_url, "dead", "requeue", str(dead1),
                                 str(pending), str(running), "999999", str(dead1))
        woken = list(listener.notifies(timeout=2, stop_after=1))
    assert code == 1
    assert [n.channel for n in woken] == ["agent_inbox_work"]
    [requeued] = [e for e in world.events("alice") if e.id == dead1]
    assert (requeued.status, requeued.attempts, requeued.error) == ("pending", 0, None)
    assert {e.id: e for u in ("alice", "bob") for e in world.events(u)
            if e.id in untouched} == untouched
    assert "requeued 1 dead events (attempts 0, claimable now):" in out
    assert f"{pending}  alice  status pending" in out
    assert f"{running}  bob    status running" in out
    assert "999999  -      no such event" in out
    assert out.splitlines()[-1] == "requeued 1 of 4 ids; 3 not requeued"
    [audit] = [line for line in err.splitlines() if line.startswith("agent-inbox audit:")]
    assert audit.startswith("agent-inbox audit: dead requeue by ")
    assert audit.endswith(f"user='alice' id={dead1} source='chat' source_id='a-dead-1' "
                          "previous attempts=3 previous error='too many attempts'")
    [recorded] = run_json(capsys, database_url, "audit", "--user", "alice")["actions"]
    assert (recorded["action"], recorded["event_id"], recorded["detail"]) == (
        "requeue", dead1, {"source": "chat", "source_id": "a-dead-1", "previous_attempts": 3,
                           "previous_error": "too many attempts"})
    assert "@" in recorded["actor"]

    # Claimable again, as a fresh event, in the batch with alice's other fresh events.
    gen = world.acquire("alice", "w-next", now=T + 10_000)
    batch = world.claim_batch("alice", "w-next", gen, now=T + 10_000)
    assert dead1 in [e.id for e in batch] and len(batch) == 4
    assert {e.attempts for e in batch} == {1}

    report = run_json(capsys, database_url, "dead", "requeue", str(dead2), "--user", "alice")
    assert report["requested"] == 1 and report["not_requeued"] == []
    assert [(r["user"], r["id"], r["source_id"], r["previous_attempts"], r["previous_error"])
            for r in report["requeued"]] == [("alice", dead2, "a-dead-2", 3, "too many attempts")]


def test_requeue_does_not_disturb_a_run_in_progress(capsys, database_url, inbox):
    ingest(inbox, "u", "m-0")
    now = exhaust(inbox, "u", T)
    [dead] = ids_of(inbox, "u", "dead")
    ingest(inbox, "u", "m-1")
    gen = inbox.acquire("u", "W", now=now)
    [running] = inbox.claim_batch("u", "W", gen, now=now)
    code, _, _ = run_cli(capsys, database_url, "dead", "requeue", str(dead), "--now", str(now))
    assert code == 0
    assert inbox.finish("u", "W", gen, [running.id], now=now + 1)  # the fence still says yes
    [again] = inbox.claim_batch("u", "W", gen, now=now + 1)
    assert (again.id, again.attempts) == (dead, 1)


def test_requeue_rechecks_dead_once_the_row_is_locked(capsys, database_url, world):
    """Another session changes a dead row while the requeue waits for its lock:
    the requeue leaves the row as that session committed it."""
    dead1, _ = ids_of(world, "alice", "dead")
    args = parse(database_url, "dead", "requeue", str(dead1), "--json")
    with psycopg.connect(database_url) as other:
        other.execute("UPDATE events SET status = 'pending', attempts = 0, error = 'by hand' "
                      "WHERE id = %s", [dead1])
        racer = races.Racers(lambda: args.run(args)).start()
        races.wait_for_lock_waiters(database_url, 1, application_name="agent-inbox-dead-requeue")
        other.commit()
    assert racer.join() == [1]
    report = json.loads(capsys.readouterr().out)
    assert report["not_requeued"] == [{"id": dead1, "user": "alice", "status": "dead",
                                       "reason": "no longer dead (changed meanwhile)"}]
    [event] = [e for e in world.events("alice") if e.id == dead1]
    assert (event.status, event.error) == ("pending", "by hand")


def test_requeue_with_a_user_filter_leaves_other_users_alone(capsys, database_url, world):
    [erin_dead] = ids_of(world, "erin", "dead")
    report = run_json(capsys, database_url, "dead", "requeue", str(erin_dead), "--user", "alice",
                      expect=1)
    assert report["requeued"] == []
    assert report["not_requeued"] == [{"id": erin_dead, "user": None, "status": None,
                                       "reason": "no such event for user 'alice'"}]
    assert ids_of(world, "erin", "dead") == [erin_dead]


def test_requeue_and_discard_work_in_chunks(capsys, database_url, inbox, monkeypatch):
    monkeypatch.setattr(admin_views, "CHUNK", 2)
    ingest(inbox, "u", *[f"m-{i}" for i in range(5)])
    exhaust(inbox, "u", T)
    dead = ids_of(inbox, "u", "dead")
    assert len(dead) == 5
    code, out, err = run_cli(capsys, database_url, "dead", "requeue", *map(str, dead))
    assert code == 0
    progress = [line for line in err.splitlines() if "ids processed" in line]
    assert progress == ["dead requeue: 2/5 ids processed, 2 requeued",
                        "dead requeue: 4/5 ids processed, 4 requeued",
                        "dead requeue: 5/5 ids processed, 5 requeued"]
    assert ids_of(inbox, "u", "pending") == dead
    exhaust(inbox, "u", T + 100_000)
    code, out, err = run_cli(capsys, database_url, "dead", "discard", *map(str, dead))
    assert code == 0 and "dead discard: 5/5 ids processed, 5 discarded" in err
    assert inbox.events("u") == []
    code, out, err = run_cli(capsys, database_url, "dead", "requeue", "1")
    assert "ids processed" not in err  # one chunk: no progress line


def test_discard_deletes_only_dead_events(capsys, database_url, world):
    dead1, dead2 = ids_of(world, "alice", "dead")
    pending = ids_of(world, "alice", "pending")
    code, out, err = run_cli(capsys, database_url, "dead", "discard", str(dead1), str(pending[0]))
    assert code == 1
    assert ids_of(world, "alice", "dead") == [dead2]
    assert ids_of(world, "alice", "pending") == pending
    assert "discarded 1 dead events (their keys can be stored again):" in out
    assert out.splitlines()[-1] == "discarded 1 of 2 ids; 1 not discarded"
    assert "dead discard by " in err and f"id={dead1} source='chat' source_id='a-dead-1'" in err
    discards = [a for a in run_json(capsys, database_url, "audit")["actions"]
                if a["action"] == "discard"]
    assert [(a["user"], a["event_id"], a["detail"]["source_id"]) for a in discards] == [
        ("alice", dead1, "a-dead-1")]
    # The dedup key went with the event: a redelivery is stored again.
    assert world.ingest("alice", "chat", "a-dead-1", {}) is True

    report = run_json(capsys, database_url, "dead", "discard", str(dead2))
    assert [(d["id"], d["source_id"], d["attempts"]) for d in report["discarded"]] == [
        (dead2, "a-dead-2", 3)]
    assert report["not_discarded"] == []
    assert ids_of(world, "alice", "dead") == []


def test_timers_show_due_and_next_due(capsys, database_url, inbox):
    inbox.add_timer("u", "daily", T + 3600, {"k": "digest"}, every=86400)
    inbox.add_timer("u", "once", T + 5, {"k": "ping"}, key=("reminder", "r-1"))
    inbox.add_timer("u", "fired", T, {})
    inbox.add_timer("u", "weekly", T + 7200, {}, cron="0 9 * * 1", timezone="Europe/Paris")
    inbox.run_scheduler(now=T)
    weekly_due = [t.due for t in inbox.timers("u") if t.timer_id == "weekly"][0]
    report = run_json(capsys, database_url, "timers", "--user", "u", "--now", str(T))
    assert [(t["timer_id"], t["due"], t["every"], t["cron"], t["key"], t["done"], t["due_in"])
            for t in report["timers"]] == [
        ("once", T + 5, None, None, ["reminder", "r-1"], False, 5),
        ("daily", T + 3600, 86400, None, None, False, 3600),
        ("weekly", weekly_due, None, "0 9 * * 1", None, False, weekly_due - T),
        ("fired", T, None, None, None, True, 0)]
    assert report["timers"][1]["payload"] == {"k": "digest"}
    assert (report["timers"][2]["timezone"], report["timers"][2]["missed"]) == (
        "Europe/Paris", "coalesce")

    code, out, _ = run_cli(capsys, database_url, "timers", "--user", "u", "--now", str(T))
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["timer", "due", "every", "key", "state", "next",
                                              "due"]
    assert lines[2].split() == ["once", "1970-01-12T13:46:45Z", "-", "reminder/r-1", "waiting",
                                "in", "5s"]
    assert lines[3].split() == ["daily", "1970-01-12T14:46:40Z", "1d", "-", "waiting", "in", "1h"]
    assert "cron 0 9 * * 1 (Europe/Paris)" in lines[4]
    assert lines[5].split() == ["fired", "1970-01-12T13:46:40Z", "-", "-", "done", "-"]
    code, out, _ = run_cli(capsys, database_url, "timers", "--user", "u", "--limit", "1")
    assert out.splitlines()[-1] == "(showing 1 of 4 timers: --limit)"


def test_approve_shows_the_standing_answer(capsys, database_url, inbox):
    inbox.request_approval("u", "deploy", expires_in=60, action={"do": "deploy"}, now=T)
    inbox.request_approval("u", "late", expires_in=60, action={}, now=T)

    code, out, _ = run_cli(capsys, database_url, "approve", "u", "deploy", "yes",
                           "--now", str(T + 10))
    assert (code, out) == (0, "yes: the answer 'yes' stands\n")
    report = run_json(capsys, database_url, "approve", "u", "deploy", "no", "--now", str(T + 11))
    assert report == {"user": "u", "request": "deploy", "answer": "no", "standing": "yes",
                      "stood": False}
    code, out, _ = run_cli(capsys, database_url, "approve", "u", "deploy", "no")
    assert (code, out) == (0, "yes: the answer 'yes' already stood; 'no' was not stored\n")

    code, out, _ = run_cli(capsys, database_url, "approve", "u", "late", "yes",
                           "--now", str(T + 61))
    assert (code, out) == (0, "expired: the request's deadline passed; 'yes' was not stored\n")
    assert run_json(capsys, database_url, "approve", "u", "late", "no")["standing"] == "expired"

    code, out, _ = run_cli(capsys, database_url, "approve", "u", "never", "yes")
    assert (code, out) == (3, "unknown: user 'u' has no approval request 'never'\n")
    assert run_json(capsys, database_url, "approve", "u", "never", "no", expect=3) == {
        "user": "u", "request": "never", "answer": "no", "standing": "unknown", "stood": False}
    assert [e.payload["answer"] for e in inbox.events("u")] == ["yes", "expired"]


def test_prune_deletes_old_done_events_and_keeps_recent_keys(capsys, database_url, inbox):
    ingest(inbox, "u", "old", "recent", "fresh")
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("UPDATE events SET status = 'done', created_at = CASE source_id "
                     "WHEN 'old' THEN 1000000 - 30 * 86400 WHEN 'recent' THEN 1000000 - 3 * 86400 "
                     "ELSE 1000000 END")
    code, out, err = run_cli(capsys, database_url, "prune", "--older-than", "1d", "--now", "1000000")
    assert code == 0, err
    assert out.strip() == "deleted 1 events; emptied 1 inside the dedup window (keys kept)"
    assert "prune: 1 users, 1 deleted, 1 emptied" in err
    assert [e.source_id for e in inbox.events("u")] == ["recent", "fresh"]
    assert inbox.ingest("u", "chat", "recent", {}) is False


BAD_INPUT = {
    "unknown status": (["events", "--user", "alice", "--status", "lost"], "invalid choice: 'lost'"),
    "empty user": (["events", "--user", ""], "argument --user: must not be empty"),
    "empty user for timers": (["timers", "--user", ""], "must not be empty"),
    "empty user filter": (["dead", "list", "--user", ""], "must not be empty"),
    "non-integer id": (["dead", "requeue", "1", "x"], "argument ID: 'x' is not a positive integer"),
    "zero id": (["dead", "discard", "0"], "'0' is not a positive integer"),
    "negative id": (["dead", "requeue", "-3"], ""),
    "id beyond bigint": (["dead", "requeue", str(2**63)], "is not a positive integer"),
    "no ids": (["dead", "discard"], "the following arguments are required: ID"),
    "zero limit": (["status", "--limit", "0"], "'0' is not a positive integer"),
    "negative now": (["status", "--now", "-1"], ""),
    "bad answer": (["approve", "u", "deploy", "maybe"], "invalid choice: 'maybe'"),
    "empty request": (["approve", "u", "", "yes"], "must not be empty"),
    "unknown dead subcommand": (["dead", "purge", "1"], "invalid choice: 'purge'"),
    "bad duration": (["prune", "--older-than", "soon"], "'soon' is not a duration"),
    "no duration": (["prune"], "the following arguments are required: --older-than"),
}


@pytest.mark.parametrize("argv, message", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_exits_2_and_changes_nothing(capsys, database_url, world, argv, message):
    before = snapshot(database_url)
    code, out, err = run_cli(capsys, database_url, *argv)
    assert code == 2 and out == ""
    assert message in err
    assert snapshot(database_url) == before


def test_missing_database_url_or_unmigrated_database_exits_2(capsys, monkeypatch,
                                                             empty_database_url):
    monkeypatch.delenv("AGENT_INBOX_DATABASE_URL", raising=False)
    code, out, err = run_cli(capsys, None, "status")
    assert (code, out) == (2, "")
    assert "--database-url is required (or AGENT_INBOX_DATABASE_URL)" in err
    code, out, err = run_cli(capsys, empty_database_url, "dead", "requeue", "1")
    assert (code, out) == (2, "")
    assert "run `agent-inbox migrate` first" in err


def test_an_unreachable_database_exits_2(capsys):
    code, out, err = run_cli(capsys, "postgresql://postgres@127.0.0.1:1/postgres", "status")
    assert (code, out) == (2, "")
    assert "agent-inbox: could not reach the database: connection failed" in err
