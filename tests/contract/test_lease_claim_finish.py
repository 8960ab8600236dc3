"""The reference's rules for leases, claims and the fenced finish, per user and
for takes of several users, on every backend (a contract test module:
tests/contract/conftest.py).

Per user: ingest stores each key once; acquire renews, refuses and takes over;
a claim needs the lease and takes every pending event (a retry alone); an
event is dead after max_attempts; the fenced finish commits outcome and
messages together, or nothing without the lease; prune keeps the keys inside
the dedup window.

Several users per take: each user its own run, lease, generation and fence;
the take never returns empty while a free user has work; concurrent takers never
share a user; one refused fence in a shared finish commits nothing of that run
and everything of the others; runs given back cost nothing, and a retry whose
last run did not finish is still seen unfinished when taken again.

When a user is taken again: as soon as its run ends or is released, and a
crashed run's when its lease expires (tests/test_wakes.py holds the wakes
table's own rules, and the races on its rows).

The tests' own probes and set-up statements use `database_url`, the direct
connection (on Citus, the coordinator).
"""

import psycopg
import pytest

from agent_inbox import Result
from agent_inbox.errors import InvalidInput
from agent_inbox.api.runs import Run
from tests.races import Racers, wait_for_lock_waiters

T = 1_000_000
TTL = 120        # the default lease
SHORT_TTL = 30   # a lease_ttl of its own


def ingest_n(inbox, user, n, source="chat"):
    for i in range(n):
        assert inbox.ingest(user, source, f"m-{i}", {"i": i})


def ingest_in_order(inbox, keys):
    for user, key in keys:
        inbox.ingest(user, "chat", key, {"k": key})


# --- one user: ingest, lease, claim, fenced finish, prune ------------------------

def test_ingest_stores_each_key_once_per_user(inbox):
    assert inbox.ingest("alice", "github", "d-1", {"pr": 12}) is True
    assert inbox.ingest("alice", "github", "d-1", {"pr": 99}) is False
    assert inbox.ingest("bob", "github", "d-1", {"pr": 12}) is True  # another user's inbox
    assert inbox.ingest("alice", "stripe", "d-1", {}) is True        # another source
    [event] = [e for e in inbox.events("alice") if e.source == "github"]
    assert (event.payload, event.status, event.attempts) == ({"pr": 12}, "pending", 0)


def test_acquire_renews_refuses_and_takes_over(inbox):
    assert inbox.acquire("u", "A", now=T) == 1
    assert inbox.acquire("u", "A", now=T + 100) == 1            # renewal keeps gen
    assert inbox.acquire("u", "B", now=T + 100 + TTL) is None   # until == now: still valid
    assert inbox.acquire("u", "B", now=T + 100 + TTL + 1) == 2  # expired: takeover
    assert inbox.acquire("u", "B", now=T + 100 + 3 * TTL) == 3  # own lapsed lease: new gen
    assert inbox.acquire("other", "A", now=T) == 1              # users are independent


def test_claim_takes_every_pending_event_in_one_batch(inbox):
    ingest_n(inbox, "u", 3)
    gen = inbox.acquire("u", "A", now=T)
    batch = inbox.claim_batch("u", "A", gen, now=T)
    assert [e.source_id for e in batch] == ["m-0", "m-1", "m-2"]
    assert {(e.status, e.attempts, e.claim_gen) for e in batch} == {("running", 1, gen)}
    assert inbox.claim_batch("u", "A", gen, now=T) == []  # nothing left pending


@pytest.mark.parametrize("holder, gen, now", [
    ("B", 1, T),            # not the holder
    ("A", 2, T),            # not the generation
    ("A", 1, T + TTL + 1),  # expired
])
def test_claim_is_empty_without_the_lease(inbox, holder, gen, now):
    ingest_n(inbox, "u", 1)
    assert inbox.acquire("u", "A", now=T) == 1
    assert inbox.claim_batch("u", holder, gen, now=now) == []
    assert inbox.events("u")[0].attempts == 0


