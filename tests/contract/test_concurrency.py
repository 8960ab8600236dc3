"""Concurrency guarantees, proven with real races against the real server.

Each race is forced, never hoped for: a plain connection (the blocker) opens a
transaction holding a lock every racer needs, the racers start in threads (each
on its own Inbox whose connections are named `racer-...`), the test waits until
PostgreSQL reports every racer waiting on a lock, and only then lets go, so they
all proceed at once. Where a race needs no lock (dispatch's try-lock, scheduler
batches) threads are lined up on a threading primitive instead. No sleeps.

A contract test module: each race runs on every backend (tests/contract/conftest.py).
Behind PgBouncer every racer's Inbox goes through it (each guarantee holds when
consecutive transactions of one client run on different server connections);
the lock holder and the probe stay direct (`database_url`). On Citus the lock
holder is routed to the user's node, and the probe reads citus_stat_activity,
where the racers' waits on the worker nodes show.
"""

import threading
import uuid

import psycopg
import pytest

import agent_inbox.api.scheduling
from agent_inbox.store import keys
from agent_inbox.store import lease as lease_store
from tests.races import Racers, wait_for_lock_waiters

# Behind PgBouncer a racer waiting on a lock holds a server connection (its
# transaction is open), and races.wait_for_lock_waiters needs every racer
# waiting at once: the widest race (16 first acquires) needs 16. The lock holder
# and the probe are direct connections and take none.
pytestmark = pytest.mark.pgbouncer_pool_size(16)

T = 1_700_000_000
RACERS = "racer-%"


# --- forcing a race ------------------------------------------------------------

def race_behind(url, lock_sql, params, calls, *, commit=False, in_order=False):
    """Hold `lock_sql` in an open transaction, start `calls` in threads, wait until
    each waits on a lock, then commit (or roll back) and return their results.

    With `in_order`, each call is started only once the ones before it wait, so
    PostgreSQL's lock queue hands them the lock in the order given."""
    groups = [[call] for call in calls] if in_order else [list(calls)]
    started = []
    with psycopg.connect(url) as blocker:
        blocker.execute(lock_sql, params)
        try:
            for group in groups:
                started.append(Racers(*group).start())
                waiting = sum(len(racers.threads) for racers in started)
                wait_for_lock_waiters(url, waiting, application_name=RACERS)
        finally:
            if commit:
                blocker.commit()
            else:
                blocker.rollback()
    return [result for racers in started for result in racers.join()]


def racer_inboxes(make_inbox, count, **options):
    return [make_inbox(application_name=f"racer-{i}", **options) for i in range(count)]


def query(url, sql, params=None):
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


LOCK_EVENTS = "LOCK TABLE events IN SHARE MODE"  # blocks every insert into events


# --- 1. lease -------------------------------------------------------------------

def test_simultaneous_first_acquires_give_exactly_one_lease(database_url, make_inbox):
    """Sixteen first acquires of one user at the same instant: one gets gen 1, fifteen get None."""
    inboxes = racer_inboxes(make_inbox, 16)
    calls = [lambda ib=ib, i=i: ib.acquire("alice", f"w{i}", now=T) for i, ib in enumerate(inboxes)]

    gens = race_behind(
        database_url,
        "INSERT INTO leases (bucket, user_id, holder, gen, until)"
        " VALUES (%(bucket)s, %(user)s, 'blocker', 0, -1)",
        keys.user_key("alice"), calls)

    assert sorted(gens, key=lambda g: g is None) == [1] + [None] * 15
    winner = f"w{gens.index(1)}"
    assert query(database_url, "SELECT holder, gen, until FROM leases WHERE user_id = %s",
                 ("alice",)) == [(winner, 1, T + 120)]


# --- 2. ingest ------------------------------------------------------------------

def test_simultaneous_ingests_of_one_key_store_it_once(database_url, make_inbox):
    """Eight connections ingesting one key at once: exactly one True, exactly one row."""
    inboxes = racer_inboxes(make_inbox, 8)
    calls = [lambda ib=ib, i=i: ib.ingest("alice", "mail", "m-1", {"copy": i})
             for i, ib in enumerate(inboxes)]

    stored = race_behind(
        database_url,
        "INSERT INTO events (bucket, user_id, source, source_id, payload) "
        "VALUES (%(bucket)s, %(user)s, 'mail', 'm-1', '{}'::jsonb)",
        keys.user_key("alice"), calls)

    assert sorted(stored) == [False] * 7 + [True]
    assert query(database_url, "SELECT count(*) FROM events WHERE user_id = %s "
                 "AND source = 'mail' AND source_id = 'm-1'", ("alice",)) == [(1,)]


