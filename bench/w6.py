"""W6, delivery: users with one held message each, a channel that takes 200 ms
per send, real `agent-inbox dispatcher` processes.

    .venv/bin/python -m bench.w6 [--users 10000] [--concurrency 200] [--runs 3]

Per run: one dispatcher at --concurrency (sends/s over the drain, first send's
start to last send's end, beside the ideal concurrency / 0.2 s), then two
dispatchers at once over the same number of users (every batch key must be
sent exactly once). Medians over the runs; results in bench/results/w6.json.
A database of its own, dropped at the end; the dispatchers are stopped.
"""

import argparse
import collections
import json
import os
import shutil
import statistics
import tempfile
import threading
import time

from agent_inbox.schema import migrate
from agent_inbox.dev import pgserver
from bench.common import RESULTS, VENV_BIN, scalar, spawn, sql, stop_processes, src_fingerprint

SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"
SEND_SECONDS = 0.2

_log_lock = threading.Lock()


def slow_send(user: str, text: str, key: str) -> None:
    """The benchmark's channel: 200 ms per send, like an HTTP POST to a chat
    service; each send appended to $BENCH_SEND_LOG as `start end key`."""
    start = time.time()
    time.sleep(SEND_SECONDS)
    with _log_lock, open(os.environ["BENCH_SEND_LOG"], "a") as log:
        log.write(f"{start} {time.time()} {key}\n")


def hold_messages(url: str, users: int) -> None:
    """One held message per user, every user due now (as finishes leave them)."""
    sql(url, "TRUNCATE outbox, deliveries")
    sql(url, "INSERT INTO outbox (user_id, body, created) SELECT 'u' || lpad(n::text, 6, '0'), "
             "'hello ' || n, 0 FROM generate_series(1, %s) n", (users,))
    sql(url, "INSERT INTO deliveries (user_id, due_at) SELECT DISTINCT user_id, 0 FROM outbox")
    sql(url, "VACUUM ANALYZE outbox")
    sql(url, "VACUUM ANALYZE deliveries")


def run_dispatchers(url: str, count: int, users: int, concurrency: int, timeout: float) -> dict:
    hold_messages(url, users)
    scratch = tempfile.mkdtemp(prefix="bench-w6-")  # kept when the run fails, for its logs
    if True:
        send_log = os.path.join(scratch, "sends.log")
        open(send_log, "w").close()
        procs = [spawn([str(VENV_BIN / "agent-inbox"), "dispatcher", "--database-url", url,
                        "--channel", "bench.w6:slow_send", "--concurrency", str(concurrency),
                        "--outbox-gap", "3600", "--poll-interval", "1", "--log-level", "warning"],
                       {"BENCH_SEND_LOG": send_log}, os.path.join(scratch, f"d{n}.log"))
                 for n in range(count)]
        try:
            deadline = time.monotonic() + timeout
            while scalar(url, "SELECT count(*) FROM outbox WHERE sent_at IS NULL"):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise SystemExit(f"not drained in {timeout} s (or a dispatcher exited): see "
                                     f"{scratch}")
                time.sleep(0.2)
        finally:
            stop_processes(procs)
        sends = [line.split() for line in open(send_log)]
    shutil.rmtree(scratch)
    keys = collections.Counter(key for _, _, key in sends)
    first = min(float(start) for start, _, _ in sends)
    last = max(float(end) for _, end, _ in sends)
    return {"dispatchers": count, "sends": len(sends), "distinct_keys": len(keys),
            "sent_twice": sum(1 for n in keys.values() if n > 1),
            "drain_s": round(last - first, 3), "sends_per_s": round(len(sends) / (last - first), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server-url", default=SERVER)
    parser.add_argument("--users", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=180)
    args = parser.parse_args()
    ideal = args.concurrency / SEND_SECONDS
    url = pgserver.create_database(args.server_url, prefix="bench_w6")
    runs = []
    try:
        migrate.upgrade(url)
        for n in range(args.runs):
            one = run_dispatchers(url, 1, args.users, args.concurrency, args.timeout)
            two = run_dispatchers(url, 2, args.users, args.concurrency, args.timeout)
            runs.append({"one": one, "two": two})
            print(f"run {n + 1}: one dispatcher {one['sends_per_s']} sends/s "
                  f"({one['sends_per_s'] / ideal:.3f} of ideal {ideal:.0f}), sent twice "
                  f"{one['sent_twice']}; two dispatchers {two['sends_per_s']} sends/s, "
                  f"sent twice {two['sent_twice']}", flush=True)
    finally:
        pgserver.drop_database(url)
    rate = statistics.median(r["one"]["sends_per_s"] for r in runs)
    result = {"workload": "W6", "users": args.users, "concurrency": args.concurrency,
              "send_seconds": SEND_SECONDS, "ideal_sends_per_s": ideal,
              "median_sends_per_s": rate, "median_of_ideal": round(rate / ideal, 3),
              "two_dispatchers_median_sends_per_s":
                  statistics.median(r["two"]["sends_per_s"] for r in runs),
              "sent_twice_total": sum(r["one"]["sent_twice"] + r["two"]["sent_twice"]
                                      for r in runs),
              "runs": runs, "source": src_fingerprint()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "w6.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"W6: median {rate} sends/s = {rate / ideal:.3f} of ideal {ideal:.0f}; two dispatchers "
          f"{result['two_dispatchers_median_sends_per_s']} sends/s; batches sent twice: "
          f"{result['sent_twice_total']}")


if __name__ == "__main__":
    main()
