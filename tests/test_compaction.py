"""Compaction (store/compaction.py) keeps every live wake and lease as it was
and drops the dead row versions a held horizon leaves behind (wakes by moving
to a clean ring: store/wake_rings.py, tests/test_wake_rings.py); it never
waits for anyone, and a statement that waited for it sees the rewritten table.

The interleavings are held in place by table locks (another session's ACCESS
SHARE, as pg_dump takes, or an uncommitted ingest's ROW EXCLUSIVE) and waited
for through pg_stat_activity (tests/races.py)."""

import contextlib
import threading
import time

import psycopg
import pytest

from agent_inbox import Result, metrics
from agent_inbox.store import compaction, wake_rings
from agent_inbox.services.worker.compactor import Compactor
from tests.races import Racers, wait_for_lock_waiters

T = 1_000_000
TTL = 30
FORCED = {"min_dead": 0, "ratio": 0, "held_for": None}  # whatever the dead tuples and horizon


COLUMNS = {"wakes": "user_id, id, at, from_id", "leases": "*"}  # a wake's ring is where it is


def rows(url: str, table: str) -> list[tuple]:
    with psycopg.connect(url) as conn:
        return conn.execute(f"SELECT {COLUMNS[table]} FROM {table} ORDER BY 1, 2").fetchall()


def ring_partition(url: str) -> str:
    """The partition of the ring the last rotation moved the wakes to."""
    with psycopg.connect(url) as conn:
        return f"wakes_{conn.execute('SELECT ring FROM wakes_ring').fetchone()[0]}"


def sizes(url: str, table: str, index: str) -> tuple[int, int, int]:
    """Bytes of the table, of its index, and the table's file node."""
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT pg_relation_size(%s), pg_relation_size(%s),"
                            " pg_relation_filenode(%s)", (table, index, table)).fetchone()


def compacted(inbox, **options) -> dict[str, compaction.Compaction]:
    return {look.table: look for look in inbox.compact(**{**FORCED, **options})}


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


def test_compaction_keeps_every_live_row_and_drops_what_a_held_horizon_keeps(
        database_url, make_inbox):
    inbox = make_inbox(lease_ttl=TTL)
    with held_horizon(database_url):
        churn(inbox, users=50, rounds=20)               # 1,000 runs' wakes and lease versions
        inbox.ingest_many([(f"u{i}", "chat", "open", {}) for i in range(10)])  # due now
        held = [inbox.take_work("H2", now=T) for _ in range(3)]  # their wake: the lease end
        assert all(run is not None for run in held)
        stalled = inbox.take_work("H2", now=T)          # taken over below: its finish refused
        wakes_before, leases_before = rows(database_url, "wakes"), rows(database_url, "leases")
        assert len(wakes_before) == 10 and len(leases_before) == 50
        indexes = (("wakes_0", "wakes_0_at_id_idx"), ("leases", "pk_leases"))
        before = {t: sizes(database_url, t, i) for t, i in indexes}
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("VACUUM wakes, leases")        # the hold: nothing removed
        assert all(sizes(database_url, t, i)[:2] == before[t][:2] for t, i in indexes)

        done = compacted(inbox)

        assert done["wakes"].outcome == compaction.COMPACTED and done["wakes"].kept == 10
        assert done["leases"].outcome == compaction.COMPACTED and done["leases"].kept == 50
        # every wake's user, time and id; every lease's holder, generation and expiry
        assert rows(database_url, "wakes") == wakes_before
        assert rows(database_url, "leases") == leases_before
        ring = ring_partition(database_url)
        for (table, index), now in zip(indexes, ((ring, f"{ring}_at_id_idx"),
                                                 ("leases", "pk_leases"))):
            table_size, index_size, node = sizes(database_url, *now)
            assert node != before[table][2]                  # other files
            assert table_size < before[table][0] / 4 and index_size <= before[table][1]
    # the fences hold as before: the stalled run, taken over, is refused
    takeover = inbox.take_work("H4", now=T + TTL + 1)
    assert takeover is not None and takeover.user == stalled.user
    assert not inbox.finish_run(stalled, Result(), now=T + TTL + 1)
    assert inbox.finish_run(takeover, Result(), now=T + TTL + 1)
    # every open event is still taken: the 6 left at once, the 3 held at their lease end
    taken = list(iter(lambda: inbox.take_work("H3", now=T + TTL + 1), None))
    assert sorted(run.user for run in taken) == sorted(
        {f"u{i}" for i in range(10)} - {stalled.user})
    assert all(inbox.finish_run(run, Result(), now=T + TTL + 1) for run in taken)


