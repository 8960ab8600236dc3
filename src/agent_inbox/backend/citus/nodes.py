"""Which worker node holds each bucket, and connections straight to the nodes.

`NodeMap` reads the coordinator's metadata (cached NODE_MAP_TTL seconds) and
sets aside a node that timed out (HUNG_SKIP, doubling to HUNG_SKIP_MAX);
`NodePools` keeps a small pool per worker node for `--citus-nodes direct`;
`per_node` runs one statement on every node's shards over one connection a
node; `by_bucket` groups what one transaction about one bucket gets.
"""

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar, cast

import psycopg
from psycopg.conninfo import make_conninfo

from agent_inbox import db, errors
from agent_inbox.store.keys import BUCKETS, bucket

log = logging.getLogger("agent_inbox.citus")

T = TypeVar("T")


def by_bucket(items: Sequence[T], user_of: Callable[[T], str]) -> list[list[T]]:
    """`items` in one list per bucket of `user_of(item)`, by bucket, each in the
    order given: what one statement or transaction about one bucket gets."""
    groups: dict[int, list[T]] = {}
    for item in items:
        groups.setdefault(bucket(user_of(item)), []).append(item)
    return [groups[b] for b in sorted(groups)]


# Which buckets each worker node holds, and the node's address as the
# coordinator reaches it: a row per node, from the coordinator's own metadata
# (the shard whose hash range holds each bucket's hash, where that shard is
# placed, and that group's primary node).
NODE_BUCKETS = f"""
SELECT array_agg(b ORDER BY b), n.nodename, n.nodeport
  FROM generate_series(0, {BUCKETS - 1}) b
  JOIN pg_dist_shard s ON s.logicalrelid = 'leases'::regclass
   AND worker_hash(b) BETWEEN s.shardminvalue::int AND s.shardmaxvalue::int
  JOIN pg_dist_placement p ON p.shardid = s.shardid
  JOIN pg_dist_node n ON n.groupid = p.groupid AND n.noderole = 'primary'
 GROUP BY p.groupid, n.nodename, n.nodeport
 ORDER BY p.groupid
"""

NODE_MAP_TTL = 10.0
"""Seconds a NodeMap keeps what it read."""

SKIP_WARNING_INTERVAL = 30.0
"""Seconds between two warnings that one node's buckets were skipped."""

SLOW_FAILURE = 1.0
"""A node's failure that took at least this long (a timeout: the node hangs,
it does not refuse) sets its buckets aside for HUNG_SKIP seconds."""

HUNG_SKIP = 5.0
"""Seconds a node that timed out is not asked again: the calls about its
buckets say at once that it did not answer, instead of each waiting out the
timeout again (a keeper renewing, a completer retrying finishes, a take
reading due buckets). Then it is asked once more; each timeout in a row
doubles the pause, up to HUNG_SKIP_MAX; an answer ends it."""

HUNG_SKIP_MAX = 30.0