# --- 3. fencing a stale holder ------------------------------------------------------

LOCK_LEASE = lease_store.LOCK


def start_a_run(inbox, user, holder, now):
    """Acquire and claim as `holder`; the generation and the claimed event ids."""
    gen = inbox.acquire(user, holder, now=now)
    assert gen is not None
    return gen, [event.id for event in inbox.claim_batch(user, holder, gen, now=now)]


def take_over_and_finish(inbox, user, holder, now):
    """A whole takeover run: acquire, claim, finish with one message."""
    gen, ids = start_a_run(inbox, user, holder, now)
    return gen, ids, inbox.finish(user, holder, gen, ids, messages=["report sent"], now=now)


@pytest.mark.parametrize("stale_now, in_order", [
    pytest.param(T + 121, False, id="stale-by-its-own-clock"),
    pytest.param(T + 60, True, id="valid-by-its-own-clock-but-taken-over-first"),
])
def test_stale_holders_finish_racing_a_takeover_is_refused(database_url, make_inbox, inbox,
                                                             stale_now, in_order):
    """A gen-1 finish racing a gen-2 takeover is refused; only the takeover's outcome commits."""
    a = make_inbox(application_name="racer-a", lease_ttl=120)
    b = make_inbox(application_name="racer-b", lease_ttl=120)
    inbox.ingest("alice", "mail", "m-1", {"subject": "report"})
    gen_a, ids_a = start_a_run(a, "alice", "A", T)
    assert (gen_a, len(ids_a)) == (1, 1)

    # B goes first in the lock queue when in_order: its takeover commits before A's finish.
    (gen_b, ids_b, b_finished), a_finished = race_behind(
        database_url, LOCK_LEASE, keys.user_key("alice"),
        [lambda: take_over_and_finish(b, "alice", "B", T + 121),
         lambda: a.finish("alice", "A", gen_a, ids_a, messages=["report sent"], now=stale_now)],
        commit=True, in_order=in_order)

    assert a_finished is False
    assert (gen_b, ids_b, b_finished) == (2, ids_a, True)
    assert [m.body for m in inbox.outbox("alice")] == ["report sent"]
    [event] = inbox.events("alice")
    assert (event.status, event.claim_gen, event.attempts) == ("done", 2, 2)


# --- 4. scheduler ---------------------------------------------------------------

