"""Calling a user's handler for one run: the `Context` it gets, and what it
returns made a `Result` (the quarantine process that runs a suspect run alone
is services/worker/quarantine.py).

A handler is `handle(batch, ctx)` or `async def handle(batch, ctx)`, returning
`Result`, `None` (nothing to say) or raising. Whatever it does becomes a
`Result`: an exception or a wrong return type is `Result(error=...)`.

`ctx.lease_lost` is set when the run's lease is gone (a renewal was refused or
failed past the TTL, the run timed out, the worker is stopping and the grace
period ended): nothing the run returns will commit. A thread checks
`ctx.lease_lost.is_set()` or waits with `.wait(seconds)`; an async handler may
`await ctx.lease_lost`, and is cancelled anyway when it is set.
"""

import asyncio
import functools
import importlib
import inspect
import logging
import os
import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from agent_inbox import errors, tracing
from agent_inbox.agent.app import App
from agent_inbox.agent.permits import ApprovalNeeded, Permit, RunPermits
from agent_inbox.agent.result import Result
from agent_inbox.agent.steps import NO_RUN, RunSteps
from agent_inbox.records import Event


class LeaseLostSignal:
    """A flag set once, from any thread, that threads wait on and coroutines await.
    Its threading.Event is made by the first thread that waits (most runs never
    wait on it: one fewer Condition per run)."""

    def __init__(self):
        self._set = False
        self._event: threading.Event | None = None
        self._guard = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def set(self) -> None:
        with self._guard:
            self._set = True
            if self._event is not None:
                self._event.set()
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, future)
            except RuntimeError:  # that loop is closed: nobody waits any more
                pass

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        with self._guard:
            if self._set:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def __await__(self):
        return self._wait_async().__await__()

    async def _wait_async(self) -> bool:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._guard:
            if self._set:
                return True
            self._waiters.append((loop, future))
        await future
        return True


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(True)


@dataclass
class Context:
    """What a handler knows about its run (see `LeaseLostSignal` for `lease_lost`),
    and its durable steps (steps.py): `await ctx.step(name, fn, *args)` in an
    async handler, `ctx.step_sync(name, fn, *args)` in a plain one, and
    `ctx.step_key(name)`, the idempotency key of the next call of `name`;
    and the fleet's limits (limits.py): `await ctx.limit(name, cost=1)`, or
    `ctx.limit_sync(name, cost=1)` in a plain handler."""

    user: str
    holder: str
    gen: int
    lease_lost: LeaseLostSignal = field(default_factory=LeaseLostSignal)
    steps: RunSteps | None = field(default=None, repr=False)
    # The user's memory document as the run's claim read it (None: none yet);
    # Result(memory=...) replaces it in the run's finish.
    memory: Any = field(default=None, repr=False)
    permits: RunPermits | None = field(default=None, repr=False)
    # Which attempt this run is at its events (1: the first claim), and when
    # the worker stops it (epoch seconds by this host's clock; None: no limit).
    attempt: int = 1
    deadline: float | None = None
    # limits.Limiter (the worker's), or a PipeLimiter in a quarantine process
    limiter: Any = field(default=None, repr=False)

    @functools.cached_property
    def log(self) -> logging.LoggerAdapter:
        """A logger whose lines name this run's user and generation."""
        return RunLog(logging.getLogger("agent_inbox.run"), {"user": self.user, "gen": self.gen})

    async def permit(self, tool: str, args: Any = None) -> Permit:
        """Whether this call of `tool` with `args` may run: Permit.ALLOW or
        Permit.DENY, decided by the policies and recorded (permissions.py); a
        rule that asks ends the run with an approval request (ApprovalNeeded)."""
        return await self._permits().ask_async(tool, args)

    def permit_sync(self, tool: str, args: Any = None) -> Permit:
        """`permit` for a plain (thread) handler."""
        return self._permits().ask(tool, args)

    def _permits(self) -> RunPermits:
        if self.permits is None:
            raise errors.AgentInboxError(
                "ctx.permit needs a run: call it from a handler the worker runs, or make the "
                "context with Inbox.context(run)")
        return self.permits

    async def step(self, name: str, fn: Callable, /, *args, **kwargs) -> Any:
        """`fn(*args, **kwargs)` (awaited if it returns an awaitable), called
        once for this run's events however many attempts the run takes: its
        result is recorded before it is returned, and replayed to later attempts."""
        return await self._steps().run_async(name, fn, args, kwargs)

    def step_sync(self, name: str, fn: Callable, /, *args, **kwargs) -> Any:
        """`step` for a plain (thread) handler: blocks until the record is committed."""
        return self._steps().run_blocking(name, fn, args, kwargs)

    def step_key(self, name: str) -> str:
        """A key that names the next `step(name, ...)` call of this run the same
        way on every attempt: a provider's idempotency key."""
        return self._steps().key(name)

    async def limit(self, name: str, cost: int = 1) -> None:
        """Wait until the fleet's limit `name` lets `cost` tokens through
        (first come, first served; the run holds no connection meanwhile).
        errors.UnknownLimit if the database has no such limit,
        errors.CostAboveBurst if `cost` is above its burst: nothing is taken."""
        with tracing.span("agent_inbox.limit.wait", attributes={"agent_inbox.limit": name,
                                                                 "agent_inbox.limit.cost": cost}):
            await self._limiter().acquire(name, cost)

    def limit_sync(self, name: str, cost: int = 1) -> None:
        """`limit` for a plain (thread) handler: blocks until let through (or
        the run is stopped: limits.LimitAbandoned)."""
        with tracing.span("agent_inbox.limit.wait", attributes={"agent_inbox.limit": name,
                                                                 "agent_inbox.limit.cost": cost}):
            self._limiter().acquire_blocking(name, cost, abandoned=self.lease_lost.is_set)

    def _limiter(self):
        if self.limiter is None:
            raise errors.AgentInboxError(NO_LIMITER)
        return self.limiter

    def _steps(self) -> RunSteps:
        if self.steps is None:
            raise errors.AgentInboxError(NO_RUN)
        return self.steps