class NodeMap:
    """Which buckets each worker node holds (NODE_BUCKETS), read again at most
    every NODE_MAP_TTL seconds. Shards move only when an operator moves them;
    until the next read a moved bucket is read with its old node's group, which
    changes no answer, only which node's silence holds it up."""

    def __init__(self) -> None:
        self._groups: list[list[int]] = []
        self._addresses: dict[int, tuple[str, int]] = {}  # bucket -> its node (host, port)
        self._read_at = -math.inf
        self._warned: dict[tuple[int, ...], float] = {}
        self._hung: dict[tuple[int, ...], float] = {}  # a node's buckets: set aside until
        self._timeouts: dict[tuple[int, ...], int] = {}  # a node's timeouts in a row
        self._lock = threading.Lock()  # the keeper, the completer and takes share one map

    def groups(self, conn: psycopg.Connection[Any]) -> list[list[int]]:
        if time.monotonic() - self._read_at > NODE_MAP_TTL:
            nodes = conn.execute(NODE_BUCKETS).fetchall()
            self._groups = [buckets for buckets, _, _ in nodes]
            self._addresses = {bucket: (host, port) for buckets, host, port in nodes
                               for bucket in buckets}
            self._read_at = time.monotonic()
        return self._groups

    def address(self, bucket: int) -> tuple[str, int] | None:
        """The (host, port) of `bucket`'s node as last read; None before a read."""
        return self._addresses.get(bucket)

    def skipped(self, buckets: list[int], exc: BaseException) -> None:
        """Log that a node's buckets were skipped: at most once per
        SKIP_WARNING_INTERVAL for a node, however often work is looked for."""
        key, now = tuple(buckets), time.monotonic()
        if now - self._warned.get(key, -math.inf) >= SKIP_WARNING_INTERVAL:
            self._warned[key] = now
            log.warning("a worker node did not answer; its buckets are skipped until it "
                        "does: %s", errors.first_line(exc))

    def hung(self, bucket: int) -> bool:
        """Whether `bucket`'s node timed out within the last HUNG_SKIP seconds."""
        now = time.monotonic()
        with self._lock:
            return any(until > now and bucket in group for group, until in self._hung.items())

    def failed(self, buckets: Iterable[int], exc: BaseException, seconds: float) -> None:
        """A piece of work on the node of `buckets` (some of them) failed after
        `seconds`: if that is a timeout (SLOW_FAILURE or more), the node's
        buckets are set aside for HUNG_SKIP seconds, with a warning."""
        if seconds < SLOW_FAILURE:
            return
        wanted = set(buckets)
        for group in self._groups:
            if not wanted & set(group):
                continue
            with self._lock:
                key = tuple(group)
                self._timeouts[key] = self._timeouts.get(key, 0) + 1
                pause = min(HUNG_SKIP_MAX, HUNG_SKIP * 2 ** (self._timeouts[key] - 1))
                self._hung[key] = time.monotonic() + pause
                log.warning("a worker node did not answer within %.1f s (timed out): its %d "
                            "buckets are set aside for %g s: %s", seconds, len(group), pause,
                            errors.first_line(exc))

    def answered(self, buckets: Iterable[int]) -> None:
        """The node of `buckets` answered: it is not set aside any more."""
        if not self._hung:
            return
        wanted = set(buckets)
        with self._lock:
            back = [key for key in self._hung if wanted & set(key)]
            for key in back:
                del self._hung[key]
                self._timeouts.pop(key, None)
        for key in back:
            log.info("a worker node that timed out answers again (%d buckets)", len(key))


@contextlib.contextmanager
def node_may_fail(conn: psycopg.Connection[Any], failures: list[Exception],
                  nodes: "NodeMap | None" = None, buckets: Iterable[int] = ()) -> Iterator[None]:
    """Around a piece of work on one node (a bucket's transaction or read) sent
    through the coordinator connection `conn`: if the node does not answer,
    or the work deadlocks, while `conn` itself is fine, the error is added to
    `failures` and the piece is skipped (a transaction inside is rolled back),
    so the work on other nodes goes on. A lost coordinator connection, and any
    other error, goes up; but a connection closed under a statement that had no
    answer within its bound (db.StatementCut: the node hangs, and the
    coordinator with it) is a failure of the piece: the caller, whose `conn` is
    closed, leaves the rest undone (`conn.closed`). Given `nodes` and the piece's
    `buckets`, a failure that was a timeout sets the node aside (NodeMap.failed)."""
    began = time.monotonic()
    try:
        yield
        if nodes is not None:
            nodes.answered(buckets)
    except psycopg.OperationalError as exc:
        cut = isinstance(exc, db.StatementCut) or isinstance(exc.__cause__, db.StatementCut)
        if (conn.closed or conn.broken) and not cut:
            raise
        failures.append(exc)
        if nodes is not None:
            nodes.failed(buckets, exc, time.monotonic() - began)


NODES = ("auto", "coordinator", "direct")
"""Where the run path sends its take and finish calls on Citus (Inbox.connect's
`citus_nodes`): through the coordinator, straight to the worker node that
holds the bucket (NodePools), or "auto" (the default): straight to the nodes
if every one answers from here when the Inbox opens, else through the
coordinator, with a log line that says which and why (`choose`)."""


