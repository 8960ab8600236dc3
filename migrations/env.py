"""Alembic environment for agent-inbox.

The database comes from a connection passed in `config.attributes["connection"]`
(how `agent_inbox.schema.migrate` calls it), else from AGENT_INBOX_DATABASE_URL or
`sqlalchemy.url`. Online migrations hold a transaction-scoped advisory lock, so
two processes migrating at once run one after the other and the second finds
nothing to do.
"""

import os
import re

import psycopg
import sqlalchemy as sa
from alembic import context

from agent_inbox.schema import model as schema

# An arbitrary constant shared by every copy of agent-inbox: the migration lock.
MIGRATION_LOCK_KEY = 0x6167656E74  # "agent"

config = context.config

# The partitions of `wakes` (migration 0011, store/wake_rings.py): made and
# truncated by the code, not described in schema.py.
WAKE_RING = re.compile(r"wakes_\d+")


def include_object(obj, name, type_, reflected, compare_to) -> bool:
    return not (type_ == "table" and reflected and WAKE_RING.fullmatch(name or ""))


def _database_url() -> str:
    url = os.environ.get("AGENT_INBOX_DATABASE_URL") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("no database: set AGENT_INBOX_DATABASE_URL or sqlalchemy.url")
    return url


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=schema.metadata,
                      include_object=include_object)
    with context.begin_transaction():
        connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY})")
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = _database_url()
    engine = sa.create_engine(
        "postgresql+psycopg://", creator=lambda: psycopg.connect(url), poolclass=sa.NullPool
    )
    with engine.connect() as connection:
        _run(connection)


def run_offline() -> None:
    context.configure(
        dialect_name="postgresql",
        target_metadata=schema.metadata,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
