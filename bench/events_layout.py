"""W1 (agent-inbox only) over several layouts of `events`, interleaved: what a
layout's HOT updates are worth before a migration is written for it.

    .venv/bin/python -m bench.events_layout [--layouts fillfactor80,fillfactor50] [--reps 3]
                                            [--users 1000] [--out FILE]

A layout (LAYOUTS) is DDL run on the freshly migrated database before the
preload, so the backlog's pages are written with it:
- `fillfactor80`, `fillfactor50`: the table's fillfactor (migration 0014's,
  0015's): room on each page for the claims' HOT versions;
- `hot_close`: fillfactor 50 with `ix_events_open` and `ix_events_dead`
  dropped, so that no index holds `outcome` and a run's close is HOT too.
  The run path still drains exactly once on it (a user's open events are
  then read through the primary key from its low-water mark), but the views
  that count open or dead events across users have no index left: this
  measures the lever, it is not a layout to ship as it stands.

Each repetition runs bench.run's W1 drain (`--users` users x 20 events,
preloaded in arrival order, 4 worker processes at concurrency 32) once per
layout, the order rotating between repetitions. Reports, per layout,
events/s over the drain (medians, and every run) and the share of the
`events` updates that were HOT (pg_stat_user_tables, read after the workers
stopped). Writes bench/results/w1_events_layout.json (or --out).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import psycopg

from bench import workloads as wl
from bench.common import RESULTS, ours_database, resources, src_fingerprint
from bench.run import FULL

LAYOUTS = {
    "fillfactor80": ("ALTER TABLE events SET (fillfactor = 80)",),
    "fillfactor50": ("ALTER TABLE events SET (fillfactor = 50)",),
    "hot_close": ("ALTER TABLE events SET (fillfactor = 50)",
                  "DROP INDEX ix_events_open", "DROP INDEX ix_events_dead"),
}

HOT_SHARE = ("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables"
             " WHERE relname = 'events'")


def drain_in(url: str, layout: str, users: int) -> dict:
    """One W1 drain on a database migrated anew and given `layout`: its
    figures and HOT share."""
    preload = wl._preload_ours

    def preload_at(url_: str, users_: int, per_user: int) -> set:
        with psycopg.connect(url_, autocommit=True) as conn:
            for statement in LAYOUTS[layout]:
                conn.execute(statement)
        return preload(url_, users_, per_user)

    before = []  # the counters as the workers start (they add up over the repetitions)

    def counters() -> tuple[int, int]:
        with psycopg.connect(url, autocommit=True) as conn:
            return conn.execute(HOT_SHARE).fetchone()

    wl._preload_ours = preload_at
    try:
        r = wl.drain("ours", url, users=users, per_user=FULL["w1"]["per_user"],
                     workers=FULL["workers"], concurrency=FULL["ours_concurrency"],
                     poll=FULL["poll_interval"], timeout=FULL["drain_timeout"],
                     on_loaded=lambda: before.append(counters()))
    finally:
        wl._preload_ours = preload
    # a claim and a close per event, reported by the workers' backends as they end
    deadline = time.monotonic() + 10
    while True:
        updates, hot = (now - was for now, was in zip(counters(), before[0]))
        if updates >= 2 * r["events"] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    r["events_updates"], r["events_hot_updates"] = updates, hot
    r["hot_share"] = hot / updates if updates else None
    return r


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.events_layout")
    parser.add_argument("--layouts", default="fillfactor80,fillfactor50",
                        help=f"comma-separated, of {', '.join(LAYOUTS)}; the first is the base")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--users", type=int, default=FULL["w1"]["users"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--server-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args(argv)
    layouts = args.layouts.split(",")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout {', '.join(unknown)}: one of {', '.join(LAYOUTS)}")
    res = resources()
    runs: dict[str, list[dict]] = {name: [] for name in layouts}
    ok = True
    try:
        for rep in range(args.reps):
            k = rep % len(layouts)
            for name in layouts[k:] + layouts[:k]:
                url = ours_database(args.server_url)
                r = drain_in(url, name, args.users)
                res.drop(url)
                ok = ok and r["check"]["ok"]
                runs[name].append(r)
                print(f"rep {rep + 1} {name}: {r['events_per_s_drain']:,.0f} events/s"
                      f" (drain), HOT {100 * (r['hot_share'] or 0):.0f} % of the events' updates,"
                      f" exactly once {r['check']['ok']}", flush=True)
    finally:
        res.release()
    medians = {name: {"events_per_s_drain": statistics.median(r["events_per_s_drain"] for r in rs),
                      "hot_share": statistics.median(r["hot_share"] or 0 for r in rs)}
               for name, rs in runs.items()}
    base = medians[layouts[0]]["events_per_s_drain"]
    for name in layouts:
        m = medians[name]
        print(f"{name}: {m['events_per_s_drain']:,.0f} events/s over the drain (median),"
              f" {m['events_per_s_drain'] / base:.3f}x {layouts[0]}'s;"
              f" HOT {100 * m['hot_share']:.0f} %")
    path = Path(args.out) if args.out else RESULTS / "w1_events_layout.json"
    path.write_text(json.dumps({"layouts": {name: LAYOUTS[name] for name in layouts},
                                "reps": args.reps, "users": args.users,
                                "working_tree": src_fingerprint(), "medians": medians,
                                "runs": runs, "correct": ok,
                                "date": time.strftime("%Y-%m-%dT%H:%M:%S")},
                               indent=1, default=str))
    print(path, "correct" if ok else "CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
