"""agent-inbox vs. the PostgreSQL ceiling and procrastinate: `python -m bench.run`.

    .venv/bin/python -m bench.run [--quick] [--out bench/results/latest.json]
    .venv/bin/python -m bench.run --scaling     # W1 at 1, 2, 4, 8 workers -> w1_scaling.png
    .venv/bin/python -m bench.run --only w5,w5s [--set w5.concurrency=200] [--ours-src REV]

See bench/README.md for what each workload measures and how.
"""

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import psycopg

from bench import workloads as wl
from bench.common import (RESULTS, ours_database, peer_database, resources,
                          src_fingerprint, summary)

DEFAULT_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"

FULL = {
    "reps": 3,
    "pgbench": {"scale": 10, "clients": 4, "threads": 2, "seconds": 20},
    "insert_loop_s": 5.0,
    # W1, W1b, W2: the peer's workers run at `concurrency`, ours at `ours_concurrency`
    # (a run in flight costs ours a task or a thread, no process and no connection, and
    # the producer takes up to that many users in one statement: 32 is the batch the
    # previous worker took per take; set it to 1 with --ours-src of such a revision).
    "workers": 4, "concurrency": 1, "ours_concurrency": 32, "poll_interval": 1.0,
    "drain_timeout": 900,
    "w1": {"users": 1000, "per_user": 20},
    "w1b": {"users": 20000, "per_user": 1},
    "w2": {"users": 200, "interval": 0.010, "duration": 20.0},
    "w3": {"events": 20000, "dup_fraction": 0.10, "users": 1000, "batch": 500, "conns": 4},
    "w4": {"scales": [1000, 100000], "busy": 100, "done_per_idle": 10, "pending": 5,
           "calls": 200, "warmup": 20},
    # W4b: `thinking` users holding a valid lease with `thinking_pending` pending events
    # each, plus `busy` free users with work, measured rep by rep beside W4 at
    # `baseline_users` (its own database, `busy` of them with work).
    "w4b": {"thinking": 10000, "thinking_pending": 10, "busy": 100, "pending": 5,
            "baseline_users": 1000, "done_per_idle": 10, "calls": 200, "warmup": 20},
    # W5/W5s: ONE worker process, handlers that wait 1 s. ours_extra_args None: automatic
    # (`--isolation thread` if this agent-inbox lists --isolation, else nothing).
    # systems: which of "ours", "peer" run (e.g. --set 'w5.systems=["peer"]').
    # The peer runs at each of peer_variants (concurrency, and threads of its sync-task
    # executor: None = procrastinate's default; a timeout of its own), its best median
    # runs/s is compared. procrastinate's default runs sync tasks on 6 threads on 2 cores
    # (Python's default executor): that variant cannot drain W5s, 30 s shows its rate.
    "w5": {"systems": ["ours", "peer"], "users": 10000, "concurrency": 1000, "handler": "async",
           "sleep": 1.0, "lease_ttl": 60, "timeout": 120, "stall_s": 30, "rss_cap_mib": 4096,
           "conn_cap": 64, "ours_extra_args": None,
           "peer_variants": [{"concurrency": 1000}, {"concurrency": 500}, {"concurrency": 200}]},
    "w5s": {"systems": ["ours", "peer"], "users": 2000, "concurrency": 200, "handler": "sync",
            "sleep": 1.0, "lease_ttl": 60, "timeout": 120, "stall_s": 30, "rss_cap_mib": 4096,
            "conn_cap": 64, "ours_extra_args": None,
            "peer_variants": [{"concurrency": 200, "timeout": 30},
                              {"concurrency": 200, "threads": 200}]},
    # W5x3 (agent-inbox only: procrastinate has no durable steps): W5's shape, each run
    # three `await ctx.step(...)` of 0.3 s each; ideal 1,000 runs/s (concurrency / `sleep`
    # = 1 s a run, the reference; the sleeps alone are 0.9 s).
    "w5x3": {"systems": ["ours"], "users": 10000, "concurrency": 1000, "handler": "steps",
             "steps": 3, "step_sleep": 0.3, "sleep": 1.0, "lease_ttl": 60, "timeout": 120,
             "stall_s": 30, "rss_cap_mib": 4096, "conn_cap": 64, "ours_extra_args": None,
             "peer_variants": []},
}

