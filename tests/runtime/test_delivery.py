"""Delivery at scale: sends at once with nothing held in the database, claims
that run out, backoff and parking, operator repairs, and the race between a
finish that queues a message and a dispatcher deciding a user has none."""

import itertools
import json
import subprocess
import sys
import threading

import psycopg
import pytest

from agent_inbox import Message, PermanentSendError, Result
from agent_inbox.backend.citus import layout as citus
from agent_inbox.services.dispatcher import Dispatcher
from agent_inbox.backend.citus import statements as bucketed
from agent_inbox.store import outbox
from agent_inbox.store import keys
from tests.races import Racers, wait_for_lock_waiters
from tests.runtime.support import ROOT

T = 1_000_000
_keys = itertools.count()


def queue(inbox, user, now, *messages):
    inbox.ingest(user, "chat", f"{user}-{next(_keys)}", {})
    run = inbox.take_work(f"w-{user}", now=now)
    assert inbox.finish_run(run, Result(messages=list(messages)), now=now)


def delivery(url, user):
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT due_at, batch, attempts, sending_until FROM deliveries "
                           "WHERE user_id = %s", (user,)).fetchone()
    return dict(zip(("due_at", "batch", "attempts", "sending_until"), row)) if row else None


def test_sends_run_at_once_with_no_connection_busy_or_lock_held(database_url, make_inbox, inbox):
    users = [f"u{i}" for i in range(8)]
    for user in users:
        queue(inbox, user, T, f"hello {user}")
    all_sending = threading.Barrier(len(users) + 1, timeout=20)
    release = threading.Event()

    def channel(user, text, key):
        all_sending.wait()          # every send must be in flight at once to get past
        release.wait(20)

    sender = make_inbox(pool_size=2, application_name="dispatcher-under-test")
    dispatcher = Dispatcher(sender, channel, concurrency=len(users))
    passing = Racers(lambda: dispatcher.run_once(now=T)).start()
    all_sending.wait()
    with psycopg.connect(database_url, autocommit=True) as conn:
        busy = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                            "'dispatcher-under-test' AND state <> 'idle'").fetchone()[0]
        locks = conn.execute("SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
                             "WHERE a.application_name = 'dispatcher-under-test' "
                             "AND l.locktype IN ('tuple', 'transactionid', 'advisory')").fetchone()[0]
    assert (busy, locks) == (0, 0)
    assert inbox.dispatch("u0", lambda text: pytest.fail("sent twice"), now=T) == 0  # claimed
    release.set()
    passing.join()
    assert all(m.sent_at == T for u in users for m in inbox.outbox(u))


def test_a_dispatcher_that_died_mid_send_is_followed_after_its_deadline_same_key(
        make_inbox, inbox):
    queue(inbox, "u", T, "report")
    dead = make_inbox(send_timeout=60)
    _, [claimed] = dead.delivery.claim_due(10, now=T)      # claimed, then the process died
    sends = []
    dispatcher = Dispatcher(make_inbox(send_timeout=60),
                            lambda user, text, key: sends.append((text, key)))
    dispatcher.run_once(now=T + 59)
    assert sends == []                             # the claim still holds
    dispatcher.run_once(now=T + 61)
    assert sends == [("report", claimed.key)]
    assert dead.delivery.mark_sent([claimed], now=T + 62) == []   # its late mark is refused
    assert [m.sent_at for m in inbox.outbox("u")] == [T + 61]


def test_failed_sends_back_off_then_park_and_later_messages_go_on(database_url, make_inbox,
                                                                  inbox):
    queue(inbox, "u", T, "first")
    attempts = []

    def failing(user, text, key):
        attempts.append(key)
        raise ConnectionError("chat service down")

    dispatcher = Dispatcher(make_inbox(max_send_attempts=3, send_backoff=10), failing)
    now = T
    for failures in (1, 2):
        dispatcher.run_once(now=now)
        state = delivery(database_url, "u")
        assert state["attempts"] == failures
        delay = state["due_at"] - now
        assert 10 * 2 ** (failures - 1) * 0.5 <= delay <= 10 * 2 ** (failures - 1)
        dispatcher.run_once(now=state["due_at"] - 1)     # backing off: no send
        assert len(attempts) == failures
        now = state["due_at"]
    dispatcher.run_once(now=now)                          # third failure: parked
    assert len(set(attempts)) == 1 and len(attempts) == 3
    [parked] = inbox.outbox("u")
    assert parked.failed_at == now and "chat service down" in parked.error
    queue(inbox, "u", now, "second")
    sends = []
    Dispatcher(inbox, lambda user, text, key: sends.append(text)).run_once(now=now)
    assert sends == ["second"]


