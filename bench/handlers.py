"""agent-inbox handlers for the benchmark (run by the real `agent-inbox worker`).

`handle` is a no-op that records, per run: the user, the lease generation, the
event ids of the batch, the producer timestamps carried in W2 payloads
(`{"t0": ...}`), and the handler's start and end (time.time()).

`agent_async` (W5) and `agent_sync` (W5s) stand for an agent waiting on a model or a
tool: they wait AGENT_SLEEP seconds (`await asyncio.sleep`, resp. `time.sleep`;
$BENCH_AGENT_SLEEP, default 1.0) between their start and end, and record the same.
"""

import asyncio
import os
import time

from agent_inbox import Result

from bench import records


def handle(batch, ctx):
    start = time.time()
    ids = [e.id for e in batch]
    t0 = [e.payload.get("t0") if isinstance(e.payload, dict) else None for e in batch]
    end = time.time()
    records.write("ours", {"u": ctx.user, "g": ctx.gen, "h": ctx.holder, "p": os.getpid(),
                           "a": max((e.attempts for e in batch), default=0), "ids": ids, "t0": t0,
                           "s": start, "e": end})
    return Result()


AGENT_SLEEP = float(os.environ.get("BENCH_AGENT_SLEEP", "1.0"))


def _record(batch, ctx, start: float, end: float) -> None:
    records.write("ours", {"u": ctx.user, "g": ctx.gen, "h": ctx.holder, "p": os.getpid(),
                           "a": max((e.attempts for e in batch), default=0),
                           "ids": [e.id for e in batch], "t0": [None] * len(batch),
                           "s": start, "e": end})


async def agent_async(batch, ctx):
    start = time.time()
    await asyncio.sleep(AGENT_SLEEP)
    _record(batch, ctx, start, time.time())
    return Result()


def agent_sync(batch, ctx):
    start = time.time()
    time.sleep(AGENT_SLEEP)
    _record(batch, ctx, start, time.time())
    return Result()
