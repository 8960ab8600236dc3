"""Soak: steady ingest for N minutes, with and without a transaction held open
from minute M (issue 21: "a transaction held open elsewhere must not take the
inbox down").

    .venv/bin/python -m bench.soak [--minutes 6] [--hold-at 1] [--hold-kind idle|dump] [--rate 400]
                                   [--users 5000] [--workers 2] [--concurrency 32] [--reps 1]
                                   [--explain bench/results/soak_explain.txt]
                                   [--auto-explain-ms 50]

Each side (`baseline`, `held`) runs on a throwaway cluster of its own
(pgserver.TemporaryCluster, the same settings both sides: a held transaction
must never sit on the machine's shared server), migrated, its --users users
registered (one event each, drained, VACUUM ANALYZE), then for --minutes:

- an ingester in this process calls `Inbox.ingest_many` every 0.25 s with
  rate/4 events for users drawn uniformly at random, paced on an absolute
  schedule (a late batch does not shift the next); each event's payload carries
  its ingest time ({"t": time.time()} taken just before the call);
- --workers real `agent-inbox worker --concurrency C` processes run
  `bench.handlers:soak`, a no-op that appends one line per run (its start, the
  event ids, each event's lag = start - t) to a per-process file with one
  os.write: nothing in the database is touched by the measurement (`--handler
  agent`: `soak_agent`, the same record, then 1 s awaited: W5's shape, for
  which --concurrency must cover rate x 1 s across the workers);
- on the `held` side, from minute --hold-at to the end, a separate connection
  runs BEGIN; SELECT txid_current(); and then stays idle in its transaction
  (`--hold-kind dump`: what `pg_dump` holds while it runs instead, a
  REPEATABLE READ snapshot and ACCESS SHARE on every table of the schema,
  which also keeps compaction's rewrite from being granted);
- every 15 s a sampler reads the backlog (open events), the oldest pending
  event's age, the dead and live tuples and the size of events, leases and wakes,
  and the horizon's age (horizon.read: what the worker's check sees).

With --explain, in each side's last window (ingest and workers running, the
transaction still held): EXPLAIN (ANALYZE, BUFFERS) of a claim (CLAIM) and a finish with release
(FINISH) of a user taken first, then of a take (TAKE_WORK), rolled back,
and per index of events, leases and wakes the tuples read per scan over the
measured minutes (pg_stat_user_indexes) with the tables' dead tuples, appended
to that file: where a held horizon's cost grows.

Per 15 s window: events ingested, events handled (runs started in the window),
lag p50/p99 of the events handled in it, backlog and dead tuples at its end.
Repetitions (--reps) alternate which side goes first. Results in
bench/results/soak.json (--out), the per-window table on stdout.
"""

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time

import psycopg

from agent_inbox import Inbox
from agent_inbox.services.worker import horizon
from agent_inbox.schema import migrate
from agent_inbox.dev import pgserver
from agent_inbox.records import ClaimPolicy
from agent_inbox.store import inbox as inbox_sql, lease as lease_sql, wake_rings
from agent_inbox.store.keys import users_key
from bench import records
from bench.common import RESULTS, Workers, percentile, src_fingerprint, stop_processes

WINDOW = 15.0
# --handler: what each run does (bench/handlers.py)
HANDLERS = {"quick": "bench.handlers:soak", "agent": "bench.handlers:soak_agent"}
TICK = 0.25
TABLES = ("events", "leases", "wakes")
# The same for both sides. fsync off (durable=False): the measurement is about
# the horizon, not the disk, and both sides pay the same.
SETTINGS = {"max_connections": "100"}

SAMPLE = """
SELECT count(*) FILTER (WHERE status IN ('pending', 'running')),
       extract(epoch FROM clock_timestamp())::float8
         - min(created_at) FILTER (WHERE status = 'pending')
  FROM events WHERE status IN ('pending', 'running')
"""
# A partition's figures (wakes': migration 0011) under its table's and index's names.
STATS = """
SELECT coalesce(p.relname, s.relname), sum(s.n_live_tup)::bigint, sum(s.n_dead_tup)::bigint,
       sum(pg_total_relation_size(s.relid))::bigint, sum(s.autovacuum_count)::bigint,
       min(extract(epoch FROM now() - s.last_autovacuum))::float8
  FROM pg_stat_user_tables s
  LEFT JOIN pg_inherits i ON i.inhrelid = s.relid LEFT JOIN pg_class p ON p.oid = i.inhparent
 WHERE coalesce(p.relname, s.relname) = ANY(%s)
 GROUP BY 1
"""
INDEX_STATS = """
SELECT coalesce(p.relname, s.relname), coalesce(pi.relname, s.indexrelname),
       sum(s.idx_scan)::bigint, sum(s.idx_tup_read)::bigint, sum(s.idx_tup_fetch)::bigint
  FROM pg_stat_user_indexes s
  LEFT JOIN pg_inherits i ON i.inhrelid = s.relid LEFT JOIN pg_class p ON p.oid = i.inhparent
  LEFT JOIN pg_inherits ii ON ii.inhrelid = s.indexrelid
  LEFT JOIN pg_class pi ON pi.oid = ii.inhparent
 WHERE coalesce(p.relname, s.relname) = ANY(%s)
 GROUP BY 1, 2 ORDER BY 1, 2
"""
EXPLAIN = "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) "
EXPLAIN_USERS = 32  # users the explained take asks for (a worker's takes ask for its free places)


