"""Several users per take: each user its own run, lease, generation and fence;
the take never returns empty while a free user has work; concurrent takers never
share a user; one refused fence in a shared finish commits nothing of that run
and everything of the others; runs given back cost nothing, and a retry whose
last run did not finish is still seen unfinished when taken again."""

import psycopg
import pytest

from agent_inbox import Result
from agent_inbox.errors import InvalidInput
from agent_inbox.api.runs import Run
from tests.races import Racers, wait_for_lock_waiters

T = 1_000_000


def ingest_in_order(inbox, keys):
    for user, key in keys:
        inbox.ingest(user, "chat", key, {"k": key})


def test_a_take_holds_distinct_users_longest_waiting_first(inbox):
    ingest_in_order(inbox, [("b", "1"), ("a", "1"), ("c", "1"), ("a", "2"), ("d", "1")])
    runs = inbox.take_runs("H", users=3, now=T)
    assert [(r.user, r.gen, [e.source_id for e in r.events]) for r in runs] == [
        ("b", 1, ["1"]), ("a", 1, ["1", "2"]), ("c", 1, ["1"])]
    assert all(e.user == r.user and e.claim_gen == r.gen for r in runs for e in r.events)
    [d] = inbox.events("d")
    assert (d.status, d.attempts) == ("pending", 0)           # not taken: the take was full


def test_a_user_with_many_events_gives_fewer_users_never_none(inbox):
    ingest_in_order(inbox, [("busy", str(n)) for n in range(10)] + [("late", "1")])
    [run] = inbox.take_runs("H", users=4, now=T)
    assert (run.user, len(run.events)) == ("busy", 10)
    [late] = inbox.take_runs("H", users=4, now=T)
    assert late.user == "late"
    assert inbox.take_runs("H", users=4, now=T) == []


def test_a_refused_fence_in_a_shared_finish_leaves_the_other_runs_committed(inbox):
    ingest_in_order(inbox, [("a", "1"), ("b", "1"), ("c", "1")])
    a, b, c = inbox.take_runs("H", users=3, now=T)
    stale_b = Run(b.user, b.holder, b.gen + 1, b.claimed_at, b.events)  # a generation not held
    outcomes = [inbox.outcome(run, Result(messages=[f"to {run.user}"])) for run in (a, stale_b, c)]
    accepted = inbox.finish_runs(outcomes, now=T + 1)
    assert accepted == [True, False, True]
    assert [m.body for u in "abc" for m in inbox.outbox(u)] == ["to a", "to c"]
    assert [inbox.events(u)[0].status for u in "abc"] == ["done", "running", "done"]
    assert inbox.acquire("a", "other", now=T + 1) == 2        # released in the same commit
    assert inbox.acquire("b", "other", now=T + 1) is None     # b's lease still held by H


def test_concurrent_takers_never_share_a_user(database_url, make_inbox, inbox):
    """Eight takers of eight users each, released at once from behind a table lock."""
    ingest_in_order(inbox, [(f"u{n:02}", str(k)) for k in range(2) for n in range(40)])
    racers = [make_inbox(application_name=f"taker-{i}") for i in range(8)]
    with psycopg.connect(database_url) as blocker:
        blocker.execute("LOCK TABLE leases IN EXCLUSIVE MODE")
        started = Racers(*[lambda ib=ib, i=i: ib.take_runs(f"H{i}", users=8, now=T)
                           for i, ib in enumerate(racers)]).start()
        wait_for_lock_waiters(database_url, 8, application_name="taker-%")
        blocker.rollback()
        takes = started.join()

    taken = [run for take in takes for run in take]
    users = [run.user for run in taken]
    assert len(users) == len(set(users)) and len(users) >= 8
    assert all(len(run.events) == 2 and run.gen == 1 for run in taken)
    with psycopg.connect(database_url) as conn:
        holders = dict(conn.execute("SELECT user_id, holder FROM leases WHERE gen = 1").fetchall())
    assert holders == {run.user: run.holder for run in taken}


