"""Handlers of tests/runtime/test_recovery.py (child processes import them)."""

import asyncio
import os
import signal

from agent_inbox import Result


async def poison_or_hold(batch, ctx):
    """A poison event kills its process during its task's step; any other
    appends this process's pid to the file `runs` names (one line per
    execution) and holds until the file `release` names exists."""
    payload = batch[0].payload
    if payload.get("poison"):
        os.kill(os.getpid(), signal.SIGKILL)
    with open(payload["runs"], "a") as runs:
        runs.write(f"{os.getpid()}\n")
    while not os.path.exists(payload["release"]):
        await asyncio.sleep(0.05)
    return Result(messages=[str(os.getpid())])