QUICK = {
    "reps": 1,
    "pgbench": {"scale": 1, "clients": 4, "threads": 2, "seconds": 5},
    "insert_loop_s": 2.0,
    "workers": 4, "concurrency": 1, "ours_concurrency": 32, "poll_interval": 1.0,
    "drain_timeout": 300,
    "w1": {"users": 200, "per_user": 10},
    "w1b": {"users": 1000, "per_user": 1},
    "w2": {"users": 50, "interval": 0.010, "duration": 5.0},
    "w3": {"events": 2000, "dup_fraction": 0.10, "users": 200, "batch": 250, "conns": 4},
    "w4": {"scales": [1000, 10000], "busy": 100, "done_per_idle": 10, "pending": 5,
           "calls": 50, "warmup": 10},
    "w4b": {"thinking": 2000, "thinking_pending": 10, "busy": 100, "pending": 5,
            "baseline_users": 1000, "done_per_idle": 10, "calls": 50, "warmup": 10},
    "w5": {"systems": ["ours", "peer"], "users": 3000, "concurrency": 1000, "handler": "async",
           "sleep": 1.0, "lease_ttl": 60, "timeout": 60, "stall_s": 20, "rss_cap_mib": 4096,
           "conn_cap": 64, "ours_extra_args": None,
           "peer_variants": [{"concurrency": 1000}, {"concurrency": 500}, {"concurrency": 200}]},
    "w5s": {"systems": ["ours", "peer"], "users": 600, "concurrency": 200, "handler": "sync",
            "sleep": 1.0, "lease_ttl": 60, "timeout": 60, "stall_s": 20, "rss_cap_mib": 4096,
            "conn_cap": 64, "ours_extra_args": None,
            "peer_variants": [{"concurrency": 200, "timeout": 20},
                              {"concurrency": 200, "threads": 200}]},
    # W5x3 (agent-inbox only: procrastinate has no durable steps): W5's shape, each run
    # three `await ctx.step(...)` of 0.3 s each; ideal 1,000 runs/s (concurrency / `sleep`
    # = 1 s a run, the reference; the sleeps alone are 0.9 s).
    "w5x3": {"systems": ["ours"], "users": 3000, "concurrency": 1000, "handler": "steps",
             "steps": 3, "step_sleep": 0.3, "sleep": 1.0, "lease_ttl": 60, "timeout": 60,
             "stall_s": 20, "rss_cap_mib": 4096, "conn_cap": 64, "ours_extra_args": None,
             "peer_variants": []},
}

# The agent-inbox runtime with a connection per slot (it lists `--isolation`) opens up to
# concurrency + 2 connections: above this it is not started (max_connections is 100 on a
# shared server). The redesigned worker uses a fixed few connections whatever concurrency.
PER_SLOT_MAX_CONCURRENCY = 200