class Ingester(threading.Thread):
    """rate/4 events every 0.25 s until `until` (time.time()); (when, n) per batch."""

    def __init__(self, url: str, rate: int, users: int, start: float, until: float):
        super().__init__(name="soak-ingester", daemon=True)
        self.url, self.rate, self.users, self.start_at, self.until = url, rate, users, start, until
        self.batches: list[tuple[float, int]] = []
        self.late = 0          # batches sent more than one tick after their time
        self.error: str | None = None

    def run(self) -> None:
        per_tick = self.rate * TICK
        rng = random.Random(21)
        seq, owed = 0, 0.0
        try:
            with Inbox.connect(self.url, pool_size=1, application_name="bench-ingester") as inbox:
                k = 0
                while True:
                    due = self.start_at + k * TICK
                    if due >= self.until:
                        return
                    pause = due - time.time()
                    if pause > 0:
                        time.sleep(pause)
                    elif pause < -TICK:
                        self.late += 1
                    owed += per_tick
                    n = int(owed)
                    owed -= n
                    now = time.time()
                    batch = [(f"u{rng.randrange(self.users):05}", "soak", str(seq + i), {"t": now})
                             for i in range(n)]
                    seq += n
                    inbox.ingest_many(batch)
                    self.batches.append((now, n))
                    k += 1
        except Exception as exc:  # noqa: BLE001 -- reported in the figures
            self.error = repr(exc)


# What `pg_dump` holds from its start to its end: one REPEATABLE READ snapshot
# (the horizon) and ACCESS SHARE on each table it dumps (no ACCESS EXCLUSIVE
# lock, so no TRUNCATE, is granted until it ends).
DUMP_LOCKS = """
DO $$ DECLARE t regclass; BEGIN
  FOR t IN SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p') LOOP
    EXECUTE format('LOCK TABLE %s IN ACCESS SHARE MODE', t);
  END LOOP;
END $$"""


class Holder:
    """From `hold()` until released: `kind` "idle", BEGIN; SELECT
    txid_current(); then idle in transaction; "dump", what pg_dump holds
    (DUMP_LOCKS), then idle in that transaction."""

    def __init__(self, url: str, kind: str = "idle"):
        self.url, self.kind = url, kind
        self.conn: psycopg.Connection | None = None
        self.pid = self.at = None

    def hold(self) -> None:
        self.conn = psycopg.connect(self.url, application_name="soak-held-transaction")
        if self.kind == "dump":
            self.conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            self.conn.execute(DUMP_LOCKS)
        else:
            self.conn.execute("SELECT txid_current()")
        self.pid, self.at = self.conn.info.backend_pid, time.time()

    def release(self) -> None:
        if self.conn is not None:
            self.conn.rollback()
            self.conn.close()
            self.conn = None


class Sampler(threading.Thread):
    """At every window's end: backlog, oldest pending age, table stats, horizon."""

    def __init__(self, url: str, start: float, windows: int):
        super().__init__(name="soak-sampler", daemon=True)
        self.url, self.start_at, self.windows = url, start, windows
        self.samples: list[dict] = []
        self.error: str | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.url, autocommit=True, application_name="bench-sampler") as conn:
                for w in range(1, self.windows + 1):
                    time.sleep(max(0.0, self.start_at + w * WINDOW - time.time()))
                    self.samples.append(self.sample(conn, w))
        except Exception as exc:  # noqa: BLE001 -- reported in the figures
            self.error = repr(exc)

    def sample(self, conn, w: int) -> dict:
        at = time.time()
        backlog, oldest = conn.execute(SAMPLE).fetchone()
        tables = {name: {"live": live, "dead": dead, "bytes": size, "autovacuums": count,
                         "last_autovacuum_ago_s": ago}
                  for name, live, dead, size, count, ago in conn.execute(STATS, (list(TABLES),))}
        reading = horizon.read(conn)
        return {"window": w, "at": at - self.start_at, "backlog": backlog,
                "oldest_pending_s": oldest, "tables": tables,
                "horizon_age_s": max(0.0, reading.age_seconds), "horizon_age_xids": reading.age_xids,
                "horizon_holder": reading.oldest.summary() if reading.oldest else None,
                "sample_s": time.time() - at}


