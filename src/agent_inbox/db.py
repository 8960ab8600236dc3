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

import contextlib
import math
import random
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import psycopg
from psycopg.rows import tuple_row
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


# psycopg >= 3.3 ends a wait past a timeout; an older one waits unbounded.
_WAIT_TIMEOUT = getattr(psycopg.errors, "_WaitTimeout", None)
_CAN_CUT = _WAIT_TIMEOUT is not None


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


def _session(name: str, pooler: str, configure, statement_timeout: float | None,
             connect_timeout: float | None) -> tuple[dict, Callable]:
    """What every connection of ours is opened with (its keyword arguments)
    and the set-up each gets once opened (see open_pool)."""
    bound = _seconds("statement_timeout", statement_timeout)
    opening = _seconds("connect_timeout", connect_timeout)
    if opening is not None:
        opening = max(2, math.ceil(opening))  # libpq: whole seconds, at least 2

    def bounded(conn: psycopg.Connection) -> None:
        conn.bound = None  # the set-up itself is not bounded by the run path's bound
        conn.server_timeout = bound is not None and pooler == "none"
        if pooler == "none":  # session state: not behind a transaction pooler
            settings = {"jit": "off"}
            if conn.server_timeout:
                settings["statement_timeout"] = f"{max(1, int(bound * SERVER_SHARE * 1000))}ms"
            conn.execute("SELECT set_config(name, value, false)"
                         " FROM unnest(%s::text[], %s::text[]) AS s(name, value)",
                         (list(settings), list(settings.values())))
        if configure is not None:
            configure(conn)
        conn.bound = bound

    return ({"autocommit": True, "application_name": name, **connect_options(pooler),
             **LIVENESS, **({"connect_timeout": opening} if opening else {})}, bounded)


def connect(url: str, *, name: str = "agent-inbox", configure=None,
            statement_timeout: float | None = DEFAULT_STATEMENT_TIMEOUT,
            connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT) -> "BoundedConnection":
    """One connection, opened and set up as open_pool's are (psycopg's errors
    go up: a refused connection at once, a silent server after
    `connect_timeout`)."""
    kwargs, set_up = _session(name, "none", configure, statement_timeout, connect_timeout)
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
    kwargs, set_up = _session(name, pooler, configure, statement_timeout, connect_timeout)
    pool = ConnectionPool(
        url,
        min_size=1,
        max_size=size,
        kwargs=kwargs,
        connection_class=BoundedConnection,
        name=name,
        configure=set_up,
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


class CallersConnection:
    """The caller's psycopg connection as the store's functions use it:
    statements answer tuples whatever row factory the caller set."""

    def __init__(self, conn: psycopg.Connection):
        self._conn = conn

    def execute(self, query, params=None):
        return self._conn.cursor(row_factory=tuple_row).execute(query, params)


CALLERS_CONNECTIONS = ("a psycopg Connection, a SQLAlchemy Connection or ORM Session "
                       "(postgresql+psycopg://)")


def _callers_psycopg(given) -> psycopg.Connection:
    """The psycopg connection under `given`, checked to have (or be able to
    open) a transaction of the caller's; InvalidInput when it cannot."""
    if isinstance(given, psycopg.AsyncConnection):
        raise errors.InvalidInput("connection", given, "is an asyncio connection: use "
                                  "AsyncInbox for it, or pass " + CALLERS_CONNECTIONS)
    if isinstance(given, psycopg.Connection):
        conn = given
    elif type(given).__module__.startswith("sqlalchemy."):
        from sqlalchemy.engine import Connection as SAConnection
        from sqlalchemy.orm import Session
        if isinstance(given, Session):
            given = given.connection()  # begins the session's transaction if none is open
        if not isinstance(given, SAConnection):
            raise errors.InvalidInput("connection", given, "must be " + CALLERS_CONNECTIONS)
        if given.dialect.driver != "psycopg":
            raise errors.InvalidInput(
                "connection", given, f"uses the {given.dialect.driver} driver: agent-inbox "
                "speaks psycopg 3 (a URL postgresql+psycopg://...)")
        if not given.in_transaction():
            given.begin()  # what SQLAlchemy's autobegin would do at the first statement
        conn = given.connection.dbapi_connection
    else:
        raise errors.InvalidInput("connection", given, "must be " + CALLERS_CONNECTIONS)
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


@contextlib.contextmanager
def callers_transaction(given) -> Iterator[CallersConnection]:
    """Statements in the transaction the caller holds open on `given` (see
    CALLERS_CONNECTIONS): they commit or roll back with it, never here. Errors
    are translated as anywhere (a deadlock or a serialization failure is the
    caller's to retry: its transaction is the one PostgreSQL rolled back)."""
    conn = _callers_psycopg(given)
    with translated():
        yield CallersConnection(conn)


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