SYSTEMS = ("ours", "peer")
NAMES = {"ours": "agent-inbox", "peer": "procrastinate"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Collector:
    """Per-rep figures and checks, by workload and system."""

    def __init__(self):
        self.runs: dict = {}     # workload -> system -> list of per-rep dicts
        self.errors: list = []

    def add(self, workload: str, system: str, result: dict) -> None:
        self.runs.setdefault(workload, {}).setdefault(system, []).append(result)

    def attempt(self, workload: str, system: str, fn, *args, **kwargs):
        t = time.monotonic()
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 -- one failed rep must not lose the others
            self.errors.append({"workload": workload, "system": system, "error": repr(exc),
                                "traceback": traceback.format_exc()})
            log(f"  {workload} {system}: FAILED {exc!r}")
            return None
        result["loadavg_1m"] = os.getloadavg()[0]
        self.add(workload, system, result)
        check = result.get("check", {})
        mark = "" if check.get("ok", True) else f"  CHECK FAILED {check}"
        log(f"  {workload} {NAMES.get(system, system)}: {_brief(result)} "
            f"({time.monotonic() - t:.1f} s){mark}")
        return result

    def summary(self, workload: str, system: str, key: str) -> dict:
        return summary([r.get(key) for r in self.runs.get(workload, {}).get(system, [])])

    def checks(self, workload: str, system: str) -> list:
        return [r.get("check") for r in self.runs.get(workload, {}).get(system, []) if "check" in r]


def _brief(result: dict) -> str:
    keys = ["tps", "commits_per_s", "events_per_s", "events_per_s_drain", "runs_per_s", "p50_ms",
            "p99_ms", "max_ms", "median_ms", "server_ms", "drain_s", "runs_per_s_drain",
            "ratio_to_ideal", "runs_per_s_upto_stop", "peak_rss_mib", "peak_connections",
            "peak_runs_at_once", "runs_per_s_from_spawn", "step_cost_p50_ms", "step_cost_p99_ms"]
    text = ", ".join(f"{k}={result[k]:.2f}" for k in keys if isinstance(result.get(k), (int, float))
                     and not isinstance(result.get(k), bool))
    if "outcome" in result:
        text += f", outcome={result['outcome']}"
    return text


# --- the run ---------------------------------------------------------------------------------

def machine(server_url: str) -> dict:
    with psycopg.connect(server_url) as conn:
        version = conn.execute("SELECT version()").fetchone()[0]
        settings = dict(conn.execute(
            "SELECT name, setting FROM pg_settings WHERE name IN ('fsync', 'synchronous_commit',"
            " 'shared_buffers', 'max_connections', 'wal_level', 'jit')").fetchall())
    try:
        import procrastinate
        peer_version = procrastinate.__version__
    except AttributeError:
        from importlib.metadata import version as v
        peer_version = v("procrastinate")
    code = src_fingerprint()
    return {"nproc": os.cpu_count(), "loadavg_at_start": os.getloadavg(),
            "postgresql": version, "postgresql_settings": settings,
            "python": platform.python_version(), "procrastinate": peer_version,
            "psycopg": psycopg.__version__, "agent_inbox_code": code,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "platform": platform.platform()}


def run_all(cfg: dict, server_url: str, only: set | None, budget_s: float | None,
            quick: bool = False) -> tuple[Collector, dict]:
    """Repetition-major: each repetition runs the ceiling and W1, W1b, W2, W3, W5, W5s once for
    each system (their order alternating between repetitions), so every figure's
    repetitions are spread over the whole run and see the same background load. W4 runs
    last, on its own databases. With a time budget, repetitions after the first are
    skipped when the previous one says they would not fit (the JSON says how many ran)."""
    c = Collector()
    extra: dict = {"reps_done": 0}
    reps = cfg["reps"]
    wanted = lambda name: only is None or name in only  # noqa: E731
    workers_of = lambda system: dict(  # noqa: E731
        workers=cfg["workers"], poll=cfg["poll_interval"], timeout=cfg["drain_timeout"],
        concurrency=cfg["ours_concurrency" if system == "ours" else "concurrency"])
    started = time.monotonic()
    ceiling_url = ours_url = peer_url = None
    needs_dbs = any(wanted(w) for w in ("w1", "w1b", "w2", "w3", "w5", "w5s", "w5x3"))
    if needs_dbs:
        ours_url = ours_database(server_url)
        peer_url = peer_database(server_url)
    url_of = lambda system: ours_url if system == "ours" else peer_url  # noqa: E731
    if wanted("w3"):
        w3 = cfg["w3"]
        events, distinct = wl.w3_events(w3["events"], w3["dup_fraction"], w3["users"])
        extra["w3_distinct_keys"] = distinct
    w4_reserve = 60.0 if wanted("w4") else 0.0
    last_rep = 0.0
    agent_args = {}
    for name in ("w5", "w5s", "w5x3"):
        if wanted(name):
            if "ours" not in cfg[name]["systems"]:
                continue
            args, per_slot = wl.ours_agent_args(wl.OURS_ENV, cfg[name]["ours_extra_args"])
            refused = (per_slot and cfg[name]["concurrency"] > PER_SLOT_MAX_CONCURRENCY)
            agent_args[name] = None if refused else args
            extra[f"{name}_ours_extra_args"] = args
            extra[f"{name}_ours_connection_per_slot"] = per_slot
            if refused:
                msg = (f"{name} agent-inbox not run: this worker opens a connection per slot "
                       f"(it lists --isolation), concurrency {cfg[name]['concurrency']} > "
                       f"{PER_SLOT_MAX_CONCURRENCY}; use --set {name}.concurrency=200")
                c.errors.append({"workload": name, "system": "ours", "error": msg,
                                 "traceback": None})
                log(msg)

    for rep in range(reps):
        if rep and budget_s and time.monotonic() - started + last_rep + w4_reserve > budget_s:
            log(f"time budget ({budget_s:.0f} s): stopping after {rep} repetition(s)")
            break
        rep_started = time.monotonic()
        code = src_fingerprint()
        extra.setdefault("code_per_rep", []).append(code)
        log(f"--- repetition {rep + 1} of {reps} (agent-inbox {code['git']}, src {code['sha256']})")
        order = SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]
        if wanted("ceiling"):
            pb = cfg["pgbench"]
            if ceiling_url is None:
                log(f"ceiling: pgbench -i -s {pb['scale']}")
                ceiling_url = wl.pgbench_init(server_url, pb["scale"])
            c.attempt("ceiling_pgbench", "pg", wl.pgbench_run, ceiling_url, pb["clients"],
                      pb["threads"], pb["seconds"])
            c.attempt("ceiling_insert", "pg", wl.insert_commit_loop, ceiling_url,
                      cfg["insert_loop_s"])
        for name in ("w1", "w1b"):
            if wanted(name):
                log(f"{name}: drain {cfg[name]['users']} users x {cfg[name]['per_user']} events")
                for system in order:
                    c.attempt(name, system, wl.drain, system, url_of(system), **cfg[name],
                              **workers_of(system))
        if wanted("w2"):
            w2 = cfg["w2"]
            log(f"w2: latency, 1 event / {w2['interval'] * 1000:.0f} ms for {w2['duration']} s, "
                f"{w2['users']} users")
            for system in order:
                c.attempt("w2", system, wl.latency, system, url_of(system), **w2,
                          **workers_of(system))
        if wanted("w3"):
            log(f"w3: ingest {len(events)} deliveries, {distinct} distinct keys")
            k, b = w3["conns"], w3["batch"]
            variants = [("w3_single_1c", "single", 1, True), ("w3_batch_1c", "batch", 1, True),
                        (f"w3_batch_{k}c", "batch", k, True)]
            for name, mode, conns, dedupe in variants:
                for system in order:
                    if system == "ours":
                        c.attempt(name, system, wl.w3_ours, ours_url, events, distinct, mode=mode,
                                  conns=conns, batch=b)
                    else:
                        c.attempt(name, system, wl.w3_peer, peer_url, events, distinct, mode=mode,
                                  conns=conns, batch=b, dedupe=dedupe)
            for conns in (1, k):
                c.attempt(f"w3_batch_{conns}c_nodedupe", "peer", wl.w3_peer, peer_url, events,
                          distinct, mode="batch", conns=conns, batch=b, dedupe=False)
        for name in ("w5", "w5s", "w5x3"):
            if not wanted(name):
                continue
            w5 = {k: v for k, v in cfg[name].items()
                  if k not in ("ours_extra_args", "peer_variants", "systems")}
            variants = cfg[name]["peer_variants"]
            log(f"{name}: {w5['users']} users x 1 event, handler {w5['handler']} "
                + (f"{w5['steps']} steps x {w5['step_sleep']} s" if w5.get("steps")
                   else f"sleep {w5['sleep']} s") + ", 1 worker process; agent-inbox "
                + (f"concurrency {w5['concurrency']} {agent_args[name]}" if agent_args.get(name)
                   is not None else "not run")
                + (f", procrastinate {[wl.peer_variant_name(v) for v in variants]}"
                   if "peer" in cfg[name]["systems"] else ", procrastinate not run"))
            for system in order:
                if system not in cfg[name]["systems"]:
                    continue
                if system == "ours":
                    if agent_args.get(name) is not None:
                        c.attempt(name, "ours", wl.agents, "ours", ours_url, **w5,
                                  extra_args=agent_args[name])
                    continue
                for v in variants:
                    c.attempt(name, f"peer_{wl.peer_variant_name(v)}", wl.agents, "peer", peer_url,
                              **{**w5, "concurrency": v["concurrency"],
                                 "timeout": v.get("timeout", w5["timeout"])},
                              threads=v.get("threads"))
        extra["reps_done"] = rep + 1
        last_rep = time.monotonic() - rep_started
        log(f"--- repetition {rep + 1} took {last_rep:.0f} s")

    if ours_url:
        resources().drop(ours_url)
        resources().drop(peer_url)
    if ceiling_url is not None:
        resources().drop(ceiling_url)

    if wanted("w4"):
        w4 = cfg["w4"]
        serial = [0]
        for users in w4["scales"]:
            log(f"w4: take_work with {users} users, {w4['busy']} with work")
            t = time.monotonic()
            url = wl.w4_setup(server_url, users, w4["busy"], w4["done_per_idle"], w4["pending"])
            rows = wl.scalar(url, "SELECT count(*) FROM events")
            log(f"  setup {time.monotonic() - t:.1f} s ({rows} event rows)")
            for rep in range(reps):
                c.attempt(f"w4_{users}", "ours", wl.w4_measure, url, calls=w4["calls"],
                          warmup=w4["warmup"], pending=w4["pending"], serial=serial)
            from agent_inbox import Inbox
            with Inbox.connect(url, pool_size=1) as inbox:
                text = wl.explain_take_work(url, inbox, "bench-w4-explain")
            path = RESULTS / f"{'quick_' if quick else ''}explain_w4_{users}.txt"
            path.write_text(f"-- TAKE_WORK at {users} users ({w4['busy']} with work, "
                            f"{w4['done_per_idle']} done events per idle user)\n" + text)
            extra[f"w4_{users}_server_ms"] = wl.server_execution_ms(text)
            extra[f"w4_{users}_event_rows"] = rows
            resources().drop(url)
    if wanted("w4b"):
        run_w4b(c, extra, cfg["w4b"], server_url, reps, quick)
    return c, extra


