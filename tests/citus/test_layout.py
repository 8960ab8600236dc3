"""`migrate --citus`: refused, exit 2, where there is no Citus coordinator; on
one, every user-keyed table distributed by bucket, co-located, and the users
of a real ingest spread over both worker nodes."""

import psycopg

from agent_inbox.backend.citus import layout as citus
from agent_inbox import cli
from agent_inbox.schema import revision
from agent_inbox.dev import pgserver


def test_migrate_citus_on_plain_postgresql_is_refused(server_url, capsys):
    url = pgserver.create_database(server_url, prefix="agent_inbox_not_citus")
    try:
        assert cli.main(["migrate", "--citus", "--database-url", url]) == 2
        assert "no citus extension" in capsys.readouterr().err
    finally:
        pgserver.drop_database(url)


def test_migrate_citus_distributes_every_table(citus_cluster, capsys):
    url = citus_cluster.create_database()
    try:
        assert cli.main(["migrate", "--citus", "--database-url", url]) == 0
        assert "distributed by bucket" in capsys.readouterr().out
        assert cli.main(["migrate", "--citus", "--database-url", url]) == 0
        assert "(already)" in capsys.readouterr().out
        with psycopg.connect(url) as conn:
            layout = dict(conn.execute(
                "SELECT logicalrelid::text, column_to_column_name(logicalrelid, partkey)"
                "  FROM pg_dist_partition").fetchall())
            groups = conn.execute(
                "SELECT count(DISTINCT colocationid) FROM pg_dist_partition"
                " WHERE logicalrelid::text = ANY(%s)", (list(citus.USER_TABLES),)).fetchone()[0]
        assert layout == {**{t: "bucket" for t in citus.USER_TABLES}, "run_stats": "process",
                          **{t: None for t in citus.REFERENCE_TABLES}}
        assert groups == 1
    finally:
        citus_cluster.drop_database(url)


def test_users_are_spread_over_both_worker_nodes(inbox, database_url, citus_cluster):
    for n in range(200):
        inbox.ingest(f"user-{n}", "s", "k", {})
    with psycopg.connect(database_url) as conn:
        per_node = dict(conn.execute("""
            SELECT nodeport, sum(result::bigint) FROM run_command_on_shards(
                   'leases', 'SELECT count(*) FROM %s') r
              JOIN citus_shards s ON s.shardid = r.shardid
             GROUP BY nodeport""").fetchall())
    workers = {node.port for node in citus_cluster.workers}
    assert set(per_node) == workers, per_node
    assert sum(per_node.values()) == 200 and min(per_node.values()) >= 50, per_node


def test_a_database_laid_out_before_0006_gets_the_new_tables_distributed(citus_cluster):
    """A cluster migrated and distributed at 0005, then upgraded: `migrate
    --citus` lays out the tables 0006 and 0007 added (steps, memory, policies,
    permit decisions by bucket, co-located; default_policies a reference
    table), and then a run's durable step and memory work there."""
    from agent_inbox import Inbox, Result
    from agent_inbox.schema import migrate

    url = citus_cluster.create_database()
    try:
        migrate.upgrade(url, "0005")
        assert citus.distribute(url)
        migrate.upgrade(url)
        assert citus.distribute(url)  # the new tables
        assert not citus.distribute(url)  # nothing left to do
        with psycopg.connect(url) as conn:
            layout = dict(conn.execute(
                "SELECT logicalrelid::text, column_to_column_name(logicalrelid, partkey)"
                "  FROM pg_dist_partition").fetchall())
        assert {t: layout.get(t, "missing") for t in ("steps", "memory", "policies",
                                                      "permit_decisions", "default_policies")} == {
            "steps": "bucket", "memory": "bucket", "policies": "bucket",
            "permit_decisions": "bucket", "default_policies": None}
        with Inbox.connect(url, pool_size=1) as inbox:
            inbox.ingest("alice", "chat", "m1", {})
            run = inbox.take_work("A")
            assert inbox.context(run).step_sync("s", lambda: 1) == 1
            assert inbox.finish_run(run, Result(memory={"ok": True}))
            assert inbox.memory("alice") == {"ok": True}
    finally:
        citus_cluster.drop_database(url)


