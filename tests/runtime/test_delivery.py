"""Delivery at scale: sends at once with nothing held in the database, claims
that run out, backoff and parking, operator repairs, and the race between a
finish that queues a message and a dispatcher deciding a user has none."""

import json
import subprocess
import sys
import threading

import psycopg
import pytest

from agent_inbox import PermanentSendError, Result
from agent_inbox.dispatcher import Dispatcher
from agent_inbox.store import outbox
from tests.races import Racers, wait_for_lock_waiters
from tests.runtime.support import ROOT

T = 1_000_000


def queue(inbox, user, now, *messages):
    inbox.ingest(user, "chat", f"{user}-{now}-{len(messages)}", {})
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
    _, [claimed] = dead.claim_due(10, now=T)      # claimed, then the process died
    sends = []
    dispatcher = Dispatcher(make_inbox(send_timeout=60),
                            lambda user, text, key: sends.append((text, key)))
    dispatcher.run_once(now=T + 59)
    assert sends == []                             # the claim still holds
    dispatcher.run_once(now=T + 61)
    assert sends == [("report", claimed.key)]
    assert dead.mark_sent([claimed], now=T + 62) == []   # its late mark is refused
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
        assert outbox.lock_due(conn, 10, T) == ["u"]
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
