"""A/B two agent-inbox source trees on W5 and W5s (one worker process, 1 s handlers at
concurrency 1000 / 200), interleaved.

    .venv/bin/python -m bench.ab_agents REV [REV ...] [--reps 3] [--quick] [--only w5,w5s]
                                        [--set w5.concurrency=5000] [--out FILE]

Each REV's src/ is extracted with `git archive` into a temp dir (the repository is not
touched) and its worker runs with PYTHONPATH pointing there; B is the working tree. The
database schema is the working tree's (migrations/). Each repetition runs every
workload once for each tree, the tree that goes first alternating between repetitions,
(rotating, with more than two trees), so all see the same background load. Sizes and bounds are bench.run's (FULL, or QUICK
with --quick); agent-inbox only. Writes bench/results/ab_agents_<first REV>.json (or
--out): per-repetition figures, medians, and the ratios of the medians of every other
tree over the first REV's.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import workloads as wl
from bench.common import RESULTS, ROOT, ours_database, resources, src_fingerprint
from bench.run import FULL, QUICK, apply_settings

KEYS = ("runs_per_s_drain", "ratio_to_ideal", "drain_s", "startup_s", "peak_rss_mib",
        "peak_connections", "peak_runs_at_once")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ab_agents")
    parser.add_argument("revs", nargs="+", metavar="REV")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="bench.run's --quick sizes")
    parser.add_argument("--only", default="w5,w5s")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                        help="override a setting as bench.run does, e.g. --set "
                             "w5.concurrency=5000 --set w5.users=50000 (repeatable)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--server-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args(argv)
    cfg = json.loads(json.dumps(QUICK if args.quick else FULL))
    apply_settings(cfg, args.set, parser.error)
    names = args.only.split(",")
    res = resources()
    trees, commits = {}, {}
    for rev in args.revs:
        tree = res.tempdir("ab-src")
        archive = subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        commits[rev] = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT,
                                      capture_output=True, text=True, check=True).stdout.strip()
        trees[rev] = {"PYTHONPATH": f"{tree}/src:{ROOT}"}
    trees["working-tree"] = {}
    base = args.revs[0]
    extra_args = {t: {n: wl.ours_agent_args(env, cfg[n]["ours_extra_args"])[0] for n in names}
                  for t, env in trees.items()}
    out: dict = {n: {t: [] for t in trees} for n in names}
    ok = True
    try:
        url = ours_database(args.server_url)
        for rep in range(args.reps):
            items = list(trees.items())
            k = rep % len(items)
            order = items[k:] + items[:k]
            if len(items) == 2 and rep % 2:
                order = items[::-1]
            for t, env in order:
                wl.OURS_ENV = env
                for n in names:
                    w = {k: v for k, v in cfg[n].items()
                         if k not in ("ours_extra_args", "peer_variants", "systems")}
                    r = wl.agents("ours", url, **w, extra_args=extra_args[t][n])
                    r["loadavg_1m"] = os.getloadavg()[0]
                    ok = ok and r["check"]["ok"]
                    out[n][t].append(r)
                    print(f"rep {rep + 1} {n} {t}: " + ", ".join(
                        f"{k} {r.get(k):.2f}" for k in KEYS if r.get(k) is not None)
                        + f", outcome {r['outcome']}, check {r['check']['ok']}", flush=True)
    finally:
        wl.OURS_ENV = {}
        res.release()
    medians = {n: {t: {k: statistics.median(v) if (v := [r[k] for r in rows
                                                           if r.get(k) is not None]) else None
                       for k in KEYS}
                   for t, rows in by_tree.items()} for n, by_tree in out.items()}
    ratios = {n: {t: {k: (m[t][k] / m[base][k] if m[t][k] and m[base][k] else None)
                      for k in KEYS} for t in trees if t != base}
              for n, m in medians.items()}
    path = Path(args.out) if args.out else RESULTS / f"ab_agents_{base}.json"
    path.write_text(json.dumps({"revs": args.revs, "commits": commits, "quick": args.quick,
                                "working_tree": src_fingerprint(), "reps": args.reps,
                                "config": {n: cfg[n] for n in names}, "extra_args": extra_args,
                                "medians": medians, f"ratio_over_{base}": ratios,
                                "runs": out, "correct": ok,
                                "date": time.strftime("%Y-%m-%dT%H:%M:%S")},
                               indent=1, default=str))
    for n in names:
        for t in trees:
            m = medians[n][t]
            print(f"{n} {t:>14}: " + ", ".join(f"{k} {v:.2f}" for k, v in m.items()
                                               if v is not None))
        for t, r in ratios[n].items():
            print(f"{n} {t} / {base}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in r.items() if v is not None))
    print(path, "correct" if ok else "CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