def test_a_session_holding_the_table_makes_compaction_give_up_and_change_nothing(
        database_url, make_inbox):
    """pg_dump holds ACCESS SHARE on every table it dumps for as long as it runs:
    compaction of leases asks for its lock briefly, gives up, and the takes go
    on; the wakes move to another ring all the same."""
    inbox = make_inbox(lease_ttl=TTL, application_name="taker")
    churn(inbox, users=5, rounds=2)
    inbox.ingest("u0", "chat", "open", {})
    before = {t: (rows(database_url, t), sizes(database_url, t, t)[2])
              for t in compaction.TABLES}
    with psycopg.connect(database_url, application_name="dump") as dump:
        dump.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        dump.execute("LOCK TABLE wakes, leases IN ACCESS SHARE MODE")

        done = compacted(inbox, lock_timeout_ms=200)

        assert {t: look.outcome for t, look in done.items()} == {
            "wakes": compaction.COMPACTED, "leases": compaction.NOT_GRANTED}
        assert {t: (rows(database_url, t), sizes(database_url, t, t)[2])
                for t in compaction.TABLES} == before
        assert ring_partition(database_url) == "wakes_1"
        run = inbox.take_work("H", now=T)                         # not queued behind it
        assert run is not None and run.user == "u0"


def test_with_held_for_compaction_waits_for_a_held_horizon(
        database_url, make_inbox):
    """With `held_for`, dead tuples alone are left to VACUUM: a transaction
    of this database holding the horizon (older than `held_for`: 0 here,
    any) is what calls for compaction."""
    inbox = make_inbox(lease_ttl=TTL)
    churn(inbox, users=5, rounds=2)
    assert {t: look.outcome for t, look in compacted(inbox, held_for=0).items()} == {
        t: compaction.NOT_HELD for t in compaction.TABLES}
    with held_horizon(database_url):
        assert {t: look.outcome for t, look in compacted(inbox, held_for=0).items()} == {
            t: compaction.COMPACTED for t in compaction.TABLES}


def test_a_wake_inserted_but_not_committed_holds_compaction_off_and_is_kept(
        database_url, make_inbox):
    inbox = make_inbox(lease_ttl=TTL)
    churn(inbox, users=5, rounds=2)
    with psycopg.connect(database_url) as ingest:
        ingest.execute("INSERT INTO events (user_id, source, source_id, payload)"
                       " VALUES ('late', 'chat', '1', '{}')")   # its trigger inserts a wake
        assert compacted(inbox, lock_timeout_ms=200)["wakes"].outcome == compaction.NOT_GRANTED
        ingest.commit()
    done = compacted(inbox)["wakes"]
    assert done.outcome == compaction.COMPACTED and done.kept == 1
    run = inbox.take_work("H", now=T)
    assert run is not None and run.user == "late"


@pytest.mark.parametrize("table, waiter", [(table, waiter) for table in compaction.TABLES
                                            for waiter in ("take", "finish")]
                         + [("wakes", "ingest")])