def test_claim_returns_older_generation_rows_and_claims_a_retry_alone(inbox):
    ingest_n(inbox, "u", 2)
    gen1 = inbox.acquire("u", "A", now=T)
    inbox.claim_batch("u", "A", gen1, now=T)                   # A stalls with both
    assert inbox.ingest("u", "chat", "fresh", {})
    gen2 = inbox.acquire("u", "B", now=T + TTL + 1)
    first = inbox.claim_batch("u", "B", gen2, now=T + TTL + 1)
    assert [(e.source_id, e.attempts) for e in first] == [("m-0", 2)]  # oldest retry, alone
    assert inbox.finish("u", "B", gen2, [first[0].id], now=T + TTL + 1)
    second = inbox.claim_batch("u", "B", gen2, now=T + TTL + 1)
    assert [(e.source_id, e.attempts) for e in second] == [("m-1", 2)]
    assert inbox.finish("u", "B", gen2, [second[0].id], now=T + TTL + 1)
    third = inbox.claim_batch("u", "B", gen2, now=T + TTL + 1)
    assert [(e.source_id, e.attempts) for e in third] == [("fresh", 1)]


def test_an_event_is_dead_after_max_attempts_and_stays_visible(make_inbox):
    inbox = make_inbox(max_attempts=2)
    ingest_n(inbox, "u", 1)
    now = T
    for expected_attempts in (1, 2):  # two crashed runs
        gen = inbox.acquire("u", f"W{now}", now=now)
        [event] = inbox.claim_batch("u", f"W{now}", gen, now=now)
        assert event.attempts == expected_attempts
        now += TTL + 1
    gen = inbox.acquire("u", "W", now=now)
    assert inbox.claim_batch("u", "W", gen, now=now) == []
    [dead] = inbox.events("u", status="dead")
    assert (dead.source_id, dead.attempts, dead.error) == ("m-0", 2, "too many attempts")


def test_finish_commits_outcome_and_messages_together(inbox):
    ingest_n(inbox, "u", 2)
    gen = inbox.acquire("u", "A", now=T)
    ids = [e.id for e in inbox.claim_batch("u", "A", gen, now=T)]
    assert inbox.finish("u", "A", gen, ids, messages=["one", "two"], now=T + 5)
    assert {e.status for e in inbox.events("u")} == {"done"}
    assert [(m.body, m.created, m.sent_at) for m in inbox.outbox("u")] == [
        ("one", T + 5, None), ("two", T + 5, None)]


def test_finish_with_error_returns_events_to_pending_and_queues_nothing(inbox):
    ingest_n(inbox, "u", 1)
    gen = inbox.acquire("u", "A", now=T)
    ids = [e.id for e in inbox.claim_batch("u", "A", gen, now=T)]
    assert inbox.finish("u", "A", gen, ids, messages=["never"], error="tool timed out", now=T)
    [event] = inbox.events("u")
    assert (event.status, event.attempts, event.error) == ("pending", 1, "tool timed out")
    assert inbox.outbox("u") == []


@pytest.mark.parametrize("holder, gen, now", [
    ("B", 1, T), ("A", 2, T), ("A", 1, T + TTL + 1)])
def test_finish_is_refused_without_the_lease_and_writes_nothing(inbox, holder, gen, now):
    ingest_n(inbox, "u", 1)
    inbox.acquire("u", "A", now=T)
    ids = [e.id for e in inbox.claim_batch("u", "A", 1, now=T)]
    assert inbox.finish("u", holder, gen, ids, messages=["x"], now=now) is False
    assert [e.status for e in inbox.events("u")] == ["running"]
    assert inbox.outbox("u") == []


def test_finish_naming_an_event_not_running_under_this_gen_writes_nothing(inbox):
    ingest_n(inbox, "u", 2)
    gen = inbox.acquire("u", "A", now=T)
    [first, second] = inbox.claim_batch("u", "A", gen, now=T)
    assert inbox.finish("u", "A", gen, [first.id], now=T)
    # first is done now: naming it again, even beside a running event, is refused whole
    assert inbox.finish("u", "A", gen, [first.id, second.id], messages=["x"], now=T) is False
    assert [e.status for e in inbox.events("u")] == ["done", "running"]
    assert inbox.outbox("u") == []