def run_w4b(c: Collector, extra: dict, w4b: dict, server_url: str, reps: int,
            quick: bool) -> None:
    """W4b beside W4 at baseline_users, the two measured in turn in each repetition (so
    both see the same background load), then each TAKE_WORK explained."""
    from agent_inbox import Inbox
    serial = [0]
    log(f"w4b: take_work with {w4b['thinking']} users holding a lease "
        f"({w4b['thinking_pending']} pending events each), {w4b['busy']} free with work; "
        f"beside w4 at {w4b['baseline_users']} users")
    t = time.monotonic()
    base_url = wl.w4_setup(server_url, w4b["baseline_users"], w4b["busy"], w4b["done_per_idle"],
                           w4b["pending"])
    url, settle = wl.w4b_setup(server_url, w4b["thinking"], w4b["busy"], w4b["pending"],
                               w4b["thinking_pending"], serial)
    extra["w4b_setup"] = {**settle, "s": time.monotonic() - t,
                          "event_rows": wl.scalar(url, "SELECT count(*) FROM events"),
                          "pending_of_held_leases": wl.scalar(url, wl.PENDING_OF_HELD_LEASES)}
    log(f"  setup {extra['w4b_setup']['s']:.1f} s ({settle['settle_calls']} settling takes in "
        f"{settle['settle_s']:.1f} s)")
    kwargs = dict(calls=w4b["calls"], warmup=w4b["warmup"], pending=w4b["pending"], serial=serial)
    for _ in range(reps):
        c.attempt("w4b_baseline", "ours", wl.w4_measure, base_url, **kwargs)
        c.attempt("w4b", "ours", wl.w4_measure, url, **kwargs)
    prefix = "quick_" if quick else ""
    for name, db, what in (
            (f"explain_w4b_{w4b['thinking']}.txt", url,
             f"{w4b['thinking']} users holding a lease with {w4b['thinking_pending']} pending "
             f"events each, {w4b['busy']} free users with work"),
            (f"explain_w4b_baseline_{w4b['baseline_users']}.txt", base_url,
             f"{w4b['baseline_users']} users ({w4b['busy']} with work, {w4b['done_per_idle']} "
             f"done events per idle user)")):
        with Inbox.connect(db, pool_size=1) as inbox:
            text = wl.explain_take_work(db, inbox, "bench-w4-explain")
        (RESULTS / (prefix + name)).write_text(f"-- TAKE_WORK at {what}\n" + text)
        extra[name.removeprefix("explain_").removesuffix(".txt") + "_server_ms"] = \
            wl.server_execution_ms(text)
    resources().drop(url)
    resources().drop(base_url)


