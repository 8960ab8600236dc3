"""One worker run, driven by `run_once`: what the handler returns is what commits,
all in the fenced finish; failures come back after a backoff; handlers run in
their slot's own process, so a crash kills only that run."""

import os
import time

import psycopg
import pytest

import agent_inbox.worker
from agent_inbox.errors import DatabaseUnavailable
from agent_inbox.worker import Worker

H = "tests.runtime.handlers"
T = 1_000_000
TTL = 120


@pytest.fixture
def worker():
    """Make Workers (handler processes stopped at teardown)."""
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
    run_holder = w.holders[0]
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
    w = worker(inbox, "explode", isolation="thread")
    now, delays = T, []
    for _ in range(4):
        assert w.run_once(now=now)["runs"] == 1
        [event] = inbox.events("u")
        delays.append(event.available_at - now)
        now = event.available_at
    # base 10, 20, then capped at 25; jitter scales each into [half, whole]
    for delay, full in zip(delays, (10, 20, 25, 25)):
        assert full // 2 <= delay <= full


def test_a_poison_event_crashes_only_its_slots_handler_process(inbox, worker):
    inbox.ingest("u", "chat", "poison", {"poison": True})
    w = worker(inbox, "crash_process")
    now = T
    for attempt in (1, 2, 3):
        counts = w.run_once(now=now)                       # the worker survives each crash
        assert counts == {"runs": 1, "events": 1, "accepted": 1}
        [event] = inbox.events("u")
        assert (event.status, event.attempts) == ("pending", attempt)
        assert "handler process died (exit code -9)" in event.error
        now = event.available_at
    w.run_once(now=now)
    [event] = inbox.events("u")
    assert (event.status, event.attempts, event.error) == ("dead", 3, "too many attempts")


def test_handlers_run_in_the_slots_process_which_is_replaced_after_a_crash(inbox, worker):
    w = worker(inbox, "pid_of_runner", concurrency=2)
    inbox.ingest("a", "chat", "1", {})
    w.run_once(0, now=T)
    inbox.ingest("a", "chat", "2", {})
    w.run_once(0, now=T)
    first, again = [m.body for m in inbox.outbox("a")]
    assert first == again != str(os.getpid())             # one long-lived process per slot
    crashed = w.processes[0]._process
    crashed.kill()
    crashed.join()                                        # died while idle, between runs
    inbox.ingest("b", "chat", "1", {})
    w.run_once(0, now=T)
    [replaced] = [m.body for m in inbox.outbox("b")]
    assert replaced not in (first, str(os.getpid()))


def test_thread_isolation_runs_handlers_in_the_worker(inbox, worker):
    inbox.ingest("a", "chat", "1", {})
    worker(inbox, "pid_of_runner", isolation="thread").run_once(now=T)
    assert [m.body for m in inbox.outbox("a")] == [str(os.getpid())]


def test_take_work_prefers_the_user_waiting_longest(inbox):
    for user in ("late", "early", "middle"):
        inbox.ingest(user, "chat", "1", {})
    import psycopg
    with psycopg.connect(inbox.pool.conninfo, autocommit=True) as conn:
        conn.execute("UPDATE events SET available_at = CASE user_id WHEN 'early' THEN 10 "
                     "WHEN 'middle' THEN 20 ELSE 30 END")
    order = [inbox.take_work(f"w{n}", now=T).user for n in range(3)]
    assert order == ["early", "middle", "late"]
    assert inbox.take_work("w4", now=T) is None


# --- several users per take ------------------------------------------------------

def test_quick_handlers_grow_the_take_to_several_users(inbox, worker):
    users = ["first", "b1", "b2", "c1", "c2", "c3", "c4"]
    for user in users:
        inbox.ingest(user, "chat", "1", {})
    w = worker(inbox, "echo", max_users_per_take=8)
    # a slot's first take holds one user; each quick take doubles the next
    assert [w.run_once(now=T)["runs"] for _ in range(4)] == [1, 2, 4, 0]
    assert [m.body for u in users for m in inbox.outbox(u)] == [f"{u}:1" for u in users]
    assert {inbox.acquire(u, "other", now=T) for u in users} == {2}    # all released


