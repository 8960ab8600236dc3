"""Compacting `wakes` (store/wakes.py) keeps every live wake and drops the dead
row versions a held horizon leaves behind; it never waits for anyone, and a
statement that waited for it sees the rewritten table.

The interleavings are held in place by table locks (another session's ACCESS
SHARE, as pg_dump takes, or an uncommitted ingest's ROW EXCLUSIVE) and waited
for through pg_stat_activity (tests/races.py)."""

import threading
import time

import psycopg
import pytest

from agent_inbox import Result
from agent_inbox.store import wakes as wakes_sql
from tests.races import Racers, wait_for_lock_waiters

T = 1_000_000
TTL = 30
FORCED = {"min_dead": 0, "ratio": 0}  # compact whatever the dead tuples


def live_wakes(url: str) -> list[tuple]:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT user_id, at, id FROM wakes ORDER BY at, id").fetchall()


def sizes(url: str) -> tuple[int, int, int]:
    """Bytes of the table, of ix_wakes_at, and the table's file node."""
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT pg_relation_size('wakes'), pg_relation_size('ix_wakes_at'),"
                            " pg_relation_filenode('wakes')").fetchone()


def held_horizon(url: str) -> psycopg.Connection:
    """A session idle in a transaction with an id: VACUUM keeps every row
    version from now on (it never reads wakes, so it holds no lock on them)."""
    conn = psycopg.connect(url, application_name="held-horizon")
    conn.execute("SELECT txid_current()")
    return conn


def churn(inbox, users: int, rounds: int) -> None:
    """Runs that each insert and delete wakes: ingest, take, finish, released."""
    for r in range(rounds):
        inbox.ingest_many([(f"u{i}", "chat", f"{r}", {}) for i in range(users)])
        while (run := inbox.take_work("H", now=T)) is not None:
            assert inbox.finish_run(run, Result(), now=T)


def test_compaction_keeps_every_live_wake_and_drops_what_a_held_horizon_keeps(
        database_url, make_inbox):
    inbox = make_inbox(lease_ttl=TTL)
    with held_horizon(database_url):
        churn(inbox, users=50, rounds=20)                       # 1,000 runs' wakes, all dead
        inbox.ingest_many([(f"u{i}", "chat", "open", {}) for i in range(10)])  # due now
        held = [inbox.take_work("H2", now=T) for _ in range(3)]  # their wake: the lease end
        assert all(run is not None for run in held)
        before = live_wakes(database_url)
        assert len(before) == 10
        table, index, node = sizes(database_url)
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("VACUUM wakes")                         # the hold: nothing removed
        assert sizes(database_url)[:2] == (table, index)

        done = inbox.compact_wakes(**FORCED)

        assert done.outcome == wakes_sql.COMPACTED and done.kept == 10
        assert live_wakes(database_url) == before                # same users, times and ids
        table_after, index_after, node_after = sizes(database_url)
        assert node_after != node                                # new files
        assert table_after <= 8192 < table and index_after <= 2 * 8192 < index
    # every open event is still taken: 7 at once, the 3 held at their lease end
    taken = list(iter(lambda: inbox.take_work("H3", now=T), None))
    assert len(taken) == 7 and all(inbox.finish_run(run, Result(), now=T) for run in taken)
    later = [run.user for run in iter(lambda: inbox.take_work("H3", now=T + TTL + 1), None)]
    assert sorted(later) == sorted(run.user for run in held)


def test_a_session_holding_the_table_makes_compaction_give_up_and_change_nothing(
        database_url, make_inbox):
    """pg_dump holds ACCESS SHARE on every table it dumps for as long as it runs:
    compaction asks for its lock briefly, gives up, and the takes go on."""
    inbox = make_inbox(lease_ttl=TTL, application_name="taker")
    churn(inbox, users=5, rounds=2)
    inbox.ingest("u0", "chat", "open", {})
    before, node = live_wakes(database_url), sizes(database_url)[2]
    with psycopg.connect(database_url, application_name="dump") as dump:
        dump.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        dump.execute("LOCK TABLE wakes IN ACCESS SHARE MODE")

        done = inbox.compact_wakes(**FORCED, lock_timeout_ms=200)

        assert done.outcome == wakes_sql.NOT_GRANTED
        assert sizes(database_url)[2] == node and live_wakes(database_url) == before
        run = inbox.take_work("H", now=T)                         # not queued behind it
        assert run is not None and run.user == "u0"


