"""Finding work by wakes (store/inbox.py, TAKE_WORK): a user that can be taken
has a wake at or before that time, whichever path made it takeable, and a take
or finish deletes only the wakes its own snapshot shows.

The races are held in place by a row lock on a wake: the take (or finish) has
taken its snapshot and waits to delete the wakes it saw while an ingest for the
same user commits; its wake must survive, and the user be taken.

What a caller sees of it (a user taken again as soon as its run ends or is
released, a crashed run's when its lease expires) is in
tests/contract/test_lease_claim_finish.py, on every backend; these tests read
and lock the wakes table itself, as the plain backend's TAKE_WORK keeps it."""

import psycopg

from agent_inbox import Result
from tests.races import Racers, wait_for_lock_waiters

T = 1_000_000
TTL = 30


def wakes(url: str, user: str) -> list[int]:
    with psycopg.connect(url) as conn:
        return [at for at, in conn.execute(
            "SELECT at FROM wakes WHERE user_id = %s ORDER BY at", (user,)).fetchall()]


def holding_wakes_of(url: str, user: str) -> psycopg.Connection:
    """A transaction holding a row lock on every wake `user` has (a deleter waits)."""
    conn = psycopg.connect(url)
    assert conn.execute("SELECT count(*) FROM (SELECT 1 FROM wakes WHERE user_id = %s"
                        " FOR UPDATE) w", (user,)).fetchone()[0] > 0
    return conn


def test_an_ingest_committing_while_a_take_looks_at_the_user_keeps_its_wake(
        database_url, make_inbox):
    """The take saw the user with a wake and no work (its lease released after a
    run), decided it has no next wake, and waits to delete the wake it saw; the
    ingest commits meanwhile, after the take's snapshot."""
    inbox = make_inbox(application_name="taker", lease_ttl=TTL)
    inbox.ingest("u", "chat", "1", {})
    run = inbox.take_work("H", now=T)
    assert inbox.finish_run(run, Result(), release=False, now=T)
    assert inbox.runs.release("u", "H", run.gen, now=T)           # a wake now, no work left
    with holding_wakes_of(database_url, "u") as blocker:
        taking = Racers(lambda: inbox.take_work("H2", now=T + 1)).start()
        wait_for_lock_waiters(database_url, 1, application_name="taker")
        make_inbox().ingest("u", "chat", "2", {})           # commits after the take's snapshot
        blocker.rollback()
        assert taking.join() == [None]
    [again] = [inbox.take_work("H3", now=T + 1)]
    assert again is not None and [e.source_id for e in again.events] == ["2"]


def test_an_ingest_committing_while_a_finish_releases_keeps_its_wake(database_url, make_inbox):
    """The completer's finish with release saw no other open event and waits to
    delete the user's wakes; a message for the user commits meanwhile."""
    inbox = make_inbox(application_name="finisher", lease_ttl=TTL)
    inbox.ingest("u", "chat", "1", {})
    run = inbox.take_work("H", now=T)
    with holding_wakes_of(database_url, "u") as blocker:
        finishing = Racers(lambda: inbox.finish_run(run, Result(), now=T)).start()
        wait_for_lock_waiters(database_url, 1, application_name="finisher")
        make_inbox().ingest("u", "chat", "2", {})
        blocker.rollback()
        assert finishing.join() == [True]
    again = inbox.take_work("H2", now=T)                     # at once, not at the lease's end
    assert again is not None and [e.source_id for e in again.events] == ["2"]


def test_a_held_lease_is_looked_at_again_at_its_end_not_before(database_url, make_inbox):
    inbox = make_inbox(lease_ttl=TTL)
    gen = inbox.acquire("u", "api", now=T)                   # held by an API caller
    inbox.ingest("u", "chat", "1", {})
    assert inbox.take_work("H", now=T + 1) is None
    assert wakes(database_url, "u") == [T + TTL + 1]         # its next look: the lease's end
    assert inbox.take_work("H", now=T + TTL) is None
    run = inbox.take_work("H", now=T + TTL + 1)
    assert (run.user, run.gen, len(run.events)) == ("u", gen + 1, 1)


def test_a_retry_backing_off_is_taken_when_due(database_url, inbox):
    inbox.ingest("u", "chat", "1", {})
    run = inbox.take_work("H", now=T)
    assert inbox.finish_run(run, Result(error="flaky"), now=T)   # released, retry backs off
    [event] = inbox.events("u")
    assert event.available_at > T + 1
    assert inbox.take_work("H", now=T + 1) is None
    assert wakes(database_url, "u") == [event.available_at]  # looked at: next, the retry
    assert inbox.take_work("H", now=event.available_at - 1) is None
    again = inbox.take_work("H", now=event.available_at)
    assert [(e.id, e.attempts) for e in again.events] == [(event.id, 2)]


def test_a_requeued_dead_event_is_taken_at_once(database_url, make_inbox):
    inbox = make_inbox(max_attempts=1)
    inbox.ingest("u", "chat", "1", {})
    run = inbox.take_work("H", now=T)
    assert inbox.finish_run(run, Result(error="broken"), now=T)
    parked = inbox.take_work("H", now=T + 1000)              # out of attempts: parked dead
    assert parked.died == 1 and inbox.finish_run(parked, Result(), now=T + 1000)
    assert inbox.take_work("H", now=T + 1000) is None and wakes(database_url, "u") == []
    assert inbox.repair_dead([("u", run.events[0].id)], requeue=True, actor="operator",
                             now=T + 1000)
    again = inbox.take_work("H", now=T + 1000)
    assert [e.id for e in again.events] == [run.events[0].id]


def test_a_user_with_no_work_left_has_no_wake(database_url, inbox):
    inbox.ingest("u", "chat", "1", {})
    assert inbox.finish_run(inbox.take_work("H", now=T), Result(), now=T)
    assert wakes(database_url, "u") == []


def test_a_take_reads_past_held_users_to_a_free_one_and_puts_them_off_to_their_lease_end(
        database_url, make_inbox):
    inbox = make_inbox(lease_ttl=TTL)
    for user in ("held1", "held2", "held3"):
        inbox.acquire(user, "api", now=T)
        inbox.ingest(user, "chat", "1", {})                  # woken first, but held
    inbox.ingest("free", "chat", "1", {})
    [run] = inbox.runs.take_runs("H", users=1, now=T + 1)
    assert run.user == "free"
    assert [wakes(database_url, u) for u in ("held1", "held2", "held3")] == [[T + TTL + 1]] * 3
    assert inbox.runs.take_runs("H", users=3, now=T + 1) == []    # nothing is read again before then
