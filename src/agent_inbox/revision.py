"""The schema revision this code was written for, and the check every service
makes at start: refuse a database whose schema is not at that revision.

Read with one query and no Alembic, so a worker starts without loading Alembic
and SQLAlchemy (a test keeps HEAD equal to the head of the migrations tree: a
new migration must move it).
"""

import psycopg

from agent_inbox import errors

HEAD = "0001"


def current_revision(url: str) -> str | None:
    """The database's Alembic revision; None for a database never migrated."""
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
            if conn.execute("SELECT to_regclass('alembic_version')").fetchone()[0] is None:
                return None
            row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    except psycopg.OperationalError as exc:
        raise errors.DatabaseUnavailable(f"could not reach the database: {exc}") from None
    return row[0] if row else None


def require_head(url: str) -> None:
    """Refuse to run services against a schema this code was not written for."""
    current = current_revision(url)
    if current != HEAD:
        raise errors.SchemaNotAtHead(
            f"database schema is at revision {current or 'none (empty database)'}, "
            f"this agent-inbox needs {HEAD}: run `agent-inbox migrate` first"
        )