def test_a_statement_that_waited_for_compaction_sees_the_rewritten_table(
        database_url, make_inbox, waiter, table):
    """TRUNCATE is not MVCC-safe, and a rotation moves the wakes: a statement
    whose snapshot were older than the compaction's commit would see the table
    empty, or the wakes where they were. The take (or the finish with release)
    queued behind compaction's lock must see every row copied back or moved:
    the user's wake and free lease (taken), or its run's lease (the finish
    accepted) and next wake. Its statements are prepared (psycopg prepares
    after five uses): a cached plan's locks are taken before its snapshot too.
    An ingest queued behind a rotation inserts its wake in the new ring
    (tests/test_wake_rings.py: one whose snapshot is older, too). An
    uncommitted writer of the table (ROW EXCLUSIVE) holds compaction off
    meanwhile."""
    inbox = make_inbox(lease_ttl=TTL, application_name="waiter")
    compactor = make_inbox(application_name="compactor")
    for i in range(6):                                          # prepared from here on
        inbox.ingest(f"warm{i}", "chat", "1", {})
        assert inbox.finish_run(inbox.take_work("H", now=T), Result(), now=T)
    if waiter != "ingest":
        inbox.ingest("u", "chat", "1", {})
    if waiter == "finish":
        run = inbox.take_work("H", now=T)
        inbox.ingest("u", "chat", "2", {})                      # work left at its release
    with psycopg.connect(database_url, application_name="writer") as writer:
        writer.execute("BEGIN")
        writer.execute(f"LOCK TABLE {table} IN ROW EXCLUSIVE MODE")
        compacting = Racers(lambda: compacted(compactor, lock_timeout_ms=30_000)).start()
        wait_for_lock_waiters(database_url, 1, application_name="compactor")
        if waiter == "take":
            waiting = Racers(lambda: inbox.take_work("H2", now=T)).start()
        elif waiter == "finish":
            waiting = Racers(lambda: inbox.finish_run(run, Result(), now=T)).start()
        else:
            waiting = Racers(lambda: inbox.ingest("u", "chat", "1", {})).start()
        wait_for_lock_waiters(database_url, 2, application_name="%")
        writer.rollback()
        [done] = compacting.join()
        [answer] = waiting.join()
    assert done[table].outcome == compaction.COMPACTED
    if waiter == "take":
        assert answer is not None and answer.user == "u"
    elif waiter == "finish":
        assert answer is True
        again = inbox.take_work("H2", now=T)
        assert again is not None and [e.source_id for e in again.events] == ["2"]
    else:
        assert answer is True
        with psycopg.connect(database_url) as conn:
            assert conn.execute("SELECT ring = (SELECT ring FROM wakes_ring) FROM wakes"
                                " WHERE user_id = 'u'").fetchall() == [(True,)]
        again = inbox.take_work("H2", now=T)
        assert again is not None and again.user == "u"


def test_a_run_holding_its_lease_row_holds_compaction_off(database_url, make_inbox):
    """A run-path transaction locks its lease rows to its end: compaction
    cannot rewrite them under it, and the run's fence is intact after."""
    inbox = make_inbox(lease_ttl=TTL)
    inbox.ingest("u", "chat", "1", {})
    run = inbox.take_work("H", now=T)
    with psycopg.connect(database_url) as finishing:
        finishing.execute("SELECT * FROM leases WHERE user_id = 'u' FOR UPDATE")
        assert compacted(inbox, lock_timeout_ms=200)["leases"].outcome == compaction.NOT_GRANTED
    assert compacted(inbox)["leases"].outcome == compaction.COMPACTED
    assert inbox.finish_run(run, Result(), now=T)


def test_only_the_tables_it_knows_are_compacted(database_url):
    with psycopg.connect(database_url) as conn, pytest.raises(ValueError, match="not 'events'"):
        compaction.compact(conn, "events")


@pytest.mark.parametrize("dumping", [False, True], ids=["", "during a pg_dump"])
def test_compaction_racing_ingest_takes_and_finishes_loses_no_event(
        database_url, make_inbox, dumping):
    """Four takers finishing runs, an ingester, and a compactor rewriting both
    tables as often as it can get their locks, each on connections of its own:
    every event is handled exactly once (no fence lost to a rewritten lease)
    and no user is left without a wake. During a pg_dump (ACCESS SHARE on
    every table, held throughout) leases are never rewritten, the wakes still
    move from ring to ring, and rings made during the dump are used again."""
    users, rounds = 40, [0]  # rounds of one event per user: 15, more until 10 rotations
    stop = threading.Event()
    handled: list[tuple[str, str]] = []
    compactions: list[tuple[str, str]] = []

    def ingester():
        feed = make_inbox()
        while rounds[0] < 15 or (compactions.count(("wakes", compaction.COMPACTED)) < 10
                                 and rounds[0] < 500):
            feed.ingest_many([(f"u{i}", "chat", str(rounds[0]), {}) for i in range(users)])
            rounds[0] += 1

    def taker(k: int):
        inbox = make_inbox(lease_ttl=TTL)
        while not stop.is_set():
            for run in inbox.runs.take_runs(f"H{k}", users=4):
                handled.extend((run.user, e.source_id) for e in run.events)
                assert inbox.finish_run(run, Result())

    def compacting():
        inbox = make_inbox()
        while not stop.is_set():
            compactions.extend((look.table, look.outcome)
                               for look in inbox.compact(**FORCED, lock_timeout_ms=20))

    with contextlib.ExitStack() as held:
        if dumping:
            held.enter_context(dump_session(database_url))
        racers = Racers(*[lambda k=k: taker(k) for k in range(4)], compacting).start()
        Racers(ingester).start().join()
        with psycopg.connect(database_url, autocommit=True) as conn:
            wait_until_done(conn, users * rounds[0], racers)
        stop.set()
        racers.join()
        with psycopg.connect(database_url) as conn:
            partitions = wake_rings.partitions(conn)
    assert sorted(handled) == sorted((f"u{i}", str(n)) for i in range(users)
                                     for n in range(rounds[0]))
    assert compactions.count(("wakes", compaction.COMPACTED)) >= 10, compactions
    if dumping:
        assert ("leases", compaction.COMPACTED) not in compactions
        assert len(partitions) <= 6, partitions      # 3 held, and a few used by turns
    else:
        assert compactions.count(("leases", compaction.COMPACTED)) >= 10, compactions