def register_users(url: str, users: int, workers: Workers) -> None:
    """One event per user, drained: every user has its lease row, as in steady state."""
    with Inbox.connect(url, pool_size=1, application_name="bench-ingester") as inbox:
        for lo in range(0, users, 1000):
            inbox.ingest_many([(f"u{n:05}", "warmup", str(n), {"t": time.time()})
                               for n in range(lo, min(users, lo + 1000))])
    deadline = time.monotonic() + 300
    with psycopg.connect(url, autocommit=True, application_name="bench-poll") as conn:
        while conn.execute("SELECT EXISTS (SELECT 1 FROM events WHERE status IN "
                           "('pending', 'running'))").fetchone()[0]:
            if not workers.alive():
                raise RuntimeError(f"a worker died at warm-up: see {workers.log_dir}")
            if time.monotonic() > deadline:
                raise TimeoutError("warm-up not drained after 300 s")
            time.sleep(0.2)
        for table in ("events", "leases", "wakes"):
            conn.execute(f"VACUUM ANALYZE {table}")


def index_stats(url: str) -> dict:
    with psycopg.connect(url, autocommit=True, application_name="bench-sampler") as conn:
        return {(table, index): (scans, read, fetched)
                for table, index, scans, read, fetched in conn.execute(INDEX_STATS, (list(TABLES),))}


class Explaining:
    """A connection whose statements are explained (run, their plans answered)."""

    def __init__(self, conn):
        self.conn = conn

    def execute(self, query, params):
        return self.conn.execute(EXPLAIN + query, params)


def explain_run_path(url: str, side: str, at_start: dict, path: str) -> None:
    """Appends to `path` the plans, as they run now, of a claim and a finish with
    release of one user taken first, then of a take, all in a transaction rolled
    back, and each index's tuples read per scan since `at_start`."""
    policy = ClaimPolicy()
    take = {"holder": "soak-explain", "ttl": 60, "now": None, "users": EXPLAIN_USERS,
            **policy.params()}
    lines = [f"==== {side}: {time.strftime('%Y-%m-%d %H:%M:%S')}"]
    with psycopg.connect(url, application_name="bench-explain") as conn:
        taken = inbox_sql.take_work(conn, "soak-explain-1", 60, policy, None,
                                    wake_rings.Given(), 1)
        if taken:
            user, gen, _, _, _, _, events = taken[0]
            claim = {"user": user, "holder": "soak-explain-1", "gen": gen, "now": None,
                     **policy.params()}
            plan = conn.execute(EXPLAIN + inbox_sql.CLAIM, claim).fetchall()
            lines += [f"-- CLAIM (user {user}, after a take claimed {len(events)})",
                      *(r[0] for r in plan)]
            conn.execute(lease_sql.LOCK_MANY, users_key([user]))
            finish = inbox_sql.Finish(user, "soak-explain-1", gen, [e.id for e in events], [], None)
            plan = inbox_sql.send_finish(Explaining(conn), [finish], None, release=True).fetchall()
            lines += [f"-- FINISH with release ({len(events)} events)", *(r[0] for r in plan)]
        else:
            lines.append("-- (no user to take: CLAIM and FINISH not explained)")
        plan = conn.execute(EXPLAIN + inbox_sql.TAKE_WORK,
                            {**take, **wake_rings.Given().params(conn)}).fetchall()
        lines += ["-- TAKE_WORK (users=%d)" % EXPLAIN_USERS, *(r[0] for r in plan)]
        conn.rollback()
        dead = conn.execute(STATS, (list(TABLES),)).fetchall()
    lines.append("-- dead tuples: " + ", ".join(f"{name} {d}" for name, _, d, *_ in dead))
    lines.append(f"-- per index since the measured minutes began: {'scans':>10} "
                 f"{'tuples read':>12} {'read/scan':>10}")
    for (table, index), (scans, read, _) in index_stats(url).items():
        scans0, read0, _ = at_start.get((table, index), (0, 0, 0))
        n, r = scans - scans0, read - read0
        lines.append(f"   {table + '.' + index:<44} {n:>10} {r:>12} "
                     f"{(r / n if n else 0):>10.1f}")
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")


