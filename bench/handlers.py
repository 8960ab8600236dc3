"""agent-inbox handlers for the benchmark (run by the real `agent-inbox worker`).

`handle` is a no-op that records, per run: the user, the lease generation, the
event ids of the batch, the producer timestamps carried in W2 payloads
(`{"t0": ...}`), and the handler's start and end (time.time()).

`agent_async` (W5) and `agent_sync` (W5s) stand for an agent waiting on a model or a
tool: they wait AGENT_SLEEP seconds (`await asyncio.sleep`, resp. `time.sleep`;
$BENCH_AGENT_SLEEP, default 1.0) between their start and end, and record the same.

`agent_steps` (W5x3) is an agent whose run is BENCH_STEPS durable steps (default 3), each
`await ctx.step(...)` of a function that awaits asyncio.sleep(BENCH_STEP_SLEEP) (default
0.3 s). Its record adds, per step, the step's cost: the time `ctx.step` took minus the
time its function took (both measured here, perf_counter), i.e. what recording the
result (queueing it to the completer, its batched commit, the wake-up) added; and how
many step functions this attempt called.
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


STEPS = int(os.environ.get("BENCH_STEPS", "3"))
STEP_SLEEP = float(os.environ.get("BENCH_STEP_SLEEP", "0.3"))


async def agent_steps(batch, ctx):
    start = time.time()
    costs, calls = [], 0
    for n in range(STEPS):
        took = []

        async def call(n=n):
            t = time.perf_counter()
            await asyncio.sleep(STEP_SLEEP)
            took.append(time.perf_counter() - t)
            return n

        t = time.perf_counter()
        await ctx.step(f"s{n}", call)
        total = time.perf_counter() - t
        if took:
            calls += 1
            costs.append(total - took[0])
    records.write("ours", {"u": ctx.user, "g": ctx.gen, "h": ctx.holder, "p": os.getpid(),
                           "a": max((e.attempts for e in batch), default=0),
                           "ids": [e.id for e in batch], "t0": [None] * len(batch),
                           "s": start, "e": time.time(), "sc": costs, "calls": calls})
    return Result()


def soak(batch, ctx):
    """bench.soak's handler: a quick no-op that records, per run, its start and
    each event's lag (start minus the ingest time its payload carries: {"t": ...})."""
    _record_lag(batch, ctx, time.time())
    return Result()


async def soak_agent(batch, ctx):
    """bench.soak --handler agent: W5's shape, an agent that waits AGENT_SLEEP
    seconds on its model after recording its start and lag as `soak` does."""
    _record_lag(batch, ctx, time.time())
    await asyncio.sleep(AGENT_SLEEP)
    return Result()


def _record_lag(batch, ctx, start: float) -> None:
    records.write("soak", {"s": start, "u": ctx.user, "ids": [e.id for e in batch],
                           "l": [start - e.payload["t"] for e in batch]})
