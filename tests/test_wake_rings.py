"""The ring of `wakes` partitions (store/wake_rings.py): a rotation needs no
lock a pg_dump holds, takes read the live rings only, a retired ring is
truncated once nothing holds it and used again, and no wake is lost: not to
a rotation that failed half-way, nor to an insert whose snapshot is older
than the rotation.

A pg_dump is played as it behaves: a REPEATABLE READ transaction holding
ACCESS SHARE on every table of the schema (partitions included) and a
snapshot, for as long as it runs."""

import re

import psycopg
import pytest

from agent_inbox import Result
from agent_inbox.store import compaction, inbox as inbox_store, wake_rings
from tests.races import Racers
from tests.test_compaction import dump_session

T = 1_000_000
TTL = 30
FORCED = {"min_dead": 0, "ratio": 0, "held_for": None}  # whatever the dead tuples and horizon


def rotate(inbox, **options) -> compaction.Compaction:
    """One compactor look at wakes (a rotation, forced, and the retiring before it)."""
    with inbox.pool.connection() as conn:
        return compaction.compact(conn, "wakes", **{**FORCED, **options})


def rings(url: str) -> tuple[list[int], dict[int, bool]]:
    """The live rings, and every partition's ring: whether it is clean."""
    with psycopg.connect(url) as conn:
        return wake_rings.live(conn), wake_rings.partitions(conn)


def handle_all(inbox, now: int = T) -> list[tuple[str, str]]:
    """Take and finish every run there is now; the (user, source_id) handled."""
    handled = []
    while (run := inbox.take_work("H", now=now)) is not None:
        handled += [(run.user, e.source_id) for e in run.events]
        assert inbox.finish_run(run, Result(), now=now)
    return handled


def test_under_a_dump_the_wakes_move_and_takes_read_the_new_ring_only(database_url, make_inbox):
    """The take names the live rings (wake_rings.GIVEN): the others are
    pruned before its plan runs (here, planned for the parameters, before
    it is planned)."""
    inbox = make_inbox(lease_ttl=TTL)
    for r in range(5):                                  # dead wakes in ring 0
        inbox.ingest_many([(f"u{i}", "chat", f"old{r}", {}) for i in range(20)])
        handle_all(inbox)
    inbox.ingest_many([(f"u{i}", "chat", "open", {}) for i in range(20)])
    with dump_session(database_url):
        done = rotate(inbox, lock_timeout_ms=200)
        assert done.outcome == compaction.COMPACTED and done.kept == 20
        assert rings(database_url)[0] == [1]
        with inbox.pool.connection() as conn, conn.transaction():
            plan = "\n".join(line for line, in conn.execute(
                "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) " + inbox_store.TAKE_WORK,
                {"holder": "X", "ttl": TTL, "now": T, "users": 4,
                 **inbox.settings.claim.params(), **wake_rings.Given().params(conn)}).fetchall())
            raise psycopg.Rollback()  # the take explained is not kept
        scans = [line.strip() for line in plan.splitlines()
                 if re.search(r"Scan .*on wakes_\d", line)]
        assert scans and all("wakes_1" in line for line in scans), plan   # pruned when planned

        assert rotate(inbox, lock_timeout_ms=200).outcome == compaction.COMPACTED
        assert rings(database_url) == ([2], {0: False, 1: False, 2: False})  # held: not truncated
    assert rotate(inbox, min_dead=10**9).outcome == compaction.FEW_DEAD   # retires all the same
    assert rings(database_url) == ([2], {0: True, 1: True, 2: False})
    assert sorted(handle_all(inbox)) == sorted((f"u{i}", "open") for i in range(20))


def test_rings_made_during_a_dump_are_truncated_and_used_again(database_url, make_inbox):
    """The dump holds the partitions that were there when it began: those it
    holds dirty stay so until it ends; the ones made since are truncated and
    used again, so a long dump does not make a partition per rotation."""
    inbox = make_inbox(lease_ttl=TTL)
    inbox.ingest("u", "chat", "0", {})
    with dump_session(database_url):
        seen = []
        for n in range(1, 9):
            inbox.ingest("u", "chat", str(n), {})       # a wake in every ring
            assert rotate(inbox, lock_timeout_ms=100).outcome == compaction.COMPACTED
            seen.append(rings(database_url)[0][0])
        live, partitions = rings(database_url)
        assert seen[:4] == [1, 2, 3, 4]                 # 1 and 2 were clean; 3 and 4 made
        assert set(seen[4:]) <= {3, 4}                  # then 3 and 4 by turns
        assert sorted(partitions) == [0, 1, 2, 3, 4]
    assert [e for _, e in handle_all(inbox)] == [str(n) for n in range(9)]


