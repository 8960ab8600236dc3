"""The single-user API on Citus: ingest (with the trigger's work done by the
code), acquire, claim, finish, the operator's view; and the layout itself."""

import psycopg

from agent_inbox import Result
from agent_inbox.store import keys


def test_ingest_acquire_claim_finish(inbox):
    assert inbox.ingest("alice", "github", "d1", {"n": 1})
    assert not inbox.ingest("alice", "github", "d1", {"n": 1})
    assert inbox.ingest("alice", "github", "d2", {"n": 2})
    gen = inbox.acquire("alice", "A")
    assert gen == 1 and inbox.acquire("alice", "B") is None
    batch = inbox.claim_batch("alice", "A", gen)
    assert [e.source_id for e in batch] == ["d1", "d2"]
    assert inbox.finish("alice", "A", gen, [e.id for e in batch], messages=["hi"])
    assert not inbox.finish("alice", "A", gen, [e.id for e in batch])
    assert [e.status for e in inbox.events("alice")] == ["done", "done"]
    assert [m.body for m in inbox.outbox("alice")] == ["hi"]


T = 1_000_000


def test_a_run_that_leaves_work_leaves_a_wake_and_the_next_take_finds_it(make_inbox):
    """Takes one bucket at a time and finishes that release: the user's events
    past max_batch are found by the next take, through the wake the finish
    left; a failed run's events come back once their backoff ends."""
    inbox = make_inbox(max_batch=2, pool_size=2)
    inbox.ingest_many([("carol", "chat", str(n), {}) for n in range(5)])

    def take(now):
        run = inbox.take_work("W", now=now)
        return run, run and [e.source_id for e in run.events]

    run, ids = take(T)
    assert ids == ["0", "1"] and inbox.finish_run(run, Result(messages=["a"]), now=T)
    run, ids = take(T)
    assert ids == ["2", "3"] and inbox.finish_run(run, Result(error="tool down"), now=T)
    run, ids = take(T)
    assert ids == ["4"] and inbox.finish_run(run, Result(), now=T)
    assert take(T) == (None, None)                  # the retries are backing off
    run, ids = take(T + 400)
    assert ids == ["2"] and inbox.finish_run(run, Result(), now=T + 400)
    run, ids = take(T + 400)
    assert ids == ["3"] and inbox.finish_run(run, Result(), now=T + 400)
    assert take(T + 400) == (None, None)
    assert [e.status for e in inbox.events("carol")] == ["done"] * 5
    assert [m.body for m in inbox.outbox("carol")] == ["a"]


def test_ingest_creates_the_lease_and_the_wake(inbox, database_url):
    inbox.ingest("bob", "chat", "m1", {})
    with psycopg.connect(database_url) as conn:
        lease = conn.execute("SELECT bucket, holder, gen FROM leases WHERE user_id = 'bob'").fetchone()
        wakes = conn.execute("SELECT count(*) FROM wakes WHERE user_id = 'bob'").fetchone()[0]
    assert lease == (keys.bucket("bob"), "", 0) and wakes == 1


def test_buckets_agree_with_sql(database_url):
    users = [f"user-{n}" for n in range(200)] + ["", "ü", "a" * 300]
    with psycopg.connect(database_url) as conn:
        in_sql = conn.execute("SELECT agent_inbox_bucket(u) FROM unnest(%s::text[]) u",
                              (users,)).fetchall()
    assert [b for b, in in_sql] == [keys.bucket(u) for u in users]