class RunLog(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return f"user={self.extra['user']} gen={self.extra['gen']}: {msg}", kwargs


NO_LIMITER = ("ctx.limit needs a limiter: the worker sets one on every run's context "
              "(Inbox.context does too); a Context made by hand has none (set ctx.limiter = "
              "inbox.limiter)")


def load(reference: str, *, what: str = "handler") -> Callable:
    """`module:function` to the callable it names (a handler, or `what` else),
    or to an App. The one loader of every `module:attr` option (--handler,
    --app, --channel): the module is imported as `python -m` would from the
    current working directory, which is put first on sys.path if it is not
    there yet (the `agent-inbox` script's path holds its own folder, not
    yours), whichever service loads it."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise errors.InvalidInput(what, reference, "must look like module:function")
    _current_folder_on_path()
    try:
        target = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except Exception as exc:  # an import that fails in any way is a reference that cannot load
        raise errors.InvalidInput(what, reference, f"cannot be loaded: {exc}") from None
    if not callable(target) and not isinstance(target, App):
        raise errors.InvalidInput(what, reference, "is not callable")
    return target


def _current_folder_on_path() -> None:
    try:
        here = os.getcwd()
    except OSError:  # the folder was removed: nothing to add
        return
    if "" not in sys.path and here not in sys.path:
        sys.path.insert(0, here)


def is_async(handler: Callable) -> bool:
    """Whether calling the handler makes a coroutine (async def, or an object
    whose __call__ is async)."""
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None))


def call(handler: Callable, batch: list[Event], ctx: Context,
         await_on: Callable[[Any], Any]) -> Result:
    """Run a handler to completion in this thread; an awaitable it returns is
    handed to `await_on`, which waits for it (on an event loop). Never raises."""
    try:
        with tracing.activate(ctx.steps):  # the run's span is the handler's current span
            outcome = handler(batch, ctx)
            if inspect.isawaitable(outcome):
                outcome = await_on(outcome)
    except KeyboardInterrupt:
        raise
    except ApprovalNeeded as needed:  # a permit that asks: the run ends with the request
        return Result(approvals=[needed.request])
    except BaseException as exc:  # SystemExit, CancelledError: still the run's error
        return Result(error=describe(exc))
    return as_result(outcome)


async def call_async(handler: Callable, batch: list[Event], ctx: Context) -> Result:
    """Run an async handler as a task on the caller's loop. Raises CancelledError
    only when the task is cancelled; every other exception is the run's error."""
    try:
        with tracing.activate(ctx.steps):  # the run's span is the handler's current span
            outcome = await handler(batch, ctx)
    except asyncio.CancelledError:
        raise
    except ApprovalNeeded as needed:  # a permit that asks: the run ends with the request
        return Result(approvals=[needed.request])
    except BaseException as exc:
        return Result(error=describe(exc))
    return as_result(outcome)


async def awaited(awaitable):
    return await awaitable


def as_result(outcome) -> Result:
    if outcome is None:
        return Result()
    if not isinstance(outcome, Result):
        return Result(error=f"handler returned {type(outcome).__name__}, not agent_inbox.Result")
    return outcome


def describe(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" at {last[0].filename}:{last[0].lineno}" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"[:2000]
