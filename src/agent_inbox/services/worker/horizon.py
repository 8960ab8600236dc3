"""The xmin horizon: who holds it back, for how long, and what it costs.

VACUUM removes a dead row version only once no transaction can still see it:
the oldest snapshot or transaction id still in use (the xmin horizon) decides.
One transaction held open anywhere in the database (a reporting session left
`idle in transaction`, a forgotten psql, a prepared transaction, a replication
slot of a standby with hot_standby_feedback) freezes that horizon, and every
update the inbox makes from then on leaves a row version nobody may remove:
`leases` (one row per user, updated by every take and finish), `wakes` and
`events` grow dead tuples, and scans walk them. Workers rewrite `wakes` and
`leases` without theirs (store/compaction.py); each user's scans of
`events` start at its low-water mark (store/inbox.py), past the versions its
earlier runs left (bench/soak.py measures it; docs/operating/horizon.md).

`read(conn)` is one plain SELECT (it works through PgBouncer) of the oldest
holders among pg_stat_activity (backend_xid, backend_xmin; this database's
sessions and walsenders: since PostgreSQL 14 another database's sessions do not
hold this one's tables back), pg_replication_slots (xmin, catalog_xmin) and
pg_prepared_xacts, with their age in transactions and in seconds, and the dead
tuples of the inbox's tables (pg_stat_user_tables). `Checker` runs it every 30
s on one connection, taken for the check and given back after it; sets
the Prometheus gauges and logs a warning naming the holder once it is older
than `warn_after` seconds, at most once per holder every `repeat` seconds.
`lockers(conn, table)` reads who holds a lock on a table (a pg_dump holds
ACCESS SHARE on every table): the compactor names them when its rewrite is
refused (worker/compactor.py).

A session's age in seconds is counted from its transaction's start when it has
a transaction id or is idle in its transaction, else from its statement's start
(a READ COMMITTED transaction holds its snapshot only for a statement); a
replication slot has no age in seconds: it is judged by its age in
transactions (`warn_xids`). Without pg_monitor (or pg_read_all_stats) another
role's query, state and start times read as NULL: the holder's pid, role and
age are still shown.

On Citus the coordinator's view is what is read: its sessions (which include
the distributed transactions it coordinates), its slots and prepared
transactions. A transaction held open on a worker node directly, and the
shards' dead tuples (the coordinator's tables are empty shells), are not seen
from there.
"""

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable

import psycopg
from psycopg.rows import dict_row

from agent_inbox import metrics

log = logging.getLogger("agent_inbox.horizon")

# The inbox's tables (schema.metadata's, checked by a test), for their dead tuples.
TABLES = ("console_sessions", "default_policies", "deliveries", "events", "fleet_pause", "leases",
          "limits", "memory", "operator_actions", "outbox", "permit_decisions", "policies", "run_stats",
          "steps", "timers", "wakes", "wakes_ring")

# seconds between checks (AGENT_INBOX_HORIZON_INTERVAL)
INTERVAL = float(os.environ.get("AGENT_INBOX_HORIZON_INTERVAL", "30"))
WARN_AFTER = 60.0      # seconds a holder may hold the horizon before a warning
WARN_XIDS = 10_000_000  # transactions a slot (no age in seconds) may hold it back
REPEAT = 600.0         # seconds before the same holder is warned about again
HOLDERS = 5            # holders read, oldest first

QUERY = """
WITH holders AS (
    SELECT 'session' AS kind, a.pid, a.usename::text AS role, a.application_name,
           a.client_addr::text AS client, a.state, a.backend_type,
           a.xact_start, a.query_start, left(split_part(a.query, E'\\n', 1), 200) AS query,
           NULL::text AS name,
           greatest(age(a.backend_xid), age(a.backend_xmin)) AS age_xids,
           extract(epoch FROM now() - CASE WHEN a.backend_xid IS NOT NULL OR a.state <> 'active'
                                           THEN a.xact_start
                                           ELSE coalesce(a.query_start, a.xact_start) END
                  )::float8 AS age_seconds
      FROM pg_stat_activity a
     WHERE (a.backend_xid IS NOT NULL OR a.backend_xmin IS NOT NULL)
       AND a.pid <> pg_backend_pid()
       AND a.backend_type IS DISTINCT FROM 'autovacuum worker'
       AND (a.datname = current_database() OR a.datname IS NULL)
    UNION ALL
    SELECT 'replication slot', s.active_pid, NULL, NULL, NULL,
           CASE WHEN s.active THEN 'active' ELSE 'inactive' END, s.slot_type, NULL, NULL, NULL,
           s.slot_name::text, greatest(age(s.xmin), age(s.catalog_xmin)), NULL
      FROM pg_replication_slots s
     WHERE (s.xmin IS NOT NULL OR s.catalog_xmin IS NOT NULL)
       AND (s.database IS NULL OR s.database = current_database())
    UNION ALL
    SELECT 'prepared transaction', NULL, p.owner::text, NULL, NULL, 'prepared', NULL,
           p.prepared, NULL, NULL, p.gid, age(p.transaction),
           extract(epoch FROM now() - p.prepared)::float8
      FROM pg_prepared_xacts p
     WHERE p.database = current_database()
)
SELECT (SELECT coalesce(json_agg(h), '[]')
          FROM (SELECT * FROM holders
                 ORDER BY age_xids DESC NULLS LAST, age_seconds DESC NULLS LAST
                 LIMIT %(holders)s) h) AS holders,
       (SELECT coalesce(json_object_agg(name, dead), '{}')
          FROM (SELECT coalesce(p.relname, s.relname) AS name, sum(s.n_dead_tup) AS dead
                  FROM pg_stat_user_tables s  -- a partition's under its table's name
                  LEFT JOIN pg_inherits i ON i.inhrelid = s.relid
                  LEFT JOIN pg_class p ON p.oid = i.inhparent
                 WHERE s.schemaname = ANY(current_schemas(false))
                   AND coalesce(p.relname, s.relname) = ANY(%(tables)s)
                 GROUP BY 1) t) AS dead
"""


