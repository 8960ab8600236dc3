"""Pause, resume and cancel (store/pauses.py), per user and for the fleet, on
every backend (a contract test module: tests/contract/conftest.py).

A paused user's events are stored and not taken, its timers fire, its
approvals are answered, its messages are held; resume releases all of it in
order. A cancel fences the run in flight off: its renewal, step records and
finish are refused, its events are pending again with the attempt undone, its
durable steps are kept. The fleet's pause stops every take and every send.
The worker's side (a real run cancelled within seconds) is in
tests/runtime/test_stopping.py.
"""

import psycopg
import pytest

from agent_inbox import Result
from agent_inbox.errors import InvalidInput
from agent_inbox.records import StepRecord

T = 1_000_000


def ingest(inbox, user, *keys):
    for key in keys:
        assert inbox.ingest(user, "chat", key, {"k": key})


def take(inbox, holder="H", now=T):
    return {run.user: run for run in inbox.runs.take_runs(holder, users=10, now=now)}


def actions(database_url, user):
    with psycopg.connect(database_url) as conn:
        return [row[0] for row in conn.execute(
            "SELECT action FROM operator_actions WHERE user_id = %s ORDER BY id", (user,))]


def test_a_paused_user_is_stored_not_run_and_resume_runs_it_in_order(inbox, database_url):
    ingest(inbox, "alice", "a-1")
    ingest(inbox, "bob", "b-1")
    paused = inbox.pause("alice", actor="ops", reason="prompt injection")
    assert (paused["already"], paused["reason"], paused["cancelled"]) == (
        False, "prompt injection", None)
    assert set(take(inbox)) == {"bob"}
    # still stored while paused, and deduplicated as usual
    assert inbox.ingest("alice", "chat", "a-2", {}) is True
    assert inbox.ingest("alice", "chat", "a-2", {}) is False
    assert take(inbox, now=T + 1) == {}
    assert [e.status for e in inbox.events("alice")] == ["pending", "pending"]
    state = inbox.pauses()
    assert (state["fleet"], state["users_total"]) == (None, 1)
    assert [(u["user"], u["reason"]) for u in state["users"]] == [("alice", "prompt injection")]

    assert inbox.resume("alice", actor="ops") == {"user": "alice", "resumed": True}
    runs = take(inbox, now=T + 2)
    assert [e.source_id for e in runs["alice"].events] == ["a-1", "a-2"]
    assert inbox.pauses()["users_total"] == 0
    assert actions(database_url, "alice") == ["pause", "resume"]


def test_pausing_twice_keeps_the_first_pause_and_resuming_a_running_user_changes_nothing(
        inbox, database_url):
    ingest(inbox, "alice", "a-1")
    first = inbox.pause("alice", actor="ops", reason="first", now=T)
    again = inbox.pause("alice", actor="ops", reason="second", now=T + 5)
    assert (again["already"], again["paused_at"], again["reason"]) == (True, first["paused_at"],
                                                                        "first")
    assert inbox.resume("alice", actor="ops")["resumed"] is True
    assert inbox.resume("alice", actor="ops")["resumed"] is False
    assert actions(database_url, "alice") == ["pause", "resume"]


def test_a_run_in_flight_when_paused_finishes_and_the_next_events_wait(inbox):
    ingest(inbox, "alice", "a-1")
    [run] = take(inbox).values()
    inbox.pause("alice", actor="ops")
    ingest(inbox, "alice", "a-2")
    assert inbox.runs.renew_runs([run], now=T + 1) == {run.key}  # the run keeps its lease
    assert inbox.runs.finish_runs([inbox.runs.outcome(run, Result(messages=["hi"]))],
                                  now=T + 1) == [True]
    assert take(inbox, now=T + 2) == {}
    assert [e.status for e in inbox.events("alice")] == ["done", "pending"]


