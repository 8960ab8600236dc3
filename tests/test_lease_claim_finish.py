"""The reference's rules for leases, claims and the fenced finish, per user."""

import psycopg
import pytest

T = 1_000_000
TTL = 120


def ingest_n(inbox, user, n, source="chat"):
    for i in range(n):
        assert inbox.ingest(user, source, f"m-{i}", {"i": i})


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
    from agent_inbox.api import inbox as inbox_module

    monkeypatch.setattr(inbox_module, "INGEST_CHUNK", 2)  # keys repeat across statements too
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
