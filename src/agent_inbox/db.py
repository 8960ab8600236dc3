"""Connections: the pool, transactions, and the one place psycopg errors are
translated into agent-inbox's own.

Pooled connections run in autocommit; `transaction(pool)` opens an explicit
transaction that commits when the block ends and rolls back if it raises.

Behind a transaction pooler (PgBouncer `pool_mode = transaction`, `pooler=
"transaction"`) consecutive transactions of one client connection may run on
different server connections, so nothing may outlive a transaction on the
server: every connection opened through `connect_options(pooler)` prepares no
statement (psycopg would after 5 executions, and the next transaction's server
does not have it), and the code keeps no session state (no session advisory
lock, no SET outside a transaction, no temporary table; LISTEN only on a direct
connection: service.Listener).
"""

import contextlib
import random
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from agent_inbox import errors

T = TypeVar("T")

# What sits between us and PostgreSQL: nothing, or a pooler that hands each
# transaction any server connection.
POOLERS = ("none", "transaction")


def connect_options(pooler: str) -> dict:
    """psycopg.connect() keyword arguments for connections through `pooler`."""
    if pooler not in POOLERS:
        raise errors.InvalidInput("pooler", pooler, f"must be one of {', '.join(POOLERS)}")
    return {"prepare_threshold": None} if pooler == "transaction" else {}


def open_pool(url: str, *, size: int, name: str = "agent-inbox", timeout: float = 30.0,
              pooler: str = "none", configure=None) -> ConnectionPool:
    """A pool of `size` autocommit connections; raises DatabaseUnavailable if the
    first connection cannot be made within `timeout` seconds. `configure(conn)`,
    if given, is called on each new connection."""
    pool = ConnectionPool(
        url,
        min_size=1,
        max_size=size,
        kwargs={"autocommit": True, "application_name": name, **connect_options(pooler)},
        name=name,
        configure=configure,
        open=False,
    )
    try:
        pool.open(wait=True, timeout=timeout)
    except PoolTimeout as exc:
        pool.close()
        raise errors.DatabaseUnavailable(f"could not connect to the database: {exc}") from None
    return pool


# SQLSTATE classes of a statement refused for its content, however often it is
# sent: data exception, program limit exceeded (54000: an index row too large,
# which psycopg files under OperationalError). Integrity violations (23) stay
# psycopg's own: callers that expect one catch it.
REFUSED_CLASSES = ("22", "54")


@contextlib.contextmanager
def translated() -> Iterator[None]:
    """Turn lost connections, a server shutting down or out of resources, and
    pool exhaustion into DatabaseUnavailable (retry later); deadlocks into
    TransactionConflict; a statement PostgreSQL refuses for what it holds
    (a data exception, a program limit) into DatabaseRefused (never retry)."""
    try:
        yield
    except psycopg.Error as exc:
        sqlstate = exc.sqlstate or ""
        # class 40: deadlock_detected, serialization_failure (which psycopg 3 files
        # under OperationalError, not under TransactionRollback)
        if sqlstate.startswith("40"):
            raise errors.TransactionConflict(str(exc).strip()) from exc
        if sqlstate[:2] in REFUSED_CLASSES:
            raise errors.DatabaseRefused(str(exc).strip(), exc.sqlstate) from exc
        if isinstance(exc, psycopg.OperationalError):
            raise errors.DatabaseUnavailable(str(exc).strip() or type(exc).__name__) from exc
        raise
    except PoolTimeout as exc:
        raise errors.DatabaseUnavailable(str(exc).strip() or type(exc).__name__) from exc


def in_transaction(pool: ConnectionPool, work: Callable[[psycopg.Connection], T], *,
                   attempts: int = 5) -> T:
    """Run `work(conn)` in one transaction, again from the start if PostgreSQL
    broke a deadlock by rolling it back (for statements whose lock order follows
    their input, such as a batch insert that must keep its arrival order)."""
    for attempt in range(1, attempts + 1):
        try:
            with transaction(pool) as conn:
                return work(conn)
        except errors.TransactionConflict:
            if attempt == attempts:
                raise
            time.sleep(random.uniform(0, 0.01 * attempt))
    raise AssertionError("unreachable")


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


@contextlib.contextmanager
def pipelined_transaction(conn: psycopg.Connection) -> Iterator[None]:
    """BEGIN, the block's statements and COMMIT sent as one pipeline: one round
    trip. Read no result inside the block (that would wait for the server); read
    the cursors after it. On any error the transaction is rolled back whole."""
    try:
        with translated():
            with conn.pipeline():
                conn.execute("BEGIN")
                yield
                conn.execute("COMMIT")
    except BaseException:
        if not conn.closed:
            with contextlib.suppress(psycopg.Error):
                conn.rollback()
        raise