def arm_timers(inbox, users):
    """Three due timers per user (a coalescing recurring one, two one-offs);
    the event key each must produce when fired at T, one per timer."""
    expected = []
    for n in range(users):
        user = f"u{n:03}"
        inbox.add_timer(user, "tick", T - 1000, {"kind": "tick"}, every=60)
        inbox.add_timer(user, "remind", T - 5, {"kind": "remind"})
        inbox.add_timer(user, "deadline", T, {"kind": "deadline"}, key=("deadline", f"{user}-d"))
        latest_tick = T - 1000 + (1000 // 60) * 60  # missed occurrences coalesce into the latest
        expected += [(user, "timer", f"tick@{latest_tick}"), (user, "timer", f"remind@{T - 5}"),
                     (user, "deadline", f"{user}-d")]
    return sorted(expected)


def event_keys(url):
    return query(url, "SELECT user_id, source, source_id FROM events ORDER BY 1, 2, 3")


def test_simultaneous_schedulers_fire_each_occurrence_once(database_url, make_inbox, inbox):
    """Four schedulers released at once: every due occurrence becomes exactly one event."""
    expected = arm_timers(inbox, users=40)
    schedulers = racer_inboxes(make_inbox, 4)

    # The scheduler's single statement inserts into events, so each takes its lock on
    # events while the statement is parsed, before it locks (or skips) any timer row:
    # all four really block, none can run ahead and find nothing to do.
    fired = race_behind(database_url, LOCK_EVENTS, None,
                        [lambda s=s: s.run_scheduler(now=T) for s in schedulers])

    assert sum(fired) == len(expected) == 120
    assert event_keys(database_url) == expected
    assert inbox.run_scheduler(now=T) == 0


def test_concurrent_schedulers_over_many_batches_fire_each_timer_once(
        database_url, make_inbox, inbox, monkeypatch):
    """Four schedulers making many small-batch passes at once: each timer fires exactly once."""
    monkeypatch.setattr(agent_inbox.api.scheduling, "SCHEDULER_BATCH", 7)
    batches = []  # timers fired by each batch, across all schedulers
    count_fired = agent_inbox.api.scheduling.Scheduling._count_fired

    def counted(batch):
        batches.append(batch.fired)
        count_fired(batch)

    monkeypatch.setattr(agent_inbox.api.scheduling.Scheduling, "_count_fired", staticmethod(counted))
    expected = arm_timers(inbox, users=100)
    schedulers = racer_inboxes(make_inbox, 4)
    start = threading.Barrier(len(schedulers))

    def passes(scheduler):
        start.wait(timeout=30)
        return sum(scheduler.run_scheduler(now=T) for _ in range(5))

    fired = Racers(*[lambda s=s: passes(s) for s in schedulers]).start().join()

    assert sum(fired) == len(expected) == 300
    assert sum(batches) == 300 and len(batches) >= 300 // 7
    assert event_keys(database_url) == expected
    assert inbox.run_scheduler(now=T) == 0


# --- 5. dispatch ----------------------------------------------------------------

def queue_messages(inbox, user, bodies, now):
    """A whole run that queues `bodies` in the user's outbox."""
    inbox.ingest(user, "chat", uuid.uuid4().hex, {"text": "hi"})
    gen, ids = start_a_run(inbox, user, "worker", now)
    assert inbox.finish(user, "worker", gen, ids, messages=bodies, now=now)


class Recorder:
    """A send() that records every text; optionally parks in the first call until released."""

    def __init__(self, park=False):
        self.texts = []
        self.parked, self.release = threading.Event(), threading.Event()
        self.park = park

    def __call__(self, text):
        self.texts.append(text)
        if self.park:
            self.parked.set()
            assert self.release.wait(timeout=30), "never released"


def test_dispatchers_of_one_user_send_each_message_once(database_url, make_inbox, inbox):
    """While one dispatcher is mid-send, three more for the same user send nothing; all go once."""
    bodies = ["first", "second", "third"]
    queue_messages(inbox, "alice", bodies, T)
    first, *others = racer_inboxes(make_inbox, 4)
    parked, send = Recorder(park=True), Recorder()

    sending = Racers(lambda: first.dispatch("alice", parked, now=T)).start()
    assert parked.parked.wait(timeout=30), "the first dispatcher never reached send()"
    skipped = Racers(*[lambda d=d: d.dispatch("alice", send, now=T) for d in others]).start().join()
    parked.release.set()

    assert sending.join() == [3] and skipped == [0, 0, 0]
    assert parked.texts == ["first\n\nsecond\n\nthird"] and send.texts == []
    assert all(m.sent_at == T for m in inbox.outbox("alice"))

    queue_messages(inbox, "alice", ["later"], T + 30)
    assert inbox.dispatch("alice", send, now=T + 60) == 0  # inside the gap: held
    assert send.texts == []
    assert [m.sent_at for m in inbox.outbox("alice")] == [T, T, T, None]


def test_dispatchers_looping_over_many_users_send_each_message_once(database_url, make_inbox, inbox):
    """Four dispatchers each sweeping every user at once: every message is sent exactly once."""
    users = [f"u{n:02}" for n in range(30)]
    for user in users:
        queue_messages(inbox, user, [f"{user}/a", f"{user}/b"], T)
    dispatchers = racer_inboxes(make_inbox, 4)
    start = threading.Barrier(len(dispatchers))
    sent = {user: [] for user in users}

    def sweep(dispatcher, offset):
        start.wait(timeout=30)
        order = users[offset:] + users[:offset]  # different starting points: more collisions
        return sum(dispatcher.dispatch(u, lambda text, u=u: sent[u].append(text), now=T) for u in order)

    counts = Racers(*[lambda d=d, i=i: sweep(d, i * 7) for i, d in enumerate(dispatchers)]).start().join()

    assert sum(counts) == 2 * len(users)
    assert sent == {user: [f"{user}/a\n\n{user}/b"] for user in users}
    assert all(m.sent_at == T for user in users for m in inbox.outbox(user))


# --- 6. approvals -----------------------------------------------------------------

def standing_payloads(url, user, request_id):
    return [row[0] for row in query(
        url, "SELECT payload FROM events WHERE user_id = %s AND source = 'approval' "
             "AND source_id = %s", (user, request_id))]


def assert_one_standing_answer(url, inbox, user, request_id, told):
    """One approval event; every caller was told its answer; a late answer gets it too."""
    [payload] = standing_payloads(url, user, request_id)
    assert set(told) == {payload["answer"]}
    assert inbox.answer_approval(user, request_id, "no", now=T + 1) == payload["answer"]


def test_answer_racing_the_expiry_timer_has_one_outcome(database_url, make_inbox, inbox):
    """An in-time answer racing the expiry: one event stands and the answerer is told it."""
    answerer = make_inbox(application_name="racer-answer")
    scheduler = make_inbox(application_name="racer-scheduler")
    for round_ in range(10):
        request_id = f"r{round_}"
        inbox.request_approval("alice", request_id, expires_in=3600, action={"send": "report"}, now=T)

        told, fired = race_behind(database_url, LOCK_EVENTS, None, [
            lambda: answerer.answer_approval("alice", request_id, "yes", now=T + 3599),
            lambda: scheduler.run_scheduler(now=T + 3600)])

        assert fired == 1
        assert told in ("yes", "expired")
        assert_one_standing_answer(database_url, inbox, "alice", request_id, [told])


def test_two_answers_racing_are_told_the_same_answer(database_url, make_inbox, inbox):
    """'yes' and 'no' answered at once: one answer stands and both callers are told it."""
    yes = make_inbox(application_name="racer-yes")
    no = make_inbox(application_name="racer-no")
    for round_ in range(5):
        request_id = f"r{round_}"
        inbox.request_approval("alice", request_id, expires_in=3600, action={"send": "report"}, now=T)

        told = race_behind(database_url, LOCK_EVENTS, None, [
            lambda: yes.answer_approval("alice", request_id, "yes", now=T + 10),
            lambda: no.answer_approval("alice", request_id, "no", now=T + 10)])

        assert told[0] in ("yes", "no")
        assert_one_standing_answer(database_url, inbox, "alice", request_id, told)


def test_a_deadlock_is_retried_by_in_transaction(database_url, make_inbox):
    """Two transactions locking two rows in opposite orders: PostgreSQL breaks the
    deadlock by rolling one back; db.in_transaction runs it again and both finish.
    The two users share a bucket (on Citus: one node, whose deadlock detector
    answers as plain PostgreSQL's does)."""
    from agent_inbox import db

    b = next(user for user in (f"b{n}" for n in range(1000))
             if keys.bucket(user) == keys.bucket("a"))
    with psycopg.connect(database_url, autocommit=True) as conn:
        for user in ("a", b):
            conn.execute("INSERT INTO leases (bucket, user_id, holder, gen, until)"
                         " VALUES (%(bucket)s, %(user)s, '', 0, -1)", keys.user_key(user))
    both_hold_one = threading.Barrier(2)
    attempts = []

    def lock_in_order(first, second):
        def work(conn):
            attempts.append(first)
            conn.execute(lease_store.LOCK, keys.user_key(first))
            if len(attempts) <= 2:              # the first round: meet, then cross
                both_hold_one.wait(timeout=30)
            conn.execute(lease_store.LOCK, keys.user_key(second))
            return first
        return work

    inboxes = racer_inboxes(make_inbox, 2)
    results = Racers(lambda: db.in_transaction(inboxes[0].pool, lock_in_order("a", b)),
                     lambda: db.in_transaction(inboxes[1].pool, lock_in_order(b, "a"))
                     ).start().join()
    assert sorted(results) == ["a", b]
    # one of the two ran again (under load its retry may meet the other's
    # still-held lock and deadlock once more before the other commits)
    assert len(attempts) >= 3
