"""Limits shared by the fleet, measured: 4 worker processes at --concurrency
250, every run calling `await ctx.limit("llm")` once, 3,000 runs, against a
limit of 100 per second with a burst of 100.

    .venv/bin/python -m bench.limits [--server-url URL] [--workers 4] [--concurrency 250]
                                     [--runs 3000] [--rate 100] [--burst 100] [--out FILE]

A database of its own (dropped at the end). The limit is set with `agent-inbox
limits set`; the workers are started and listening before the 3,000 events
(one per user) are ingested in one statement. Each run's handler writes, as
soon as the limit lets it through, the time (time.time(): one host, one clock),
its process and its limiter's counters (grant statements sent, tokens granted)
to a record file of its process.

Reports the most calls let through in any 10-second span (sliding over every
call's time) against 100 x 10 + burst, and in any 1-second span against
100 + burst; the rate over the whole (from the first call let through to the
last: all calls, and the calls beyond the burst, which are what the rate
alone allows) against the limit (at least 90 %); the grant statements the
limiters sent per call let through; the wall time. Saves bench/results/limits.json.
Exit 0 only if the 10-second bound held and the rate was at least 90 %.
"""

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import time

import psycopg

from agent_inbox import Inbox, Result
from agent_inbox.schema import migrate
from agent_inbox.dev import pgserver
from bench import records
from bench.common import RESULTS, ROOT, VENV_BIN, src_fingerprint

SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"
OUT = RESULTS / "limits.json"
LIMIT = "llm"


async def handle(batch, ctx):
    await ctx.limit(LIMIT)
    stats = ctx.limiter.stats()
    records.write("limits", {"t": time.time(), "p": os.getpid(), "u": ctx.user,
                             "st": stats["statements"], "tok": stats["tokens"]})
    return Result()


def most_within(times: list[float], span: float) -> tuple[int, float]:
    """The most times inside any closed span of `span` seconds, and where it starts."""
    best, at, j = 0, times[0], 0
    for i, start in enumerate(times):
        while j < len(times) and times[j] - start <= span:
            j += 1
        if j - i > best:
            best, at = j - i, start
    return best, at


def wait_for(condition, what: str, timeout: float, workers=()) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if any(w.poll() is not None for w in workers):
            raise RuntimeError(f"a worker exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def count(url: str, query: str, *params) -> int:
    with psycopg.connect(url, autocommit=True, application_name="bench-poll") as conn:
        return conn.execute(query, params).fetchone()[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server-url", default=SERVER)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=250)
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--rate", type=int, default=100, help="per second")
    parser.add_argument("--burst", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()

    url = pgserver.create_database(args.server_url, prefix="bench_limits")
    record_dir = os.path.join("/tmp", f"bench-limits-{os.getpid()}")
    os.makedirs(record_dir, exist_ok=True)
    workers: list[subprocess.Popen] = []
    logs = []
    try:
        migrate.upgrade(url)
        agent_inbox = [str(VENV_BIN / "agent-inbox")]
        subprocess.run([*agent_inbox, "limits", "set", LIMIT, "--rate", str(args.rate),
                        "--per", "1", "--burst", str(args.burst), "--database-url", url],
                       check=True, cwd=ROOT)
        env = dict(os.environ, PYTHONPATH=str(ROOT), BENCH_RECORD_DIR=record_dir)
        for n in range(args.workers):
            log = open(os.path.join(record_dir, f"worker-{n}.log"), "w")
            logs.append(log)
            workers.append(subprocess.Popen(
                [*agent_inbox, "worker", "--database-url", url, "--handler", "bench.limits:handle",
                 "--concurrency", str(args.concurrency), "--log-level", "warning"],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        dbname = psycopg.conninfo.conninfo_to_dict(url)["dbname"]
        wait_for(lambda: count(url, "SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                                    "AND application_name = 'agent-inbox-listener'",
                               dbname) >= args.workers, "the workers to listen", 60, workers)
        started = time.time()
        with Inbox.connect(url, pool_size=1) as inbox:
            inbox.ingest_many([(f"u{n:05}", "bench", "1", {}) for n in range(args.runs)])
        wait_for(lambda: count(url, "SELECT count(*) FROM events WHERE status = 'done'")
                 == args.runs, "every run to be done", args.timeout, workers)
        drained = time.time()
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.terminate()
        for worker in workers:
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        for log in logs:
            log.close()
        pgserver.drop_database(url)

    calls = []
    for path in glob.glob(os.path.join(record_dir, "limits-*.jsonl")):
        with open(path) as lines:
            calls += [json.loads(line) for line in lines]
    times = sorted(call["t"] for call in calls)
    statements = {p: max(c["st"] for c in calls if c["p"] == p) for p in {c["p"] for c in calls}}
    tokens = {p: max(c["tok"] for c in calls if c["p"] == p) for p in statements}
    in_10, at_10 = most_within(times, 10.0)
    in_1, at_1 = most_within(times, 1.0)
    span = times[-1] - times[0]
    bound_10 = args.rate * 10 + args.burst
    report = {
        "setup": {"workers": args.workers, "concurrency": args.concurrency, "runs": args.runs,
                  "limit": {"rate": args.rate, "per_seconds": 1, "burst": args.burst},
                  "handler": "await ctx.limit('llm') once per run, then a record line"},
        "calls_let_through": len(times),
        "distinct_users": len({c["u"] for c in calls}),
        "most_in_10s": in_10, "bound_10s": bound_10, "most_in_10s_starts_s": at_10 - times[0],
        "most_in_1s": in_1, "bound_1s": args.rate + args.burst,
        "most_in_1s_starts_s": at_1 - times[0],
        "span_s": span,
        "rate_all_calls_per_s": len(times) / span,
        "rate_beyond_burst_per_s": (len(times) - args.burst) / span,
        "rate_beyond_burst_share_of_limit": (len(times) - args.burst) / span / args.rate,
        "grant_statements": sum(statements.values()),
        "grant_statements_by_process": sorted(statements.values()),
        "tokens_granted": sum(tokens.values()),
        "statements_per_call": sum(statements.values()) / len(times),
        "ingest_to_first_call_s": times[0] - started,
        "ingest_to_drained_s": drained - started,
        "machine": {"nproc": os.cpu_count(), "loadavg_at_end": os.getloadavg(),
                    "python": platform.python_version()},
        "code": src_fingerprint(),
        "command": "python -m bench.limits " + " ".join(sys.argv[1:]),
    }
    held = in_10 <= bound_10 and report["rate_beyond_burst_share_of_limit"] >= 0.9
    report["passed"] = held and len(times) == args.runs
    with open(args.out, "w") as out:
        json.dump(report, out, indent=2)
        out.write("\n")
    print(f"{len(times)} calls let through by {args.workers} workers at --concurrency "
          f"{args.concurrency}, limit {args.rate}/s burst {args.burst}:")
    print(f"  most in any 10 s: {in_10} (bound {bound_10}); in any 1 s: {in_1} "
          f"(bound {args.rate + args.burst})")
    print(f"  over {span:.1f} s: {len(times) / span:.1f} calls/s, "
          f"{report['rate_beyond_burst_per_s']:.1f}/s beyond the burst "
          f"({100 * report['rate_beyond_burst_share_of_limit']:.0f} % of the limit)")
    print(f"  grant statements: {report['grant_statements']} "
          f"({report['statements_per_call']:.3f} per call let through; by process "
          f"{report['grant_statements_by_process']})")
    print(f"saved {args.out}")
    for path in glob.glob(os.path.join(record_dir, "*")):
        os.remove(path)
    os.rmdir(record_dir)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
