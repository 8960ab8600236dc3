"""W7: the inbox on a 3-node Citus cluster beside one plain PostgreSQL, in one run.

    .venv/bin/python -m bench.w7 [--reps 3] [--take-users 100000] [--quick] [--out FILE]

Both sides are throwaway servers started for the run from the local binaries,
with the same settings (those of the test clusters: fsync off, 200
connections): *plain*, one TemporaryCluster; *citus*, a CitusCluster of a
coordinator and two worker nodes (64 buckets over 32 shards). Every node
preloads pg_stat_statements (planning tracked); the Citus nodes keep their
two-phase-commit records (`citus.recover_2pc_interval = -1`: the maintenance
daemon would otherwise delete them) and count single- and multi-shard
executions (`citus.enable_stat_counters`). The agent-inbox code connects as
its own role, so the statistics show its statements apart from the bench's.

Per repetition, the two sides alternating who goes first:

* **W1**: bench.run's W1 (1,000 users x 20 events preloaded, 4 worker
  processes at concurrency 32, exactly once checked from the handlers'
  records). Over the drain (workers started to all done): events/s; the CPU
  seconds of each node's server processes (/proc: the postmaster's reaped
  children and its live ones), net of what the bench's own 50 ms poll costs
  alone (measured once per side before the repetitions); the statements the
  workers sent (pg_stat_statements of their role on each node: calls,
  planning and execution time); two-phase commits (pg_dist_transaction rows
  added). All per run (a handler call). Citus twice on one database: with
  the workers' default options (*citus*: `--citus-nodes auto`, which goes
  straight to the worker nodes when they answer, as here) and with
  `--citus-nodes coordinator` (*coordinator*).
* **take at scale**: bench.run's W4 at `--take-users` users (100 with 5
  pending events each, the rest idle with an expired lease and 10 done
  events; on Citus the bulk rows are loaded before `citus.distribute` lays
  them out): `take_work` timed alone, 20 warm-up then 200 timed calls, each
  run finished and its user given fresh events between calls, untimed. Then
  a profile of 50 takes alone: statements per take on each node, planning
  and execution time, Citus's single- and multi-shard executions.

Prints a table with the ratios citus/plain of the medians and saves
bench/results/w7.json (every repetition's figures, the statements, the
machine, the code). Exit 0 only if every drain was exactly once.
"""

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import psycopg
from psycopg import conninfo

from agent_inbox import Inbox
from agent_inbox.backend.citus import layout as citus
from agent_inbox.schema import migrate
from agent_inbox.dev import pgserver
from agent_inbox.store import keys
from bench import workloads
from bench.common import (RESULTS, open_count_query, poll_connection, resources,
                          server_cpu_seconds, src_fingerprint)
from bench.run import FULL, machine

OUT = RESULTS / "w7.json"
# W1 runs on three sides: one plain server, Citus with the workers' default
# options (`--citus-nodes auto`: every node answers here, so their take and
# finish calls go straight to the worker nodes), and Citus with them through
# the coordinator (`--citus-nodes coordinator`, on the same cluster and
# database); the take at scale on the first two.
SIDES = ("plain", "citus", "coordinator")
TAKE_SIDES = ("plain", "citus")
ROLE = "bench_w7_inbox"            # the agent-inbox code's own role on every node
TAKES_PROFILED = 50
POLL_CALIBRATION_S = 5.0

STATS = {"shared_preload_libraries": "pg_stat_statements",
         "pg_stat_statements.track_planning": "on", "pg_stat_statements.max": "10000"}
CITUS_STATS = {**STATS, "shared_preload_libraries": "citus,pg_stat_statements",
               "citus.enable_stat_counters": "on", "citus.recover_2pc_interval": "-1"}

# The statements the agent-inbox role sent in the database, on one node.
STATEMENTS = """
SELECT s.query, s.calls, s.total_exec_time, s.total_plan_time
  FROM pg_stat_statements s
 WHERE s.userid = (SELECT oid FROM pg_roles WHERE rolname = %(role)s)
   AND s.dbid = (SELECT oid FROM pg_database WHERE datname = %(db)s)
"""