@dataclasses.dataclass(frozen=True)
class Holder:
    """One session, replication slot or prepared transaction holding the horizon."""

    kind: str                 # 'session', 'replication slot', 'prepared transaction'
    pid: int | None
    role: str | None
    application_name: str | None
    client: str | None
    state: str | None
    backend_type: str | None  # a slot's: its type (physical, logical)
    xact_start: str | None    # a prepared transaction's: when it was prepared
    query_start: str | None
    query: str | None         # the first line of its query, cut at 200 characters
    name: str | None          # a slot's name, a prepared transaction's gid
    age_xids: int | None
    age_seconds: float | None

    @property
    def key(self) -> tuple:
        """Which holder this is, across checks."""
        if self.kind == "session":
            return (self.kind, self.pid, self.xact_start)
        return (self.kind, self.name)

    def describe(self) -> str:
        if self.kind == "session":
            parts = [f"pid {self.pid}", f"application {self.application_name!r}",
                     f"role {self.role!r}", f"state {self.state!r}"]
            if self.client:
                parts.append(f"client {self.client}")
            parts += [f"xact_start {self.xact_start}", f"query_start {self.query_start}",
                      f"query {self.query!r}"]
            if self.backend_type and self.backend_type != "client backend":
                parts.insert(1, self.backend_type)
            return ", ".join(parts)
        if self.kind == "replication slot":
            return (f"replication slot {self.name!r} ({self.backend_type}, {self.state}"
                    + (f", pid {self.pid}" if self.pid else "") + ")")
        return (f"prepared transaction {self.name!r} (owner {self.role!r}, prepared "
                f"{self.xact_start}): COMMIT PREPARED or ROLLBACK PREPARED ends it")

    def summary(self) -> str:
        """Short, for the console: who, in a few words."""
        if self.kind == "session":
            return f"pid {self.pid} {self.application_name or ''} ({self.state})".replace("  ", " ")
        return f"{self.kind} {self.name}"


@dataclasses.dataclass(frozen=True)
class Reading:
    holders: list[Holder]     # oldest first (by age in transactions)
    dead: dict[str, int]      # table -> n_dead_tup

    @property
    def oldest(self) -> Holder | None:
        return self.holders[0] if self.holders else None

    @property
    def age_seconds(self) -> float:
        return max((h.age_seconds or 0.0 for h in self.holders), default=0.0)

    @property
    def age_xids(self) -> int:
        return max((h.age_xids or 0 for h in self.holders), default=0)

    def as_json(self) -> dict:
        """For the console's overview: the oldest holder, its age, the dead tuples."""
        oldest = self.oldest
        return {"age_seconds": int(self.age_seconds), "age_xids": self.age_xids,
                "holder": oldest.summary() if oldest else None,
                "oldest": dataclasses.asdict(oldest) if oldest else None,
                "dead_tuples": dict(self.dead)}


def read(conn: psycopg.Connection) -> Reading:
    """The horizon's holders and the inbox's dead tuples, in one SELECT."""
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(QUERY, {"holders": HOLDERS, "tables": list(TABLES)}).fetchone()
    fields = {f.name for f in dataclasses.fields(Holder)}
    holders = [Holder(**{k: v for k, v in h.items() if k in fields}) for h in row["holders"]]
    return Reading(holders, {table: int(n) for table, n in sorted(row["dead"].items())})


