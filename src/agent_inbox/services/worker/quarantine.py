"""The quarantine process: a suspect run alone in a process of its own.

A `HandlerProcess` runs one run at a time in a spawned process (the worker's
quarantine, see worker/__init__.py): a run that kills its process kills only
itself. The process asks its worker, over a pipe, what only the worker can
answer (the run's durable steps, its permit calls, its limits), and exits when
its worker is gone.
"""

import asyncio
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_any
from typing import Any

from agent_inbox import errors
from agent_inbox.agent.app import as_app
from agent_inbox.agent.handler import Context, awaited, call, describe, load
from agent_inbox.agent.permits import RunPermits
from agent_inbox.agent.steps import RunSteps
from agent_inbox.records import Event
from agent_inbox.agent.result import Result


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
                                 may_resume=any(e.ran_before for e in batch),
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
