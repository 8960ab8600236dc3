"""Running a user's handler for one run: in a thread, or isolated in a child process.

A handler is `handle(batch, ctx)` (or `async def`) returning `Result`, `None`
(nothing to say) or raising. Whatever it does becomes a `Result`: an exception or
a wrong return type is `Result(error=...)`. A retried event runs in a child
process, so an event that crashes its process every time (a poison event) kills
only that child: the worker and the other users' runs beside it live on, and
healthy events are parked dead only by crashes of their own.
"""

import asyncio
import importlib
import inspect
import multiprocessing
import threading
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_any
from typing import Any, Callable

from agent_inbox import errors
from agent_inbox.records import Event
from agent_inbox.result import Result


@dataclass
class Context:
    """What a handler knows about its run. `lease_lost` is set when the lease could
    not be renewed or has lapsed: the run's result will be refused, so stop."""

    user: str
    holder: str
    gen: int
    lease_lost: Any = field(default_factory=threading.Event)


def load(reference: str) -> Callable:
    """`module:function` to the callable it names."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise errors.InvalidInput("handler", reference, "must look like module:function")
    try:
        target = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise errors.InvalidInput("handler", reference, f"cannot be loaded: {exc}") from None
    if not callable(target):
        raise errors.InvalidInput("handler", reference, "is not callable")
    return target


def call(handler: Callable, batch: list[Event], ctx: Context) -> Result:
    """Run the handler to completion here; never raises."""
    try:
        outcome = handler(batch, ctx)
        if inspect.isawaitable(outcome):
            outcome = asyncio.run(_awaited(outcome))
    except Exception as exc:
        return Result(error=_describe(exc))
    if outcome is None:
        return Result()
    if not isinstance(outcome, Result):
        return Result(error=f"handler returned {type(outcome).__name__}, not agent_inbox.Result")
    return outcome


async def _awaited(awaitable):
    return await awaitable


def _describe(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" at {last[0].filename}:{last[0].lineno}" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"[:2000]


def run_in_thread(handler: Callable, batch: list[Event], ctx: Context, wake: threading.Event) -> Result | None:
    """Run in a daemon thread; None if the lease was lost first (the thread is
    abandoned: its result would be refused by the fence anyway)."""
    box: list[Result] = []

    def target():
        box.append(call(handler, batch, ctx))
        wake.set()

    threading.Thread(target=target, name=f"handler-{ctx.user}", daemon=True).start()
    while not box:
        wake.wait()
        wake.clear()
        if not box and ctx.lease_lost.is_set():
            return None
    return box[0]


_SPAWN = multiprocessing.get_context("spawn")


def _child_main(reference: str, batch: list[Event], user: str, holder: str, gen: int,
                lease_lost, conn) -> None:
    ctx = Context(user=user, holder=holder, gen=gen, lease_lost=lease_lost)
    conn.send(call(load(reference), batch, ctx))
    conn.close()


def run_in_child(reference: str, batch: list[Event], ctx: Context) -> Result | None:
    """Run in a fresh child process; a crash of the child is this run's error.
    None if the lease was lost first (the child is terminated)."""
    receiver, sender = _SPAWN.Pipe(duplex=False)
    lost = _SPAWN.Event()
    child = _SPAWN.Process(target=_child_main, name=f"agent-inbox-handler-{ctx.user}",
                           args=(reference, batch, ctx.user, ctx.holder, ctx.gen, lost, sender),
                           daemon=True)
    child.start()
    sender.close()
    try:
        while True:
            ready = wait_any([receiver, child.sentinel], timeout=0.2)
            if receiver in ready:
                try:
                    return receiver.recv()
                except EOFError:
                    pass  # the child died without an answer: its exit code says why
            if child.sentinel in ready or not child.is_alive():
                child.join()
                return Result(error=f"handler process died (exit code {child.exitcode})")
            if ctx.lease_lost.is_set():
                lost.set()
                return None
    finally:
        if child.is_alive():
            child.terminate()
        child.join(timeout=5)
        receiver.close()