def test_a_rotation_that_failed_after_moving_the_insert_ring_loses_no_wake(
        database_url, make_inbox):
    """Killed between setting the insert ring and naming it in `wakes_ring`:
    new wakes go to the new ring, the old ones stay where they were, both
    rings are read, and the next rotation moves both."""
    inbox = make_inbox(lease_ttl=TTL)
    inbox.ingest_many([(f"old{i}", "chat", "1", {}) for i in range(5)])
    with inbox.pool.connection() as conn, pytest.raises(RuntimeError):
        with conn.transaction():
            conn.execute("SELECT set_config('lock_timeout', '1s', true)")
            wake_rings.rotate(conn)
            raise RuntimeError("the compactor's connection is cut before its commit")
    assert rings(database_url)[0] == [0, 1]             # wakes_ring: 0; wakes_insert_ring: 1
    inbox.ingest_many([(f"new{i}", "chat", "1", {}) for i in range(5)])
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT ring, count(*) FROM wakes GROUP BY 1 ORDER BY 1").fetchall() \
            == [(0, 5), (1, 5)]
    first = inbox.runs.take_runs("H", users=3, now=T)
    assert sorted(run.user for run in first) == ["old0", "old1", "old2"]   # oldest first
    assert all(inbox.finish_run(run, Result(), now=T) for run in first)

    assert rotate(inbox).outcome == compaction.COMPACTED
    assert rings(database_url)[0] == [2]
    assert sorted(user for user, _ in handle_all(inbox)) == \
        ["new0", "new1", "new2", "new3", "new4", "old3", "old4"]


def test_an_insert_whose_snapshot_is_older_than_the_rotation_goes_to_the_new_ring(
        database_url, make_inbox):
    """A REPEATABLE READ transaction's snapshot may predate a rotation it never
    waited for: its events' wakes still go where takes look (the insert ring
    is a sequence, read outside any snapshot), and the user is taken."""
    inbox = make_inbox(lease_ttl=TTL)
    inbox.ingest("warm", "chat", "1", {})
    with psycopg.connect(database_url) as app:
        app.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        app.execute("SELECT count(*) FROM events").fetchone()        # its snapshot, now
        assert rotate(inbox).outcome == compaction.COMPACTED
        app.execute("INSERT INTO events (user_id, source, source_id, payload)"
                    " VALUES ('late', 'chat', '1', '{}')")
        app.commit()
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT user_id, ring FROM wakes ORDER BY 1").fetchall() == [
            ("late", 1), ("warm", 1)]
    assert sorted(user for user, _ in handle_all(inbox)) == ["late", "warm"]


def test_a_spare_beyond_the_few_kept_is_dropped(database_url, make_inbox):
    inbox = make_inbox(lease_ttl=TTL)
    with psycopg.connect(database_url, autocommit=True) as conn:
        for ring in (3, 4, 5):
            conn.execute(f"CREATE TABLE wakes_{ring} PARTITION OF wakes FOR VALUES IN ({ring})")
    rotate(inbox, min_dead=10**9)
    live, partitions = rings(database_url)
    assert live == [0] and sorted(partitions) == [0, 1, 2]          # SPARE clean ones kept


def test_a_rotation_gives_the_planner_the_new_rings_statistics(database_url, make_inbox):
    """After a rotation the partition new wakes go to is analyzed (without it the
    take's plans over a partition the planner knew as empty cost W5 a tenth of
    its runs/s)."""
    inbox = make_inbox(lease_ttl=TTL)
    inbox.ingest_many([(f"u{i}", "chat", "1", {}) for i in range(30)])
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT reltuples FROM pg_class WHERE relname = 'wakes_1'"
                            ).fetchone()[0] < 0                     # never analyzed
    assert rotate(inbox).kept == 30
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT reltuples FROM pg_class WHERE relname = 'wakes_1'"
                            ).fetchone()[0] == 30


def test_the_new_rings_statistics_commit_with_the_rotation(database_url, make_inbox):
    """The partition the wakes move to is analyzed in the rotation's own
    transaction: a statement that waited for the rotation's lock plans, as it
    gets it, with the partition's rows counted, not over a partition known as
    empty (a sequential scan of every wake for each user it looks at)."""
    inbox = make_inbox(lease_ttl=TTL)
    inbox.ingest_many([(f"u{i}", "chat", "1", {}) for i in range(3000)])
    with psycopg.connect(database_url) as conn:
        with conn.transaction():
            assert wake_rings.rotate(conn) == 3000                  # no analyze() after it
        assert conn.execute("SELECT reltuples FROM pg_class WHERE relname = 'wakes_1'"
                            ).fetchone()[0] == 3000
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute("PREPARE low_water (text) AS SELECT min(from_id) FROM wakes"
                     f" WHERE user_id = $1 AND ring IN ({wake_rings.LIVE})")
        plan = "\n".join(row for row, in conn.execute("EXPLAIN EXECUTE low_water('u7')"))
    assert "Index" in plan and "Seq Scan on wakes_1" not in plan, plan


