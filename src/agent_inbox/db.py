"""Connections: the pool, transactions, and the one place psycopg errors are
translated into agent-inbox's own.

Pooled connections run in autocommit; `transaction(pool)` opens an explicit
transaction that commits when the block ends and rolls back if it raises.
"""

import contextlib
from collections.abc import Iterator

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from agent_inbox import errors


def open_pool(url: str, *, size: int, name: str = "agent-inbox", timeout: float = 30.0) -> ConnectionPool:
    """A pool of `size` autocommit connections; raises DatabaseUnavailable if the
    first connection cannot be made within `timeout` seconds."""
    pool = ConnectionPool(
        url,
        min_size=1,
        max_size=size,
        kwargs={"autocommit": True, "application_name": name},
        name=name,
        open=False,
    )
    try:
        pool.open(wait=True, timeout=timeout)
    except PoolTimeout as exc:
        pool.close()
        raise errors.DatabaseUnavailable(f"could not connect to the database: {exc}") from None
    return pool


@contextlib.contextmanager
def translated() -> Iterator[None]:
    """Turn lost connections and pool exhaustion into DatabaseUnavailable."""
    try:
        yield
    except (psycopg.OperationalError, PoolTimeout) as exc:
        raise errors.DatabaseUnavailable(str(exc).strip() or type(exc).__name__) from exc


@contextlib.contextmanager
def connection(pool: ConnectionPool) -> Iterator[psycopg.Connection]:
    """One autocommit connection: each statement is its own transaction."""
    with translated(), pool.connection() as conn:
        yield conn


@contextlib.contextmanager
def transaction(pool: ConnectionPool) -> Iterator[psycopg.Connection]:
    """One connection inside one transaction."""
    with translated(), pool.connection() as conn, conn.transaction():
        yield conn
