"""Handlers the runtime tests name as module:function (child processes import them)."""

import asyncio
import os
import signal
import time

from agent_inbox import ApprovalRequest, Message, Result, TimerRequest


def echo(batch, ctx):
    return Result(messages=[f"{ctx.user}:" + ",".join(e.source_id for e in batch)])


def everything(batch, ctx):
    return Result(messages=["plain", Message("now!", urgent=True)],
                  timers=[TimerRequest("follow-up", 2_000_000, {"n": 1})],
                  approvals=[ApprovalRequest("refund-1", 3600, "refund")])


def explode(batch, ctx):
    raise RuntimeError("tool failed")


def wrong_type(batch, ctx):
    return "done"


async def async_echo(batch, ctx):
    await asyncio.sleep(0)
    return Result(messages=[f"async {len(batch)}"])


def bad_result(batch, ctx):
    return Result(messages=[""])


def crash_process(batch, ctx):
    """A poison event: kills whatever process runs it."""
    if any(e.payload.get("poison") for e in batch):
        os.kill(os.getpid(), signal.SIGKILL)
    return Result(messages=["ok"])


def pid_of_runner(batch, ctx):
    return Result(messages=[str(os.getpid())])


def hold_until_released(batch, ctx):
    """Mark its start (the payload's file name + ".started"), then run until the
    file named in the payload exists, or the lease is lost."""
    path = batch[0].payload["release_file"]
    open(path + ".started", "w").close()
    while not os.path.exists(path):
        if ctx.lease_lost.wait(0.02):
            return Result(messages=["after the lease was lost"])
    return Result(messages=["released"])


def message_not_in_a_list(batch, ctx):
    return Result(messages="hello")


def slow(batch, ctx):
    """A handler slower than a take's budget (as an LLM call would be)."""
    time.sleep(0.08)
    return Result(messages=["slow"])


def slow_when_marked(batch, ctx):
    if any(e.payload.get("slow") for e in batch):
        return slow(batch, ctx)
    return Result(messages=["quick"])


class NeedsTwo(Exception):
    """Pickles, but cannot be unpickled (its __init__ needs two arguments)."""

    def __init__(self, first, second):
        super().__init__(f"{first} {second}")


def unreadable_result(batch, ctx):
    return Result(messages=[NeedsTwo("a", "b")])


def exits(batch, ctx):
    raise SystemExit(3)


async def async_pid_of_runner(batch, ctx):
    return Result(messages=[str(os.getpid())])


async def async_loop_id(batch, ctx):
    return Result(messages=[str(id(asyncio.get_running_loop()))])


async def async_wait_for_lease_loss(batch, ctx):
    """Waits for the lease to be lost (and is cancelled then)."""
    await ctx.lease_lost
    return Result(messages=["after the lease was lost"])