def test_retiring_a_ring_a_dump_holds_never_waits_in_front_of_the_run_path(
        database_url, make_inbox):
    """Every statement of the run path locks every partition of `wakes`, so a
    TRUNCATE waiting for a partition a dump holds would hold up every take
    and finish queued behind it: the retiring asks without waiting, again and
    again, and, the holder being old, no request of it ever waits in pg_locks."""
    inbox = make_inbox(lease_ttl=TTL)
    inbox.ingest("u", "chat", "1", {})
    handle_all(inbox)                                   # ring 0 holds a dead wake
    assert rotate(inbox).outcome == compaction.COMPACTED
    with dump_session(database_url) as dump, \
            psycopg.connect(database_url, autocommit=True) as watch:
        while watch.execute("SELECT clock_timestamp() - xact_start < interval '0.2 s'"
                            " FROM pg_stat_activity WHERE pid = %s",
                            (dump.info.backend_pid,)).fetchone()[0]:
            pass                                        # until the dump is 0.2 s old
        waits, looks = _watch_waits(inbox, watch, budget_s=0.5, held_long_s=0.2)
        assert looks > 10 and waits == set()
        assert rings(database_url)[1][0] is False       # held: still dirty
    rotate(inbox, min_dead=10**9)
    assert rings(database_url)[1][0] is True            # the dump ended: truncated


def test_retiring_a_ring_someone_holds_sends_no_lock_request_to_be_refused(
        database_url, make_inbox):
    """A refused NOWAIT request is an ERROR in the server's log: while
    another session holds the ring, the retiring looks at pg_locks again and
    again and sends no request at all; once it is free, one is sent and had."""
    inbox = make_inbox(lease_ttl=TTL)
    inbox.ingest("u", "chat", "1", {})
    handle_all(inbox)
    assert rotate(inbox).outcome == compaction.COMPACTED
    with psycopg.connect(database_url) as holder:
        holder.execute("LOCK TABLE wakes_0 IN ACCESS SHARE MODE")
        with inbox.pool.connection() as conn:
            sent = _Statements(conn)
            _retire(sent, budget_s=0.2, held_long_s=0)  # the holder counts as long
        assert sent.requests("wakes_0") == [] and sent.looks("LOCKED_BY_OTHERS") > 2
        assert rings(database_url)[1][0] is False
    with inbox.pool.connection() as conn:
        sent = _Statements(conn)
        _retire(sent, budget_s=0.2, held_long_s=0)
    assert sent.requests("wakes_0") == ["LOCK TABLE wakes_0 IN ACCESS EXCLUSIVE MODE NOWAIT"]
    assert rings(database_url)[1][0] is True


class _Statements:
    """A connection that keeps the text of what is sent through it."""

    def __init__(self, conn):
        self.conn, self.sent = conn, []

    def execute(self, query, params=None):
        self.sent.append(query)
        return self.conn.execute(query, params)

    def transaction(self):
        return self.conn.transaction()

    def looks(self, name: str) -> int:
        return sum(query == getattr(wake_rings, name) for query in self.sent)

    def requests(self, table: str) -> list[str]:
        return [q for q in self.sent if isinstance(q, str) and q.startswith(f"LOCK TABLE {table} ")]


def test_retiring_a_ring_the_run_path_holds_waits_for_it(database_url, make_inbox):
    """A busy fleet always holds some partition locks, each for a short
    transaction: once asking without waiting has failed, the retiring waits
    for a young holder (at most `lock_timeout`) and the ring is truncated."""
    inbox = make_inbox(lease_ttl=TTL)
    inbox.ingest("u", "chat", "1", {})
    handle_all(inbox)
    assert rotate(inbox).outcome == compaction.COMPACTED
    with psycopg.connect(database_url) as taker, \
            psycopg.connect(database_url, autocommit=True) as watch:
        taker.execute("SELECT count(*) FROM wakes")     # a transaction reading every ring
        with inbox.pool.connection() as conn:
            retiring = Racers(lambda: _retire(conn, budget_s=0.05, held_long_s=60)).start()
            while not watch.execute("SELECT EXISTS (SELECT 1 FROM pg_locks WHERE NOT granted"
                                    " AND relation = 'wakes_0'::regclass)").fetchone()[0]:
                assert any(thread.is_alive() for thread in retiring.threads), retiring.join()
            taker.commit()                              # the holder's transaction ends
            retiring.join()
    assert rings(database_url)[1][0] is True


