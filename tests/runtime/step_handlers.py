"""Handlers of five durable steps for tests/runtime/test_steps_worker.py.

Every call of a step's function is written to `<payload.log>` (one line: the
step's name), outside the process, so a test counts calls across attempts and
processes. On its first attempt a run then fails after step 3 as its event's
payload says (`after_3`): `kill` (SIGKILL to the process running it), `hang`
(past the run timeout), `raise`, or `lose` (waits until its lease is lost,
after marking `<payload.log>.waiting`).
"""

import asyncio
import os
import signal

from agent_inbox import Result

STEPS = ("fetch", "think", "refund", "email", "note")


def _called(path: str, name: str) -> str:
    with open(path, "a") as log:
        log.write(name + "\n")
    return f"{name}-result"


def _fail_first_attempt(batch, how: str, path: str) -> None:
    if batch[0].attempts != 1:
        return
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "raise":
        raise RuntimeError("the tool raised after step 3")


async def five_steps(batch, ctx):
    payload = batch[0].payload
    path, how = payload["log"], payload["after_3"]
    results = []
    for n, name in enumerate(STEPS, 1):
        results.append(await ctx.step(name, _async_called, path, name))
        if n == 3:
            _fail_first_attempt(batch, how, path)
            if batch[0].attempts == 1 and how == "hang":
                await asyncio.sleep(3600)
            if batch[0].attempts == 1 and how == "lose":
                open(path + ".waiting", "w").close()
                await ctx.lease_lost
                await asyncio.sleep(3600)  # cancelled by the worker meanwhile
    return Result(messages=[" ".join(results)])


async def _async_called(path, name):
    await asyncio.sleep(0)
    return _called(path, name)


def five_steps_plain(batch, ctx):
    payload = batch[0].payload
    path, how = payload["log"], payload["after_3"]
    results = []
    for n, name in enumerate(STEPS, 1):
        results.append(ctx.step_sync(name, _called, path, name))
        if n == 3:
            _fail_first_attempt(batch, how, path)
    return Result(messages=[" ".join(results)])
