"""Calling a user's handler for one run, and the quarantine process that runs a
suspect run alone.

A handler is `handle(batch, ctx)` or `async def handle(batch, ctx)`, returning
`Result`, `None` (nothing to say) or raising. Whatever it does becomes a
`Result`: an exception or a wrong return type is `Result(error=...)`.

`ctx.lease_lost` is set when the run's lease is gone (a renewal was refused or
failed past the TTL, the run timed out, the worker is stopping and the grace
period ended): nothing the run returns will commit. A thread checks
`ctx.lease_lost.is_set()` or waits with `.wait(seconds)`; an async handler may
`await ctx.lease_lost`, and is cancelled anyway when it is set.

A `HandlerProcess` runs one run at a time in a process of its own (the worker's
quarantine, see worker/): a run that kills its process kills only itself.
"""

import asyncio
import functools
import importlib
import inspect
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_any
from typing import Any, Callable

from agent_inbox import errors, tracing
from agent_inbox.records import Event
from agent_inbox.result import Result
from agent_inbox.app import App, as_app
from agent_inbox.permissions import ApprovalNeeded, Permit, RunPermits
from agent_inbox.steps import NO_RUN, RunSteps


class LeaseLost:
    """A flag set once, from any thread, that threads wait on and coroutines await."""

    def __init__(self):
        self._event = threading.Event()
        self._guard = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def set(self) -> None:
        with self._guard:
            self._event.set()
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, future)
            except RuntimeError:  # that loop is closed: nobody waits any more
                pass

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def __await__(self):
        return self._wait_async().__await__()

    async def _wait_async(self) -> bool:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._guard:
            if self._event.is_set():
                return True
            self._waiters.append((loop, future))
        await future
        return True


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(True)


@dataclass
class Context:
    """What a handler knows about its run (see `LeaseLost` for `lease_lost`),
    and its durable steps (steps.py): `await ctx.step(name, fn, *args)` in an
    async handler, `ctx.step_sync(name, fn, *args)` in a plain one, and
    `ctx.step_key(name)`, the idempotency key of the next call of `name`;
    and the fleet's limits (limits.py): `await ctx.limit(name, cost=1)`, or
    `ctx.limit_sync(name, cost=1)` in a plain handler."""

    user: str
    holder: str
    gen: int
    lease_lost: LeaseLost = field(default_factory=LeaseLost)
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
              "limits.limiter_for(inbox))")


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


# --- the quarantine process ----------------------------------------------------------

_SPAWN = multiprocessing.get_context("spawn")


def _exit_with_parent(parent: int) -> None:
    """A handler process must not outlive its worker (killed outright, it cannot
    stop its children): it exits when its parent is gone."""
    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


# A handler process says so before it calls the handler: a death before that
# is not the run's doing (the process died between runs), and the run is sent
# to a new process, at most DEATHS_BEFORE_START times.
RUN_STARTED = "started"
DEATHS_BEFORE_START = 3


# A handler process asks its worker what only the worker can answer (its run's
# durable steps, its permit calls): it sends (STEPS_ASKED,), (STEP_RECORDED,
# record) or (PERMIT_ASKED, question) and waits for ("ok", answer),
# ("refused", message) or ("failed", message).
STEPS_ASKED = "steps?"
STEP_RECORDED = "step"
PERMIT_ASKED = "permit?"
# ... and its limits (PipeLimiter): (LIMIT_ASKED, name, cost), answered with
# ("ok", None) once the worker's limiter let it through, or ("refused",
# (error class name, field, value, problem)), or ("failed", message).
LIMIT_ASKED = "limit"
QUESTIONS = (STEPS_ASKED, STEP_RECORDED, PERMIT_ASKED)


