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

Bounds (`open_pool`'s `statement_timeout` and `connect_timeout`, 5 s each by
default): a pooled connection waits at most `statement_timeout` seconds for any
answer (BoundedConnection: past it the connection is closed and the statement
fails with StatementCut, a DatabaseUnavailable once translated); on a direct
connection the server's own statement_timeout is set a little below it, so
the server normally cancels first and the connection stays usable. libpq's
connect_timeout bounds a connection's opening, TCP keepalives and
tcp_user_timeout a peer that is gone (a host down, a network cut). Behind a
transaction pooler no session setting is made (the server's statement_timeout
is then the role's or the pooler's own): the client's bound holds all the same.

Reconnects: a pool replaces each connection it finds broken (a server that died,
a failover) by itself, first at once, then after 1 s, 2 s, 4 s, never more
than RECONNECT_CAP seconds apart (`Pool`, `AsyncPool`): psycopg_pool's own
delay doubles without a cap until its reconnect_timeout, so after a failover
that took 30 s its next attempt could come 30 s after the new primary was up.
Capped and jittered, the attempts of a fleet's pools stay spread out (no
storm). A multi-host URL (`host=a,b target_session_attrs=read-write`) makes
each attempt find whichever server is the primary now.

JIT compilation is off on a direct connection (`jit = off`, session state like
statement_timeout). The run path's statements are short, but their estimated
costs grow with the rows the planner expects (a sub-plan per due wake, LIMITs
it cannot see through): a take's passes `jit_above_cost` (100,000) with about
60,000 due wakes (134,578 estimated, 240 users with 250 wakes each), and a
variant of it did with a few thousand during the chaos test's backlog, where
compiling cost 976 ms of a 1,184 ms take, on every execution. Behind a
transaction pooler it is the role's or the pooler's setting:
docs/operating/pgbouncer.md says how to turn it off there.
"""

import asyncio
import contextlib
import math
import random
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from typing import Any, NamedTuple, TypeVar

import psycopg
from psycopg.rows import tuple_row
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout
from psycopg_pool.base import AttemptWithBackoff

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


DEFAULT_STATEMENT_TIMEOUT = 5.0
"""Seconds a pooled connection waits for an answer, by default (None: no bound)."""

DEFAULT_CONNECT_TIMEOUT = 5.0
"""Seconds a new connection may take to open, by default (libpq's minimum is 2)."""

SERVER_SHARE = 0.8
"""The server's statement_timeout, as a share of the client's bound: the
server's cancel (a clean error, the connection kept) comes first when it can."""

# TCP liveness of a pooled connection: an idle peer probed after 5 s, every 2 s,
# given up after 2 unanswered probes; data unacknowledged for 5 s ends it.
LIVENESS = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
            "keepalives_count": 2, "tcp_user_timeout": 5000}


class StatementCut(psycopg.OperationalError):
    """No answer came within the connection's bound (BoundedConnection): the
    connection was closed under the statement."""


class BoundedConnection(psycopg.Connection):
    """A connection that waits at most `bound` seconds (None: no bound) for any
    one answer of the server: a statement, a commit, a rollback. Past it the
    connection is closed and StatementCut raised: the server's own
    statement_timeout cannot end every wait (a Citus coordinator whose worker
    node stopped answering waits for that node even to cancel: its abort
    sends the node a cancel request and waits for the reply)."""

    bound: float | None = None

    def wait(self, gen, *args, **kwargs):
        if self.bound is None or args[1:] or "timeout" in kwargs or not _CAN_CUT:
            return super().wait(gen, *args, **kwargs)
        try:
            return super().wait(gen, *args, timeout=self.bound, **kwargs)
        except _WAIT_TIMEOUT:
            self.pgconn.finish()  # mid-statement: never to be used again
            raise StatementCut(f"no answer from the database within {self.bound:g} s "
                               "(statement timeout): connection closed") from None