# The sessions holding a lock on a table (which a compaction's ACCESS EXCLUSIVE
# waits for), oldest transaction first, as `holders` reads sessions.
LOCKERS = """
SELECT 'session' AS kind, a.pid, a.usename::text AS role, a.application_name,
       a.client_addr::text AS client, a.state, a.backend_type,
       a.xact_start::text, a.query_start::text,
       left(split_part(a.query, E'\\n', 1), 200) AS query, NULL AS name,
       NULL::int AS age_xids, extract(epoch FROM now() - a.xact_start)::float8 AS age_seconds,
       string_agg(DISTINCT l.mode, ', ') AS modes
  FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
 WHERE l.locktype = 'relation' AND l.relation = %(table)s::regclass AND l.granted
   AND l.pid <> pg_backend_pid()
 GROUP BY a.pid, a.usename, a.application_name, a.client_addr, a.state, a.backend_type,
          a.xact_start, a.query_start, a.query
 ORDER BY a.xact_start NULLS LAST
 LIMIT %(holders)s
"""


def lockers(conn: psycopg.Connection, table: str) -> list[tuple[Holder, str]]:
    """The sessions holding a lock on `table`, oldest transaction first, each
    with the modes it holds (what keeps a compaction's rewrite off)."""
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(LOCKERS, {"table": table, "holders": HOLDERS}).fetchall()
    return [(Holder(**{k: v for k, v in row.items() if k != "modes"}), row["modes"])
            for row in rows]


def overdue(holder: Holder, warn_after: float, warn_xids: int) -> bool:
    if holder.age_seconds is not None:
        return holder.age_seconds >= warn_after
    return (holder.age_xids or 0) >= warn_xids


class Checker(threading.Thread):
    """Every `interval` seconds (the first check at once): `read` on the
    connection `connect()` gives (a context manager: a pool's, or a connection
    of its own), for that one statement; the gauges set; a warning for
    each holder past `warn_after` seconds (or, without an age in seconds,
    `warn_xids` transactions), at most once per holder every `repeat` seconds.
    A failed check is logged and the next one comes at its time."""

    def __init__(self, connect: Callable[[], psycopg.Connection], stop: threading.Event, *,
                 interval: float = INTERVAL, warn_after: float = WARN_AFTER,
                 warn_xids: int = WARN_XIDS, repeat: float = REPEAT,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(name="agent-inbox-horizon", daemon=True)
        self.connect, self.stop = connect, stop
        self.interval, self.warn_after, self.warn_xids = interval, warn_after, warn_xids
        self.repeat, self.clock = repeat, clock
        self._warned: dict[tuple, float] = {}  # holder key -> when it was last warned about
        self.last: Reading | None = None

    @classmethod
    def for_pool(cls, pool, stop: threading.Event, **options) -> "Checker":
        """A checker on one of `pool`'s connections, taken for the check and given
        back after it (a worker's connection budget stays what its pool allows)."""
        return cls(lambda: pool.connection(timeout=10), stop, **options)

    def run(self) -> None:
        while not self.stop.is_set():
            self.check()
            self.stop.wait(self.interval)

    def check(self) -> Reading | None:
        try:
            with self.connect() as conn:
                with conn.transaction():  # SET LOCAL: nothing outlives it (PgBouncer)
                    conn.execute("SET LOCAL statement_timeout = '10s'")
                    reading = read(conn)
        except Exception as exc:  # a check that fails must not end the thread
            log.warning("horizon check failed: %s", str(exc).strip() or type(exc).__name__)
            return None
        self.observe(reading)
        return reading

    def observe(self, reading: Reading) -> None:
        self.last = reading
        metrics.HORIZON_AGE_SECONDS.set(reading.age_seconds)
        metrics.HORIZON_AGE_XIDS.set(reading.age_xids)
        for table, dead in reading.dead.items():
            metrics.DEAD_TUPLES.labels(table).set(dead)
        now = self.clock()
        current = {h.key for h in reading.holders}
        for key in [k for k in self._warned if k not in current]:
            del self._warned[key]
            log.info("the %s warned about no longer holds the xmin horizon back", key[0])
        for holder in reading.holders:
            if not overdue(holder, self.warn_after, self.warn_xids):
                continue
            last = self._warned.get(holder.key)
            if last is not None and now - last < self.repeat:
                continue
            self._warned[holder.key] = now
            age = (f"{holder.age_seconds:.0f} s, " if holder.age_seconds is not None else "")
            worst = sorted((i for i in reading.dead.items() if i[1]), key=lambda i: -i[1])[:3]
            log.warning(
                "a transaction held open holds back VACUUM on the inbox's tables (%s%s "
                "transactions): %s; dead tuples %s (README: A transaction held open elsewhere)",
                age, holder.age_xids, holder.describe(),
                ", ".join(f"{t} {n}" for t, n in worst) or "-")