class WorkerLink:
    """A quarantined run's questions to its worker, over the process's pipe
    (one run at a time, so one question at a time), answered once the worker's
    completer has read, committed or decided it. It is the run's step journal
    (steps.Journal) and its permit asker."""

    def __init__(self, conn):
        self._conn = conn

    def _ask(self, *question):
        self._conn.send(question)
        verdict, answer = self._conn.recv()
        if verdict == "refused":
            raise errors.StepRefused(answer)
        if verdict == "failed":
            raise errors.DatabaseUnavailable(answer)
        return answer

    def recorded(self):
        return self._ask(STEPS_ASKED)

    def record(self, record) -> None:
        self._ask(STEP_RECORDED, record)

    def permit(self, question):
        return self._ask(PERMIT_ASKED, question)

    # The process runs this run alone: a wait blocks no other run.
    async def recorded_async(self):
        return self.recorded()

    async def record_async(self, record) -> None:
        self.record(record)

    async def permit_async(self, question):
        return self.permit(question)


class PipeLimiter:
    """A quarantined run's limits: each call waits on the worker's limiter,
    over the process's pipe. One limiter per worker process, whichever way its
    runs are executed: its callers queue together in arrival order, and the
    quarantine process needs no connection of its own."""

    def __init__(self, conn):
        self._conn = conn

    def acquire_blocking(self, name: str, cost: int = 1, **_) -> None:
        self._conn.send((LIMIT_ASKED, name, cost))
        verdict, answer = self._conn.recv()
        if verdict == "refused":
            kind, *details = answer
            raise getattr(errors, kind, errors.InvalidInput)(*details)
        if verdict == "failed":
            raise errors.AgentInboxError(answer)

    async def acquire(self, name: str, cost: int = 1) -> None:  # the process runs this run alone
        self.acquire_blocking(name, cost)


def _answer_limit(question: tuple, ctx: Context, process) -> tuple[str, Any]:
    """The worker's side of PipeLimiter: wait on the worker's limiter (in the
    thread that serves this quarantined run) until it lets the call through,
    the run is stopped or the process dies."""
    _, name, cost = question
    try:
        ctx._limiter().acquire_blocking(
            name, cost, abandoned=lambda: ctx.lease_lost.is_set() or not process.is_alive())
        return "ok", None
    except errors.InvalidInput as exc:
        message = str(exc)  # "{field} {problem} (got {value!r})"
        problem = message[len(exc.field) + 1:message.rfind(" (got ")]
        return "refused", (type(exc).__name__, exc.field, exc.value, problem)
    except Exception as exc:
        return "failed", f"{type(exc).__name__}: {exc}"


def _answer_question(question: tuple, ctx: Context) -> tuple[str, Any]:
    """The worker's side of WorkerLink: the answer to a quarantined run's question."""
    try:
        if question[0] == STEPS_ASKED:
            return "ok", ctx.steps.journal.recorded()
        if question[0] == STEP_RECORDED:
            ctx.steps.journal.record(question[1])
            return "ok", None
        return "ok", ctx.permits.decide(question[1])
    except errors.StepRefused as exc:
        return "refused", str(exc)
    except Exception as exc:
        return "failed", f"{type(exc).__name__}: {exc}"


def _serve_runs(reference: str, conn, parent: int) -> None:
    """A handler process's loop: one run per message, answered with (result,
    seconds the handler took), until the pipe closes. Async handlers run on one
    event loop that lives as long as the process."""
    _exit_with_parent(parent)
    # A terminal's Ctrl-C reaches the whole process group: the worker decides
    # when its runs stop (grace, then stop); this process ends when told.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    loop = asyncio.new_event_loop()

    def await_on(outcome):
        return loop.run_until_complete(awaited(outcome))

    app, problem = None, None
    try:
        app = as_app(load(reference), reference)
        app.start(await_on)  # before its first run, once for the process
    except Exception as exc:  # every run of this process then ends with this error
        app, problem = None, f"the handler process could not start: {describe(exc)}"
    link = WorkerLink(conn)
    while True:
        try:
            batch, user, holder, gen, step_limit, memory, limited, deadline = conn.recv()
        except EOFError:
            break
        # lease_lost is never set here: the process is stopped instead
        ctx = Context(user=user, holder=holder, gen=gen, memory=memory, deadline=deadline,
                      attempt=max((e.attempts for e in batch), default=1))
        if limited:  # the worker has a limiter: ctx.limit asks it
            ctx.limiter = PipeLimiter(conn)
        if step_limit is not None:  # a worker's run: steps and permits go to the worker
            ctx.steps = RunSteps(user, holder, gen, [e.id for e in batch],
                                 may_resume=any(e.attempts > 1 for e in batch),
                                 journal=link, max_result_bytes=step_limit)
            ctx.permits = RunPermits(user, holder, gen, link.permit, link.permit_async)
        conn.send(RUN_STARTED)
        started = time.monotonic()
        result = (Result(error=problem) if app is None
                  else call(app.handler, batch, ctx, await_on))
        conn.send((result, time.monotonic() - started))
    if app is not None:
        app.stop(await_on)


