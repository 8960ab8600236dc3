"""The worker runtime driven in step by `run_once`: what the handler returns is
what commits, all in the fenced finish; failures come back after a backoff;
first attempts run in the worker (async on its loop, plain on threads), a run
whose last attempt ended without a finish runs alone in a quarantine process."""

import os

import psycopg
import pytest

from agent_inbox.errors import DatabaseUnavailable
from agent_inbox.services.worker import Worker
from agent_inbox.services.worker.flight import StopReason

from tests.runtime.support import wait_until

H = "tests.runtime.handlers"
T = 1_000_000
TTL = 120


@pytest.fixture
def worker():
    """Make Workers (quarantine processes and loops stopped at teardown)."""
    made = []

    def make(inbox, name, **options):
        made.append(Worker(inbox, f"{H}:{name}", **options))
        return made[-1]

    yield make
    for w in made:
        w.close()


def test_a_run_commits_messages_timers_and_approvals_together(inbox, worker):
    inbox.ingest("u", "chat", "1", {})
    counts = worker(inbox, "everything").run_once(now=T)
    assert counts == {"runs": 1, "events": 1, "accepted": 1}
    assert [(m.body, m.sent_at) for m in inbox.outbox("u")] == [("plain", None), ("now!", None)]
    timers = {t.timer_id: t for t in inbox.timers("u")}
    assert timers["follow-up"].due == 2_000_000
    assert timers["expire:refund-1"].due == T + 3600
    assert timers["expire:refund-1"].key == ("approval", "refund-1")
    assert [e.status for e in inbox.events("u")] == ["done"]


def test_the_lease_is_released_at_finish_and_still_fences(inbox, worker):
    inbox.ingest("u", "chat", "1", {})
    w = worker(inbox, "echo")
    w.run_once(now=T)
    assert inbox.acquire("u", "someone-else", now=T) == 2   # free at once, not after the TTL
    run_holder = w.holder
    assert inbox.finish("u", run_holder, 1, [], now=T) is False


@pytest.mark.parametrize("name, error", [
    ("explode", "RuntimeError: tool failed"),
    ("wrong_type", "handler returned str, not agent_inbox.Result"),
    ("bad_result", "invalid handler result"),
    ("message_not_in_a_list", "result.messages must be a list or tuple"),
])
def test_a_failing_handler_puts_its_events_back_for_a_retry(inbox, worker, name, error):
    inbox.ingest("u", "chat", "1", {})
    counts = worker(inbox, name).run_once(now=T)
    assert counts["accepted"] == 1
    [event] = inbox.events("u")
    assert (event.status, event.attempts) == ("pending", 1)
    assert error in event.error
    assert inbox.outbox("u") == []


def test_an_async_handler_runs(inbox, worker):
    inbox.ingest("u", "chat", "1", {})
    worker(inbox, "async_echo").run_once(now=T)
    assert [m.body for m in inbox.outbox("u")] == ["async 1"]


def test_a_retry_waits_for_its_backoff_while_fresh_events_go_ahead(make_inbox, worker):
    inbox = make_inbox(retry_backoff=60, retry_backoff_cap=600)
    inbox.ingest("u", "chat", "broken", {})
    worker(inbox, "explode").run_once(now=T)           # attempt 1 fails
    [failed] = inbox.events("u")
    assert T + 30 <= failed.available_at <= T + 60      # 60 s, jittered into [30, 60]
    inbox.ingest("u", "chat", "fresh", {})
    echo = worker(inbox, "echo")
    assert echo.run_once(now=T + 1)["events"] == 1      # only the fresh event
    assert [m.body for m in inbox.outbox("u")] == ["u:fresh"]
    assert echo.run_once(now=T + 2)["runs"] == 0        # the retry is still backing off
    assert echo.run_once(now=failed.available_at)["events"] == 1
    assert [e.source_id for e in inbox.events("u", status="done")] == ["broken", "fresh"]


def test_backoff_doubles_per_attempt_up_to_the_cap(make_inbox, worker):
    inbox = make_inbox(retry_backoff=10, retry_backoff_cap=25, max_attempts=5)
    inbox.ingest("u", "chat", "broken", {})
    w = worker(inbox, "explode")
    now, delays = T, []
    for _ in range(4):
        assert w.run_once(now=now)["runs"] == 1
        [event] = inbox.events("u")
        delays.append(event.available_at - now)
        now = event.available_at
    # base 10, 20, then capped at 25; jitter scales each into [half, whole]
    for delay, full in zip(delays, (10, 20, 25, 25)):
        assert full // 2 <= delay <= full