def test_a_wake_inserted_but_not_committed_holds_compaction_off_and_is_kept(
        database_url, make_inbox):
    inbox = make_inbox(lease_ttl=TTL)
    churn(inbox, users=5, rounds=2)
    with psycopg.connect(database_url) as ingest:
        ingest.execute("INSERT INTO events (user_id, source, source_id, payload)"
                       " VALUES ('late', 'chat', '1', '{}')")   # its trigger inserts a wake
        assert inbox.compact_wakes(**FORCED, lock_timeout_ms=200).outcome == wakes_sql.NOT_GRANTED
        ingest.commit()
    done = inbox.compact_wakes(**FORCED)
    assert done.outcome == wakes_sql.COMPACTED and done.kept == 1
    run = inbox.take_work("H", now=T)
    assert run is not None and run.user == "late"


@pytest.mark.parametrize("waiter", ["take", "finish"])
def test_a_statement_that_waited_for_compaction_sees_the_rewritten_table(
        database_url, make_inbox, waiter):
    """TRUNCATE is not MVCC-safe: a statement whose snapshot were older than the
    compaction's commit would see the table empty. The take (or the finish
    with release) queued behind compaction's lock must see every wake copied
    back: the user taken, or its next wake kept. Its statement is prepared
    (psycopg prepares after five uses): the cached plan's locks are taken
    before its snapshot too."""
    inbox = make_inbox(lease_ttl=TTL, application_name="waiter")
    compactor = make_inbox(application_name="compactor")
    for i in range(6):                                          # prepared from here on
        inbox.ingest(f"warm{i}", "chat", "1", {})
        assert inbox.finish_run(inbox.take_work("H", now=T), Result(), now=T)
    inbox.ingest("u", "chat", "1", {})
    if waiter == "finish":
        run = inbox.take_work("H", now=T)
        inbox.ingest("u", "chat", "2", {})                      # work left at its release
    with psycopg.connect(database_url, application_name="dump") as dump:
        dump.execute("BEGIN")
        dump.execute("LOCK TABLE wakes IN ACCESS SHARE MODE")
        compacting = Racers(lambda: compactor.compact_wakes(**FORCED,
                                                            lock_timeout_ms=30_000)).start()
        wait_for_lock_waiters(database_url, 1, application_name="compactor")
        if waiter == "take":
            waiting = Racers(lambda: inbox.take_work("H2", now=T)).start()
        else:
            waiting = Racers(lambda: inbox.finish_run(run, Result(), now=T)).start()
        wait_for_lock_waiters(database_url, 2, application_name="%")
        dump.rollback()
        [done] = compacting.join()
        [answer] = waiting.join()
    assert done.outcome == wakes_sql.COMPACTED
    if waiter == "take":
        assert answer is not None and answer.user == "u"
    else:
        assert answer is True
        again = inbox.take_work("H2", now=T)
        assert again is not None and [e.source_id for e in again.events] == ["2"]


def test_compaction_racing_ingest_takes_and_finishes_loses_no_event(database_url, make_inbox):
    """Four takers finishing runs, an ingester, and a compactor rewriting the
    table as often as it can get the lock, each on connections of its own:
    every event is handled exactly once and no user is left without a wake."""
    users, events_per_user = 40, 15
    stop = threading.Event()
    handled: list[tuple[str, str]] = []
    compactions: list[str] = []

    def ingester():
        feed = make_inbox()
        for n in range(events_per_user):
            feed.ingest_many([(f"u{i}", "chat", str(n), {}) for i in range(users)])

    def taker(k: int):
        inbox = make_inbox(lease_ttl=TTL)
        while not stop.is_set():
            for run in inbox.take_runs(f"H{k}", users=4):
                handled.extend((run.user, e.source_id) for e in run.events)
                assert inbox.finish_run(run, Result())

    def compacting():
        inbox = make_inbox()
        while not stop.is_set():
            compactions.append(inbox.compact_wakes(**FORCED, lock_timeout_ms=20).outcome)

    racers = Racers(*[lambda k=k: taker(k) for k in range(4)], compacting).start()
    Racers(ingester).start().join()
    with psycopg.connect(database_url, autocommit=True) as conn:
        wait_until_done(conn, users * events_per_user, racers)
    stop.set()
    racers.join()
    assert sorted(handled) == sorted((f"u{i}", str(n)) for i in range(users)
                                     for n in range(events_per_user))
    assert compactions.count(wakes_sql.COMPACTED) >= 5, compactions


def wait_until_done(conn, total: int, racers: Racers, timeout: float = 120.0) -> None:
    """Poll the events' state until `total` are done (bounded: a lost wake
    leaves some open for good, and the test fails naming how many); a racer
    that failed is reported at once."""
    deadline = time.monotonic() + timeout
    while True:
        if any(racers.errors):
            racers.join()
        done = conn.execute("SELECT count(*) FROM events WHERE status = 'done'").fetchone()[0]
        if done >= total:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{total - done} of {total} events were never handled")
        time.sleep(0.05)
