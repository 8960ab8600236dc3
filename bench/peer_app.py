"""The peer: a procrastinate 3.x app with one no-op task, `bench_handle`.

Workers run it with the real CLI:
    BENCH_PEER_URL=... procrastinate --app bench.peer_app.app worker --concurrency 1
Jobs are deferred with `lock=<user>` (one job per user at a time), the peer's
counterpart of agent-inbox's per-user lease. The task is async (the cheapest way
procrastinate runs a task: no thread hop) and records what bench.handlers records.

W5/W5s use `bench_agent` (async, `await asyncio.sleep`) and `bench_agent_sync` (a plain
function, `time.sleep`; procrastinate runs it through asgiref's `sync_to_async(...,
thread_sensitive=False)`, i.e. on the event loop's default executor, which Python sizes
min(32, cpus + 4) threads: 6 on 2 cores, whatever --concurrency is). With
$BENCH_PEER_THREADS=N the bench gives those sync tasks an executor of N threads instead
(a patch of procrastinate.utils.sync_to_async, the peer's tuned variant).
"""

import asyncio
import os
import time

import procrastinate
import procrastinate.utils

from bench import records

TASK_NAME = "bench_handle"
AGENT_TASK = "bench_agent"
AGENT_SYNC_TASK = "bench_agent_sync"
AGENT_SLEEP = float(os.environ.get("BENCH_AGENT_SLEEP", "1.0"))


async def bench_handle(user: str, eid: int, t0: float | None = None) -> None:
    start = time.time()
    end = time.time()
    records.write("peer", {"u": user, "p": os.getpid(), "ids": [eid], "t0": [t0], "s": start,
                           "e": end})


async def bench_agent(user: str, eid: int) -> None:
    start = time.time()
    await asyncio.sleep(AGENT_SLEEP)
    records.write("peer", {"u": user, "p": os.getpid(), "ids": [eid], "t0": [None], "s": start,
                           "e": time.time()})


def bench_agent_sync(user: str, eid: int) -> None:
    start = time.time()
    time.sleep(AGENT_SLEEP)
    records.write("peer", {"u": user, "p": os.getpid(), "ids": [eid], "t0": [None], "s": start,
                           "e": time.time()})


def _executor_threads(n: int) -> None:
    """Run the worker's sync tasks on an executor of n threads (procrastinate 3.10 has no
    setting for it: it calls asgiref's sync_to_async without an executor)."""
    from concurrent.futures import ThreadPoolExecutor

    from asgiref import sync

    pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="bench-peer-sync")

    async def sync_to_async(func, *args, **kwargs):
        return await sync.sync_to_async(func, thread_sensitive=False, executor=pool)(*args, **kwargs)

    procrastinate.utils.sync_to_async = sync_to_async


if os.environ.get("BENCH_PEER_THREADS"):
    _executor_threads(int(os.environ["BENCH_PEER_THREADS"]))


def build_app(url: str, **pool_kwargs) -> procrastinate.App:
    """An App on `url` with PsycopgConnector; pool_kwargs go to its psycopg pool."""
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url, **pool_kwargs))
    app.task(name=TASK_NAME)(bench_handle)
    app.task(name=AGENT_TASK)(bench_agent)
    app.task(name=AGENT_SYNC_TASK)(bench_agent_sync)
    return app


app = build_app(os.environ.get("BENCH_PEER_URL", "postgresql:///bench_peer_url_unset"))
