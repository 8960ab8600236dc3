"""Handlers the runtime tests name as module:function (child processes import them)."""

import asyncio
import os
import signal
import threading
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


async def async_crash_process(batch, ctx):
    """crash_process, async: the poison kills its process in its task's step."""
    if any(e.payload.get("poison") for e in batch):
        os.kill(os.getpid(), signal.SIGKILL)
    await asyncio.sleep(0)
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


# --- the runtime at agent scale (test_agents.py) ------------------------------------

_arrived = 0
_together: asyncio.Event | None = None


async def async_all_at_once(batch, ctx):
    """Returns only once AGENT_SCALE_RUNS runs are in flight together in this
    process (each waits up to 60 s), so every run that commits proves it."""
    global _arrived, _together
    if _together is None:
        _together = asyncio.Event()
    _arrived += 1
    if _arrived >= int(os.environ["AGENT_SCALE_RUNS"]):
        _together.set()
    await asyncio.wait_for(_together.wait(), 60)
    return Result(messages=[f"{ctx.holder} {batch[0].id}"])


_barrier: threading.Barrier | None = None
_barrier_guard = threading.Lock()


def all_at_once(batch, ctx):
    """The plain-handler twin of async_all_at_once: a barrier of AGENT_SCALE_RUNS threads."""
    global _barrier
    with _barrier_guard:
        if _barrier is None:
            _barrier = threading.Barrier(int(os.environ["AGENT_SCALE_RUNS"]), timeout=60)
    _barrier.wait()
    return Result(messages=[f"{ctx.holder} {batch[0].id}"])


async def async_hang(batch, ctx):
    await asyncio.Event().wait()


def hang(batch, ctx):
    threading.Event().wait()


def _touch(path):
    open(path, "w").close()


async def async_hold(batch, ctx):
    """Marks its start (payload `started`), then runs until the file named
    `release` exists; marks `cancelled` if its task is cancelled."""
    payload = batch[0].payload
    _touch(payload["started"])
    try:
        while not os.path.exists(payload["release"]):
            await asyncio.sleep(0.02)
    except asyncio.CancelledError:
        _touch(payload["started"] + f".cancelled-{ctx.lease_lost.is_set()}")
        raise
    return Result(messages=["released"])


async def async_briefly(batch, ctx):
    await asyncio.sleep(0.02)
    return Result(messages=[f"{ctx.holder} {batch[0].id}"])


def poison_or_hold(batch, ctx):
    """A poison event kills its process; any other marks its start (payload
    `started`) and runs until the file named `release` exists."""
    payload = batch[0].payload
    if payload.get("poison"):
        os.kill(os.getpid(), signal.SIGKILL)
    _touch(payload["started"] + f".{batch[0].attempts}")
    while not os.path.exists(payload["release"]):
        time.sleep(0.02)
    return Result(messages=[f"{os.getpid()}"])


def exits_cleanly(batch, ctx):
    """A poison event that ends its process with exit code 0 (os._exit(0))."""
    os._exit(0)


def exits_2(batch, ctx):
    """A poison event that ends its process with exit code 2, the code of bad input."""
    os._exit(2)


_LEAKED = []


def leak(batch, ctx):
    """Keeps payload["leak_mib"] MiB per run for the life of its process (pages
    touched, so they count in its RSS), and marks each event it handles with a
    file in payload["dir"] named <event id>.<pid>.<gen>: executions counted
    outside the process."""
    time.sleep(0.05)
    _LEAKED.append(b"\x01" * (batch[0].payload["leak_mib"] * 2**20))
    for event in batch:
        open(os.path.join(event.payload["dir"], f"{event.id}.{os.getpid()}.{ctx.gen}"), "w").close()
    return Result(messages=[f"{ctx.user}:{len(batch)}"])


async def block_the_loop(batch, ctx):
    """On its first attempt, holds the event loop payload["block"] seconds
    (time.sleep in an async handler); then awaits payload["wait"] seconds."""
    payload = batch[0].payload
    if payload.get("block") and batch[0].attempts == 1:
        sleep_holding_the_loop(payload["block"])
    await asyncio.sleep(payload.get("wait", 0))
    return Result(messages=[f"{ctx.user}:{batch[0].attempts}"])


def sleep_holding_the_loop(seconds):
    time.sleep(seconds)