def dump_session(url: str) -> psycopg.Connection:
    """A session holding what a pg_dump holds while it runs: a REPEATABLE READ
    snapshot and ACCESS SHARE on every table of the schema."""
    conn = psycopg.connect(url, application_name="pg_dump")
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    tables = [name for name, in conn.execute(
        "SELECT format('%I', tablename) FROM pg_tables WHERE schemaname = 'public'")]
    conn.execute(f"LOCK TABLE {', '.join(tables)} IN ACCESS SHARE MODE")
    return conn


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


def test_the_workers_compactor_counts_what_it_did(make_inbox):
    """The thread every worker runs (worker/compactor.py): a look compacts
    both tables when told to and counts it in the metric."""
    inbox = make_inbox()
    churn(inbox, users=5, rounds=2)
    counted = {t: metrics.COMPACTIONS.labels(t, "compacted")._value.get()
               for t in compaction.TABLES}
    looks = Compactor(inbox, threading.Event(), **FORCED).look()
    assert [(look.table, look.outcome) for look in looks] == [
        (t, compaction.COMPACTED) for t in compaction.TABLES]
    assert all(metrics.COMPACTIONS.labels(t, "compacted")._value.get() == counted[t] + 1
               for t in compaction.TABLES)


def test_a_table_refused_its_lock_for_long_is_reported_with_who_holds_it(
        database_url, make_inbox, caplog):
    """A pg_dump holds ACCESS SHARE on every table until it ends: the compactor
    says for how long each rewrite has been refused (the gauge), warns once
    past `warn_after` naming the session holding the lock, not again within
    `repeat`, and says when it is no longer refused."""
    inbox = make_inbox(application_name="compactor")
    churn(inbox, users=5, rounds=2)
    seconds = [1000.0]
    compactor = Compactor(inbox, threading.Event(), warn_after=60, repeat=600,
                          clock=lambda: seconds[0], lock_timeout_ms=100, **FORCED)
    refused = metrics.COMPACTION_REFUSED_SECONDS
    caplog.set_level("INFO", logger="agent_inbox.worker")
    with psycopg.connect(database_url, application_name="nightly-dump") as dump:
        dump.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        dump.execute("LOCK TABLE leases IN ACCESS SHARE MODE")
        dump_pid = dump.info.backend_pid

        looks = {look.table: look.outcome for look in compactor.look()}
        assert looks == {"wakes": compaction.COMPACTED, "leases": compaction.NOT_GRANTED}
        assert refused.labels("leases")._value.get() == 0       # refused just now
        assert not [r for r in caplog.records if r.levelname == "WARNING"]

        seconds[0] += 59
        compactor.look()
        assert refused.labels("leases")._value.get() == 59
        assert not [r for r in caplog.records if r.levelname == "WARNING"]

        seconds[0] += 1
        compactor.look()
        [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert warning.startswith("compaction of leases has been refused its table lock for 60 s")
        assert f"pid {dump_pid}" in warning and "'nightly-dump'" in warning
        assert "holds AccessShareLock" in warning

        seconds[0] += 300
        compactor.look()                                        # within `repeat`: once
        assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
        assert refused.labels("leases")._value.get() == 360
    seconds[0] += 1
    assert {look.table: look.outcome for look in compactor.look()}["leases"] == \
        compaction.COMPACTED
    assert refused.labels("leases")._value.get() == 0
    assert any(r.getMessage() == "compaction of leases is no longer refused its lock "
               f"({compaction.COMPACTED}) after 361 s" for r in caplog.records)