def test_slow_handlers_are_taken_one_user_at_a_time(inbox, worker):
    for user in ("a", "b", "c"):
        inbox.ingest(user, "chat", "1", {})
    w = worker(inbox, "slow", max_users_per_take=8)
    assert [w.run_once(now=T)["runs"] for _ in range(4)] == [1, 1, 1, 0]


def test_a_crash_in_a_shared_take_costs_only_the_run_it_was_in(inbox, worker, monkeypatch):
    monkeypatch.setattr(agent_inbox.worker, "TAKE_BUDGET", 60.0)  # no give-back: see below
    for user in ("first", "w1", "w2", "a", "b", "c", "d"):
        inbox.ingest(user, "chat", "1", {"poison": user == "b"})
    w = worker(inbox, "crash_process", max_users_per_take=8)
    w.run_once(now=T)
    w.run_once(now=T)                                     # grows the next take to a, b, c, d
    assert w.run_once(now=T) == {"runs": 4, "events": 4, "accepted": 4}
    a, b, c, d = (inbox.events(u)[0] for u in "abcd")
    assert (a.status, c.status, d.status) == ("done", "done", "done")  # in a new process
    assert (b.status, b.attempts) == ("pending", 1)
    assert "handler process died (exit code -9)" in b.error
    assert [m.body for u in "acd" for m in inbox.outbox(u)] == ["ok", "ok", "ok"]


def test_users_behind_a_handler_that_used_up_the_budget_are_given_back_untouched(inbox, worker):
    for user in ("first", "w1", "w2", "slow", "x", "y", "z"):
        inbox.ingest(user, "chat", "1", {"slow": user == "slow"})
    w = worker(inbox, "slow_when_marked", max_users_per_take=8)
    w.run_once(now=T)
    w.run_once(now=T)                                     # the next take: slow, x, y, z
    assert w.run_once(now=T) == {"runs": 1, "events": 1, "accepted": 1}
    assert [m.body for m in inbox.outbox("slow")] == ["slow"]
    for user in "yz":                                     # as if never taken: no attempt spent
        [event] = inbox.events(user)
        assert (event.status, event.attempts, event.error) == ("pending", 0, None)
        assert inbox.acquire(user, "other", now=T) == 2    # the lease free at once
    [x] = inbox.events("x")                               # longest waiting: the next take, alone
    assert (x.status, x.attempts, x.claim_gen) == ("running", 1, 2)
    assert w.run_once(now=T) == {"runs": 1, "events": 1, "accepted": 1}


def test_a_handler_process_that_dies_before_the_handler_is_tried_again_then_blamed(inbox):
    inbox.ingest("u", "chat", "1", {})
    w = Worker(inbox, "tests.runtime.dies_in_handler_process:handle")
    try:
        assert w.run_once(now=T) == {"runs": 1, "events": 1, "accepted": 1}
    finally:
        w.close()
    [event] = inbox.events("u")
    assert (event.status, event.attempts) == ("pending", 1)
    assert event.error == "handler process died before the run started, 3 times"


