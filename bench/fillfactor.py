"""W1 (agent-inbox only) at several fillfactors of `events`, interleaved: what
the room left on each page for the claims' HOT updates is worth.

    .venv/bin/python -m bench.fillfactor [--fillfactors 80,50] [--reps 3] [--users 1000]
                                         [--out FILE]

Each repetition runs bench.run's W1 drain (`--users` users x 20 events,
preloaded in arrival order, 4 worker processes at concurrency 32) once per
fillfactor, the order rotating between repetitions. The fillfactor is set on
the freshly migrated `events` before the preload, so the backlog's pages are
written with it. Reports, per fillfactor, events/s over the drain (medians,
and every run) and the share of the `events` updates that were HOT
(pg_stat_user_tables, read after the workers stopped). Writes
bench/results/w1_fillfactor.json (or --out).
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

HOT_SHARE = ("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables"
             " WHERE relname = 'events'")


def drain_at(url: str, fillfactor: int, users: int) -> dict:
    """One W1 drain with `events` at `fillfactor`: its figures and HOT share."""
    preload = wl._preload_ours

    def preload_at(url_: str, users_: int, per_user: int) -> set:
        with psycopg.connect(url_, autocommit=True) as conn:
            conn.execute(f"ALTER TABLE events SET (fillfactor = {int(fillfactor)})")
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
    parser = argparse.ArgumentParser(prog="python -m bench.fillfactor")
    parser.add_argument("--fillfactors", default="80,50")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--users", type=int, default=FULL["w1"]["users"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--server-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args(argv)
    fillfactors = [int(f) for f in args.fillfactors.split(",")]
    if any(not 10 <= f <= 100 for f in fillfactors):
        parser.error("a fillfactor is 10 to 100")
    res = resources()
    runs: dict[int, list[dict]] = {f: [] for f in fillfactors}
    ok = True
    try:
        url = ours_database(args.server_url)
        for rep in range(args.reps):
            k = rep % len(fillfactors)
            for f in fillfactors[k:] + fillfactors[:k]:
                r = drain_at(url, f, args.users)
                ok = ok and r["check"]["ok"]
                runs[f].append(r)
                print(f"rep {rep + 1} fillfactor {f}: {r['events_per_s_drain']:,.0f} events/s"
                      f" (drain), HOT {100 * (r['hot_share'] or 0):.0f} % of the events' updates,"
                      f" exactly once {r['check']['ok']}", flush=True)
    finally:
        res.release()
    medians = {f: {"events_per_s_drain": statistics.median(r["events_per_s_drain"] for r in rs),
                   "hot_share": statistics.median(r["hot_share"] or 0 for r in rs)}
               for f, rs in runs.items()}
    base = fillfactors[0]
    for f in fillfactors:
        m = medians[f]
        print(f"fillfactor {f}: {m['events_per_s_drain']:,.0f} events/s over the drain (median),"
              f" {m['events_per_s_drain'] / medians[base]['events_per_s_drain']:.3f}x"
              f" fillfactor {base}'s; HOT {100 * m['hot_share']:.0f} %")
    path = Path(args.out) if args.out else RESULTS / "w1_fillfactor.json"
    path.write_text(json.dumps({"fillfactors": fillfactors, "reps": args.reps, "users": args.users,
                                "working_tree": src_fingerprint(), "medians": medians,
                                "runs": runs, "correct": ok,
                                "date": time.strftime("%Y-%m-%dT%H:%M:%S")},
                               indent=1, default=str))
    print(path, "correct" if ok else "CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