def test_pause_with_cancel_fences_the_run_off_and_keeps_its_steps(inbox, database_url):
    ingest(inbox, "alice", "a-1", "a-2")
    [run] = take(inbox).values()
    assert [e.attempts for e in run.events] == [1, 1]
    event_ids = tuple(e.id for e in run.events)
    assert inbox.runs.record_steps(
        [StepRecord(run.user, run.holder, run.gen, event_ids, 1, "llm", 1, '"draft"')],
        now=T) == [True]

    paused = inbox.pause("alice", actor="ops", reason="loop", cancel=True, now=T + 1)
    assert paused["cancelled"] == {"gen": run.gen, "events": list(event_ids)}
    # everything the cancelled run would write is refused
    assert inbox.runs.renew_runs([run], now=T + 2) == set()
    assert inbox.runs.record_steps(
        [StepRecord(run.user, run.holder, run.gen, event_ids, 2, "send", 1, '"sent"')],
        now=T + 2) == [False]
    assert inbox.runs.finish_runs([inbox.runs.outcome(run, Result(messages=["twice"]))],
                                  now=T + 2) == [False]
    assert inbox.outbox("alice") == []
    # the events are pending again, the attempt undone; not taken while paused
    assert [(e.status, e.attempts) for e in inbox.events("alice")] == [("pending", 0)] * 2
    assert take(inbox, now=T + 3) == {}

    inbox.resume("alice", actor="ops", now=T + 4)
    [again] = take(inbox, now=T + 5).values()
    assert again.gen > run.gen and [e.attempts for e in again.events] == [1, 1]
    # its attempt count undone, the next run still reads the steps the cancelled one kept
    assert [(s.position, s.name) for s in inbox.runs.recorded_steps(
        [(again.user, event_ids)])[0]] == [(1, "llm")]
    assert not again.unfinished  # a cancel is not a crash: no quarantine
    assert actions(database_url, "alice") == ["pause", "resume"]
    assert all(e.ran_before for e in again.events)
    calls = []
    ctx = inbox.context(again)
    assert ctx.step_sync("llm", lambda: calls.append("llm") or "fresh") == "draft"
    assert calls == []                          # the completed step is not called again


def test_a_holder_that_kept_its_lease_claims_nothing_while_paused(inbox):
    """The low-level API: acquire, claim_batch, finish keep the lease; a pause
    between two claims stops the second (and so does the fleet's)."""
    ingest(inbox, "carol", "c-1")
    gen = inbox.acquire("carol", "H", now=T)
    [first] = inbox.claim_batch("carol", "H", gen, now=T)
    inbox.pause("carol", actor="ops")
    assert inbox.finish("carol", "H", gen, [first.id], now=T)  # the run in flight ends
    ingest(inbox, "carol", "c-2")
    assert inbox.acquire("carol", "H", now=T) == gen            # a renewal, allowed
    assert inbox.claim_batch("carol", "H", gen, now=T) == []
    inbox.resume("carol", actor="ops")
    inbox.pause_fleet(actor="ops")
    assert inbox.claim_batch("carol", "H", gen, now=T) == []
    inbox.resume_fleet(actor="ops")
    assert [e.source_id for e in inbox.claim_batch("carol", "H", gen, now=T)] == ["c-2"]


def test_cancel_without_pause_runs_the_events_again_at_once(inbox, database_url):
    ingest(inbox, "alice", "a-1")
    [run] = take(inbox).values()
    cancelled = inbox.cancel("alice", actor="ops", reason="stuck", now=T + 1)
    assert cancelled["cancelled"]["gen"] == run.gen
    [again] = take(inbox, holder="H2", now=T + 1).values()
    assert again.gen > run.gen and [e.attempts for e in again.events] == [1]
    assert inbox.runs.finish_runs([inbox.runs.outcome(run, Result())], now=T + 2) == [False]
    assert inbox.runs.finish_runs([inbox.runs.outcome(again, Result())], now=T + 2) == [True]
    # nothing in flight: nothing to cancel, nothing recorded
    assert inbox.cancel("alice", actor="ops", now=T + 3)["cancelled"] is None
    assert actions(database_url, "alice") == ["cancel"]


def test_a_paused_users_messages_are_held_and_sent_once_after_resume(inbox):
    ingest(inbox, "alice", "a-1")
    [run] = take(inbox).values()
    assert inbox.runs.finish_runs([inbox.runs.outcome(run, Result(messages=["one", "two"]))],
                                  now=T) == [True]
    inbox.pause("alice", actor="ops")
    sent = []
    assert inbox.dispatch("alice", sent.append, now=T + 1) == 0
    assert sent == []
    inbox.resume("alice", actor="ops")
    assert inbox.dispatch("alice", sent.append, now=T + 2) == 2
    assert inbox.dispatch("alice", sent.append, now=T + 3) == 0
    assert sent == ["one\n\ntwo"]  # one batch


