"""A user's memory: read with the run's claim, replaced only by the run's fenced
finish (never by a stale run) or by an operator while no run holds the lease.

A contract test module: each test runs on every backend (tests/contract/conftest.py).
"""

import json

import psycopg
import pytest

from agent_inbox import Result, errors


def run_with(inbox, holder="A", **options):
    run = inbox.take_work(holder, **options)
    assert run is not None
    return run


def test_a_run_reads_the_memory_its_predecessor_left(inbox):
    inbox.ingest("alice", "chat", "m1", {})
    first = run_with(inbox)
    assert first.memory is None and inbox.context(first).memory is None
    assert inbox.finish_run(first, Result(memory={"seen": ["m1"], "tone": "brief"}))

    inbox.ingest("alice", "chat", "m2", {})
    second = run_with(inbox, "B")
    assert second.memory == {"seen": ["m1"], "tone": "brief"}
    assert inbox.context(second).memory == second.memory
    assert inbox.finish_run(second, Result(messages=["hi"]))  # memory left out: kept
    assert inbox.memory("alice") == {"seen": ["m1"], "tone": "brief"}

    inbox.ingest("alice", "chat", "m3", {})
    third = run_with(inbox)
    assert inbox.finish_run(third, Result(memory=None))  # None: deleted
    assert inbox.memory("alice") is None


def test_memory_comes_with_every_users_claim_in_one_take(inbox):
    inbox.ingest_many([(f"u{n}", "chat", f"m{n}-{k}", {}) for n in range(3) for k in range(3)])
    runs = inbox.runs.take_runs("A", users=3)
    assert inbox.runs.finish_runs([inbox.runs.outcome(r, Result(memory={"n": r.user})) for r in runs]) == [
        True] * 3
    inbox.ingest_many([(f"u{n}", "chat", f"later-{n}", {}) for n in range(3)])
    again = inbox.runs.take_runs("A", users=3)
    assert sorted((r.user, r.memory) for r in again) == [
        (f"u{n}", {"n": f"u{n}"}) for n in range(3)]


def test_a_stale_or_failed_run_never_writes_memory(inbox):
    inbox.ingest("bob", "chat", "m1", {})
    stale = run_with(inbox)
    assert inbox.runs.release_runs([stale], error="the worker died") == ["bob"]
    newer = run_with(inbox, "B")
    assert inbox.finish_run(newer, Result(memory={"by": "newer"}))
    assert not inbox.finish_run(stale, Result(memory={"by": "stale"}))  # refused by the fence
    assert inbox.memory("bob") == {"by": "newer"}

    inbox.ingest("bob", "chat", "m2", {})
    failing = run_with(inbox)
    assert inbox.finish_run(failing, Result(error="the tool raised", memory={"by": "failed"}))
    assert inbox.memory("bob") == {"by": "newer"}


def test_memory_over_the_limit_is_refused_and_nothing_commits(make_inbox):
    inbox = make_inbox(max_memory_bytes=32)
    inbox.ingest("carol", "chat", "m1", {})
    run = run_with(inbox)
    with pytest.raises(errors.PayloadTooLarge, match="result.memory is 42 bytes as JSON, "
                                                     "over the limit of 32"):
        inbox.finish_run(run, Result(memory={"notes": "x" * 30}), release=False)
    with pytest.raises(errors.InvalidPayload, match="result.memory is not JSON-serialisable"):
        inbox.finish_run(run, Result(memory={"when": object()}), release=False)
    assert [e.status for e in inbox.events("carol")] == ["running"]
    assert inbox.memory("carol") is None
    assert inbox.finish_run(run, Result(memory={"ok": 1}))


def test_an_operator_changes_memory_only_while_no_run_holds_the_lease(inbox, database_url):
    inbox.ingest("dave", "chat", "m1", {})
    run = run_with(inbox)
    with pytest.raises(errors.UserBusy, match=r"user 'dave' has a run in flight \(holder A, "
                                              r"generation 1, lease expires in \d+ s\)"):
        inbox.set_memory("dave", {"reset": True}, actor="ops@host")
    assert inbox.finish_run(run, Result(memory={"v": 1}))
    inbox.set_memory("dave", {"reset": True}, actor="ops@host")
    inbox.set_memory("erin", {"new": True}, actor="ops@host")  # a user with no lease row yet
    assert inbox.memory("dave") == {"reset": True} and inbox.memory("erin") == {"new": True}
    inbox.set_memory("dave", None, actor="ops@host")
    assert inbox.memory("dave") is None
    with psycopg.connect(database_url, autocommit=True) as conn:
        audit = conn.execute("SELECT user_id, actor, action, detail FROM operator_actions"
                             " WHERE user_id = 'dave' ORDER BY id").fetchall()
    assert audit == [("dave", "ops@host", "memory_set", {"previous": {"v": 1},
                                                         "memory": {"reset": True}}),
                     ("dave", "ops@host", "memory_clear", {"previous": {"reset": True},
                                                           "memory": None})]
    inbox.ingest("dave", "chat", "m2", {})
    assert run_with(inbox).memory is None


def test_an_operators_change_is_seen_by_the_next_run_not_overwritten(inbox):
    inbox.ingest("fay", "chat", "m1", {})
    assert inbox.finish_run(run_with(inbox), Result(memory={"v": 1}))
    inbox.set_memory("fay", {"v": 100}, actor="ops")
    inbox.ingest("fay", "chat", "m2", {})
    run = run_with(inbox)
    assert run.memory == {"v": 100}
    assert inbox.finish_run(run, Result(memory={"v": run.memory["v"] + 1}))
    assert inbox.memory("fay") == {"v": 101}


def test_bad_memory_input_changes_nothing(inbox):
    with pytest.raises(errors.InvalidPayload, match="memory is not JSON-serialisable"):
        inbox.set_memory("gus", {"x": {1, 2}}, actor="ops")
    with pytest.raises(errors.InvalidInput, match="actor must not be empty"):
        inbox.set_memory("gus", {}, actor="")
    assert inbox.memory("gus") is None


def test_the_memory_cli_gets_sets_and_clears(capsys, database_url, inbox):
    from tests.test_operator_cli import run_cli

    code, out, err = run_cli(capsys, database_url, "memory", "set", "--user", "hal",
                             '{"likes": ["tea"]}')
    assert code == 0 and "memory_set" in err and "user='hal'" in err
    code, out, _ = run_cli(capsys, database_url, "memory", "get", "--user", "hal", "--json")
    assert code == 0 and json.loads(out) == {"user": "hal", "memory": {"likes": ["tea"]}}
    code, _, err = run_cli(capsys, database_url, "memory", "set", "--user", "hal", "{not json")
    assert code == 2 and "document is not JSON" in err
    assert inbox.memory("hal") == {"likes": ["tea"]}
    inbox.ingest("hal", "chat", "m1", {})
    run_with(inbox)
    code, _, err = run_cli(capsys, database_url, "memory", "clear", "--user", "hal")
    assert code == 2 and "has a run in flight" in err
    assert inbox.memory("hal") == {"likes": ["tea"]}