def auto_explain_settings(min_ms: int) -> dict:
    """Server settings that log the plan of every statement slower than `min_ms`
    as it ran (the workers' own, generic plans included), with buffers."""
    return {"session_preload_libraries": "auto_explain",
            "auto_explain.log_min_duration": f"{min_ms}ms", "auto_explain.log_analyze": "on",
            "auto_explain.log_buffers": "on", "auto_explain.log_timing": "off",
            "log_lock_waits": "on", "log_autovacuum_min_duration": "0"}


def run_side(side: str, args) -> dict:
    scratch = tempfile.mkdtemp(prefix=f"bench-soak-{side}-")
    record_dir = os.path.join(scratch, "records")
    os.mkdir(record_dir)
    settings = dict(SETTINGS)
    if args.auto_explain_ms is not None:
        settings.update(auto_explain_settings(args.auto_explain_ms))
    cluster = pgserver.TemporaryCluster(settings=settings).start()
    holder = Holder(cluster.url, args.hold_kind)
    workers = Workers("ours", cluster.url, args.workers, args.concurrency, 1.0, record_dir,
                      scratch, handler=HANDLERS[args.handler])
    try:
        migrate.upgrade(cluster.url)
        workers.start()
        workers.wait_listening()
        register_users(cluster.url, args.users, workers)  # its runs start before `start`
        at_start = index_stats(cluster.url)
        windows = int(args.minutes * 60 / WINDOW)
        start = time.time() + 1.0
        until = start + windows * WINDOW
        ingester = Ingester(cluster.url, args.rate, args.users, start, until)
        sampler = Sampler(cluster.url, start, windows)
        if side == "held":
            threading.Timer(start + args.hold_at * 60 - time.time(), holder.hold).start()
        explainer = None
        if args.explain:
            explainer = threading.Timer(until - WINDOW / 2 - time.time(), explain_run_path,
                                        (cluster.url, side, at_start, args.explain))
            explainer.start()
        ingester.start()
        sampler.start()
        ingester.join(windows * WINDOW + 120)
        sampler.join(WINDOW * 2 + 60)
        if explainer is not None:
            explainer.join(120)
        alive = workers.alive()
        workers.stop()
        horizon_warnings = [line.strip() for n in range(args.workers)
                            for line in open(os.path.join(scratch, f"ours-worker-{n}.log"))
                            if "agent_inbox.horizon" in line and "WARNING" in line]
        runs = records.read(record_dir, "soak")
        return summarize(side, args, start, windows, ingester, sampler, runs, holder, alive,
                         horizon_warnings)
    finally:
        holder.release()
        stop_processes(workers.procs)
        if args.auto_explain_ms is not None:
            shutil.copy(cluster.log, f"{args.out.removesuffix('.json')}_{side}_server.log")
        cluster.stop()
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)