def test_take_runs_rejects_a_take_of_no_users(inbox):
    with pytest.raises(InvalidInput, match="users"):
        inbox.take_runs("H", users=0)


def test_a_run_given_back_unstarted_costs_its_events_nothing(inbox):
    ingest_in_order(inbox, [("a", "1"), ("b", "1")])
    gen = inbox.acquire("a", "W", now=T)
    [event] = inbox.claim_batch("a", "W", gen, now=T)
    assert inbox.finish("a", "W", gen, [event.id], error="flaky", now=T)  # attempt 1 failed
    [a, b] = inbox.take_runs("H", users=2, now=T + 1000)                  # a's retry is due
    assert [e.attempts for e in a.events] == [2]

    assert inbox.hand_back([a, b], now=T + 1000) == ["a", "b"]
    [retry] = inbox.events("a")
    assert (retry.status, retry.attempts, retry.error) == ("pending", 1, "flaky")
    [fresh] = inbox.events("b")
    assert (fresh.status, fresh.attempts) == ("pending", 0)
    assert inbox.finish("b", "H", b.gen, [fresh.id], now=T + 1000) is False  # still fenced
    assert inbox.hand_back([b], now=T + 1000) == []                          # not held: no-op
    assert [r.user for r in inbox.take_runs("H2", users=2, now=T + 1000)] == ["a", "b"]


def test_a_holder_gives_back_the_runs_a_lost_commit_took_unseen(inbox):
    ingest_in_order(inbox, [("a", "1"), ("b", "1"), ("c", "1")])
    known, *_ = inbox.take_runs("H", users=3, now=T)
    assert sorted(inbox.hand_back_orphans("H", [known], now=T)) == ["b", "c"]
    assert [inbox.events(u)[0].status for u in "abc"] == ["running", "pending", "pending"]
    assert [inbox.events(u)[0].attempts for u in "abc"] == [1, 0, 0]
    assert inbox.acquire("a", "other", now=T) is None          # kept


def test_an_orphan_of_a_known_user_in_a_newer_generation_is_given_back(inbox):
    """A lost answer hid that user a's run (gen 1) was finished and a taken again (gen 2)."""
    ingest_in_order(inbox, [("a", "1")])
    [first] = inbox.take_runs("H", users=1, now=T)
    inbox.ingest("a", "chat", "2", {})
    assert inbox.finish_runs([inbox.outcome(first, Result())], now=T) == [True]
    [again] = inbox.take_runs("H", users=1, now=T)
    assert again.gen == first.gen + 1
    assert inbox.hand_back_orphans("H", [first], now=T) == ["a"]
    assert [(e.status, e.attempts) for e in inbox.events("a")] == [("done", 1), ("pending", 0)]


def test_an_unfinished_retry_given_back_is_still_unfinished_when_taken_again(inbox):
    ingest_in_order(inbox, [("a", "1")])
    inbox.take_runs("died", users=1, now=T)                   # its run never finished
    [retry] = inbox.take_runs("H", users=1, now=T + 1000)
    assert (retry.unfinished, [e.attempts for e in retry.events]) == (1, [2])
    assert inbox.hand_back([retry], now=T + 1000) == ["a"]
    [event] = inbox.events("a")
    assert (event.status, event.attempts) == ("running", 1)   # under the given-back gen
    [again] = inbox.take_runs("H2", users=1, now=T + 1000)
    assert (again.unfinished, [e.attempts for e in again.events]) == (1, [2])


def test_a_given_back_event_keeps_its_place_in_the_queue(database_url, inbox):
    ingest_in_order(inbox, [("early", "1"), ("late", "1")])
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("UPDATE events SET created_at = 100, available_at = 100 WHERE user_id = 'early'")
        conn.execute("UPDATE events SET created_at = 200, available_at = 200 WHERE user_id = 'late'")
    [early] = inbox.take_runs("H", users=1, now=T)
    assert inbox.hand_back([early], now=T + 10) == ["early"]
    assert [r.user for r in inbox.take_runs("H2", users=1, now=T + 10)] == ["early"]