def test_a_stalled_holder_that_re_takes_the_lease_cannot_finish_its_old_claim(inbox):
    ingest_n(inbox, "u", 1)
    gen_a = inbox.acquire("u", "A", now=T)
    stale = [e.id for e in inbox.claim_batch("u", "A", gen_a, now=T)]
    t2 = T + TTL + 1
    gen_b = inbox.acquire("u", "B", now=t2)
    redo = [e.id for e in inbox.claim_batch("u", "B", gen_b, now=t2)]
    assert inbox.finish("u", "B", gen_b, redo, messages=["report"], now=t2)
    assert inbox.acquire("u", "A", now=t2 + TTL + 1) == gen_b + 1   # A holds the lease again
    assert inbox.finish("u", "A", gen_a, stale, messages=["report"], now=t2 + TTL + 1) is False
    assert len(inbox.outbox("u")) == 1


def test_database_clock_is_used_when_now_is_omitted(inbox, database_url):
    with psycopg.connect(database_url) as conn:
        db_now = conn.execute("SELECT floor(extract(epoch FROM clock_timestamp()))::bigint").fetchone()[0]
    assert inbox.ingest("u", "chat", "1", {})
    gen = inbox.acquire("u", "A")
    batch = inbox.claim_batch("u", "A", gen)
    assert inbox.finish("u", "A", gen, [e.id for e in batch], messages=["hi"])
    with psycopg.connect(database_url) as conn:
        until = conn.execute("SELECT until FROM leases WHERE user_id = 'u'").fetchone()[0]
    assert db_now + TTL <= until <= db_now + TTL + 60
    # with the database clock, an explicit far-past `now` would be expired:
    assert inbox.claim_batch("u", "A", gen, now=until + 1) == []


def test_ingest_many_reports_each_event_and_stores_each_key_once(inbox, monkeypatch):
    from agent_inbox.api import calls

    monkeypatch.setattr(calls, "INGEST_CHUNK", 2)  # keys repeat across statements too
    assert inbox.ingest("u", "chat", "old", {}) is True
    stored = inbox.ingest_many([
        ("u", "chat", "a", {"n": 1}),
        ("u", "chat", "old", {}),       # already stored
        ("u", "chat", "a", {"n": 2}),   # repeated inside the batch
        ("v", "chat", "a", {}),         # another user
        ("u", "chat", "b", [1, 2]),
    ])
    assert stored == [True, False, False, True, True]
    assert [(e.source_id, e.payload) for e in inbox.events("u")] == [
        ("old", {}), ("a", {"n": 1}), ("b", [1, 2])]
    assert inbox.ingest_many([]) == []


def test_an_events_kind_is_stored_and_reaches_the_claim(inbox):
    assert inbox.ingest("u", "github", "d-1", {"ref": "main"}, kind="push")
    assert inbox.ingest_many([("u", "github", "d-2", {}, "issues"), ("u", "chat", "m-1", {})]) == [
        True, True]
    gen = inbox.acquire("u", "A")
    assert [(e.source_id, e.kind) for e in inbox.claim_batch("u", "A", gen)] == [
        ("d-1", "push"), ("d-2", "issues"), ("m-1", None)]
    inbox.ingest("v", "github", "d-3", {}, kind="pull_request")
    assert [e.kind for e in inbox.take_work("B").events] == ["pull_request"]


def test_ingest_many_with_one_bad_event_stores_nothing(inbox):
    from agent_inbox import InvalidInput

    with pytest.raises(InvalidInput, match=r"events\[1\] source_id must not be empty"):
        inbox.ingest_many([("u", "chat", "a", {}), ("u", "chat", "", {})])
    assert inbox.events("u") == []


