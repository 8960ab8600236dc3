"""What one poison event costs the agents runtime: W5's shape (async handlers
that await 1 s, one worker at --concurrency 1000) with one event that kills
its process, ingested while a wave of runs is in flight.

    .venv/bin/python -m bench.poison_cost [--users 600] [--concurrency 200] [--quarantine 8]

Reports the runs re-executed (healthy events claimed twice: the runs in flight
when the runtime died), the most attempts a healthy event took, the drain time
(every event done or dead, the poison included) and when the healthy events
alone were done, and the peak RSS of the worker's whole process tree
(supervisor, runtime, quarantine processes); also in
bench/results/poison_cost.json. A database of its own, dropped at the end; the
worker is stopped.
"""

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import psycopg

from agent_inbox import Inbox, Result
from agent_inbox.schema import migrate
from agent_inbox.dev import pgserver
from bench.common import RESULTS, ROOT, process_tree

SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"


def tree_rss_mib(root: int) -> float:
    return sum(rss for _, rss, _ in process_tree(root).values()) / 2 ** 20


async def handle(batch, ctx):
    if any(e.payload.get("poison") for e in batch):
        os.kill(os.getpid(), signal.SIGKILL)
    await asyncio.sleep(1.0)
    return Result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server-url", default=SERVER)
    parser.add_argument("--users", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--quarantine", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=180)
    args = parser.parse_args()
    url = pgserver.create_database(args.server_url, prefix="bench_poison")
    worker = None
    try:
        migrate.upgrade(url)
        with Inbox.connect(url, pool_size=1) as inbox:
            inbox.ingest_many([(f"u{n:05}", "bench", "1", {}) for n in range(args.users)])
        worker = subprocess.Popen(
            [sys.executable, "-m", "agent_inbox.cli", "worker", "--database-url", url,
             "--handler", "bench.poison_cost:handle", "--concurrency", str(args.concurrency),
             "--quarantine", str(args.quarantine),
             "--lease-ttl", "60", "--retry-backoff", "1", "--log-level", "warning"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        peak = 0.0
        with psycopg.connect(url, autocommit=True) as conn:
            def count(sql):
                return conn.execute(sql).fetchone()[0]

            deadline = time.monotonic() + args.timeout
            while count("SELECT count(*) FROM events WHERE status = 'running'") < args.concurrency:
                peak = max(peak, tree_rss_mib(worker.pid))
                if time.monotonic() > deadline:
                    raise SystemExit("the first wave never filled the worker")
                time.sleep(0.02)
            began = time.monotonic()
            with Inbox.connect(url, pool_size=1) as inbox:
                inbox.ingest("poison", "bench", "1", {"poison": True})
            healthy_drained = None
            while count("SELECT count(*) FROM events WHERE status IN ('pending', 'running')"):
                if healthy_drained is None and not count(
                        "SELECT count(*) FROM events WHERE status IN ('pending', 'running') "
                        "AND user_id <> 'poison'"):
                    healthy_drained = time.monotonic() - began
                peak = max(peak, tree_rss_mib(worker.pid))
                if time.monotonic() > deadline:
                    raise SystemExit("not drained in time")
                time.sleep(0.05)
            drained = time.monotonic() - began
            healthy_drained = drained if healthy_drained is None else healthy_drained
            again = count("SELECT count(*) FROM events WHERE user_id <> 'poison' AND attempts > 1")
            most = count("SELECT max(attempts) FROM events WHERE user_id <> 'poison'")
            poison = conn.execute("SELECT status, attempts FROM events WHERE user_id = 'poison'"
                                  ).fetchone()
            dead_healthy = count("SELECT count(*) FROM events WHERE user_id <> 'poison' "
                                 "AND status = 'dead'")
        worker.send_signal(signal.SIGTERM)
        _, log = worker.communicate(timeout=60)
        restarts = log.count("agent-inbox worker: the runtime")
        print(f"{args.users} users at concurrency {args.concurrency}, {args.quarantine} quarantine "
              f"processes, one poison event: "
              f"runtime restarts {restarts}, runs re-executed {again}, healthy dead {dead_healthy}, "
              f"most attempts of a healthy event {most}, "
              f"poison {poison[0]} after {poison[1]} attempts, drained {drained:.1f} s after the "
              f"poison arrived (healthy events {healthy_drained:.1f} s), "
              f"peak RSS of the process tree {peak:.0f} MiB")
        result = {"users": args.users, "concurrency": args.concurrency,
                  "quarantine": args.quarantine, "runtime_restarts": restarts,
                  "runs_reexecuted": again, "healthy_dead": dead_healthy,
                  "max_healthy_attempts": most, "poison_status": poison[0],
                  "poison_attempts": poison[1], "drained_s": round(drained, 1),
                  "healthy_drained_s": round(healthy_drained, 1), "peak_rss_mib": round(peak)}
        (RESULTS / "poison_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    finally:
        if worker is not None and worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
        pgserver.drop_database(url)


if __name__ == "__main__":
    main()