def choose(conn: psycopg.Connection[Any], url: str, pooler: str,
           connect: Callable[[str], psycopg.Connection[Any]]) -> str:
    """What "auto" means for a Citus coordinator at `url` (`conn`: one of its
    connections): "direct" if no pooler stands in between and every worker
    node the coordinator lists (NODE_BUCKETS) accepts a connection from this
    process (`connect`, within its connect timeout) and answers; else
    "coordinator". Logs the choice: at INFO when direct, at WARNING, naming
    the node and its error, when a node does not answer (the calls then pay
    the coordinator's planning and relaying: in bench W7 its CPU per run was
    1.08 ms against 0.35 ms direct). Asked once: a node lost later is handled
    as under "direct"."""
    if pooler != "none":
        log.info("Citus behind a transaction pooler: the run path's takes and finishes go "
                 "through the coordinator (the worker nodes' addresses are the coordinator's "
                 "own, not the pooler's)")
        return "coordinator"
    addresses = sorted({(host, port) for _, host, port in conn.execute(NODE_BUCKETS).fetchall()})
    for host, port in addresses:
        try:
            with connect(make_conninfo(url, host=host, port=port)) as node:
                node.execute("SELECT 1")
        except psycopg.Error as exc:
            log.warning("the Citus worker node %s:%d does not answer from here (%s): the run "
                        "path's takes and finishes go through the coordinator; make the nodes "
                        "reachable at the addresses the coordinator has for them "
                        "(pg_dist_node) for the direct path, or pass --citus-nodes coordinator "
                        "to silence this", host, port, errors.first_line(exc))
            return "coordinator"
    log.info("Citus: the run path's takes and finishes go straight to the %d worker nodes "
             "(%s)", len(addresses), ", ".join(f"{h}:{p}" for h, p in addresses))
    return "direct"


IDLE_CHECK_S = 1.0
"""A node's kept connection idle this long is checked (an empty query) before
it is used again: a node restarted meanwhile has closed it."""


class NodePools:
    """Connections to each worker node, opened when wanted and kept for the
    next call, at most `size` per node, in use or idle, for the calls the run
    path sends straight to the node that holds their bucket
    (`citus_nodes="direct"`): Citus routes a statement from any node (every
    node has the metadata since Citus 11), so a call sent to the bucket's own
    node runs there, and the coordinator neither plans nor relays it. Each
    node's address is the one the coordinator reaches it by (NodeMap, from
    pg_dist_node), with the rest of the coordinator's URL (database, role,
    password, options); a bucket moved since the map's last read is still
    found by its old node, which relays the call, until the map is read again.

    A call that finds all `size` of its node's connections in use waits (at
    most `wait` seconds) for one to come back, as a pool's would: a session
    opened for one call and closed after it would cost the node a backend's
    start, Citus's metadata cache and the functions' compiled plans each time
    (backend/citus/functions.py), more than the call.

    Not a psycopg_pool: a call about a node that refuses connections fails at
    once, as it does through the coordinator (a pool waits out its timeout for
    a connection it cannot make, so the node would look hung); one that does
    not answer fails after `connect_timeout` (NodeMap then sets it aside). A
    kept connection is checked before use only after IDLE_CHECK_S idle: a
    round trip per call would cost what sending the call straight saves."""

    def __init__(self, url: str, nodes: NodeMap,
                 connect: Callable[[str], psycopg.Connection], size: int, wait: float = 30.0):
        self._url, self._nodes, self._connect = url, nodes, connect
        self._size, self._wait = size, wait
        self._idle: dict[tuple[str, int], list[tuple[psycopg.Connection, float]]] = {}
        self._open: dict[tuple[str, int], int] = {}  # per node: kept or in use
        self._returned = threading.Condition()
        self._shut = False

    @contextlib.contextmanager
    def connection(self, bucket: int) -> Iterator[psycopg.Connection]:
        """A connection to `bucket`'s node (whose address the map knows), kept
        for the next call unless it broke or was left in a transaction;
        psycopg.OperationalError if none can be had."""
        # known: the caller asked the map first (an unknown one fails in _take)
        address = cast(tuple[str, int], self._nodes.address(bucket))
        conn = self._take(address)
        try:
            yield conn
        finally:
            self._give_back(address, conn)

    def call(self, buckets: list[int], failures: list[Exception],
             work: Callable[[psycopg.Connection], T]
             ) -> T | None:
        """`work(conn)` on a connection to the node of `buckets` (its first
        names it); what it answered. Any psycopg.OperationalError is the
        node's failure, a lost or unopenable connection included (the
        connection is the node's own): added to `failures`, the node set
        aside if it timed out (NodeMap.failed), and None answered."""
        began = time.monotonic()
        try:
            with self.connection(buckets[0]) as conn:
                answer = work(conn)
        except psycopg.OperationalError as exc:
            failures.append(exc)
            self._nodes.failed(buckets, exc, time.monotonic() - began)
            return None
        self._nodes.answered(buckets)
        return answer

    def _take(self, address: tuple[str, int]) -> psycopg.Connection:
        """A kept connection (checked if idle long), or a new one if fewer than
        `size` are open, or else the first one given back within `wait`."""
        deadline = time.monotonic() + self._wait
        conn: psycopg.Connection | None
        while True:
            with self._returned:
                while not self._idle.get(address) and self._open.get(address, 0) >= self._size:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise psycopg.OperationalError(
                            f"no connection to the worker node {address[0]}:{address[1]} "
                            f"came free within {self._wait:g} s (all {self._size} in use)")
                    self._returned.wait(left)
                kept = self._idle.get(address)
                if kept:
                    conn, idle_since = kept.pop()
                else:
                    conn, idle_since = None, 0.0  # a new one, below
                    self._open[address] = self._open.get(address, 0) + 1
            if conn is None:
                try:
                    return self._connect(make_conninfo(self._url, host=address[0],
                                                       port=address[1]))
                except BaseException:
                    self._closed(address)
                    raise
            if time.monotonic() - idle_since <= IDLE_CHECK_S:
                return conn
            try:
                conn.execute("")
                return conn
            except psycopg.Error:  # closed under us: the node restarted
                conn.close()
                self._closed(address)

    def _give_back(self, address: tuple[str, int], conn: psycopg.Connection) -> None:
        if self._shut or conn.closed or conn.broken \
                or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            conn.close()
            self._closed(address)
            return
        with self._returned:
            self._idle.setdefault(address, []).append((conn, time.monotonic()))
            self._returned.notify()

    def _closed(self, address: tuple[str, int]) -> None:
        with self._returned:
            self._open[address] = self._open.get(address, 1) - 1
            self._returned.notify()

    def close(self) -> None:
        with self._returned:
            kept, self._idle = [c for conns in self._idle.values() for c, _ in conns], {}
            self._open, self._shut = {}, True
        for conn in kept:
            conn.close()