class Side:
    """One side of the comparison: its nodes (the first is where clients
    connect), the database the workloads run in, and the probes around a
    measured window."""

    def __init__(self, name: str, nodes: list[pgserver.TemporaryCluster], cluster=None,
                 worker_args: list[str] = ()):
        self.name, self.nodes, self.cluster = name, nodes, cluster
        self.worker_args = list(worker_args)   # added to the W1 workers' command
        self.node_names = ["server"] if cluster is None else \
            ["coordinator", *(f"worker{n}" for n in range(1, len(nodes)))]
        self.poll_cpu_per_s: list[float] = [0.0] * len(nodes)

    def create_role(self) -> None:
        """The role on every node (Citus would propagate it, but only to the nodes
        of the database it is made in); the extension on the first (Citus
        propagates it, and refuses it on a worker)."""
        for node in self.nodes:
            with psycopg.connect(node.url, autocommit=True) as conn:
                if self.cluster is not None:
                    conn.execute("SET citus.enable_create_role_propagation = off")
                conn.execute(f"CREATE ROLE {ROLE} LOGIN SUPERUSER")
        with psycopg.connect(self.nodes[0].url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION pg_stat_statements")

    @property
    def citus(self) -> bool:
        return self.cluster is not None

    def database(self, prefix: str, lay_out: bool = True) -> str:
        """A fresh database, migrated (and distributed, on Citus, if `lay_out`)."""
        if self.citus:
            url = self.cluster.create_database(prefix=prefix)
        else:
            url = pgserver.create_database(self.nodes[0].url, prefix=prefix)
        if lay_out:
            migrate.upgrade(url)
            if self.citus:
                citus.distribute(url)
        return url

    @staticmethod
    def as_inbox(url: str) -> str:
        return conninfo.make_conninfo(url, user=ROLE)

    def postmasters(self) -> list[int]:
        return [int((node.data / "postmaster.pid").read_text().split()[0]) for node in self.nodes]

    def cpu(self) -> list[float]:
        return [server_cpu_seconds(pid) for pid in self.postmasters()]

    def reset(self, url: str) -> None:
        for node in self.nodes:
            with psycopg.connect(node.url, autocommit=True) as conn:
                conn.execute("SELECT pg_stat_statements_reset()")
        if self.citus:
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("SELECT citus_stat_counters_reset()")

    def statements(self, url: str) -> list[list[dict]]:
        """Per node, the statements the inbox role sent in `url`'s database."""
        db = conninfo.conninfo_to_dict(url)["dbname"]
        out = []
        for node in self.nodes:
            with psycopg.connect(node.url, autocommit=True) as conn:
                rows = conn.execute(STATEMENTS, {"role": ROLE, "db": db}).fetchall()
            out.append([{"query": " ".join(q.split()), "calls": c, "exec_ms": e, "plan_ms": p}
                        for q, c, e, p in rows])
        return out

    def two_phase_commits(self, url: str) -> int | None:
        if not self.citus:
            return None
        with psycopg.connect(url, autocommit=True) as conn:
            return conn.execute("SELECT count(*) FROM pg_dist_transaction").fetchone()[0]

    def shard_executions(self, url: str) -> dict | None:
        if not self.citus:
            return None
        db = conninfo.conninfo_to_dict(url)["dbname"]
        with psycopg.connect(url, autocommit=True) as conn:
            single, multi = conn.execute(
                "SELECT query_execution_single_shard, query_execution_multi_shard"
                "  FROM citus_stat_counters WHERE name = %s", (db,)).fetchone()
        return {"single_shard": single, "multi_shard": multi}

    def calibrate_poll(self, url: str) -> None:
        """CPU seconds per second each node spends answering the drain's 50 ms
        poll alone (no worker running), subtracted from the drains' CPU."""
        query = open_count_query("ours")
        with poll_connection(url) as conn:
            before, t0 = self.cpu(), time.monotonic()
            while time.monotonic() - t0 < POLL_CALIBRATION_S:
                conn.execute(query).fetchone()
                time.sleep(0.05)
            after, elapsed = self.cpu(), time.monotonic() - t0
        self.poll_cpu_per_s = [(a - b) / elapsed for a, b in zip(after, before)]


class Window:
    """What a side's nodes did between `open()` and `close()`: CPU seconds per
    node, the inbox role's statements per node, two-phase commits, shard
    executions."""

    def __init__(self, side: Side, url: str):
        self.side, self.url = side, url

    def open(self) -> None:
        self.side.reset(self.url)
        self.two_pc = self.side.two_phase_commits(self.url)
        self.cpu = self.side.cpu()
        self.t0 = time.monotonic()

    def close(self, *, net_of_poll: bool = False) -> dict:
        elapsed = time.monotonic() - self.t0
        cpu = [a - b for a, b in zip(self.side.cpu(), self.cpu)]
        if net_of_poll:
            cpu = [max(0.0, c - p * elapsed) for c, p in zip(cpu, self.side.poll_cpu_per_s)]
        two_pc = self.side.two_phase_commits(self.url)
        # The records already there at open (the preload's ingest_many across
        # nodes commits with 2PC): evidence that the probe sees them.
        return {"two_phase_commit_records_at_open": self.two_pc, "seconds": elapsed, "cpu_s": dict(zip(self.side.node_names, cpu)),
                "statements": dict(zip(self.side.node_names, self.side.statements(self.url))),
                "two_phase_commits": None if two_pc is None else two_pc - self.two_pc,
                "shard_executions": self.side.shard_executions(self.url)}


# --- workloads -------------------------------------------------------------------

def w1(side: Side, url: str, cfg: dict) -> dict:
    window = Window(side, url)
    result = workloads.drain("ours", url, **cfg["w1"], workers=cfg["workers"],
                             concurrency=cfg["ours_concurrency"], poll=cfg["poll_interval"],
                             timeout=cfg["drain_timeout"], worker_url=side.as_inbox(url),
                             worker_args=side.worker_args, on_loaded=window.open)
    result["window"] = window.close(net_of_poll=True)
    result["per_run"] = per_unit(result["window"], result["runs"])
    return result


def take_setup(side: Side, cfg: dict) -> str:
    w4 = cfg["w4"]
    url = side.database(f"bench_w7_take_{side.name}", lay_out=False)
    workloads.w4_fill(url, cfg["take_users"], w4["busy"], w4["done_per_idle"], w4["pending"],
                      lay_out=citus.distribute if side.citus else None)
    return url


def take(side: Side, url: str, cfg: dict, serial: list) -> dict:
    w4 = cfg["w4"]
    timed = workloads.w4_measure(side.as_inbox(url), calls=w4["calls"], warmup=w4["warmup"],
                                 pending=w4["pending"], serial=serial)
    # The profile: takes alone, then (outside the window) their runs finished and
    # their users given fresh events, as between W4's calls.
    window = Window(side, url)
    with Inbox.connect(side.as_inbox(url), pool_size=1) as inbox:
        window.open()
        runs = [inbox.take_work("bench-w7-profile") for _ in range(TAKES_PROFILED)]
        profile = window.close()
        assert all(run is not None and run.events for run in runs), "a profiled take found no work"
        for run in runs:
            workloads.finish_and_refill(inbox, run, w4["pending"], serial)
    return {**timed, "profile": profile, "per_take": per_unit(profile, TAKES_PROFILED)}


def per_unit(window: dict, units: int) -> dict:
    """A window's figures per run (or per take): statements, their planning and
    execution milliseconds and CPU milliseconds, per node."""
    out = {}
    for node, statements in window["statements"].items():
        out[node] = {"statements": sum(s["calls"] for s in statements) / units,
                     "plan_ms": sum(s["plan_ms"] for s in statements) / units,
                     "exec_ms": sum(s["exec_ms"] for s in statements) / units,
                     "cpu_ms": 1000 * window["cpu_s"][node] / units}
    if window["two_phase_commits"] is not None:
        out["two_phase_commits"] = window["two_phase_commits"] / units
    if window["shard_executions"] is not None:
        out["shard_executions"] = {k: v / units for k, v in window["shard_executions"].items()}
    return out


# --- the run ---------------------------------------------------------------------

def start_sides(stack: list) -> dict[str, Side]:
    plain = pgserver.TemporaryCluster(settings=STATS).start()
    stack.append(plain)
    cluster = pgserver.CitusCluster(workers=2, settings=CITUS_STATS).start()
    stack.append(cluster)
    sides = {"plain": Side("plain", [plain]), "citus": Side("citus", cluster.nodes, cluster=cluster)}
    for side in sides.values():
        side.create_role()
    sides["coordinator"] = Side("coordinator", cluster.nodes, cluster=cluster,   # the role made above
                                worker_args=["--citus-nodes", "coordinator"])
    return sides


def median_of(runs: list[dict], *path) -> float:
    values = []
    for run in runs:
        for key in path:
            run = run[key]
        values.append(run)
    return statistics.median(values)


def top_statements(window: dict, units: int, limit: int = 8) -> dict:
    """Per node, the statements of most time per unit, shard names folded
    (events_102008 -> events)."""
    out = {}
    for node, statements in window["statements"].items():
        merged: dict[str, dict] = {}
        for s in statements:
            query = re.sub(r"\b([a-z_]+)_\d{6,}\b", r"\1", s["query"])[:160]
            m = merged.setdefault(query, {"calls": 0, "plan_ms": 0.0, "exec_ms": 0.0})
            for k in ("calls", "plan_ms", "exec_ms"):
                m[k] += s[k]
        ranked = sorted(merged.items(), key=lambda kv: -(kv[1]["plan_ms"] + kv[1]["exec_ms"]))
        out[node] = [{"query": q, "per_unit_calls": m["calls"] / units,
                      "mean_plan_ms": m["plan_ms"] / m["calls"] if m["calls"] else 0.0,
                      "mean_exec_ms": m["exec_ms"] / m["calls"] if m["calls"] else 0.0}
                     for q, m in ranked[:limit]]
    return out


def report(results: dict) -> list[str]:
    lines = []
    take_med = {s: median_of(results["take"][s], "median_ms") for s in TAKE_SIDES}
    lines.append(f"{'':40} {'plain':>8} {'citus':>8} {'coord.':>8} {'citus/plain':>12} "
                 f"{'coord./plain':>12}")
    for key, title in (("events_per_s", "W1 events/s (wall, median)"),
                       ("events_per_s_drain", "W1 events/s (drain, median)"),
                       ("runs_per_s_drain", "W1 runs/s (drain, median)")):
        med = {s: median_of(results["w1"][s], key) for s in SIDES}
        lines.append(f"{title:40} {med['plain']:8.0f} {med['citus']:8.0f} "
                     f"{med['coordinator']:8.0f} {med['citus'] / med['plain']:12.3f} "
                     f"{med['coordinator'] / med['plain']:12.3f}")
    lines.append(f"{'take_work ms at %d users (median)' % results['config']['take_users']:40} "
                 f"{take_med['plain']:8.2f} {take_med['citus']:8.2f} {'':8} "
                 f"{take_med['citus'] / take_med['plain']:12.2f}")
    for title, key, unit, sides in (("W1, per run", "w1", "per_run", SIDES),
                                    ("one take at scale", "take", "per_take", TAKE_SIDES)):
        lines.append(f"{title} (medians over repetitions):")
        for side in sides:
            per = results[key][side][0][unit]
            for node in results["nodes"][side]:
                fig = {k: median_of(results[key][side], unit, node, k)
                       for k in ("statements", "plan_ms", "exec_ms", "cpu_ms")}
                lines.append(f"  {side:6} {node:12} {fig['statements']:6.2f} statements, "
                             f"planning {fig['plan_ms']:.3f} ms, executing {fig['exec_ms']:.3f} "
                             f"ms, server CPU {fig['cpu_ms']:.3f} ms")
            if "two_phase_commits" in per:
                lines.append(f"  {side:6} two-phase commits: "
                             f"{median_of(results[key][side], unit, 'two_phase_commits'):.3f}; "
                             "shard executions: single "
                             f"{median_of(results[key][side], unit, 'shard_executions', 'single_shard'):.2f}"
                             ", multi "
                             f"{median_of(results[key][side], unit, 'shard_executions', 'multi_shard'):.2f}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.w7", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--take-users", type=int, default=100_000)
    parser.add_argument("--quick", action="store_true",
                        help="1 repetition, W1 at 200 users x 20, the take at 10,000 users")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    if args.reps < 1 or args.take_users < 1000:
        parser.error("--reps must be at least 1 and --take-users at least 1,000")
    cfg = {**FULL, "take_users": args.take_users}
    if args.quick:
        cfg.update(reps=1, take_users=10_000, w1={"users": 200, "per_user": 20})
    else:
        cfg["reps"] = args.reps

    started = time.monotonic()
    servers: list = []
    results = {"w1": {s: [] for s in SIDES}, "take": {s: [] for s in TAKE_SIDES}}
    try:
        sides = start_sides(servers)
        about = machine(sides["plain"].nodes[0].url)
        w1_urls = {name: sides[name].database(f"bench_w7_w1_{name}") for name in TAKE_SIDES}
        w1_urls["coordinator"] = w1_urls["citus"]          # the same database, drained afresh
        for name in TAKE_SIDES:
            side = sides[name]
            side.calibrate_poll(w1_urls[name])
            print(f"{name}: the drain's poll alone costs "
                  + ", ".join(f"{n} {1000 * c:.1f} ms/s" for n, c in
                              zip(side.node_names, side.poll_cpu_per_s)), flush=True)
        sides["coordinator"].poll_cpu_per_s = sides["citus"].poll_cpu_per_s   # the same servers
        take_urls = {}
        for name in TAKE_SIDES:
            t = time.monotonic()
            take_urls[name] = take_setup(sides[name], cfg)
            print(f"{name}: take database at {cfg['take_users']} users loaded in "
                  f"{time.monotonic() - t:.0f} s", flush=True)
        serial = [0]
        for rep in range(cfg["reps"]):
            order = SIDES if rep % 2 == 0 else SIDES[::-1]
            for name in order:
                r = w1(sides[name], w1_urls[name], cfg)
                results["w1"][name].append(r)
                print(f"rep {rep + 1} {name:5} W1: {r['events_per_s']:7.0f} events/s, "
                      f"{r['runs']} runs, exactly once: {r['check']['ok']}, two-phase commits: "
                      f"{r['window']['two_phase_commits']}", flush=True)
            for name in (TAKE_SIDES if rep % 2 == 0 else TAKE_SIDES[::-1]):
                r = take(sides[name], take_urls[name], cfg, serial)
                results["take"][name].append(r)
                print(f"rep {rep + 1} {name:5} take: {r['median_ms']:.2f} ms median", flush=True)
    finally:
        resources().release()
        for server in reversed(servers):
            server.stop()

    ok = all(r["check"]["ok"] for runs in results["w1"].values() for r in runs)
    results.update(
        config={k: cfg[k] for k in ("reps", "workers", "ours_concurrency", "poll_interval",
                                    "w1", "w4", "take_users")},
        nodes={name: side.node_names for name, side in sides.items()},
        settings={"plain": STATS, "citus": {**pgserver.CITUS_SETTINGS, **CITUS_STATS},
                  "coordinator": "citus's, with the W1 workers at --citus-nodes coordinator",
                  "buckets": keys.BUCKETS},
        poll_cpu_per_s={name: dict(zip(side.node_names, side.poll_cpu_per_s))
                        for name, side in sides.items()},
        top_statements={key: {name: top_statements(runs[-1]["window" if key == "w1" else "profile"],
                                                   runs[-1]["runs"] if key == "w1" else TAKES_PROFILED)
                              for name, runs in results[key].items()}
                        for key in ("w1", "take")},
        all_exactly_once=ok, seconds=time.monotonic() - started,
        machine=about, code=src_fingerprint(),
        command="python -m bench.w7 " + " ".join(argv if argv is not None else sys.argv[1:]))
    lines = report(results)
    results["table"] = lines
    print("\n".join(lines))
    print(f"every drain exactly once: {ok}")
    Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    print(f"saved {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