def left_unfinished(inbox, user, now=T):
    """A run of `user` that took its events and died without a finish (its
    lease lapses after the TTL): the next claim sees them unfinished."""
    run = inbox.take_work("a-worker-that-died", now=now)
    assert run.user == user
    return now + TTL + 1


def test_first_attempts_run_in_the_worker_on_threads_or_its_event_loop(inbox, worker):
    inbox.ingest("a", "chat", "1", {})
    inbox.ingest("b", "chat", "1", {})
    worker(inbox, "pid_of_runner").run_once(now=T)
    worker(inbox, "async_pid_of_runner").run_once(now=T)
    assert [m.body for u in "ab" for m in inbox.outbox(u)] == [str(os.getpid())] * 2


def test_an_async_handler_keeps_its_event_loop_across_runs(inbox, worker):
    w = worker(inbox, "async_loop_id", concurrency=2)
    for n in range(3):
        inbox.ingest(f"u{n}", "chat", "1", {})
    w.run_once(now=T)
    w.run_once(now=T)
    loops = {m.body for n in range(3) for m in inbox.outbox(f"u{n}")}
    assert len(loops) == 1                                 # one long-lived loop, not asyncio.run


def test_a_run_whose_last_attempt_did_not_finish_runs_alone_in_quarantine(inbox, worker):
    inbox.ingest("u", "chat", "1", {})
    later = left_unfinished(inbox, "u")
    w = worker(inbox, "pid_of_runner")
    assert w.run_once(now=later) == {"runs": 1, "events": 1, "accepted": 1}
    [body] = [m.body for m in inbox.outbox("u")]
    assert body != str(os.getpid()) and int(body) in w.quarantine.pids()
    [event] = inbox.events("u")
    assert (event.status, event.attempts) == ("done", 2)


def test_a_poison_event_in_quarantine_kills_only_its_process_until_it_is_dead(inbox, worker):
    inbox.ingest("u", "chat", "poison", {"poison": True})
    now = left_unfinished(inbox, "u")                      # attempt 1 took a worker down
    w = worker(inbox, "crash_process")
    for attempt in (2, 3):
        assert w.run_once(now=now) == {"runs": 1, "events": 1, "accepted": 0}
        [event] = inbox.events("u")                       # released: still unfinished
        assert (event.status, event.attempts) == ("running", attempt)
        assert event.error == "handler process died (exit code -9)"
        now = max(event.available_at, now + 1)            # the lease is free at once
    assert w.run_once(now=now) == {"runs": 1, "events": 0, "accepted": 1}
    [event] = inbox.events("u")
    assert (event.status, event.attempts, event.error) == ("dead", 3, "too many attempts")


def test_a_quarantine_process_that_dies_before_the_handler_is_tried_again_then_blamed(inbox):
    inbox.ingest("u", "chat", "1", {})
    later = left_unfinished(inbox, "u")
    w = Worker(inbox, "tests.runtime.dies_in_handler_process:handle")
    try:
        assert w.run_once(now=later) == {"runs": 1, "events": 1, "accepted": 1}
    finally:
        w.close()
    [event] = inbox.events("u")
    assert (event.status, event.attempts) == ("pending", 2)
    assert event.error == "handler process died before the run started, 3 times"


def test_a_result_the_worker_cannot_read_from_quarantine_is_the_runs_error(inbox, worker):
    inbox.ingest("u", "chat", "1", {})
    later = left_unfinished(inbox, "u")
    w = worker(inbox, "unreadable_result")
    assert w.run_once(now=later)["accepted"] == 1
    [event] = inbox.events("u")
    assert (event.status, event.attempts) == ("pending", 2)
    assert "the handler's result could not be read" in event.error
    assert w.quarantine.pids()                            # the process goes on


def test_a_take_holds_as_many_users_as_the_worker_has_room_for(inbox, worker):
    for n in range(5):
        inbox.ingest(f"u{n}", "chat", "1", {})
    w = worker(inbox, "echo", concurrency=3)
    assert [w.run_once(now=T)["runs"] for _ in range(3)] == [3, 2, 0]
    assert {inbox.acquire(f"u{n}", "other", now=T) for n in range(5)} == {2}   # all released


