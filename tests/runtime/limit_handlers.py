"""Handlers that call the fleet's limits, for tests/runtime/test_limits_worker.py.

Each waits on `ctx.limit(payload.limit or "llm", payload.cost or 1)`, then
appends a line to `<payload.log>` (outside every process): "ok", the time it
was let through (time.time()), its process id and the event's attempt; or, if
the limit raised, "error", the attempt and the error (then raises it). A payload with
`crash` kills the process running its first attempt (before the limit), so
that the retry runs in quarantine.
"""

import os
import signal
import time

from agent_inbox import Result


def _before(batch) -> dict:
    payload = batch[0].payload
    if payload.get("crash") and batch[0].attempts == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return payload


def _write(payload: dict, line: str) -> None:
    with open(payload["log"], "a") as log:
        log.write(line + "\n")


def _let_through(batch, payload: dict) -> Result:
    _write(payload, f"ok {time.time():.6f} {os.getpid()} {batch[0].attempts}")
    return Result()


def _refused(batch, payload: dict, exc: Exception) -> None:
    _write(payload, f"error {batch[0].attempts} {type(exc).__name__}: {exc}")


async def limited(batch, ctx):
    payload = _before(batch)
    try:
        await ctx.limit(payload.get("limit", "llm"), payload.get("cost", 1))
    except Exception as exc:
        _refused(batch, payload, exc)
        raise
    return _let_through(batch, payload)


def limited_plain(batch, ctx):
    payload = _before(batch)
    try:
        ctx.limit_sync(payload.get("limit", "llm"), payload.get("cost", 1))
    except Exception as exc:
        _refused(batch, payload, exc)
        raise
    return _let_through(batch, payload)