class BoundedAsyncConnection(psycopg.AsyncConnection):
    """BoundedConnection for asyncio: at most `bound` seconds for any answer."""

    bound: float | None = None

    async def wait(self, gen, *args, **kwargs):
        if self.bound is None or args[1:] or "timeout" in kwargs or not _CAN_CUT:
            return await super().wait(gen, *args, **kwargs)
        try:
            return await super().wait(gen, *args, timeout=self.bound, **kwargs)
        except _WAIT_TIMEOUT:
            self.pgconn.finish()  # mid-statement: never to be used again
            raise StatementCut(f"no answer from the database within {self.bound:g} s "
                               "(statement timeout): connection closed") from None


# psycopg >= 3.3 ends a wait past a timeout; an older one waits unbounded.
_WAIT_TIMEOUT = getattr(psycopg.errors, "_WaitTimeout", None)
_CAN_CUT = _WAIT_TIMEOUT is not None


RECONNECT_CAP = 5.0
"""Seconds at most between a pool's attempts to replace a lost connection."""


class CappedBackoff(AttemptWithBackoff):
    """psycopg_pool's reconnect backoff (1 s, doubling, given up after the
    pool's reconnect_timeout), each delay past RECONNECT_CAP drawn from
    [RECONNECT_CAP / 2, RECONNECT_CAP] instead."""

    def update_delay(self, now: float) -> None:
        super().update_delay(now)
        if self.delay > RECONNECT_CAP:
            self.delay = RECONNECT_CAP * random.uniform(0.5, 1.0)


class Pool(ConnectionPool):
    """A ConnectionPool whose reconnects back off by CappedBackoff."""

    def _add_connection(self, attempt: AttemptWithBackoff | None, growing: bool = False) -> None:
        super()._add_connection(attempt or CappedBackoff(timeout=self.reconnect_timeout), growing)


class AsyncPool(AsyncConnectionPool):
    """An AsyncConnectionPool whose reconnects back off by CappedBackoff."""

    async def _add_connection(self, attempt: AttemptWithBackoff | None,
                              growing: bool = False) -> None:
        await super()._add_connection(attempt or CappedBackoff(timeout=self.reconnect_timeout),
                                      growing)


@contextlib.contextmanager
def unbounded(conn: psycopg.Connection) -> Iterator[None]:
    """In the caller's transaction on a pooled connection: no statement timeout,
    the server's (SET LOCAL) or the client's, for an operator's long work
    (prune)."""
    bound = getattr(conn, "bound", None)
    if bound is not None and getattr(conn, "server_timeout", False):
        conn.execute("SET LOCAL statement_timeout = 0")
    conn.bound = None
    try:
        yield
    finally:
        conn.bound = bound


def _seconds(name: str, value: float | None) -> float | None:
    if value is None or value == 0:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise errors.InvalidInput(name, value, "must be a positive number of seconds, or None")
    return float(value)


def _session(name: str, pooler: str, statement_timeout: float | None,
             connect_timeout: float | None) -> tuple[dict, float | None, "Query | None"]:
    """What every connection of ours is opened with (its keyword arguments),
    the client's bound on each answer, and the session settings each gets
    once opened (None behind a transaction pooler: see open_pool)."""
    bound = _seconds("statement_timeout", statement_timeout)
    opening = _seconds("connect_timeout", connect_timeout)
    if opening is not None:
        opening = max(2, math.ceil(opening))  # libpq: whole seconds, at least 2
    settings = None
    if pooler == "none":  # session state: not behind a transaction pooler
        values = {"jit": "off"}
        if bound is not None:
            values["statement_timeout"] = f"{max(1, int(bound * SERVER_SHARE * 1000))}ms"
        settings = Query("SELECT set_config(name, value, false)"
                         " FROM unnest(%s::text[], %s::text[]) AS s(name, value)",
                         (list(values), list(values.values())))
    return ({"autocommit": True, "application_name": name, **connect_options(pooler),
             **LIVENESS, **({"connect_timeout": opening} if opening else {})}, bound, settings)