def summarize(side, args, start, windows, ingester, sampler, runs, holder, alive,
              horizon_warnings) -> dict:
    lags: list[list[float]] = [[] for _ in range(windows)]
    handled = [0] * windows
    seen: set = set()
    twice = 0
    for run in runs:
        w = int((run["s"] - start) // WINDOW)
        for i in run["ids"]:
            key = (run["u"], i)
            twice += key in seen
            seen.add(key)
        if 0 <= w < windows:
            handled[w] += len(run["l"])
            lags[w].extend(run["l"])
    ingested = [0] * windows
    for when, n in ingester.batches:
        w = int((when - start) // WINDOW)
        if 0 <= w < windows:
            ingested[w] += n
    rows = []
    for w in range(windows):
        sample = sampler.samples[w] if w < len(sampler.samples) else {}
        tables = sample.get("tables", {})
        rows.append({
            "window": w + 1, "end_s": (w + 1) * WINDOW,
            "held": side == "held" and (w + 1) * WINDOW > args.hold_at * 60,
            "ingested": ingested[w], "handled": handled[w],
            "lag_p50_ms": 1000 * percentile(lags[w], 50) if lags[w] else None,
            "lag_p99_ms": 1000 * percentile(lags[w], 99) if lags[w] else None,
            "lag_max_ms": 1000 * max(lags[w]) if lags[w] else None,
            "backlog": sample.get("backlog"), "oldest_pending_s": sample.get("oldest_pending_s"),
            "dead": {t: tables.get(t, {}).get("dead") for t in TABLES},
            "live": {t: tables.get(t, {}).get("live") for t in TABLES},
            "mib": {t: round(tables.get(t, {}).get("bytes", 0) / 2**20, 1) for t in TABLES},
            "autovacuums": {t: tables.get(t, {}).get("autovacuums") for t in TABLES},
            "horizon_age_s": sample.get("horizon_age_s"),
            "horizon_age_xids": sample.get("horizon_age_xids"),
            "horizon_holder": sample.get("horizon_holder")})
    last = rows[-4:]  # the last minute
    return {
        "side": side, "windows": rows,
        "summary": {
            "ingested": sum(ingested), "handled": sum(handled),
            "handled_twice": twice, "late_batches": ingester.late,
            "final_backlog": rows[-1]["backlog"],
            "last_minute_lag_p50_ms": _median(r["lag_p50_ms"] for r in last),
            "last_minute_lag_p99_ms": _median(r["lag_p99_ms"] for r in last),
            "max_lag_p99_ms": max((r["lag_p99_ms"] or 0) for r in rows),
            "final_dead": rows[-1]["dead"], "final_mib": rows[-1]["mib"],
            "held_pid": holder.pid, "held_from_s": holder.at - start if holder.at else None,
            "horizon_warnings": len(horizon_warnings),
            "first_horizon_warning": horizon_warnings[0] if horizon_warnings else None,
            "workers_alive_at_end": alive,
            "errors": [e for e in (ingester.error, sampler.error) if e]}}


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def table(result: dict) -> str:
    lines = [f"{result['side']}:",
             f"{'end':>5} {'ingested':>8} {'handled':>8} {'p50 ms':>8} {'p99 ms':>9} "
             f"{'backlog':>8} {'dead ev':>8} {'dead leases':>11} {'dead wakes':>10} "
             f"{'xmin age s':>10}"]
    for r in result["windows"]:
        def f(v, spec):
            return format(v, spec) if v is not None else "-"
        lines.append(
            f"{r['end_s']:>5.0f} {r['ingested']:>8} {r['handled']:>8} {f(r['lag_p50_ms'], '8.0f')} "
            f"{f(r['lag_p99_ms'], '9.0f')} {f(r['backlog'], '8')} {f(r['dead']['events'], '8')} "
            f"{f(r['dead']['leases'], '11')} {f(r['dead']['wakes'], '10')} "
            f"{f(r['horizon_age_s'], '10.0f')}{'  held' if r['held'] else ''}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=6)
    parser.add_argument("--hold-at", type=float, default=1, help="minute the hold starts")
    parser.add_argument("--hold-kind", choices=("idle", "dump"), default="idle",
                        help="an idle transaction, or what pg_dump holds while it runs")
    parser.add_argument("--rate", type=int, default=400, help="events per second")
    parser.add_argument("--users", type=int, default=5000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--handler", choices=sorted(HANDLERS), default="quick",
                        help="quick: a no-op; agent: W5's shape, 1 s awaited per run")
    parser.add_argument("--sides", default="baseline,held")
    parser.add_argument("--out", default=str(RESULTS / "soak.json"))
    parser.add_argument("--explain", help="append the run path's plans at each side's end here")
    parser.add_argument("--auto-explain-ms", type=int,
                        help="log the plans of statements slower than this (auto_explain); "
                             "each side's server log is kept beside --out")
    parser.add_argument("--keep", action="store_true", help="keep the worker logs and records")
    args = parser.parse_args(argv)
    sides = args.sides.split(",")
    started = time.time()
    out = {"command": " ".join(["python -m bench.soak", *(argv or sys.argv[1:])]),
           "config": vars(args), "settings": SETTINGS, "window_s": WINDOW,
           "nproc": os.cpu_count(), "loadavg_start": os.getloadavg(), "code": src_fingerprint(),
           "runs": []}
    for rep in range(args.reps):
        order = sides if rep % 2 == 0 else sides[::-1]
        for side in order:
            print(f"rep {rep + 1}/{args.reps}: {side} ({args.minutes} min at {args.rate}/s)",
                  flush=True)
            result = run_side(side, args)
            result["rep"] = rep + 1
            result["loadavg_1m"] = os.getloadavg()[0]
            out["runs"].append(result)
            print(table(result), flush=True)
            print(json.dumps(result["summary"]), flush=True)
    out["loadavg_end"] = os.getloadavg()
    out["wall_s"] = time.time() - started
    out["medians"] = {side: {key: _median(r["summary"][key] for r in out["runs"]
                                          if r["side"] == side)
                             for key in ("last_minute_lag_p50_ms", "last_minute_lag_p99_ms",
                                         "final_backlog", "ingested", "handled")}
                      for side in sides}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"written {args.out}")
    return 0 if all(not r["summary"]["errors"] and not r["summary"]["handled_twice"]
                    for r in out["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
