"""The peer: a procrastinate 3.x app with one no-op task, `bench_handle`.

Workers run it with the real CLI:
    BENCH_PEER_URL=... procrastinate --app bench.peer_app.app worker --concurrency 1
Jobs are deferred with `lock=<user>` (one job per user at a time), the peer's
counterpart of agent-inbox's per-user lease. The task is async (the cheapest way
procrastinate runs a task: no thread hop) and records what bench.handlers records.
"""

import os
import time

import procrastinate

from bench import records

TASK_NAME = "bench_handle"


async def bench_handle(user: str, eid: int, t0: float | None = None) -> None:
    start = time.time()
    end = time.time()
    records.write("peer", {"u": user, "p": os.getpid(), "ids": [eid], "t0": [t0], "s": start,
                           "e": end})


def build_app(url: str, **pool_kwargs) -> procrastinate.App:
    """An App on `url` with PsycopgConnector; pool_kwargs go to its psycopg pool."""
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url, **pool_kwargs))
    app.task(name=TASK_NAME)(bench_handle)
    return app


app = build_app(os.environ.get("BENCH_PEER_URL", "postgresql:///bench_peer_url_unset"))