def test_a_run_claims_at_most_max_batch_events_the_oldest_first(make_inbox, worker):
    inbox = make_inbox(max_batch=100)
    inbox.ingest_many([("u", "chat", str(n), {}) for n in range(250)])
    w = worker(inbox, "echo")
    assert [w.run_once(now=T)["events"] for _ in range(4)] == [100, 100, 50, 0]
    bodies = [m.body for m in inbox.outbox("u")]
    assert [b.split(":")[1].split(",")[0] for b in bodies] == ["0", "100", "200"]


def test_a_take_whose_answer_was_lost_gives_back_the_runs_it_took(inbox, worker, monkeypatch):
    inbox.ingest("a", "chat", "1", {})
    w = worker(inbox, "echo")
    real_take, lost = inbox.runs.take_runs, []

    def answer_lost_once(*args, **kwargs):
        answer = real_take(*args, **kwargs)               # committed: a taken
        if not lost:
            lost.append(answer)
            raise DatabaseUnavailable("server closed the connection unexpectedly")
        return answer

    monkeypatch.setattr(inbox.runs, "take_runs", answer_lost_once)
    with pytest.raises(DatabaseUnavailable):
        w.run_once(now=T)
    assert [(r.user, r.gen) for r in lost[0]] == [("a", 1)]
    assert w.run_once(now=T) == {"runs": 1, "events": 1, "accepted": 1}
    [a] = inbox.events("a")                               # given back untouched, taken again
    assert (a.status, a.attempts, a.claim_gen) == ("done", 1, 2)


def test_a_result_the_database_refuses_costs_only_its_own_run(inbox, worker, monkeypatch):
    for user in ("a", "bad", "c", "d"):
        inbox.ingest(user, "chat", "1", {})
    w = worker(inbox, "echo", concurrency=4)
    real_finish = inbox.runs.finish_runs

    def refuses_bad(outcomes, **options):                 # as PostgreSQL would, on a value
        if any(o.run.user == "bad" and o.error is None for o in outcomes):
            raise psycopg.errors.NumericValueOutOfRange("integer out of range")
        return real_finish(outcomes, **options)

    monkeypatch.setattr(inbox.runs, "finish_runs", refuses_bad)
    assert w.run_once(now=T) == {"runs": 4, "events": 4, "accepted": 4}
    assert [m.body for u in "acd" for m in inbox.outbox(u)] == ["a:1", "c:1", "d:1"]
    assert [inbox.events(u)[0].status for u in "acd"] == ["done"] * 3
    [bad] = inbox.events("bad")
    assert (bad.status, bad.attempts) == ("pending", 1)
    assert "could not be committed" in bad.error and "integer out of range" in bad.error
    assert inbox.outbox("bad") == []


def test_a_handler_raising_system_exit_in_a_thread_is_the_runs_error(inbox, worker):
    inbox.ingest("u", "chat", "1", {})
    assert worker(inbox, "exits").run_once(now=T)["accepted"] == 1
    [event] = inbox.events("u")
    assert (event.status, event.error.split(" at ")[0]) == ("pending", "SystemExit: 3")


def test_a_stopped_async_run_is_cancelled_and_commits_nothing(inbox, worker):
    inbox.ingest("u", "chat", "1", {})
    w = worker(inbox, "async_wait_for_lease_loss")
    [flight] = w.take(1, now=T)
    wait_until(lambda: flight.state == "running", "the run to start")
    assert w.stop_run(flight, StopReason.LOST)
    assert w.complete([w._endings.get(timeout=10)], now=T) == {"runs": 0, "events": 0,
                                                                "accepted": 0}
    assert inbox.outbox("u") == [] and inbox.events("u")[0].status == "running"
    assert w.in_flight() == []


def test_a_run_that_cannot_be_started_is_given_back_untouched(inbox, worker, monkeypatch):
    inbox.ingest("u", "chat", "1", {})
    w = worker(inbox, "echo")

    def no_thread(*args):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(w._executor, "run", no_thread)
    assert w.run_once(now=T) == {"runs": 0, "events": 0, "accepted": 0}
    [event] = inbox.events("u")
    assert (event.status, event.attempts) == ("pending", 0)          # no attempt spent
    assert inbox.acquire("u", "other", now=T) == 2                    # the lease free at once
    assert w.in_flight() == []
