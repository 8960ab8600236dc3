"""The hand-over: how long from an application's commit until a running worker
has run the event, with the event written in the application's transaction
(`ingest(..., connection=conn)`, beside its own row) and, in the same run, by
`ingest` in a transaction of its own after the application's commit.

    .venv/bin/python -m bench.handoff [--events 200] [--reps 3]

One worker (in this process, LISTENing) on a fresh database; the sides
alternate event by event. Latency = the application's commit (or the plain
ingest's return) until the event's row says done, read every 2 ms. Prints
medians and p95 per side and, last, one JSON line; writes
bench/results/handoff.json.
"""

import argparse
import json
import statistics
import threading
import time

import psycopg

from agent_inbox import Inbox
from agent_inbox.services.worker import Worker
from bench.common import RESULTS, ours_database, resources

SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"


def done(conn, user: str, source_id: str) -> bool:
    return conn.execute("SELECT status = 'done' FROM events WHERE user_id = %s AND source_id = %s",
                        (user, source_id)).fetchone() == (True,)


def one_rep(url: str, events: int) -> dict[str, list[float]]:
    with Inbox.connect(url, pool_size=4) as worker_inbox, Inbox.connect(url) as app:
        worker = Worker(worker_inbox, "agent_inbox.dev.examples:echo", concurrency=8)
        serving = threading.Thread(target=worker.serve, args=(url,), daemon=True)
        serving.start()
        latencies: dict[str, list[float]] = {"callers_transaction": [], "own_transaction": []}
        try:
            with psycopg.connect(url) as conn, psycopg.connect(url, autocommit=True) as probe:
                conn.execute("CREATE TABLE IF NOT EXISTS chat_messages (user_id text, body text)")
                conn.commit()
                for n in range(events):
                    side = "callers_transaction" if n % 2 == 0 else "own_transaction"
                    user, key = f"u{n % 20}", str(n)
                    conn.execute("INSERT INTO chat_messages VALUES (%s, %s)", (user, key))
                    if side == "callers_transaction":
                        app.ingest(user, "chat", key, {}, connection=conn)
                        conn.commit()
                        start = time.perf_counter()
                    else:
                        conn.commit()
                        app.ingest(user, "chat", key, {})
                        start = time.perf_counter()
                    while not done(probe, user, key):
                        if time.perf_counter() - start > 30:
                            raise RuntimeError(f"event {key} not run in 30 s")
                        time.sleep(0.002)
                    latencies[side].append(time.perf_counter() - start)
        finally:
            worker.stop.event.set()
            serving.join(timeout=30)
            worker.close()
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--server-url", default=SERVER)
    args = parser.parse_args()
    summary: dict[str, dict] = {}
    try:
        reps = [one_rep(ours_database(args.server_url), args.events) for _ in range(args.reps)]
    finally:
        resources().release()
    for side in ("callers_transaction", "own_transaction"):
        medians = [statistics.median(rep[side]) * 1000 for rep in reps]
        p95s = [statistics.quantiles(rep[side], n=20)[18] * 1000 for rep in reps]
        summary[side] = {"median_ms": round(statistics.median(medians), 2),
                         "median_ms_per_rep": [round(m, 2) for m in medians],
                         "p95_ms": round(statistics.median(p95s), 2),
                         "max_ms": round(max(max(rep[side]) for rep in reps) * 1000, 2)}
        print(f"{side:>20}: median {summary[side]['median_ms']} ms "
              f"(reps {summary[side]['median_ms_per_rep']}), p95 {summary[side]['p95_ms']} ms, "
              f"max {summary[side]['max_ms']} ms")
    result = {"events_per_rep": args.events, "reps": args.reps, **summary,
              "ratio_callers_to_own": round(summary["callers_transaction"]["median_ms"]
                                            / summary["own_transaction"]["median_ms"], 3)}
    (RESULTS / "handoff.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
