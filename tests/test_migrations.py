"""Migrations: from empty to head, down to base and up again, no drift from
schema.py, offline SQL, concurrent migrate processes, and the head check."""

import re
import subprocess
import sys

import psycopg
import pytest

from agent_inbox import errors
from agent_inbox.schema import migrate, revision
from agent_inbox.store import keys

TABLES = {"events", "leases", "timers", "outbox", "operator_actions", "deliveries", "wakes",
          "run_stats", "steps",
          "memory", "policies", "default_policies", "permit_decisions", "limits",
          "console_sessions", "wakes_ring", "fleet_pause"}
RINGS = {"wakes_0", "wakes_1", "wakes_2"}  # the partitions of wakes (migration 0011)


def _tables(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'").fetchall()
    return {r[0] for r in rows} - {"alembic_version"}


def test_upgrade_from_empty_creates_every_table(empty_database_url):
    migrate.upgrade(empty_database_url)
    assert _tables(empty_database_url) == TABLES | RINGS
    assert revision.current_revision(empty_database_url) == revision.HEAD


def test_downgrade_to_base_and_upgrade_again(empty_database_url):
    migrate.upgrade(empty_database_url)
    migrate.downgrade(empty_database_url, "base")
    assert _tables(empty_database_url) == set()
    assert revision.current_revision(empty_database_url) is None
    migrate.upgrade(empty_database_url)
    assert _tables(empty_database_url) == TABLES | RINGS


def test_the_hot_tables_leave_room_on_their_pages(empty_database_url):
    """The tables the run path updates in place get a fillfactor that leaves
    each page room for HOT updates (0009: leases 25; 0015: events 50), and a
    downgrade past 0015 gives events 0014's 80 back."""
    def fillfactors() -> dict[str, list[str] | None]:
        with psycopg.connect(empty_database_url) as conn:
            return dict(conn.execute("SELECT relname::text, reloptions FROM pg_class"
                                     " WHERE relname IN ('events', 'leases')").fetchall())
    migrate.upgrade(empty_database_url)
    assert fillfactors() == {"events": ["fillfactor=50"], "leases": ["fillfactor=25"]}
    migrate.downgrade(empty_database_url, "0014")
    assert fillfactors()["events"] == ["fillfactor=80"]


def test_0011_keeps_every_wake_and_its_id_both_ways(empty_database_url):
    """The wakes at 0010 (one per user with open events, the trigger's) are
    the wakes at 0011, in ring 0, ids and marks unchanged, and new ids follow
    them; down to 0010 again, the same rows, and identity ids follow them."""
    url = empty_database_url
    migrate.upgrade(url, "0010")
    with psycopg.connect(url) as conn:
        conn.execute("INSERT INTO events (user_id, source, source_id, payload)"
                     " SELECT 'u' || n % 7, 's', n::text, '{}' FROM generate_series(1, 20) n")
        before = conn.execute("SELECT user_id, id, at, from_id FROM wakes ORDER BY id").fetchall()
    assert len(before) == 7
    migrate.upgrade(url)
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT user_id, id, at, from_id FROM wakes ORDER BY id").fetchall() \
            == before
        assert conn.execute("SELECT DISTINCT ring FROM wakes").fetchall() == [(0,)]
        conn.execute("INSERT INTO events (user_id, source, source_id, payload)"
                     " VALUES ('new', 's', '1', '{}')")
        [(new_id, ring)] = conn.execute(
            "SELECT id, ring FROM wakes WHERE user_id = 'new'").fetchall()
        assert new_id > before[-1][1] and ring == 0
        after = conn.execute("SELECT user_id, id, at, from_id FROM wakes ORDER BY id").fetchall()
    migrate.downgrade(url, "0010")
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT user_id, id, at, from_id FROM wakes ORDER BY id").fetchall() \
            == after
        conn.execute("INSERT INTO events (user_id, source, source_id, payload)"
                     " VALUES ('newer', 's', '1', '{}')")
        assert conn.execute("SELECT id FROM wakes WHERE user_id = 'newer'").fetchone()[0] > new_id


def test_0012_gives_every_row_its_bucket_old_and_new(empty_database_url):
    """Rows there before 0012 get their user's bucket; so do rows inserted
    afterwards the way code older than 0012 inserts them (no bucket named):
    an event, and the lease row and wake its trigger adds; down to 0011
    again, the rows stay and the column goes."""
    url = empty_database_url
    migrate.upgrade(url, "0011")
    users = [f"u{n}" for n in range(20)]
    with psycopg.connect(url) as conn:
        conn.execute("INSERT INTO events (user_id, source, source_id, payload)"
                     " SELECT u, 's', '1', '{}' FROM unnest(%s::text[]) u", (users,))
        conn.execute("INSERT INTO memory (user_id, doc, updated_by) VALUES ('u1', '{}', 'x')")
    migrate.upgrade(url)
    with psycopg.connect(url) as conn:
        conn.execute("INSERT INTO events (user_id, source, source_id, payload)"
                     " VALUES ('late', 's', '1', '{}')")
        for table in ("events", "leases", "wakes", "memory"):
            rows = conn.execute(f"SELECT user_id, bucket FROM {table}").fetchall()
            assert rows and {bucket for _, bucket in rows} != {None}
            assert all(bucket == keys.bucket(user) for user, bucket in rows), table
        assert conn.execute("SELECT count(*) FROM events").fetchone()[0] == 21
    migrate.downgrade(url, "0011")
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT count(*) FROM events").fetchone()[0] == 21
        assert conn.execute("SELECT count(*) FROM information_schema.columns"
                            " WHERE column_name = 'bucket'").fetchone()[0] == 0


def test_migrations_match_schema_py(database_url):
    migrate.check(database_url)  # raises AutogenerateDiffsDetected on drift


def test_drift_is_detected(database_url):
    from alembic.util.exc import AutogenerateDiffsDetected

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("ALTER TABLE events ADD COLUMN stray text")
    with pytest.raises(AutogenerateDiffsDetected):
        migrate.check(database_url)


def test_offline_sql_is_printed_without_a_database():
    done = subprocess.run([sys.executable, "-m", "agent_inbox.cli", "migrate", "--sql"],
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    for table in TABLES:
        assert f"CREATE TABLE {table}" in done.stdout
    assert "UNIQUE (user_id, source, source_id)" in done.stdout


def test_two_migrate_processes_at_once_both_succeed(empty_database_url):
    command = [sys.executable, "-m", "agent_inbox.cli", "migrate", "--database-url",
               empty_database_url]
    processes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for _ in range(3)]
    outcomes = [(p.wait(timeout=120), p.stderr.read()) for p in processes]
    assert all(code == 0 for code, _ in outcomes), outcomes
    assert revision.current_revision(empty_database_url) == revision.HEAD
    assert _tables(empty_database_url) == TABLES | RINGS


def test_require_head_refuses_an_unmigrated_database(empty_database_url, database_url):
    with pytest.raises(errors.SchemaNotAtHead, match="agent-inbox migrate"):
        revision.require_head(empty_database_url)
    revision.require_head(database_url)


def test_services_refuse_an_older_schema_and_accept_a_newer_one(database_url, caplog):
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0001'")    # not yet migrated
        with pytest.raises(errors.SchemaNotAtHead, match="at revision 0001, this agent-inbox needs"):
            revision.require_head(database_url)
        conn.execute("UPDATE alembic_version SET version_num = 'a1b2c3'")  # a later release's
        revision.require_head(database_url)
    assert "newer than this agent-inbox knows" in caplog.text


def test_the_revisions_services_know_are_the_migrations_tree():
    """revision.KNOWN is what workers check at start without Alembic: a new
    migration must be added to it, or every service would take the new schema
    for a later release's."""
    assert revision.KNOWN == tuple(migrate.revisions())
    assert revision.HEAD == migrate.head_revision()


def test_migrate_on_a_newer_schema_says_so_and_succeeds(database_url, capsys):
    """A node still on an older release runs `migrate` first (compose does): it
    must not fail on the newer schema a later release left."""
    from agent_inbox import cli

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("UPDATE alembic_version SET version_num = 'a1b2c3'")
    assert cli.main(["migrate", "--database-url", database_url]) == 0
    assert "at revision a1b2c3, newer than this agent-inbox knows" in capsys.readouterr().out
    assert revision.current_revision(database_url) == "a1b2c3"


# Dropped by 0009: open events by available_at, read by finding work before
# wakes (0004); since then only by plans, walking it across users.
INDEXES_NO_STATEMENT_NAMES = {"DROP INDEX IX_EVENTS_CLAIMABLE"}
# 0011 rebuilds wakes as a partitioned table: the old one is renamed aside,
# copied and dropped; the new one has the same name, columns (and a defaulted
# `ring`) and index names, so older code runs on it unchanged.
REBUILT_AS_PARTITIONED = "_0010"
# 0014 rebuilds the events' partial indexes on `outcome` under the same names:
# older code's statements still run (status is kept), by a scan.
REBUILT_INDEXES = ("IX_EVENTS_OPEN", "IX_EVENTS_DEAD")


def test_migrations_after_the_first_only_add_or_widen():
    """Older services keep running on a newer schema (revision.require_head), so a
    migration after 0001 may add tables, indexes and nullable or defaulted
    columns, and widen what older code writes (a NOT NULL dropped, a CHECK
    replaced under the same name), and drop an index no statement names (only
    plans chose it: older code runs the same, by another path), and nothing else."""
    sql = migrate.upgrade_sql(f"{revision.KNOWN[0]}:head")
    code = "\n".join(line for line in sql.splitlines() if not line.lstrip().startswith("--"))
    statements = [" ".join(s.upper().split()) for s in code.split(";") if s.strip()]
    assert any("ADD COLUMN KIND" in s for s in statements)
    checks_added = {m.group(1) for s in statements
                    for m in [re.search(r"ADD CONSTRAINT (\w+) CHECK", s)] if m}
    # 0012's NOT NULL `bucket`: filled for the rows there are, and by a BEFORE
    # INSERT trigger of its table for the rows older code inserts without it
    filled = {m.group(1) for s in statements
              for m in [re.match(r"CREATE TRIGGER FILL_BUCKET BEFORE INSERT ON (\w+) ", s)] if m}
    assert len(filled) == 11
    for statement in statements:
        set_filled = re.fullmatch(r"ALTER TABLE (\w+) ALTER COLUMN BUCKET SET NOT NULL", statement)
        if set_filled and set_filled.group(1) in filled:
            continue
        widened = re.fullmatch(r"ALTER TABLE \w+ ALTER COLUMN \w+ DROP NOT NULL", statement)
        replaced = re.fullmatch(r"ALTER TABLE \w+ DROP CONSTRAINT (\w+)", statement)
        if widened or (replaced and replaced.group(1) in checks_added):
            continue
        if statement in INDEXES_NO_STATEMENT_NAMES or REBUILT_AS_PARTITIONED in statement:
            continue
        rebuilt = re.fullmatch(r"DROP INDEX (\w+)", statement)
        if rebuilt and rebuilt.group(1) in REBUILT_INDEXES:
            after = statements[statements.index(statement) + 1:]
            assert any(s.startswith(f"CREATE INDEX {rebuilt.group(1)} ON EVENTS ") for s in after)
            continue
        assert not re.search(r"\bDROP\b|\bRENAME\b|ALTER COLUMN|SET NOT NULL", statement), statement
        if "ADD COLUMN" in statement:
            assert "NOT NULL" not in statement or "DEFAULT" in statement, statement
