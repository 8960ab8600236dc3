"""The low-water mark (store/inbox.py, `low_water`; migration 0010): the scans
of a user's open events start past its finished ones, and no open event is
ever below where they start.

The races are forced: an ingest's transaction holds its event uncommitted (its
id drawn) while other events of the user are taken and finished, so that the
finish raises the mark past it; each path that deletes the event's wake must
carry its `from_id` on, or the event would never be taken (an agent gone quiet).
The cost is read from the taking transaction's own index counters
(`pg_stat_get_xact_tuples_returned`) while a held transaction keeps every dead row
version in the index."""

import contextlib

import psycopg
import pytest

from agent_inbox import Result
from agent_inbox.records import ClaimPolicy
from agent_inbox.store import inbox as store_inbox, wake_rings
from agent_inbox.store import lease
from agent_inbox.store.keys import users_key

T = 1_000_000
TTL = 30


def open_from(url: str, user: str) -> int:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT open_from FROM leases WHERE user_id = %s",
                            (user,)).fetchone()[0]


def uncommitted_event(url: str, user: str, source_id: str) -> tuple[psycopg.Connection, int]:
    """An ingest in flight: its event's id drawn, its transaction open."""
    conn = psycopg.connect(url)
    event_id = conn.execute(
        "INSERT INTO events (user_id, source, source_id, payload)"
        " VALUES (%s, 'chat', %s, '{}') RETURNING id", (user, source_id)).fetchone()[0]
    return conn, event_id


@contextlib.contextmanager
def late_event_below_the_mark(database_url: str, inbox):
    """User u's event "late" is inserted (its id drawn) but not committed while
    "next", a higher id, is taken and finished: the finish raises the mark past
    "late". The block runs before "late" commits, at the block's end."""
    inbox.ingest("u", "chat", "first", {})                   # the user's lease row exists
    run, _ = ran(inbox, "H", T)
    assert inbox.finish_run(run, Result(), now=T)
    late, late_id = uncommitted_event(database_url, "u", "late")
    with late:
        inbox.ingest("u", "chat", "next", {})                # a higher id, committed first
        run, ids = ran(inbox, "H", T)
        assert ids == ["next"]
        assert inbox.finish_run(run, Result(), now=T)
        assert open_from(database_url, "u") > late_id        # the finish could not see it
        yield
        late.commit()


def ran(inbox, holder: str, now: int):
    """Take one run; its events' source ids."""
    run = inbox.take_work(holder, now=now)
    return run, [e.source_id for e in run.events] if run else None


def test_an_event_committed_after_a_finish_raised_the_mark_past_it_is_taken(
        database_url, make_inbox):
    inbox = make_inbox(lease_ttl=TTL)
    with late_event_below_the_mark(database_url, inbox):
        pass
    run, ids = ran(inbox, "H2", T)
    assert ids == ["late"]
    assert inbox.finish_run(run, Result(), now=T)
    assert inbox.take_work("H3", now=T) is None


def test_a_take_that_looks_at_a_held_user_carries_the_mark_of_the_wake_it_deletes(
        database_url, make_inbox):
    """The late event's wake is due while the user's lease is held: a take
    replaces it by one at the lease's end, which must name the late event, for
    the run's finish raised the lease's mark past it."""
    inbox = make_inbox(lease_ttl=TTL)
    with late_event_below_the_mark(database_url, inbox):
        inbox.ingest("u", "chat", "held", {})
        held, ids = ran(inbox, "H", T)                       # the lease held from here
        assert ids == ["held"]
    assert inbox.take_work("H2", now=T) is None              # looked at `late`'s wake: held
    assert inbox.finish_run(held, Result(), now=T)
    run, ids = ran(inbox, "H3", T)
    assert ids == ["late"]


def test_a_run_that_crashed_after_taking_an_event_below_the_mark_is_taken_again(
        database_url, make_inbox):
    """The take deleted the late event's wake and claimed it; its run crashed,
    so no finish lowered the mark: the wake at the lease's end carries it."""
    inbox = make_inbox(lease_ttl=TTL)
    with late_event_below_the_mark(database_url, inbox):
        pass
    crashed, ids = ran(inbox, "H2", T)
    assert ids == ["late"]                                   # and never finished
    again, ids = ran(inbox, "H3", T + TTL + 1)
    assert ids == ["late"] and again.unfinished == 1


def test_a_dead_event_requeued_below_the_mark_is_taken(database_url, make_inbox):
    inbox = make_inbox(lease_ttl=TTL, max_attempts=1)
    inbox.ingest("u", "chat", "poison", {})
    run, _ = ran(inbox, "H", T)
    assert inbox.finish_run(run, Result(error="boom"), now=T)
    inbox.ingest("u", "chat", "after", {})
    run, ids = ran(inbox, "H", T)
    assert ids == ["after"] and run.died == 1                # the poison: dead at claim
    assert inbox.finish_run(run, Result(), now=T)
    [dead] = [e for e in inbox.events("u") if e.status == "dead"]
    assert open_from(database_url, "u") > dead.id
    [requeued] = inbox.repair_dead([("u", dead.id)], requeue=True, actor="ops", now=T)
    assert requeued["id"] == dead.id
    run, ids = ran(inbox, "H", T)
    assert ids == ["poison"]


def index_reads(conn: psycopg.Connection, index: str) -> int:
    """Index entries this transaction has read from `index` so far."""
    return conn.execute("SELECT pg_stat_get_xact_tuples_returned(%s::regclass)",
                        (index,)).fetchone()[0]


@pytest.mark.parametrize("runs", [300])
def test_under_a_held_horizon_a_run_reads_past_none_of_its_users_finished_events(
        database_url, make_inbox, runs):
    """Each of `runs` runs leaves its event's entry in ix_events_open (the
    insert's: the claim is a HOT update on it, migration 0014), pointing at
    versions VACUUM cannot remove; the
    take and the finish of the next run read a handful of entries, while the
    same statements without the mark read them all."""
    inbox = make_inbox(lease_ttl=TTL)
    holder = psycopg.connect(database_url)
    holder.execute("SELECT txid_current()")                  # the horizon held from here
    with holder:
        for n in range(runs):
            inbox.ingest("u", "chat", str(n), {})
            run, _ = ran(inbox, "H", T)
            assert inbox.finish_run(run, Result(), now=T)
        inbox.ingest("u", "chat", "last", {})
        policy = ClaimPolicy()
        reads = {}
        for mark in ("kept", "forgotten"):
            with psycopg.connect(database_url) as conn:
                if mark == "forgotten":
                    conn.execute("UPDATE leases SET open_from = 0 WHERE user_id = 'u'")
                [(user, gen, *_rest, events)] = store_inbox.take_work(
                    conn, "H", TTL, policy, T, wake_rings.Given())
                assert [e.source_id for e in events] == ["last"]
                took = index_reads(conn, "ix_events_open")
                conn.execute(lease.LOCK_MANY, users_key(["u"]))
                finish = store_inbox.Finish("u", "H", gen, [e.id for e in events], [], None)
                assert store_inbox.finish(conn, [finish], T, release=True) == [True]
                reads[mark] = (took, index_reads(conn, "ix_events_open") - took)
                conn.rollback()
    (take_kept, finish_kept), (take_all, finish_all) = reads["kept"], reads["forgotten"]
    assert take_kept <= 12 and finish_kept <= 6, reads
    assert take_all >= runs and finish_all >= runs, reads