def per_node(conn: psycopg.Connection[Any], nodes: NodeMap, statement: str,
             params: dict[str, Any], pools: NodePools | None = None) -> list[tuple[Any, ...]]:
    """A read across shards sent once per worker node, `%(buckets)s` bound to
    that node's buckets (the statement filters `bucket = ANY(%(buckets)s)`, so
    Citus sends it to that node alone): the rows of every node that answered.
    Sent through the coordinator's `conn`, or with `pools` to the node itself
    (whose shards they all are: it reads them there). A node that cannot be
    reached is skipped with a warning: its users wait for it while every other
    node's work goes on. In autocommit only (a failed read would abort a
    transaction); each read is a transaction of its own (`_one_connection`)."""
    rows: list[tuple[Any, ...]] = []
    failures: list[Exception] = []
    for buckets in nodes.groups(conn):
        if nodes.hung(buckets[0]) or conn.closed:  # timed out a moment ago: not asked
            continue
        failed, asked = len(failures), {**params, "buckets": buckets}
        if pools is None:
            with node_may_fail(conn, failures, nodes, buckets):
                rows += _one_connection(conn, statement, asked)
        else:
            rows += pools.call(buckets, failures,
                               lambda node: _one_connection(node, statement, asked)) or []
        if len(failures) > failed:
            nodes.skipped(buckets, failures[-1])
    return rows


def _one_connection(conn: psycopg.Connection[Any], statement: str, params: dict[str, Any]
                    ) -> list[tuple[Any, ...]]:
    """A read of many shards of one node without a connection per shard: in
    autocommit Citus reads a node's shards in parallel over as many
    connections as it opens (up to 16 a node), keeps one of them, and closes
    the rest, so the node starts a backend for each on every read, the worker
    node's own local shards included. In a transaction block, with one
    connection a node, it reads them one by one: on the node itself, in its
    own backend (local execution); from the coordinator, over the one
    connection it keeps."""
    with conn.transaction():
        conn.execute("SET LOCAL citus.max_adaptive_executor_pool_size = 1")
        return conn.execute(statement, params).fetchall()
