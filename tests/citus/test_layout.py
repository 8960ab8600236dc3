"""`migrate --citus`: refused, exit 2, where there is no Citus coordinator; on
one, every user-keyed table distributed by bucket, co-located, and the users
of a real ingest spread over both worker nodes."""

import psycopg

from agent_inbox.backend.citus import layout as citus
from agent_inbox import cli
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
