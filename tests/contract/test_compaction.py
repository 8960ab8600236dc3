"""Compaction on every backend: through PgBouncer it rewrites the tables like
on one server (its locks and settings are all transaction-scoped); on Citus it
is not done (run_path.PerBucket.compact says why), and either way the run path
goes on with every lease and wake as it was."""

import psycopg

from agent_inbox import Result
from agent_inbox.store import compaction

T = 1_000_000


def leases(url: str) -> list[tuple]:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT user_id, holder, gen, until FROM leases"
                            " ORDER BY user_id").fetchall()


def test_compaction_keeps_every_lease_and_the_run_path_going(backend, make_inbox, direct_url):
    inbox = make_inbox(lease_ttl=30)
    inbox.ingest_many([(f"u{i}", "chat", "1", {}) for i in range(5)])
    run = inbox.take_work("H", now=T)
    before = leases(direct_url)

    looks = inbox.compact(min_dead=0, ratio=0, held_for=None)

    if backend == "citus":
        assert looks is None
    else:
        assert [(look.table, look.outcome) for look in looks] == [
            (table, compaction.COMPACTED) for table in compaction.TABLES]
    assert leases(direct_url) == before
    assert inbox.finish_run(run, Result(), now=T)
    taken = list(iter(lambda: inbox.take_work("H2", now=T), None))
    assert sorted(r.user for r in taken) == sorted({f"u{i}" for i in range(5)} - {run.user})