def _set_up(bound: float | None, settings: "Query | None", configure) -> Callable:
    """A new connection's set-up: the session settings, then `configure`,
    then the bound (the set-up itself is not bounded by the run path's)."""
    def set_up(conn: psycopg.Connection) -> None:
        conn.bound = None
        conn.server_timeout = bound is not None and settings is not None
        if settings is not None:
            conn.execute(settings.sql, settings.params)
        if configure is not None:
            configure(conn)
        conn.bound = bound
    return set_up


def connect(url: str, *, name: str = "agent-inbox", configure=None,
            statement_timeout: float | None = DEFAULT_STATEMENT_TIMEOUT,
            connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT) -> "BoundedConnection":
    """One connection, opened and set up as open_pool's are (psycopg's errors
    go up: a refused connection at once, a silent server after
    `connect_timeout`)."""
    kwargs, bound, settings = _session(name, "none", statement_timeout, connect_timeout)
    set_up = _set_up(bound, settings, configure)
    conn = BoundedConnection.connect(url, **kwargs)
    try:
        set_up(conn)
    except BaseException:
        conn.close()
        raise
    return conn


def open_pool(url: str, *, size: int, name: str = "agent-inbox", timeout: float = 30.0,
              pooler: str = "none", configure=None,
              statement_timeout: float | None = DEFAULT_STATEMENT_TIMEOUT,
              connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT) -> ConnectionPool:
    """A pool of `size` autocommit connections; raises DatabaseUnavailable if the
    first connection cannot be made within `timeout` seconds. `configure(conn)`,
    if given, is called on each new connection. Each connection opens within
    `connect_timeout` seconds and waits at most `statement_timeout` seconds for
    any answer (see the module's docstring; None for either: no bound)."""
    kwargs, bound, settings = _session(name, pooler, statement_timeout, connect_timeout)
    pool = Pool(
        url,
        min_size=1,
        max_size=size,
        kwargs=kwargs,
        connection_class=BoundedConnection,
        name=name,
        configure=_set_up(bound, settings, configure),
        open=False,
    )
    try:
        pool.open(wait=True, timeout=timeout)
    except PoolTimeout as exc:
        pool.close()
        raise errors.DatabaseUnavailable(f"could not connect to the database: {exc}") from None
    return pool


async def open_async_pool(url: str, *, size: int, name: str = "agent-inbox",
                          timeout: float = 30.0, pooler: str = "none",
                          configure: Callable[[Any], Any] | None = None,
                          statement_timeout: float | None = DEFAULT_STATEMENT_TIMEOUT,
                          connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT
                          ) -> AsyncConnectionPool:
    """open_pool for asyncio: the same connections (autocommit, the same
    session settings and bounds: BoundedAsyncConnection), `configure(conn)`
    awaited on each new one."""
    kwargs, bound, settings = _session(name, pooler, statement_timeout, connect_timeout)

    async def set_up(conn: psycopg.AsyncConnection) -> None:
        conn.bound = None
        if settings is not None:
            await conn.execute(settings.sql, settings.params)
        if configure is not None:
            await configure(conn)
        conn.bound = bound

    pool = AsyncPool(url, min_size=1, max_size=size, kwargs=kwargs,
                               connection_class=BoundedAsyncConnection, name=name,
                               configure=set_up, open=False)
    try:
        await pool.open(wait=True, timeout=timeout)
    except PoolTimeout as exc:
        await pool.close()
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


# --- statements written once, for sync and asyncio connections ---------------

class Query(NamedTuple):
    """One statement of a call written once for both kinds of connection: its
    SQL, its parameters and the row factory its rows are read with (tuples
    unless said, whatever factory the connection has)."""

    sql: str
    params: Any = None
    row_factory: Any = tuple_row