def _shard_answers(conn: psycopg.Connection, table: str, query: str) -> set[str]:
    """`query` (with %s for the shard) run on every shard of `table`: the
    distinct answers."""
    return {result for result, in conn.execute(
        "SELECT result FROM run_command_on_shards(%s, %s)", (table, query)).fetchall()}


def test_a_database_laid_out_at_0013_upgrades_to_hot_claims(citus_cluster, capsys):
    """Migration 0014 on a distributed database, as a user upgrading runs it
    (`migrate --citus` again): every shard of events gets `outcome`, generated
    from the rows already there (pending, running, done and dead), and the
    partial indexes on it; then this code's run path works on those rows: the
    run in flight across the upgrade finishes under its lease, the pending
    event is taken, and its failure (max_attempts 1) parks it dead."""
    from agent_inbox import Inbox, Result
    from agent_inbox.schema import migrate

    url = citus_cluster.create_database()
    try:
        migrate.upgrade(url, "0013")
        assert citus.distribute(url)
        with psycopg.connect(url) as conn:  # rows as the 0013 code left them
            for user, status, until in (("u-done", "done", 0), ("u-dead", "dead", 0),
                                        ("u-flight", "running", 2**40), ("u-open", "pending", 0)):
                conn.execute("INSERT INTO leases (bucket, user_id, holder, gen, until)"
                             " VALUES (agent_inbox_bucket(%s), %s, 'A', 1, %s)", (user, user, until))
                conn.execute("INSERT INTO events (bucket, user_id, source, source_id, payload, status,"
                             "                    attempts, claim_gen)"
                             " VALUES (agent_inbox_bucket(%s), %s, 'chat', 'm1', '{}', %s, %s, 1)",
                             (user, user, status, int(status != "pending")))
            conn.execute("INSERT INTO wakes (bucket, user_id, at)"
                         " VALUES (agent_inbox_bucket('u-open'), 'u-open', 0)")
        assert cli.main(["migrate", "--citus", "--database-url", url]) == 0
        assert f"database at revision {revision.HEAD}" in capsys.readouterr().out
        with psycopg.connect(url) as conn:
            outcomes = dict(conn.execute("SELECT user_id, outcome FROM events").fetchall())
            assert outcomes == {"u-done": "done", "u-dead": "dead", "u-flight": None, "u-open": None}
            predicates = _shard_answers(  # each shard's partial indexes, its number taken out
                conn, "events", "SELECT string_agg(d, '; ' ORDER BY d) FROM ("
                "  SELECT regexp_replace(pg_get_indexdef(indexrelid), '_[0-9]+ ', ' ', 'g') AS d"
                "    FROM pg_index WHERE indrelid = '%s'::regclass AND indpred IS NOT NULL) i")
        assert predicates == {
            "CREATE INDEX ix_events_dead ON public.events USING btree (id)"
            " WHERE (outcome = 'dead'::text); "
            "CREATE INDEX ix_events_open ON public.events USING btree (user_id, id)"
            " WHERE (outcome IS NULL)"}, predicates
        with psycopg.connect(url) as conn:  # 0015's fillfactor, on every shard
            fillfactors = _shard_answers(conn, "events", "SELECT array_to_string(reloptions, ',')"
                                         " FROM pg_class WHERE oid = '%s'::regclass")
        assert fillfactors == {"fillfactor=50"}, fillfactors
        with Inbox.connect(url, pool_size=1, max_attempts=1, retry_backoff=0) as inbox:
            [flight] = inbox.events("u-flight")
            assert inbox.finish("u-flight", "A", 1, [flight.id])
            run = inbox.take_work("B")
            assert run is not None and run.user == "u-open" and len(run.events) == 1
            assert inbox.finish_run(run, Result(error="poison"))
            assert inbox.take_work("B") is not None  # the exhausted event is parked at claim
            assert {u: [e.status for e in inbox.events(u)]
                    for u in ("u-done", "u-dead", "u-flight", "u-open")} == {
                "u-done": ["done"], "u-dead": ["dead"], "u-flight": ["done"], "u-open": ["dead"]}
    finally:
        citus_cluster.drop_database(url)