def test_prune_deletes_old_finished_events_but_keeps_keys_inside_the_dedup_window(inbox, database_url):
    day = 86400
    for user in ("a", "b"):
        for n in range(3):
            assert inbox.ingest(user, "stripe", f"evt-{n}", {"n": n})
    inbox.ingest("a", "stripe", "still-pending", {})
    with psycopg.connect(database_url, autocommit=True) as conn:
        # evt-0: 30 days old, evt-1: 3 days old, evt-2: today; all done but the pending one
        conn.execute("UPDATE events SET status = 'done', created_at = %s - "
                     "CASE source_id WHEN 'evt-0' THEN 30 * 86400 WHEN 'evt-1' THEN 3 * 86400 "
                     "ELSE 0 END WHERE source_id LIKE 'evt-%%'", (T,))
    seen = []
    deleted, compacted = inbox.prune(older_than=day, now=T, users_per_transaction=1,
                                     progress=lambda *counts: seen.append(counts))
    assert (deleted, compacted) == (2, 2)        # evt-0 gone; evt-1 emptied; evt-2 too young
    assert seen[-1] == (2, 2, 2)
    assert inbox.ingest("a", "stripe", "evt-1", {"n": 1}) is False   # inside the window
    assert inbox.ingest("a", "stripe", "evt-0", {"n": 0}) is True    # past it: new again
    by_id = {e.source_id: e for e in inbox.events("b")}
    assert set(by_id) == {"evt-1", "evt-2"}
    assert by_id["evt-1"].payload == {"pruned": True} and by_id["evt-2"].payload == {"n": 2}
    assert [e.status for e in inbox.events("a") if e.source_id == "still-pending"] == ["pending"]


def test_prune_keeps_the_standing_approval_answer(inbox, database_url):
    inbox.request_approval("u", "r1", expires_in=3600, action="refund", now=T)
    assert inbox.answer_approval("u", "r1", "yes", now=T + 1) == "yes"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("UPDATE events SET status = 'done', created_at = %s", (T - 3 * 86400,))
    inbox.prune(older_than=86400, now=T)
    assert inbox.answer_approval("u", "r1", "no", now=T + 2) == "yes"


# --- several users per take ------------------------------------------------------

@pytest.mark.skip_backend("citus", reason=(
    "a Citus take walks the buckets by their oldest wake, then by bucket number "
    "(backend/citus/statements.py, _due), so users whose wakes fall in the same "
    "second (these ingests, on the database clock) come bucket by bucket, not in "
    "arrival order: here d, c, a instead of b, a, c"))
def test_a_take_holds_distinct_users_longest_waiting_first(inbox):
    ingest_in_order(inbox, [("b", "1"), ("a", "1"), ("c", "1"), ("a", "2"), ("d", "1")])
    runs = inbox.runs.take_runs("H", users=3, now=T)
    assert [(r.user, r.gen, [e.source_id for e in r.events]) for r in runs] == [
        ("b", 1, ["1"]), ("a", 1, ["1", "2"]), ("c", 1, ["1"])]
    assert all(e.user == r.user and e.claim_gen == r.gen for r in runs for e in r.events)
    [d] = inbox.events("d")
    assert (d.status, d.attempts) == ("pending", 0)           # not taken: the take was full


@pytest.mark.skip_backend("citus", reason=(
    "a Citus take goes on to the next bucket until `users` are taken "
    "(backend/citus/path.py, take: one call per bucket), so the busy user's wakes "
    "fill only its own bucket's call and the late user, in another bucket, comes "
    "in the same take: two runs, not one"))
def test_a_user_with_many_events_gives_fewer_users_never_none(inbox):
    ingest_in_order(inbox, [("busy", str(n)) for n in range(10)] + [("late", "1")])
    [run] = inbox.runs.take_runs("H", users=4, now=T)
    assert (run.user, len(run.events)) == ("busy", 10)
    [late] = inbox.runs.take_runs("H", users=4, now=T)
    assert late.user == "late"
    assert inbox.runs.take_runs("H", users=4, now=T) == []