@dataclass(frozen=True)
class Crashed:
    """The process running the handler died during the run (a poison event)."""

    error: str


class HandlerProcess:
    """A long-lived process that runs one run at a time, started again whenever
    it dies. `run` is called by one thread at a time; `stop` may come from another."""

    def __init__(self, reference: str, name: str):
        self.reference, self.name = reference, name
        self._guard = threading.Lock()
        self._process = self._conn = None

    def _start(self):
        conn, child_conn = _SPAWN.Pipe()
        process = _SPAWN.Process(target=_serve_runs, name=self.name, daemon=True,
                                 args=(self.reference, child_conn, os.getpid()))
        process.start()
        child_conn.close()
        with self._guard:
            self._process, self._conn = process, conn
        return process, conn

    @property
    def pid(self) -> int | None:
        process = self._process
        return process.pid if process is not None else None

    def run(self, batch: list[Event], ctx: Context) -> tuple[Result | Crashed | None, float]:
        """The run's result (Crashed if the process died during the run) and the
        seconds it took; None if `ctx.lease_lost` was set first (the process is
        stopped: its answer would be refused by the fence, and it may be stuck)."""
        started = time.monotonic()
        for _ in range(DEATHS_BEFORE_START):
            with self._guard:
                current = (self._process, self._conn)
            process, conn = current if current[0] and current[0].is_alive() else self._start()
            started = time.monotonic()
            try:
                step_limit = ctx.steps.max_result_bytes if ctx.steps else None
                conn.send((batch, ctx.user, ctx.holder, ctx.gen, step_limit, ctx.memory,
                           ctx.limiter is not None, ctx.deadline))
            except OSError:  # it died after the check: nothing ran yet
                self.stop()
                continue
            answer = self._answer(process, conn, ctx, started)
            if answer is None:
                continue  # it died before the handler was called
            return answer
        died = f"handler process died before the run started, {DEATHS_BEFORE_START} times"
        return Result(error=died), time.monotonic() - started

    def _answer(self, process, conn, ctx: Context, started: float):
        """(result, seconds), (None, seconds) if the lease was lost, or None if
        the process died before calling the handler."""
        running = False
        while True:
            ready = wait_any([conn, process.sentinel], timeout=0.1)
            if conn in ready:
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    message = None  # it died: its exit code says why
                except Exception as exc:  # read whole, but it cannot be rebuilt here
                    unreadable = Result(error=f"the handler's result could not be read: {exc!r}"[:2000])
                    return unreadable, time.monotonic() - started
                if message == RUN_STARTED:
                    running = True
                    continue
                if isinstance(message, tuple) and message and message[0] in QUESTIONS:
                    conn.send(_answer_question(message, ctx))
                    continue
                if isinstance(message, tuple) and message[:1] == (LIMIT_ASKED,):
                    conn.send(_answer_limit(message, ctx, process))
                    continue
                if message is not None:
                    return message
            if process.sentinel in ready:
                process.join()
                self.stop()
                if not running:
                    return None
                return (Crashed(f"handler process died (exit code {process.exitcode})"),
                        time.monotonic() - started)
            if ctx.lease_lost.is_set():
                self.stop()
                return None, time.monotonic() - started

    def close(self, grace: float = 5.0) -> None:
        """End the process between runs: its pipe closed, it runs the app's
        shutdown hooks and exits (within `grace` seconds, else it is stopped)."""
        with self._guard:
            process, conn = self._process, self._conn
        if process is not None and process.is_alive():
            conn.close()
            process.join(timeout=grace)
        self.stop()

    def stop(self) -> None:
        with self._guard:
            process, self._process = self._process, None
        if process is None:
            return
        if process.is_alive():
            process.terminate()
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()
        if not self._conn.closed:
            self._conn.close()
