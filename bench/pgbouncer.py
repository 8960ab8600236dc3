"""W1 through PgBouncer beside W1 direct, in one run: `python -m bench.pgbouncer`.

    .venv/bin/python -m bench.pgbouncer [--server URL] [--reps 3] [--pool-size 4]

W1 as bench.run runs it (1,000 users x 20 events preloaded, 4 worker
processes at concurrency 32, every event handled exactly once, checked from the
handlers' records), twice per repetition, the order alternating: once with the
workers on the database directly, once with the workers on a PgBouncer of our
own in `pool_mode = transaction` (`--pooler transaction`, LISTEN on the direct
URL: `--listen-url`), `--pool-size` server connections for the workers' 12
pooled client connections. The preload, the drain poll and the checks are
direct in both. Reports the medians and the ratio of PgBouncer's events/s to
direct's; saves bench/results/w1_pgbouncer.json.
"""

import argparse
import json
import statistics
import sys
import time

from bench import workloads
from bench.common import RESULTS, ours_database, resources, src_fingerprint
from bench.run import DEFAULT_SERVER, FULL, machine
from tests import pgbouncer
from tests.pgbouncer import PgBouncer

OUT = RESULTS / "w1_pgbouncer.json"
GOAL = 0.8


def drain_w1(url: str, **options) -> dict:
    """W1 as bench.run runs it; `options` go to workloads.drain (worker_url, ...)."""
    return workloads.drain("ours", url, **FULL["w1"], workers=FULL["workers"],
                           concurrency=FULL["ours_concurrency"], poll=FULL["poll_interval"],
                           timeout=FULL["drain_timeout"], **options)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pgbouncer", description=__doc__)
    parser.add_argument("--server", default=DEFAULT_SERVER, help="PostgreSQL maintenance URL")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--pool-size", type=int, default=4,
                        help="PgBouncer's default_pool_size (server connections per database)")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    if args.reps < 1 or args.pool_size < 1:
        parser.error("--reps and --pool-size must be at least 1")

    started = time.monotonic()
    url = ours_database(args.server)
    runs: dict[str, list[dict]] = {"direct": [], "pgbouncer": []}
    with PgBouncer(args.server, pool_size=args.pool_size) as bouncer:
        resources().processes.append(bouncer.process)  # stopped on SIGINT/SIGTERM too
        resources().dirs.append(str(bouncer.root))
        for rep in range(args.reps):
            order = ("direct", "pgbouncer") if rep % 2 == 0 else ("pgbouncer", "direct")
            for path in order:
                logins = bouncer.log().count("login attempt")
                # Through PgBouncer the workers pool through it and LISTEN on the direct URL.
                through = ({"worker_url": bouncer.url(url),
                            "worker_args": ["--pooler", "transaction", "--listen-url", url]}
                           if path == "pgbouncer" else {})
                result = drain_w1(url, **through)
                result["pgbouncer_logins"] = bouncer.log().count("login attempt") - logins
                runs[path].append(result)
                print(f"rep {rep + 1} {path:9}: {result['events_per_s']:7.0f} events/s "
                      f"(drain {result['drain_s']:.2f} s, wall {result['wall_s']:.2f} s), "
                      f"exactly once: {result['check']['ok']}, PgBouncer client logins: "
                      f"{result['pgbouncer_logins']}", flush=True)
    medians = {path: statistics.median(r["events_per_s"] for r in results)
               for path, results in runs.items()}
    ratio = medians["pgbouncer"] / medians["direct"]
    ok = all(r["check"]["ok"] for results in runs.values() for r in results)
    print(f"W1 median events/s: direct {medians['direct']:.0f}, through PgBouncer "
          f"{medians['pgbouncer']:.0f}: ratio {ratio:.3f} (goal {GOAL}); every run exactly "
          f"once: {ok}")
    document = {
        "workload": "W1", "w1": FULL["w1"], "workers": FULL["workers"],
        "ours_concurrency": FULL["ours_concurrency"], "poll_interval": FULL["poll_interval"],
        "pgbouncer": {"pool_mode": "transaction", "default_pool_size": args.pool_size,
                      "version": pgbouncer.version(), "worker_args": ["--pooler", "transaction",
                                                                    "--listen-url <direct>"]},
        "reps": args.reps, "median_events_per_s": medians, "ratio": ratio, "goal": GOAL,
        "all_exactly_once": ok, "runs": runs, "seconds": time.monotonic() - started,
        "machine": machine(args.server), "code": src_fingerprint(),
        "command": "python -m bench.pgbouncer " + " ".join(argv if argv is not None
                                                            else sys.argv[1:]),
    }
    with open(args.out, "w") as out:
        json.dump(document, out, indent=2)
    print(f"saved {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