Queries = Generator[Query, list, T]
"""A call's statements as a generator: it yields each Query and is sent the
rows it answered (a list; empty for a statement that answers none) before it
yields the next, and returns the call's result. It does no I/O itself, so
`run` drives it on a psycopg Connection and `run_async` on an AsyncConnection:
the SQL and the logic between statements are spelled once (psycopg's own
shape: its protocol is generators that a sync and an async `wait` drive)."""


def _rows(cursor) -> list:
    return cursor.fetchall() if cursor.description is not None else []


def run(conn: psycopg.Connection, queries: "Queries[T]") -> T:
    """Drive `queries` on `conn`, in whatever transaction `conn` has."""
    try:
        query = next(queries)
        while True:
            cursor = conn.cursor(row_factory=query.row_factory)
            query = queries.send(_rows(cursor.execute(query.sql, query.params)))
    except StopIteration as done:
        return done.value


async def run_async(conn: psycopg.AsyncConnection, queries: "Queries[T]") -> T:
    """Drive `queries` on the asyncio connection `conn` (see `run`)."""
    try:
        query = next(queries)
        while True:
            cursor = conn.cursor(row_factory=query.row_factory)
            await cursor.execute(query.sql, query.params)
            query = queries.send(await cursor.fetchall() if cursor.description is not None
                                 else [])
    except StopIteration as done:
        return done.value


# --- the caller's own transaction ---------------------------------------------

CALLERS_CONNECTIONS = ("a psycopg Connection, a SQLAlchemy Connection or ORM Session "
                       "(postgresql+psycopg://)")
CALLERS_ASYNC_CONNECTIONS = ("a psycopg AsyncConnection, a SQLAlchemy AsyncConnection or "
                             "AsyncSession (postgresql+psycopg://)")


def _sqlalchemy_driver_checked(given) -> None:
    if given.dialect.driver not in ("psycopg", "psycopg_async"):
        raise errors.InvalidInput(
            "connection", given, f"uses the {given.dialect.driver} driver: agent-inbox "
            "speaks psycopg 3 (a URL postgresql+psycopg://...)")


def _transaction_checked(conn, given):
    """`conn` (the psycopg connection under `given`) if it has, or can open,
    a transaction of the caller's; InvalidInput if not."""
    if conn.closed:
        raise errors.InvalidInput("connection", given, "is closed")
    status = conn.info.transaction_status
    if status == psycopg.pq.TransactionStatus.INERROR:
        raise errors.InvalidInput("connection", given, "is in a failed transaction: roll it "
                                  "back first")
    if conn.autocommit and status == psycopg.pq.TransactionStatus.IDLE:
        raise errors.InvalidInput("connection", given, "is in autocommit mode with no "
                                  "transaction open: each statement would commit alone; "
                                  "open one first (with conn.transaction(): ...)")
    return conn


def _from_sqlalchemy(given) -> bool:
    return type(given).__module__.startswith("sqlalchemy.")


def callers_connection(given) -> psycopg.Connection:
    """The psycopg connection under `given` (see CALLERS_CONNECTIONS), in a
    transaction of the caller's (SQLAlchemy's is begun, as its autobegin
    would at the first statement); InvalidInput for anything else."""
    if isinstance(given, psycopg.AsyncConnection):
        raise errors.InvalidInput("connection", given, "is an asyncio connection: use "
                                  "AsyncInbox for it, or pass " + CALLERS_CONNECTIONS)
    if isinstance(given, psycopg.Connection):
        return _transaction_checked(given, given)
    if not _from_sqlalchemy(given):
        raise errors.InvalidInput("connection", given, "must be " + CALLERS_CONNECTIONS)
    from sqlalchemy.engine import Connection as SAConnection
    from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection, AsyncSession
    from sqlalchemy.orm import Session
    if isinstance(given, (SAAsyncConnection, AsyncSession)):
        raise errors.InvalidInput("connection", given, "is an asyncio connection: use "
                                  "AsyncInbox for it, or pass " + CALLERS_CONNECTIONS)
    if isinstance(given, Session):
        given = given.connection()  # begins the session's transaction if none is open
    if not isinstance(given, SAConnection):
        raise errors.InvalidInput("connection", given, "must be " + CALLERS_CONNECTIONS)
    _sqlalchemy_driver_checked(given)
    if not given.in_transaction():
        given.begin()
    return _transaction_checked(given.connection.dbapi_connection, given)