def test_a_refused_fence_in_a_shared_finish_leaves_the_other_runs_committed(inbox):
    ingest_in_order(inbox, [("a", "1"), ("b", "1"), ("c", "1")])
    # by user: the order of a take is test_a_take_holds_distinct_users_longest_waiting_first's
    a, b, c = sorted(inbox.runs.take_runs("H", users=3, now=T), key=lambda run: run.user)
    stale_b = Run(b.user, b.holder, b.gen + 1, b.claimed_at, b.events)  # a generation not held
    outcomes = [inbox.runs.outcome(run, Result(messages=[f"to {run.user}"])) for run in (a, stale_b, c)]
    accepted = inbox.runs.finish_runs(outcomes, now=T + 1)
    assert accepted == [True, False, True]
    assert [m.body for u in "abc" for m in inbox.outbox(u)] == ["to a", "to c"]
    assert [inbox.events(u)[0].status for u in "abc"] == ["done", "running", "done"]
    assert inbox.acquire("a", "other", now=T + 1) == 2        # released in the same commit
    assert inbox.acquire("b", "other", now=T + 1) is None     # b's lease still held by H


# Behind PgBouncer each taker waiting on the lock holds a server connection (its
# transaction is open), and all eight must wait at once: the pool of
# test_concurrency.py's widest race, 16 (the blocker and probe are direct).
@pytest.mark.pgbouncer_pool_size(16)
def test_concurrent_takers_never_share_a_user(database_url, make_inbox, inbox):
    """Eight takers of eight users each, released at once from behind a table lock."""
    ingest_in_order(inbox, [(f"u{n:02}", str(k)) for k in range(2) for n in range(40)])
    racers = [make_inbox(application_name=f"taker-{i}") for i in range(8)]
    with psycopg.connect(database_url) as blocker:
        blocker.execute("LOCK TABLE leases IN EXCLUSIVE MODE")
        started = Racers(*[lambda ib=ib, i=i: ib.runs.take_runs(f"H{i}", users=8, now=T)
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
        inbox.runs.take_runs("H", users=0)


def test_a_run_given_back_unstarted_costs_its_events_nothing(inbox):
    ingest_in_order(inbox, [("a", "1"), ("b", "1")])
    gen = inbox.acquire("a", "W", now=T)
    [event] = inbox.claim_batch("a", "W", gen, now=T)
    assert inbox.finish("a", "W", gen, [event.id], error="flaky", now=T)  # attempt 1 failed
    [a, b] = inbox.runs.take_runs("H", users=2, now=T + 1000)                  # a's retry is due
    assert [e.attempts for e in a.events] == [2]

    assert sorted(inbox.runs.hand_back([a, b], now=T + 1000)) == ["a", "b"]
    [retry] = inbox.events("a")
    assert (retry.status, retry.attempts, retry.error) == ("pending", 1, "flaky")
    [fresh] = inbox.events("b")
    assert (fresh.status, fresh.attempts) == ("pending", 0)
    assert inbox.finish("b", "H", b.gen, [fresh.id], now=T + 1000) is False  # still fenced
    assert inbox.runs.hand_back([b], now=T + 1000) == []                          # not held: no-op
    # both were given back at one instant: their wakes tie, and either may come first
    assert sorted(r.user for r in inbox.runs.take_runs("H2", users=2, now=T + 1000)) == ["a", "b"]


def test_a_holder_gives_back_the_runs_a_lost_commit_took_unseen(inbox):
    ingest_in_order(inbox, [("a", "1"), ("b", "1"), ("c", "1")])
    [known] = [run for run in inbox.runs.take_runs("H", users=3, now=T) if run.user == "a"]
    assert sorted(inbox.runs.hand_back_orphans("H", [known], now=T)) == ["b", "c"]
    assert [inbox.events(u)[0].status for u in "abc"] == ["running", "pending", "pending"]
    assert [inbox.events(u)[0].attempts for u in "abc"] == [1, 0, 0]
    assert inbox.acquire("a", "other", now=T) is None          # kept


def test_an_orphan_of_a_known_user_in_a_newer_generation_is_given_back(inbox):
    """A lost answer hid that user a's run (gen 1) was finished and a taken again (gen 2)."""
    ingest_in_order(inbox, [("a", "1")])
    [first] = inbox.runs.take_runs("H", users=1, now=T)
    inbox.ingest("a", "chat", "2", {})
    assert inbox.runs.finish_runs([inbox.runs.outcome(first, Result())], now=T) == [True]
    [again] = inbox.runs.take_runs("H", users=1, now=T)
    assert again.gen == first.gen + 1
    assert inbox.runs.hand_back_orphans("H", [first], now=T) == ["a"]
    assert [(e.status, e.attempts) for e in inbox.events("a")] == [("done", 1), ("pending", 0)]


def test_an_unfinished_retry_given_back_is_still_unfinished_when_taken_again(inbox):
    ingest_in_order(inbox, [("a", "1")])
    inbox.runs.take_runs("died", users=1, now=T)                   # its run never finished
    [retry] = inbox.runs.take_runs("H", users=1, now=T + 1000)
    assert (retry.unfinished, [e.attempts for e in retry.events]) == (1, [2])
    assert inbox.runs.hand_back([retry], now=T + 1000) == ["a"]
    [event] = inbox.events("a")
    assert (event.status, event.attempts) == ("running", 1)   # under the given-back gen
    [again] = inbox.runs.take_runs("H2", users=1, now=T + 1000)
    assert (again.unfinished, [e.attempts for e in again.events]) == (1, [2])


def test_a_given_back_event_keeps_its_place_in_the_queue(database_url, inbox):
    ingest_in_order(inbox, [("early", "1"), ("late", "1")])
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("UPDATE events SET created_at = 100, available_at = 100 WHERE user_id = 'early'")
        conn.execute("UPDATE events SET created_at = 200, available_at = 200 WHERE user_id = 'late'")
    [early] = inbox.runs.take_runs("H", users=1, now=T)
    assert inbox.runs.hand_back([early], now=T + 10) == ["early"]
    assert [r.user for r in inbox.runs.take_runs("H2", users=1, now=T + 10)] == ["early"]


# --- taken again: when a run ends, is released, or its lease expires --------------

def test_a_message_during_a_run_is_taken_as_soon_as_the_run_ends(inbox):
    inbox.ingest("u", "chat", "1", {})
    run = inbox.take_work("H", now=T)
    inbox.ingest("u", "chat", "2", {})
    assert inbox.take_work("H2", now=T) is None              # the lease is held
    assert inbox.finish_run(run, Result(), now=T)            # released in the same commit
    again = inbox.take_work("H2", now=T)
    assert again is not None and [e.source_id for e in again.events] == ["2"]


def test_a_crashed_run_is_taken_again_when_its_lease_expires(make_inbox):
    inbox = make_inbox(lease_ttl=SHORT_TTL)
    inbox.ingest("u", "chat", "1", {})
    run = inbox.take_work("H", now=T)                        # then the worker dies
    assert inbox.take_work("H2", now=T + SHORT_TTL) is None  # the lease is valid to its end
    again = inbox.take_work("H2", now=T + SHORT_TTL + 1)
    assert (again.user, again.gen, again.unfinished) == ("u", run.gen + 1, 1)


def test_a_released_run_is_taken_again_at_once_not_at_its_lease_end(make_inbox):
    """On the database's clock (no `now`), so the take's own wake, at the lease's
    end an hour away, cannot stand in for the release's."""
    inbox = make_inbox(lease_ttl=3600)
    inbox.ingest("u", "chat", "1", {})
    run = inbox.take_work("H")
    assert inbox.runs.release_runs([run], error="stopped at shutdown") == ["u"]
    again = inbox.take_work("H2")
    assert (again.user, again.gen, again.unfinished) == ("u", run.gen + 1, 1)