def _watch_waits(inbox, watch, **retiring) -> tuple[set, int]:
    """Retire (in a thread) while watching pg_locks for requests waiting on a
    partition of wakes: those seen, and how many looks."""
    with inbox.pool.connection() as conn:
        racer = Racers(lambda: _retire(conn, **retiring)).start()
        waits, looks = set(), 0
        while any(thread.is_alive() for thread in racer.threads):
            looks += 1
            waits |= {row for row in watch.execute(
                "SELECT relation::regclass::text, mode FROM pg_locks"
                " WHERE NOT granted AND relation::regclass::text LIKE 'wakes%'")}
        racer.join()
    return waits, looks


def _retire(conn, **retiring) -> None:
    with conn.transaction():
        conn.execute("SELECT set_config('lock_timeout', '5s', true)")
        wake_rings.retire(conn, **retiring)


def test_a_take_that_names_not_every_live_ring_takes_nothing_and_its_caller_reads_them_again(
        database_url, make_inbox):
    """The rings a take names are its caller's last read. A rotation cut
    after moving the insert ring since then leaves a live ring the take does
    not name: its guard fails in its snapshot, so it takes nothing and writes
    nothing, though the ring it names holds due wakes (a low-water mark read
    without the other ring's wakes could skip the events they name);
    take_work then reads the rings again and takes every user."""
    inbox = make_inbox(lease_ttl=TTL)
    inbox.ingest_many([(f"old{i}", "chat", "1", {}) for i in range(3)])
    given = wake_rings.Given()
    with inbox.pool.connection() as conn:
        assert given.params(conn) == {"ring_a": 0, "ring_b": 0}
        with pytest.raises(RuntimeError), conn.transaction():
            wake_rings.rotate(conn)
            raise RuntimeError("cut before its commit")
    inbox.ingest("new", "chat", "1", {})                             # in ring 1
    with psycopg.connect(database_url) as conn:
        before = conn.execute("SELECT user_id, holder, gen FROM leases ORDER BY 1").fetchall()
        rows = conn.execute(inbox_store.TAKE_WORK, {
            "holder": "X", "ttl": TTL, "now": T, "users": 4, **inbox.settings.claim.params(),
            **given.params(conn)}).fetchall()
        assert rows == []
        assert conn.execute("SELECT user_id, holder, gen FROM leases ORDER BY 1").fetchall() \
            == before
        assert conn.execute("SELECT ring, count(*) FROM wakes GROUP BY 1 ORDER BY 1"
                            ).fetchall() == [(0, 3), (1, 1)]
        conn.rollback()
        taken = inbox_store.take_work(conn, "X", TTL, inbox.settings.claim, T, given, users=4)
        conn.commit()
        assert given.params(conn) == {"ring_a": 0, "ring_b": 1}
    assert sorted(user for user, *_ in taken) == ["new", "old0", "old1", "old2"]


def test_a_take_naming_a_ring_a_rotation_retired_reads_the_rings_again(database_url,
                                                                        make_inbox):
    inbox = make_inbox(lease_ttl=TTL)
    inbox.ingest_many([(f"u{i}", "chat", "1", {}) for i in range(3)])
    given = wake_rings.Given()
    with psycopg.connect(database_url) as conn:
        assert given.params(conn) == {"ring_a": 0, "ring_b": 0}
        assert rotate(inbox).outcome == compaction.COMPACTED       # the wakes move to ring 1
        taken = inbox_store.take_work(conn, "X", TTL, inbox.settings.claim, T, given, users=3)
        conn.commit()
        assert given.params(conn) == {"ring_a": 1, "ring_b": 1}
    assert sorted(user for user, *_ in taken) == ["u0", "u1", "u2"]


def test_a_take_names_both_rings_of_a_rotation_cut_half_way(database_url, make_inbox):
    inbox = make_inbox(lease_ttl=TTL)
    inbox.ingest("old", "chat", "1", {})
    with inbox.pool.connection() as conn, pytest.raises(RuntimeError):
        with conn.transaction():
            wake_rings.rotate(conn)
            raise RuntimeError("cut before its commit")
    inbox.ingest("new", "chat", "1", {})
    with psycopg.connect(database_url) as conn:
        assert wake_rings.Given().params(conn) == {"ring_a": 0, "ring_b": 1}
    assert sorted(run.user for run in inbox.runs.take_runs("H", users=5, now=T)) == ["new", "old"]
