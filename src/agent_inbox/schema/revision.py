"""The schema revisions this code knows, and the check every service makes at
start: refuse a database whose schema is older than this code needs, or whose
run-path state is damaged (errors.RunPathDamaged: `agent-inbox migrate`
repairs it).

A database at a revision this code does not know is taken to be newer (a later
release migrated it first, as a rolling upgrade does) and is accepted with a
warning: migrations only add (columns, tables, indexes), so older code keeps
working on a newer schema. Read with one query and no Alembic, so a worker
starts without loading Alembic and SQLAlchemy; a test keeps KNOWN equal to the
migrations tree (a new migration must be added here).
"""

import logging

import psycopg

from agent_inbox.backend.citus import layout as citus
from agent_inbox import db, errors
from agent_inbox.backend.citus import functions as delegated
from agent_inbox.store import wake_rings

log = logging.getLogger("agent_inbox.revision")

KNOWN = ("0001", "0002", "0003", "0004", "0005", "0006", "0007", "0008", "0009",
         "0010", "0011", "0012", "0013", "0014", "0015")  # oldest first
HEAD = KNOWN[-1]


def current_revision(url: str, *, pooler: str = "none") -> str | None:
    """The database's Alembic revision; None for a database never migrated."""
    return _read(url, pooler, _revision)


def _read(url: str, pooler: str, read):
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=10,
                             **db.connect_options(pooler)) as conn:
            return read(conn)
    except psycopg.OperationalError as exc:
        raise errors.DatabaseUnavailable(f"could not reach the database: {exc}") from None


def _revision(conn: psycopg.Connection) -> str | None:
    if conn.execute("SELECT to_regclass('alembic_version')").fetchone()[0] is None:
        return None
    row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    return row[0] if row else None


def _run_path_damage(conn: psycopg.Connection) -> str | None:
    """What is wrong with the state the set-based run path reads beside the
    tables' rows (store/wake_rings.py's pointer row); None if nothing, or on
    Citus (no wake rings there)."""
    if conn.execute("SELECT to_regclass('wakes_ring')").fetchone()[0] is None:
        return None
    return wake_rings.damaged(conn)


def _citus_functions(conn: psycopg.Connection) -> str | None:
    """On a Citus coordinator: "missing" if the run path's functions
    (backend/citus/functions.py) are not all there (laid out by an older `migrate
    --citus`), "other" if they differ from this code's; None if they are
    this code's, or the database is not a Citus one."""
    if not citus.is_distributed(conn):
        return None
    if not delegated.installed(conn):
        return "missing"
    return None if delegated.current(conn) else "other"


def require_head(url: str, *, pooler: str = "none") -> None:
    """Refuse to run services against a schema older than this code needs."""
    current = current_revision(url, pooler=pooler)
    if current == HEAD:
        functions = _read(url, pooler, _citus_functions)
        if functions == "missing":
            raise errors.SchemaNotAtHead(
                "this Citus database lacks the run path's functions of this agent-inbox: "
                "run `agent-inbox migrate --citus` first")
        if functions == "other":
            raise errors.RunPathDamaged(
                "the run path's state is damaged: this Citus database's run path functions "
                "are not this agent-inbox's (another version's `migrate --citus`), and a take "
                "of another version breaks this one's rules (an older one takes paused users): "
                "run `agent-inbox migrate --citus` to replace them")
        problem = _read(url, pooler, _run_path_damage)
        if problem is not None:
            raise errors.RunPathDamaged(f"the run path's state is damaged: {problem}")
        return
    if current is None or current in KNOWN:
        raise errors.SchemaNotAtHead(
            f"database schema is at revision {current or 'none (empty database)'}, "
            f"this agent-inbox needs {HEAD}: run `agent-inbox migrate` first"
        )
    log.warning("database schema is at revision %s, newer than this agent-inbox knows (%s): "
                "going on, as migrations only add", current, HEAD)
