"""The database's share of W1 and W1b: the take/finish loop with no worker
service and no handler, N processes, K users per take.

    .venv/bin/python -m bench.floor [--users 1000] [--per-user 20] [--processes 4] [--take 32]

Each process loops `Inbox.runs.take_runs` then `Inbox.runs.finish_runs` of what it took
(a take and a commit, as the worker's producer and completer do) until no work
is left; events/s over the wall time from the first take. A database of its
own, dropped at the end.
"""

import argparse
import multiprocessing
import time

import psycopg

from agent_inbox import Inbox, Result
from agent_inbox.schema import migrate
from agent_inbox.dev import pgserver

SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"


def drain(url: str, holder: str, take: int, ready, answers) -> None:
    with Inbox.connect(url, pool_size=1, application_name="bench-floor") as inbox:
        ready.wait()  # every process connected: the clock starts
        taken = 0
        while runs := inbox.runs.take_runs(holder, users=take):
            taken += len(runs)
            inbox.runs.finish_runs([inbox.runs.outcome(run, Result()) for run in runs])
        answers.put(taken)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server-url", default=SERVER)
    parser.add_argument("--users", type=int, default=1000)
    parser.add_argument("--per-user", type=int, default=20)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--take", type=int, default=32)
    args = parser.parse_args()
    url = pgserver.create_database(args.server_url, prefix="bench_floor")
    try:
        migrate.upgrade(url)
        events = args.users * args.per_user
        with Inbox.connect(url) as inbox:
            rows = [(f"u{n % args.users}", "bench", str(n), {}) for n in range(events)]
            for first in range(0, events, 5000):
                inbox.ingest_many(rows[first:first + 5000])
        context = multiprocessing.get_context("spawn")
        ready, answers = context.Barrier(args.processes + 1), context.Queue()
        workers = [context.Process(target=drain, args=(url, f"floor-{n}", args.take, ready, answers))
                   for n in range(args.processes)]
        for worker in workers:
            worker.start()
        ready.wait()
        began = time.monotonic()
        runs = sum(answers.get(timeout=600) for _ in workers)
        wall = time.monotonic() - began
        for worker in workers:
            worker.join()
        with psycopg.connect(url, autocommit=True) as conn:
            left = conn.execute("SELECT count(*) FROM events WHERE status <> 'done'").fetchone()[0]
        print(f"{events} events, {runs} runs, {args.processes} processes x {args.take} users per take: "
              f"{wall:.2f} s, {events / wall:,.0f} events/s, {runs / wall:,.0f} runs/s; not done: {left}")
    finally:
        pgserver.drop_database(url)


if __name__ == "__main__":
    main()