# --- the table -----------------------------------------------------------------------------------

def ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def build_rows(c: Collector, cfg: dict, extra: dict) -> list[dict]:
    rows = []
    pgb = c.summary("ceiling_pgbench", "pg", "tps")
    ins = c.summary("ceiling_insert", "pg", "commits_per_s")

    def row(workload, figure, unit, better, ours, peer=None, ceiling=None, ceiling_name=None,
            note=None):
        r = {"workload": workload, "figure": figure, "unit": unit, "better": better,
             "ours": ours, "peer": peer,
             "ours_over_peer": ratio(ours and ours["median"], peer and peer["median"]) if peer else None,
             "ceiling": ceiling_name, "ceiling_value": ceiling and ceiling["median"],
             "ours_over_ceiling": ratio(ours and ours["median"], ceiling and ceiling["median"])
             if ceiling else None}
        if note:
            r["note"] = note
        rows.append(r)

    if "ceiling_pgbench" in c.runs:
        pb = cfg["pgbench"]
        row("ceiling", f"pgbench -N -s {pb['scale']} -c {pb['clients']} -j {pb['threads']} "
            f"-T {pb['seconds']}", "tps", "higher", pgb)
        row("ceiling", "INSERT+COMMIT loop, 1 connection", "commits/s", "higher", ins)

    for name in ("w1", "w1b"):
        if name not in c.runs:
            continue
        s = lambda sys_, k: c.summary(name, sys_, k)  # noqa: E731
        row(name, "wall, worker spawn -> all done", "s", "lower", s("ours", "wall_s"), s("peer", "wall_s"))
        row(name, "drain, first handler start -> all done", "s", "lower", s("ours", "drain_s"),
            s("peer", "drain_s"))
        row(name, "events/s (wall)", "events/s", "higher", s("ours", "events_per_s"),
            s("peer", "events_per_s"))
        row(name, "events/s (drain)", "events/s", "higher", s("ours", "events_per_s_drain"),
            s("peer", "events_per_s_drain"))
        row(name, "runs/s (drain; peer: jobs/s)", "runs/s", "higher", s("ours", "runs_per_s_drain"),
            s("peer", "runs_per_s_drain"), pgb if "ceiling_pgbench" in c.runs else None,
            "pgbench tps")
        row(name, "runs", "runs", "-", s("ours", "runs"), s("peer", "runs"))

    if "w2" in c.runs:
        for k, label in (("p50_ms", "latency p50"), ("p99_ms", "latency p99"), ("max_ms", "latency max")):
            row("w2", f"{label}, ingest call -> handler start, all events", "ms", "lower",
                c.summary("w2", "ours", k), c.summary("w2", "peer", k))
        for k, label in (("steady_p50_ms", "latency p50"), ("steady_p99_ms", "latency p99"),
                         ("steady_max_ms", "latency max")):
            row("w2", f"{label}, events sent after the first 2 s", "ms", "lower",
                c.summary("w2", "ours", k), c.summary("w2", "peer", k))
        row("w2", "producer rate achieved", "events/s", "-", c.summary("w2", "ours", "produced_per_s"),
            c.summary("w2", "peer", "produced_per_s"))

    k = cfg["w3"]["conns"]
    labels = [("w3_single_1c", "ingest / defer(queueing_lock), 1 conn"),
              ("w3_batch_1c", f"ingest_many / batch_defer(queueing_lock) x{cfg['w3']['batch']}, 1 conn"),
              (f"w3_batch_{k}c", f"ingest_many / batch_defer(queueing_lock) x{cfg['w3']['batch']}, {k} conns")]
    for name, label in labels:
        if name in c.runs:
            row("w3", label + " (all deduplicated)", "events/s", "higher",
                c.summary(name, "ours", "events_per_s"), c.summary(name, "peer", "events_per_s"),
                ins if "ceiling_insert" in c.runs else None, "INSERT+COMMIT/s")
    for name, label in (("w3_batch_1c_nodedupe", "peer batch_defer, no dedupe, 1 conn"),
                        (f"w3_batch_{k}c_nodedupe", f"peer batch_defer, no dedupe, {k} conns")):
        if name in c.runs:
            peer = c.summary(name, "peer", "events_per_s")
            ours_name = name.replace("_nodedupe", "")
            row("w3", label + " (reference: stores every delivery)", "events/s", "higher",
                c.summary(ours_name, "ours", "events_per_s"), peer,
                note="ours column repeats the deduplicated ingest_many figure")

    for name in ("w5", "w5s", "w5x3"):
        if name in c.runs:
            agent_rows(c, cfg, extra, name, row)

    for users in cfg["w4"]["scales"]:
        name = f"w4_{users}"
        if name in c.runs:
            row("w4", f"take_work round trip, {users} users ({cfg['w4']['busy']} busy)", "ms",
                "lower", c.summary(name, "ours", "median_ms"))
    if "w4b" in c.runs and "w4b_baseline" in c.runs:
        w4b = cfg["w4b"]
        base = c.summary("w4b_baseline", "ours", "median_ms")
        busy = c.summary("w4b", "ours", "median_ms")
        row("w4b", f"take_work round trip, {w4b['baseline_users']} users ({w4b['busy']} with "
            "work), beside W4b", "ms", "lower", base)
        row("w4b", f"take_work round trip, {w4b['thinking']} users holding a lease with "
            f"{w4b['thinking_pending']} pending events + {w4b['busy']} free with work", "ms",
            "lower", busy)
        rows.append({"workload": "w4b", "figure": "take_work W4b / W4 (goal <= 1.5)",
                     "unit": "x", "better": "lower",
                     "ours": {"median": ratio(busy["median"], base["median"]), "min": None,
                              "max": None, "runs": []},
                     "peer": None, "ours_over_peer": None, "ceiling": None, "ceiling_value": None,
                     "ours_over_ceiling": None})
    scales = cfg["w4"]["scales"]
    if all(f"w4_{u}" in c.runs for u in scales) and len(scales) == 2:
        a = c.summary(f"w4_{scales[0]}", "ours", "median_ms")["median"]
        b = c.summary(f"w4_{scales[1]}", "ours", "median_ms")["median"]
        rows.append({"workload": "w4", "figure": f"take_work {scales[1]} / {scales[0]} users",
                     "unit": "x", "better": "lower", "ours": {"median": ratio(b, a), "min": None,
                                                              "max": None, "runs": []},
                     "peer": None, "ours_over_peer": None, "ceiling": None, "ceiling_value": None,
                     "ours_over_ceiling": None})
        for u in scales:
            ms = extra.get(f"w4_{u}_server_ms")
            if ms is not None:
                rows.append({"workload": "w4", "figure": f"TAKE_WORK server execution (EXPLAIN "
                             f"ANALYZE), {u} users", "unit": "ms", "better": "lower",
                             "ours": {"median": ms, "min": ms, "max": ms, "runs": [ms]},
                             "peer": None, "ours_over_peer": None, "ceiling": None,
                             "ceiling_value": None, "ours_over_ceiling": None})
    return rows


