"""Running a user's handler for one run: in a handler process, or in a thread.

A handler is `handle(batch, ctx)` (or `async def`) returning `Result`, `None`
(nothing to say) or raising. Whatever it does becomes a `Result`: an exception or
a wrong return type is `Result(error=...)`.

Isolation (the default): each worker slot runs its handlers in a long-lived
process of its own (`HandlerProcess`). An event that crashes its process (a
poison event) kills only that slot's run: the worker and the other users' runs
beside it live on, so healthy events are parked dead only by crashes of their
own. The slot starts a new process and goes on. Thread mode (`run_in_thread`)
shares the worker's process: cheaper, for handlers that cannot crash it.
"""

import importlib
import inspect
import multiprocessing
import os
import threading
import time
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
            import asyncio  # loaded for async handlers only

            outcome = asyncio.run(_awaited(outcome))
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit, CancelledError: still the run's error
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
        try:
            box.append(call(handler, batch, ctx))
        finally:
            if not box:
                box.append(Result(error="the handler's thread ended without a result"))
            wake.set()

    threading.Thread(target=target, name=f"handler-{ctx.user}", daemon=True).start()
    while not box:
        wake.wait()
        wake.clear()
        if not box and ctx.lease_lost.is_set():
            return None
    return box[0]


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


def _serve_runs(reference: str, conn, lease_lost, parent: int) -> None:
    """A handler process's loop: one run per message, answered with (result,
    seconds the handler took), until the pipe closes."""
    _exit_with_parent(parent)
    try:
        target = load(reference)
    except errors.AgentInboxError as exc:
        target, problem = None, str(exc)
    while True:
        try:
            batch, user, holder, gen = conn.recv()
        except EOFError:
            return
        ctx = Context(user=user, holder=holder, gen=gen, lease_lost=lease_lost)
        conn.send(RUN_STARTED)
        started = time.monotonic()
        result = call(target, batch, ctx) if target else Result(error=problem)
        conn.send((result, time.monotonic() - started))


class HandlerProcess:
    """A slot's handler process, started again whenever it dies. `run` is called
    by the slot's thread only; `stop` may come from another (shutdown)."""

    def __init__(self, reference: str, name: str):
        self.reference, self.name = reference, name
        self._guard = threading.Lock()
        self._process = self._conn = self._lost = None

    def _start(self):
        conn, child_conn = _SPAWN.Pipe()
        lost = _SPAWN.Event()
        process = _SPAWN.Process(target=_serve_runs, name=self.name, daemon=True,
                                 args=(self.reference, child_conn, lost, os.getpid()))
        process.start()
        child_conn.close()
        with self._guard:
            self._process, self._conn, self._lost = process, conn, lost
        return process, conn, lost

    def start(self) -> None:
        """Start the process now (a worker does so before taking work, so the
        first run does not wait for an interpreter to start)."""
        with self._guard:
            running = self._process is not None and self._process.is_alive()
        if not running:
            self._start()

    def run(self, batch: list[Event], ctx: Context) -> tuple[Result | None, float]:
        """The run's result and the seconds it took; a crash of the process
        during the run is the run's error. None if the lease was lost first (the
        process is stopped: its answer would be refused by the fence, and it may
        be stuck)."""
        started = time.monotonic()
        for _ in range(DEATHS_BEFORE_START):
            with self._guard:
                current = (self._process, self._conn, self._lost)
            process, conn, lost = current if current[0] and current[0].is_alive() else self._start()
            lost.clear()
            started = time.monotonic()
            try:
                conn.send((batch, ctx.user, ctx.holder, ctx.gen))
            except OSError:  # it died after the check: nothing ran yet
                self.stop()
                continue
            answer = self._answer(process, conn, lost, ctx, started)
            if answer is None:
                continue  # it died before the handler was called
            return answer
        died = f"handler process died before the run started, {DEATHS_BEFORE_START} times"
        return Result(error=died), time.monotonic() - started

    def _answer(self, process, conn, lost, ctx: Context, started: float):
        """(result, seconds), (None, seconds) if the lease was lost, or None if
        the process died before calling the handler."""
        running = False
        while True:
            ready = wait_any([conn, process.sentinel], timeout=0.2)
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
                if message is not None:
                    return message
            if process.sentinel in ready:
                process.join()
                self.stop()
                if not running:
                    return None
                died = Result(error=f"handler process died (exit code {process.exitcode})")
                return died, time.monotonic() - started
            if ctx.lease_lost.is_set():
                lost.set()
                self.stop()
                return None, time.monotonic() - started

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
        self._conn.close()
