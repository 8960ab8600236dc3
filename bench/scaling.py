"""W1 throughput as worker processes go 1, 2, 4, 8, for agent-inbox and procrastinate.

    .venv/bin/python -m bench.run --scaling [--quick] [--reps N]

Writes bench/results/scaling.json (or --out) and draws bench/results/w1_scaling.png
with bench/plot.py. Each point is W1 (users x events preloaded, no-op handler,
concurrency per process: agent-inbox's ours_concurrency, the peer's concurrency) exactly
as in the main run.
"""

import json
import os
import time
from pathlib import Path

from bench import plot
from bench import workloads as wl
from bench.common import RESULTS, ours_database, peer_database, resources, summary

COUNTS = (1, 2, 4, 8)


def main(args) -> int:
    from bench.run import FULL, NAMES, QUICK, SYSTEMS, Collector, log, machine

    cfg = QUICK if args.quick else FULL
    reps = args.reps or 1
    out = Path(args.out) if args.out else RESULTS / "scaling.json"
    started = time.monotonic()
    info = machine(args.server_url)
    c = Collector()
    try:
        ours_url = ours_database(args.server_url)
        peer_url = peer_database(args.server_url)
        for n in COUNTS:
            log(f"scaling: W1 {cfg['w1']['users']} x {cfg['w1']['per_user']} with {n} worker processes")
            for rep in range(reps):
                order = SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]
                for system in order:
                    c.attempt(f"w1_{n}", system, wl.drain, system,
                              ours_url if system == "ours" else peer_url, **cfg["w1"], workers=n,
                              concurrency=cfg["ours_concurrency" if system == "ours"
                                              else "concurrency"], poll=cfg["poll_interval"],
                              timeout=cfg["drain_timeout"])
    finally:
        resources().release()
    points = {system: {str(n): {k: summary([r[k] for r in c.runs.get(f"w1_{n}", {}).get(system, [])])
                                for k in ("events_per_s", "events_per_s_drain", "runs_per_s_drain")}
                       for n in COUNTS}
              for system in SYSTEMS}
    checks_ok = all(r["check"]["ok"] for runs in c.runs.values() for rs in runs.values() for r in rs)
    doc = {"machine": info, "workload": cfg["w1"], "reps": reps, "counts": list(COUNTS),
           "names": NAMES, "points": points, "runs": c.runs, "errors": c.errors,
           "correct": checks_ok and not c.errors, "total_seconds": time.monotonic() - started,
           "loadavg_at_end": os.getloadavg()}
    out.write_text(json.dumps(doc, indent=1, default=str))
    png = plot.draw(out, RESULTS / "w1_scaling.png")
    print(f"{'workers':>8}  " + "  ".join(f"{NAMES[s] + ' ev/s (drain)':>28}" for s in SYSTEMS))
    for n in COUNTS:
        cells = []
        for s in SYSTEMS:
            m = points[s][str(n)]["events_per_s_drain"]["median"]
            cells.append(f"{'-' if m is None else f'{m:,.0f}':>28}")
        print(f"{n:>8}  " + "  ".join(cells))
    print(f"correct: {doc['correct']}; total {doc['total_seconds']:.0f} s; {out}; {png}")
    return 0 if doc["correct"] else 1