def best_peer_variant(c: Collector, name: str) -> str | None:
    """The peer variant (system key peer_<variant>) with the highest median runs/s over the
    drain among those that drained at least once; if none drained, the highest median
    runs/s until stopped."""
    variants = [k for k in c.runs.get(name, {}) if k.startswith("peer_")]
    drained = [(c.summary(name, k, "runs_per_s_drain")["median"], k) for k in variants]
    drained = [d for d in drained if d[0] is not None]
    if drained:
        return max(drained)[1]
    upto = [(c.summary(name, k, "runs_per_s_upto_stop")["median"], k) for k in variants]
    upto = [u for u in upto if u[0] is not None]
    return max(upto)[1] if upto else None


def _outcomes(c: Collector, name: str, system: str) -> str:
    reps = c.runs.get(name, {}).get(system, [])
    bad = [r["outcome"].split(":")[0] for r in reps if not r.get("drained")]
    return "" if not bad else f" [not drained {len(bad)}/{len(reps)}: {', '.join(sorted(set(bad)))}]"


def agent_rows(c: Collector, cfg: dict, extra: dict, name: str, row) -> None:
    """W5/W5s rows: ours beside the peer's best variant, then every peer variant."""
    w = cfg[name]
    best = best_peer_variant(c, name)
    extra[f"{name}_peer_best"] = best
    s = lambda sys_, k: c.summary(name, sys_, k) if sys_ else None  # noqa: E731
    tag = f" (peer: best, {best[5:]})" if best else ""
    ideal = s("ours", "ideal_runs_per_s") if "ours" in c.runs[name] else None
    row(name, f"drain, first handler start -> all done{tag}", "s", "lower", s("ours", "drain_s"),
        s(best, "drain_s"))
    row(name, f"runs/s (drain){tag}", "runs/s", "higher", s("ours", "runs_per_s_drain"),
        s(best, "runs_per_s_drain"), ideal, f"ideal {w['concurrency']}/{w['sleep']:g} s")
    row(name, f"runs/s / ideal (concurrency / {w['sleep']:g} s){tag}", "x", "higher",
        s("ours", "ratio_to_ideal"), s(best, "ratio_to_ideal"))
    row(name, f"peak RSS, worker process + descendants{tag}", "MiB", "lower",
        s("ours", "peak_rss_mib"), s(best, "peak_rss_mib"))
    row(name, f"peak DB connections of the worker{tag}", "conns", "lower",
        s("ours", "peak_connections"), s(best, "peak_connections"))
    row(name, f"peak handlers running at once{tag}", "runs", "higher",
        s("ours", "peak_runs_at_once"), s(best, "peak_runs_at_once"))
    row(name, f"start-up, worker spawn -> first handler{tag}", "s", "lower", s("ours", "startup_s"),
        s(best, "startup_s"))
    if w.get("steps"):
        row(name, "runs/s from spawn (worker spawn -> all done)", "runs/s", "higher",
            s("ours", "runs_per_s_from_spawn"))
        row(name, f"runs/s / sleeps alone (concurrency / {w['steps']} x {w['step_sleep']:g} s)",
            "x", "higher", s("ours", "ratio_to_sleep_ideal"))
        for p in ("p50", "p90", "p99", "max"):
            row(name, f"step cost {p} (ctx.step minus its function, every step)", "ms",
                "lower", s("ours", f"step_cost_{p}_ms"))
    for v in w["peer_variants"]:
        key = "peer_" + wl.peer_variant_name(v)
        if key not in c.runs[name]:
            continue
        label = (f"procrastinate concurrency {v['concurrency']}"
                 + (f", {v['threads']} sync threads" if v.get("threads") else ""))
        out = _outcomes(c, name, key)
        row(name, f"{label}: runs/s (drain; else until stopped){out}", "runs/s", "higher", None,
            s(key, "runs_per_s_drain") if not out else s(key, "runs_per_s_upto_stop"))
        row(name, f"{label}: drain{out}", "s", "lower", None, s(key, "drain_s"))
        row(name, f"{label}: peak RSS", "MiB", "lower", None, s(key, "peak_rss_mib"))
        row(name, f"{label}: peak DB connections", "conns", "lower", None,
            s(key, "peak_connections"))