def test_a_commit_whose_answer_was_lost_gives_back_the_runs_it_took(inbox, worker, monkeypatch):
    inbox.ingest("a", "chat", "1", {})
    w = worker(inbox, "echo")
    [run] = inbox.take_runs(w.holders[0], users=1, now=T)
    w._carried[0] = ([run], time.monotonic())
    inbox.ingest("b", "chat", "1", {})
    real_finish, lost = inbox.finish_runs, []

    def answer_lost_once(*args, **kwargs):
        answer = real_finish(*args, **kwargs)          # committed: a done, b taken
        if not lost:
            lost.append(answer)
            raise DatabaseUnavailable("server closed the connection unexpectedly")
        return answer

    monkeypatch.setattr(inbox, "finish_runs", answer_lost_once)
    counts = w.run_once(now=T)
    assert [r.user for r in lost[0][1]] == ["b"]           # the take the worker never saw
    assert counts == {"runs": 1, "events": 1, "accepted": 0}  # the retry is refused: already in
    assert [(e.status, m.body) for e in inbox.events("a") for m in inbox.outbox("a")] == [
        ("done", "a:1")]
    [b] = inbox.events("b")                                 # given back (gen 1), its claim
    assert (b.status, b.attempts, b.claim_gen) == ("running", 1, 2)  # undone, taken again once
    assert [(r.user, r.gen) for r in w._carried[0][0]] == [("b", 2)]
    assert w.run_once(now=T) == {"runs": 1, "events": 1, "accepted": 1}
    assert [(e.status, e.attempts) for e in inbox.events("b")] == [("done", 1)]


def test_a_result_the_database_refuses_costs_only_its_own_run(inbox, worker, monkeypatch):
    monkeypatch.setattr(agent_inbox.worker, "TAKE_BUDGET", 60.0)
    for user in ("first", "w1", "w2", "a", "bad", "c", "d"):
        inbox.ingest(user, "chat", "1", {})
    w = worker(inbox, "echo", max_users_per_take=8)
    w.run_once(now=T)
    w.run_once(now=T)                                     # the next take: a, bad, c, d
    real_finish = inbox.finish_runs

    def refuses_bad(outcomes, **options):                 # as PostgreSQL would, on a value
        if any(o.run.user == "bad" and o.error is None for o in outcomes):
            raise psycopg.errors.NumericValueOutOfRange("integer out of range")
        return real_finish(outcomes, **options)

    monkeypatch.setattr(inbox, "finish_runs", refuses_bad)
    assert w.run_once(now=T) == {"runs": 4, "events": 4, "accepted": 4}
    assert [m.body for u in "acd" for m in inbox.outbox(u)] == ["a:1", "c:1", "d:1"]
    assert [inbox.events(u)[0].status for u in "acd"] == ["done"] * 3
    [bad] = inbox.events("bad")
    assert (bad.status, bad.attempts) == ("pending", 1)
    assert "could not be committed" in bad.error and "integer out of range" in bad.error
    assert inbox.outbox("bad") == []


def test_a_lone_run_whose_result_the_database_refuses_is_finished_with_the_error(
        inbox, worker, monkeypatch):
    inbox.ingest("bad", "chat", "1", {})
    w = worker(inbox, "echo")
    real_finish = inbox.finish_runs

    def refuses_messages(outcomes, **options):
        if any(o.messages for o in outcomes):
            raise psycopg.errors.NumericValueOutOfRange("integer out of range")
        return real_finish(outcomes, **options)

    monkeypatch.setattr(inbox, "finish_runs", refuses_messages)
    assert w.run_once(now=T) == {"runs": 1, "events": 1, "accepted": 1}
    [bad] = inbox.events("bad")
    assert (bad.status, bad.attempts) == ("pending", 1) and "could not be committed" in bad.error


def test_a_result_the_worker_cannot_read_is_the_runs_error(inbox, worker):
    inbox.ingest("u", "chat", "1", {})
    w = worker(inbox, "unreadable_result")
    assert w.run_once(now=T)["accepted"] == 1
    [event] = inbox.events("u")
    assert (event.status, event.attempts) == ("pending", 1)
    assert "the handler's result could not be read" in event.error
    assert w.processes[0]._process.is_alive()             # the process goes on


def test_a_handler_raising_system_exit_in_a_thread_is_the_runs_error(inbox, worker):
    inbox.ingest("u", "chat", "1", {})
    assert worker(inbox, "exits", isolation="thread").run_once(now=T)["accepted"] == 1
    [event] = inbox.events("u")
    assert (event.status, event.error.split(" at ")[0]) == ("pending", "SystemExit: 3")