async def callers_async_connection(given) -> psycopg.AsyncConnection:
    """`callers_connection` for asyncio (see CALLERS_ASYNC_CONNECTIONS)."""
    if isinstance(given, psycopg.Connection):
        raise errors.InvalidInput("connection", given, "is not an asyncio connection: use "
                                  "Inbox for it, or pass " + CALLERS_ASYNC_CONNECTIONS)
    if isinstance(given, psycopg.AsyncConnection):
        return _transaction_checked(given, given)
    if not _from_sqlalchemy(given):
        raise errors.InvalidInput("connection", given, "must be " + CALLERS_ASYNC_CONNECTIONS)
    from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection, AsyncSession
    if isinstance(given, AsyncSession):
        given = await given.connection()  # begins the session's transaction if none is open
    if not isinstance(given, SAAsyncConnection):
        raise errors.InvalidInput("connection", given, "must be " + CALLERS_ASYNC_CONNECTIONS)
    _sqlalchemy_driver_checked(given)
    if not given.in_transaction():
        await given.begin()
    raw = await given.get_raw_connection()
    return _transaction_checked(raw.driver_connection, given)


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


class Connections:
    """For a loop of pieces of work, each on one connection: a pooled connection
    at a time (`get()`), replaced by another when a piece left it closed (a
    statement cut past its bound: citus.node_may_fail), so the pieces after it
    go on. A context manager: the last one goes back to the pool at the end."""

    def __init__(self, pool: ConnectionPool):
        self.pool = pool
        self._held: contextlib.AbstractContextManager | None = None
        self._conn: psycopg.Connection | None = None

    def get(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self.close()
            held = connection(self.pool)
            self._conn = held.__enter__()
            self._held = held
        return self._conn

    def close(self) -> None:
        held, self._held, self._conn = self._held, None, None
        if held is not None:
            held.__exit__(None, None, None)

    def __enter__(self) -> "Connections":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


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


@contextlib.contextmanager
def callers_transaction(given) -> Iterator[psycopg.Connection]:
    """The transaction the caller holds open on `given` (see
    CALLERS_CONNECTIONS): statements run in it commit or roll back with it,
    never here. Errors are translated as anywhere (a deadlock or a
    serialization failure is the caller's to retry: its transaction is the
    one PostgreSQL rolled back)."""
    conn = callers_connection(given)
    with translated():
        yield conn


@contextlib.asynccontextmanager
async def callers_async_transaction(given) -> AsyncIterator[psycopg.AsyncConnection]:
    """callers_transaction for asyncio (see CALLERS_ASYNC_CONNECTIONS)."""
    conn = await callers_async_connection(given)
    with translated():
        yield conn


@contextlib.asynccontextmanager
async def async_connection(pool: AsyncConnectionPool) -> AsyncIterator[psycopg.AsyncConnection]:
    """`connection` for asyncio: one autocommit connection."""
    with translated():
        async with pool.connection() as conn:
            yield conn


async def async_in_transaction(pool: AsyncConnectionPool, work, *, attempts: int = 5):
    """`in_transaction` for asyncio: `await work(conn)` in one transaction, again
    from the start if PostgreSQL broke a deadlock by rolling it back."""
    for attempt in range(1, attempts + 1):
        try:
            with translated():
                async with pool.connection() as conn, conn.transaction():
                    return await work(conn)
        except errors.TransactionConflict:
            if attempt == attempts:
                raise
            await asyncio.sleep(random.uniform(0, 0.01 * attempt))
    raise AssertionError("unreachable")