def fmt(s: dict | None, unit: str) -> str:
    if not s or s.get("median") is None:
        return "-"
    digits = 2 if unit in ("ms", "s", "x") else 0
    if unit == "x" and s["median"] < 10:
        digits = 3
    m = f"{s['median']:,.{digits}f}"
    if s.get("min") is None or s["min"] == s["max"]:
        return m
    return f"{m} [{s['min']:,.{digits}f}-{s['max']:,.{digits}f}]"


def print_table(rows: list[dict]) -> None:
    header = ["wl", "figure", "unit", "agent-inbox med [min-max]", "procrastinate med [min-max]",
              "ours/peer", "ours/ceiling"]
    table = [header]
    for r in rows:
        rp = r["ours_over_peer"]
        rc = r["ours_over_ceiling"]
        table.append([r["workload"], r["figure"], r["unit"] + ("" if r["better"] in ("-",) else
                                                               f" ({r['better'][0]})"),
                      fmt(r["ours"], r["unit"]), fmt(r["peer"], r["unit"]),
                      "-" if rp is None else f"{rp:.2f}",
                      "-" if rc is None else f"{rc:.3f} of {r['ceiling']}"])
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
    for n, row in enumerate(table):
        print("  ".join(str(cell).ljust(widths[i]) for i, cell in enumerate(row)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def all_checks(c: Collector) -> dict:
    out = {}
    for workload, systems in c.runs.items():
        for system, reps in systems.items():
            checks = [r["check"] for r in reps if "check" in r]
            if checks:
                out[f"{workload}.{system}"] = {"ok": all(ch.get("ok") for ch in checks),
                                               "reps": checks}
    return out


def apply_settings(cfg: dict, items: list[str], error) -> None:
    """Apply `--set KEY=JSON` overrides (KEY dotted, e.g. w5.concurrency) to
    `cfg` in place; `error(message)` for a key that names no setting."""
    for item in items:
        key, _, value = item.partition("=")
        *path, last = key.split(".")
        node = cfg
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                break
        if not isinstance(node, dict) or last not in node:
            error(f"--set {key}: no such setting")
            continue
        node[last] = json.loads(value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 run, smaller sizes (smoke test)")
    parser.add_argument("--out", default=None, help="JSON output (default bench/results/latest.json,"
                        " or quick.json with --quick, scaling.json with --scaling)")
    parser.add_argument("--server-url", default=DEFAULT_SERVER,
                        help="a maintenance database on the PostgreSQL server to use")
    parser.add_argument("--only", default=None,
                        help="comma-separated subset: ceiling,w1,w1b,w2,w3,w4,w4b,w5,w5s,w5x3")
    parser.add_argument("--scaling", action="store_true",
                        help="W1 at 1, 2, 4, 8 worker processes for both systems; writes "
                             "bench/results/scaling.json and w1_scaling.png")
    parser.add_argument("--reps", type=int, default=None, help="override the repetitions")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                        help="override a setting, e.g. --set w5.concurrency=200 --set "
                             "'w5.ours_extra_args=[\"--isolation\",\"thread\"]' (repeatable)")
    parser.add_argument("--ours-src", default=None, metavar="REV",
                        help="run agent-inbox workers from this git revision's src/ (extracted"
                             " with git archive into a temp dir; PYTHONPATH), as bench.ab does")
    parser.add_argument("--budget-min", type=float, default=None,
                        help="time budget in minutes: repetitions after the first are skipped"
                             " when they would not fit (default 40 for a full run with W5/W5s,"
                             " else 25; none with --quick)")
    args = parser.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    resources()
    if args.scaling:
        from bench import scaling
        return scaling.main(args)

    cfg = json.loads(json.dumps(QUICK if args.quick else FULL))
    if args.reps:
        cfg["reps"] = args.reps
    apply_settings(cfg, args.set, parser.error)
    if args.ours_src:
        import subprocess
        from bench.common import ROOT
        tree = resources().tempdir("ours-src")
        archive = subprocess.run(["git", "archive", args.ours_src, "src"], cwd=ROOT,
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        wl.OURS_ENV = {"PYTHONPATH": f"{tree}/src:{ROOT}"}
        commit = subprocess.run(["git", "rev-parse", "--short", args.ours_src], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.strip()
        cfg["ours_src"] = f"{args.ours_src} ({commit})" if commit != args.ours_src else commit
    out = Path(args.out) if args.out else RESULTS / ("quick.json" if args.quick else "latest.json")
    only = set(args.only.split(",")) if args.only else None
    if args.budget_min is None and not args.quick:
        # W5/W5s add ~4 min per repetition
        args.budget_min = 40.0 if only is None or only & {"w5", "w5s", "w5x3"} else 25.0
    started = time.monotonic()
    info = machine(args.server_url)
    log(f"{'quick' if args.quick else 'full'} run, {cfg['reps']} rep(s), nproc {info['nproc']}, "
        f"load {info['loadavg_at_start']}")
    try:
        c, extra = run_all(cfg, args.server_url, only,
                           args.budget_min * 60 if args.budget_min else None, args.quick)
    finally:
        resources().release()
    total = time.monotonic() - started
    rows = build_rows(c, cfg, extra)
    checks = all_checks(c)
    info["loadavg_at_end"] = os.getloadavg()
    info["agent_inbox_code_at_end"] = src_fingerprint()
    doc = {"machine": info, "config": cfg, "quick": args.quick, "total_seconds": total,
           "table": rows, "runs": c.runs, "checks": checks, "errors": c.errors, "extra": extra,
           "correct": all(v["ok"] for v in checks.values()) and not c.errors}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str))
    print()
    print(f"agent-inbox bench ({'quick' if args.quick else 'full'}), {info['date']}, "
          f"nproc {info['nproc']}, {info['postgresql'].split(' on ')[0]}, "
          f"procrastinate {info['procrastinate']}, {cfg['workers']} worker processes x "
          f"concurrency {cfg['ours_concurrency']} (agent-inbox) / {cfg['concurrency']} (procrastinate) each")
    code = info["agent_inbox_code"]
    print(f"agent-inbox {code['git']} src {code['sha256']}"
          f"{' (uncommitted: ' + ', '.join(code['uncommitted']) + ')' if code['uncommitted'] else ''}"
          f"{'' if info['agent_inbox_code_at_end'] == code else '; src CHANGED during the run, see extra.code_per_rep'}")
    for name in ("w5", "w5s", "w5x3"):
        if name in c.runs:
            w = cfg[name]
            ours = (f"agent-inbox --concurrency {w['concurrency']} --lease-ttl {w['lease_ttl']:g} "
                    f"{' '.join(extra.get(name + '_ours_extra_args') or [])}"
                    f"{' from ' + cfg['ours_src'] if cfg.get('ours_src') else ''}"
                    if "ours" in w["systems"] else "agent-inbox not run")
            what = (f"{w['steps']} steps x {w['step_sleep']:g} s (ideal from {w['sleep']:g} s a run)"
                    if w.get("steps") else f"sleep {w['sleep']:g} s")
            print(f"{name}: {w['users']} users x 1 event, handler {w['handler']} {what}, "
                  f"ONE worker process; {ours}")
    print(f"medians of {extra.get('reps_done', cfg['reps'])} run(s) (of {cfg['reps']} planned) "
          f"[min-max]; (h)/(l): higher/lower is better; load average 1 min at start "
          f"{info['loadavg_at_start'][0]:.1f}, at end {info['loadavg_at_end'][0]:.1f}")
    print()
    print_table(rows)
    print()
    bad = {k: v for k, v in checks.items() if not v["ok"]}
    print(f"correctness: {'all checks passed' if not bad and not c.errors else 'FAILURES'}"
          f" ({len(checks)} check groups)")
    for k, v in bad.items():
        print(f"  FAILED {k}: {[r for r in v['reps'] if not r.get('ok')]}")
    for e in c.errors:
        print(f"  ERROR {e['workload']} {e['system']}: {e['error']}")
    print(f"total {total:.0f} s; JSON: {out}")
    return 0 if doc["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