def test_a_paused_users_timers_fire_and_approvals_are_answered(inbox):
    ingest(inbox, "alice", "a-1")
    inbox.pause("alice", actor="ops")
    inbox.add_timer("alice", "remind", T + 10, {"what": "follow up"})
    inbox.request_approval("alice", "r-1", expires_in=3600, action={"send": "x"}, now=T)
    assert inbox.run_scheduler(now=T + 10) >= 1
    assert inbox.answer_approval("alice", "r-1", "yes", now=T + 11) == "yes"
    assert take(inbox, now=T + 12) == {}
    sources = sorted(e.source for e in inbox.events("alice"))
    assert len(sources) == 3 and "chat" in sources
    inbox.resume("alice", actor="ops")
    [run] = take(inbox, now=T + 13).values()
    assert len(run.events) == 3


def test_the_fleets_pause_stops_every_take_and_every_send(inbox, database_url):
    for user in ("alice", "bob"):
        ingest(inbox, user, f"{user}-1")
    [run] = [r for r in inbox.runs.take_runs("H", users=1, now=T)]
    assert inbox.runs.finish_runs([inbox.runs.outcome(run, Result(messages=["m"]))],
                                  now=T) == [True]
    state = inbox.pause_fleet(actor="ops", reason="bad deploy")
    assert (state["already"], state["reason"], state["cancelled"]) == (False, "bad deploy", [])
    assert inbox.pause_fleet(actor="ops")["already"] is True
    assert inbox.pauses()["fleet"]["reason"] == "bad deploy"
    ingest(inbox, "carol", "c-1")
    assert take(inbox, now=T + 1) == {}
    assert inbox.dispatch(run.user, lambda body: None, now=T + 1) == 0

    assert inbox.resume_fleet(actor="ops") == {"resumed": True}
    assert inbox.resume_fleet(actor="ops") == {"resumed": False}
    assert set(take(inbox, now=T + 2)) == {"alice", "bob", "carol"} - {run.user}
    assert inbox.dispatch(run.user, lambda body: None, now=T + 2) == 1
    assert actions(database_url, "") == ["fleet_pause", "fleet_resume"]


def test_the_fleets_pause_with_cancel_cancels_every_run_in_flight(inbox):
    for user in ("alice", "bob"):
        ingest(inbox, user, f"{user}-1")
    runs = take(inbox)
    state = inbox.pause_fleet(actor="ops", cancel=True, now=T + 1)
    assert sorted(state["cancelled"]) == ["alice", "bob"]
    outcomes = [inbox.runs.outcome(run, Result()) for run in runs.values()]
    assert inbox.runs.finish_runs(outcomes, now=T + 1) == [False, False]
    inbox.resume_fleet(actor="ops")
    assert set(take(inbox, now=T + 2)) == {"alice", "bob"}


@pytest.mark.parametrize("call, field", [
    (lambda ib: ib.pause("", actor="ops"), "user"),
    (lambda ib: ib.pause("nobody", actor="ops"), "user"),
    (lambda ib: ib.pause("alice", actor=""), "actor"),
    (lambda ib: ib.pause("alice", actor="ops", reason="x" * 1001), "reason"),
    (lambda ib: ib.pause("alice", actor="ops", cancel="yes"), "cancel"),
    (lambda ib: ib.resume("nobody", actor="ops"), "user"),
    (lambda ib: ib.cancel("nobody", actor="ops"), "user"),
    (lambda ib: ib.pause_fleet(actor="ops", reason="\x00"), "reason"),
])
def test_bad_input_is_refused_and_changes_nothing(inbox, database_url, call, field):
    ingest(inbox, "alice", "a-1")
    with pytest.raises(InvalidInput) as refused:
        call(inbox)
    assert refused.value.field == field
    state = inbox.pauses()
    assert (state["fleet"], state["users_total"]) == (None, 0)
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM operator_actions").fetchone()[0] == 0
    assert set(take(inbox)) == {"alice"}