def test_a_permanent_refusal_parks_at_once(make_inbox, inbox):
    queue(inbox, "u", T, "bad request")

    def refusing(user, text, key):
        raise PermanentSendError("HTTP 422")

    Dispatcher(make_inbox(max_send_attempts=10), refusing).run_once(now=T)
    assert inbox.outbox("u")[0].failed_at == T


def run_cli(*args):
    done = subprocess.run([sys.executable, "-m", "agent_inbox.cli", *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    return done.returncode, done.stdout, done.stderr


def test_operators_see_retry_and_discard_failed_batches(database_url, make_inbox, inbox):
    for user in ("a", "b"):
        queue(inbox, user, T, f"to {user}")

    def refusing(user, text, key):
        raise PermanentSendError("HTTP 404")

    Dispatcher(inbox, refusing).run_once(now=T)
    batch_a, batch_b = (inbox.outbox(u)[0].batch for u in ("a", "b"))
    code, out, _ = run_cli("status", "--database-url", database_url, "--json")
    assert code == 0 and json.loads(out)["totals"]["outbox_failed"] == 2
    code, out, _ = run_cli("outbox", "failed", "--database-url", database_url, "--json")
    assert {(b["user"], b["batch"]) for b in json.loads(out)["batches"]} == {("a", batch_a),
                                                                               ("b", batch_b)}
    code, out, err = run_cli("outbox", "retry", str(batch_a), "999999", "--now", str(T + 1),
                             "--database-url", database_url)
    assert code == 1 and "999999" in out and "no such batch" in out
    assert "audit: outbox retry" in err
    sends = []
    Dispatcher(inbox, lambda user, text, key: sends.append((user, key))).run_once(now=T + 1)
    assert sends == [("a", f"a:{batch_a}")]              # same key as before
    code, out, _ = run_cli("outbox", "retry", str(batch_a), "--database-url", database_url)
    assert code == 1 and "not failed: sent" in out
    code, out, _ = run_cli("outbox", "discard", str(batch_b), "--database-url", database_url)
    assert code == 0 and inbox.outbox("b") == []
    with psycopg.connect(database_url) as conn:
        recorded = conn.execute("SELECT action, outbox_batch, detail->'bodies' FROM "
                                "operator_actions ORDER BY id").fetchall()
    assert recorded == [("outbox_retry", batch_a, None), ("outbox_discard", batch_b, ["to b"])]


def lock_due_as_a_dispatcher(conn, user, now):
    """A dispatcher's first claim step, as the Inbox sends it (on Citus: in the
    user's bucket)."""
    if citus.is_distributed(conn):
        return bucketed.lock_due_deliveries(conn, keys.bucket(user), 10, now)
    return outbox.lock_due(conn, 10, now)


def test_a_message_queued_while_a_dispatcher_decides_is_not_lost(database_url, make_inbox,
                                                                 inbox):
    """The dispatcher holds the user's delivery row (nothing held yet); a finish
    queueing a message waits on it; the dispatcher decides 'nothing held' and
    commits; the finish then makes the user due, and the message goes."""
    queue(inbox, "u", T, "first")
    inbox.dispatch("u", lambda text: None, now=T)
    with psycopg.connect(database_url) as conn:         # a dispatcher's claim, held open
        conn.execute("UPDATE deliveries SET due_at = %s WHERE user_id = 'u'", (T,))
        conn.commit()
        assert lock_due_as_a_dispatcher(conn, "u", T) == ["u"]
        finishing = make_inbox(application_name="finish-racer")
        inbox.ingest("u", "chat", "late", {})
        run = finishing.take_work("w-late", now=T + 1)
        racer = Racers(lambda: finishing.finish_run(run, Result(messages=["late"]), now=T + 1))
        racer.start()
        wait_for_lock_waiters(database_url, 1, application_name="finish-racer")
        assert outbox.claim(conn, ["u"], gap=3600, send_timeout=120, now=T) == []
        conn.commit()
    assert racer.join() == [True]
    assert delivery(database_url, "u")["due_at"] == T + 1
    sends = []
    Dispatcher(make_inbox(outbox_gap=0), lambda u, text, key: sends.append(text)).run_once(
        now=T + 1)
    assert sends == ["late"]


def test_two_dispatchers_at_once_send_every_batch_once(make_inbox, inbox):
    users = [f"u{i:03}" for i in range(300)]
    for user in users:
        queue(inbox, user, T, f"to {user}")
    sent, lock = [], threading.Lock()

    def channel(user, text, key):
        with lock:
            sent.append(key)

    dispatchers = [Dispatcher(make_inbox(pool_size=2), channel, concurrency=16) for _ in range(2)]
    start = threading.Barrier(2)
    Racers(*[lambda d=d: (start.wait(), d.run_once(now=T)) for d in dispatchers]).start().join()
    assert sorted(sent) == sorted(f"{u}:{inbox.outbox(u)[0].batch}" for u in users)


def test_the_dispatcher_command_refuses_bad_options(database_url):
    code, _, err = run_cli("dispatcher", "--database-url", database_url, "--channel",
                           "no_such_module:send")
    assert code == 2 and "channel cannot be loaded: No module named 'no_such_module'" in err
    code, _, err = run_cli("dispatcher", "--database-url", database_url, "--channel",
                           "tests.runtime.handlers:echo", "--concurrency", "0")
    assert code == 2 and "--concurrency must be at least 1" in err


def test_a_finish_does_not_cut_a_failed_batchs_backoff_short(database_url, make_inbox, inbox):
    """A failed batch backs off (--send-backoff, doubling per failure): a finish
    that queues more messages for the user does not make it due before its
    backoff ends, so a chatty agent does not burn through --max-send-attempts
    during an outage the backoff is meant to ride out."""
    attempts = []

    def failing(user, text, key):
        attempts.append(key)
        raise ConnectionError("chat service down")

    dispatcher = Dispatcher(make_inbox(send_backoff=100, max_send_attempts=3), failing)
    queue(inbox, "u", T, "first")
    dispatcher.run_once(now=T)
    assert len(attempts) == 1
    backoff_ends = delivery(database_url, "u")["due_at"]
    assert backoff_ends >= T + 50
    for second in (1, 2):                      # the agent answers twice more, 1 s apart
        queue(inbox, "u", T + second, f"more {second}")
        dispatcher.run_once(now=T + second)
    assert len(attempts) == 1, (attempts, [(m.body, m.failed_at) for m in inbox.outbox("u")])
    assert delivery(database_url, "u")["due_at"] == backoff_ends
    dispatcher.run_once(now=backoff_ends)      # then the failed batch goes again, first
    assert len(attempts) == 2 and attempts[1] == attempts[0]


def test_an_operator_retry_does_not_send_a_second_batch_inside_the_gap(make_inbox, inbox):
    """Guarantee 7, at most one send per outbox_gap per user: a batch an
    operator retries waits for the gap like a new batch would."""
    refuse = {"on": True}
    sends = []

    def channel(user, text, key):
        if refuse["on"] and text == "first":
            raise PermanentSendError("HTTP 422")
        sends.append((text, key))

    dispatcher = Dispatcher(make_inbox(outbox_gap=3600), channel)
    queue(inbox, "u", T, "first")
    dispatcher.run_once(now=T)                 # parked failed; the user's later ones go on
    queue(inbox, "u", T, "second")
    dispatcher.run_once(now=T)
    assert [t for t, _ in sends] == ["second"]
    [parked] = [m.batch for m in inbox.outbox("u") if m.failed_at is not None]
    assert inbox.repair_failed_batches([parked], retry=True, actor="test", now=T + 1)
    refuse["on"] = False
    dispatcher.run_once(now=T + 1)
    assert [t for t, _ in sends] == ["second"]
    dispatcher.run_once(now=T + 3600)          # once the gap allows: same rows, same key
    assert sends == [("second", "u:2"), ("first", f"u:{parked}")]


def test_one_slow_send_does_not_hold_back_every_other_users_delivery(make_inbox, inbox):
    """While one user's send is slow, a pass goes on claiming: an urgent
    message queued meanwhile goes out though that send has not ended."""
    release = threading.Event()
    slow_in_flight = threading.Event()
    fast_sent = threading.Event()

    def channel(user, text, key):
        if user == "slow":
            slow_in_flight.set()
            release.wait(30)
        else:
            fast_sent.set()

    queue(inbox, "slow", T, "takes a while")
    dispatcher = Dispatcher(make_inbox(pool_size=2), channel, concurrency=16)
    passing = Racers(lambda: dispatcher.run_once(now=T)).start()
    try:
        assert slow_in_flight.wait(20)
        queue(inbox, "fast", T, Message("urgent: now", urgent=True))
        assert fast_sent.wait(10), "the urgent message waited for another user's send"
    finally:
        release.set()
        passing.join()


def test_a_channel_error_postgresql_cannot_store_does_not_stop_the_dispatcher(make_inbox, inbox):
    """A channel's error text is recorded as PostgreSQL can store it (a NUL
    byte or an unpaired surrogate from a peer's body is replaced): the failure
    is recorded and the dispatcher goes on sending to other users."""
    sends = []

    def channel(user, text, key):
        if user == "a":
            raise RuntimeError("peer said: \x00\x01 \udc80 garbage")
        sends.append(user)

    dispatcher = Dispatcher(make_inbox(), channel)
    queue(inbox, "a", T, "to a")
    errors = []
    for now in (T, T + 1, T + 2):
        if now == T + 1:
            queue(inbox, "b", now, "to b")
        try:
            dispatcher.run_once(now=now)
        except Exception as exc:
            errors.append(type(exc).__name__)
    assert sends == ["b"] and not errors, (sends, errors)
    [held] = inbox.outbox("a")
    assert held.error.startswith("RuntimeError: peer said: ") and "garbage" in held.error


def test_a_claim_whose_deadline_is_now_does_not_spin_the_pass(database_url, make_inbox, inbox):
    """A user whose batch another dispatcher holds until exactly now is not
    claimed back to back: the claim leaves it due later, and the pass ends."""
    queue(inbox, "u", T - 120, "hello")
    other = make_inbox(send_timeout=120)
    _, [held] = other.delivery.claim_due(10, now=T - 120)     # another dispatcher's claim: until T
    calls = {"n": 0}
    looking = make_inbox()
    original = looking.delivery.claim_due

    def counted(limit, *, now=None):
        calls["n"] += 1
        if calls["n"] > 50:           # let the pass end, so the test does not hang
            with psycopg.connect(database_url, autocommit=True) as conn:
                conn.execute("UPDATE deliveries SET due_at = %s WHERE user_id = 'u'", (T + 1,))
        return original(limit, now=now)

    looking.delivery.claim_due = counted
    Dispatcher(looking, lambda *a: None, concurrency=1).run_once(now=T)
    assert calls["n"] <= 2, f"{calls['n']} claims in one pass"


def test_mark_sent_and_a_batched_finish_do_not_deadlock(database_url, make_inbox, inbox):
    """Sends end in any order, but their outcomes lock delivery rows in user
    order, as a finish queueing messages for several users does: a dispatcher
    marking [u2, u1] and a worker finishing runs of [u1, u2] do not deadlock."""
    for user in ("u1", "u2"):
        queue(inbox, user, T, f"to {user}")
    marker = make_inbox(application_name="test-mark")
    _, batches = marker.delivery.claim_due(10, now=T)
    by_user = {b.user: b for b in batches}
    for user in ("u1", "u2"):
        inbox.ingest(user, "chat", f"{user}-again", {})
    finisher = make_inbox(application_name="test-finish")
    runs = [finisher.take_work(f"w2-{u}", now=T + 1) for u in ("u1", "u2")]
    outcomes = [finisher.runs.outcome(r, Result(messages=["again"])) for r in runs]
    with psycopg.connect(database_url) as holder:
        holder.execute("SELECT 1 FROM deliveries WHERE user_id = 'u1' FOR UPDATE")
        finishing = Racers(lambda: finisher.runs.finish_runs(outcomes, now=T + 1)).start()
        wait_for_lock_waiters(database_url, 1, application_name="test-finish")
        marking = Racers(lambda: marker.delivery.mark_sent([by_user["u2"], by_user["u1"]], now=T + 1))
        marking.start()
        wait_for_lock_waiters(database_url, 1, application_name="test-mark")
        holder.rollback()
        problems = []
        for racer in (finishing, marking):
            try:
                racer.join()
            except Exception as exc:
                problems.append(f"{type(exc).__name__}: {exc}")
    assert problems == [], problems
    assert all(m.sent_at == T + 1 for u in ("u1", "u2") for m in inbox.outbox(u)
               if m.body == f"to {u}")
