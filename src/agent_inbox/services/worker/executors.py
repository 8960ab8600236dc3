"""Where the worker's handlers run: one event loop, threads, or quarantine.

- `EventLoop`: `async def` handlers run as tasks on one event loop that lives as
  long as the worker, so an async client made at import or first use (an HTTP
  or LLM SDK client with its own connection pool) serves every run. A run is
  stopped by cancelling its task. Given the supervisor's slot (blame.py), each
  step of a run's tasks names that run in it, so that a crash is blamed on it.
- `Threads`: plain `def` handlers, each run on a thread of its own. A thread
  cannot be stopped: a run abandoned while its handler still runs (timed out,
  lease lost) leaves the thread to end on its own, its result ignored.
- `Quarantine`: runs whose last attempt ended without a finish (the process
  running it died, it hung, it lost its lease), each alone in one of a few
  long-lived processes, started on first use; a run that kills its process
  kills only itself, and a stopped run's process is killed.

Each is an `Executor`: `run(target, flight, begin, ended)` starts a run and
returns at once; it asks `begin(flight)` just before calling the handler (False:
the run was given back or stopped meanwhile, so it must not start) and reports
the end with `ended(flight, outcome, seconds)`: a `Result`, a `quarantine.Crashed`,
or None when the run was stopped. `close()` stops what it started.
"""

import asyncio
import contextvars
import logging
import os
import queue
import sys
import threading
import time
import traceback
from typing import Callable, Protocol

from agent_inbox.services.worker import blame
from agent_inbox.agent import handler
from agent_inbox.services.worker import quarantine

Begin = Callable[[object], bool]
Ended = Callable[[object, object, float], None]
# (flight or None, seconds, stack, first): see EventLoop.watch.
Blocked = Callable[[object, float, str, bool], None]

log = logging.getLogger("agent_inbox.worker")


class Executor(Protocol):
    """Where a run's handler runs (see the module's docstring)."""

    def run(self, target: Callable, flight, begin: Begin, ended: Ended) -> None:
        """Start `target` (the handler) on `flight`'s events, or return if
        `begin(flight)` says no; report its end with `ended`."""

    def close(self) -> None:
        """Stop the executor's threads or processes (runs left are abandoned)."""

# The run a task on the loop works for: set in the context of each run's task,
# and so inherited by every task its handler starts (EventLoop maps tasks to it).
RUN: contextvars.ContextVar = contextvars.ContextVar("agent_inbox_run", default=None)
# The loop is blocked when a heartbeat posted to it is not answered for this
# long while one task (or one callback outside any task) held it at every look;
# the watchdog looks every LOOP_WATCH_EVERY seconds.
BLOCKED_AFTER = 1.0
LOOP_WATCH_EVERY = 0.2


class EventLoop:
    """One asyncio loop on a thread of its own."""

    def __init__(self, slot: blame.Slot | None = None):
        self.loop = asyncio.new_event_loop()
        self._owners: dict[asyncio.Task, object] = {}  # task -> the flight it works for
        self._slot = slot  # marked with the run stepping (blame.py), if the supervisor gave one
        self.loop.set_task_factory(self._new_task)
        self.blocked_since: float | None = None  # set by the watchdog while the loop is blocked
        self._closed = threading.Event()
        self._answered = True
        self._thread = threading.Thread(target=self.loop.run_forever, name="agent-inbox-loop",
                                        daemon=True)
        self._thread.start()

    def run(self, target: Callable, flight, begin: Begin, ended: Ended) -> None:
        """Start `flight`'s async handler as a task; `flight.cancel` stops it."""
        def start_task():
            if not begin(flight):
                return
            started = time.monotonic()
            context = contextvars.copy_context()
            context.run(RUN.set, flight)
            if self._slot is not None:
                blame.enter(context, flight.run.user, flight.run.gen)
            task = self.loop.create_task(handler.call_async(target, flight.run.events, flight.ctx),
                                         context=context)
            task.add_done_callback(lambda done: ended(
                flight, None if done.cancelled() else done.result(), time.monotonic() - started))
            flight.cancel = lambda: self.loop.call_soon_threadsafe(task.cancel)
            if flight.ctx.lease_lost.is_set():  # stopped before the cancel was in place
                task.cancel()

        self.loop.call_soon_threadsafe(start_task)

    def _new_task(self, loop, coro, **options):
        """Every task of the loop: remember the run it works for (RUN in its
        context) and, with a slot, mark the slot at each of its steps (blame.py)."""
        if self._slot is not None:
            coro = blame.traced(coro, self._slot)
        task = asyncio.Task(coro, loop=loop, **options)
        context = options.get("context")
        flight = RUN.get() if context is None else context.get(RUN)
        if flight is not None:
            self._owners[task] = flight
            task.add_done_callback(self._owners.pop)
        return task

    def watch(self, blocked: Blocked) -> None:
        """Watch the loop from a thread of its own: while it is blocked (see
        BLOCKED_AFTER), call `blocked(flight, seconds, stack, first)` at every
        look: the run whose task holds it (None: none known), for how long, the
        loop thread's stack, and whether this block is new."""
        threading.Thread(target=self._watch, args=(blocked,), name="agent-inbox-loop-watch",
                         daemon=True).start()

    def _answer(self) -> None:
        self._answered = True

    def _watch(self, blocked: Blocked) -> None:
        posted = time.monotonic()  # when the heartbeat not yet answered was posted
        holder, since = None, posted  # the task (or None) the loop ran at every look since `since`
        reported = None  # the holder of the block last reported
        while not self._closed.wait(LOOP_WATCH_EVERY):
            now = time.monotonic()
            if self._answered:
                self.blocked_since, reported = None, None
                self._answered, posted = False, now
                try:
                    self.loop.call_soon_threadsafe(self._answer)
                except RuntimeError:  # the loop is closed
                    return
            task = asyncio.current_task(self.loop)
            if task is not holder:
                holder, since = task, now
            began = max(since, posted)  # at the latest (the loop answered the beat before)
            if now - began < BLOCKED_AFTER:
                continue
            self.blocked_since = began
            stack = self._stack()
            key = self if holder is None else holder  # self: a callback outside any task
            first, reported = reported is not key, key
            try:
                blocked(self._owners.get(holder) if holder is not None else None,
                        now - began, stack, first)
            except Exception:  # never lose the watchdog
                log.exception("the event loop's watchdog failed; going on")

    def _stack(self) -> str:
        """The loop thread's stack, from the first frame that is not the loop's
        own machinery (threading, asyncio)."""
        frame = sys._current_frames().get(self._thread.ident)
        if frame is None:
            return ""
        frames = traceback.extract_stack(frame)
        machinery = tuple(os.path.dirname(module.__file__) + os.sep for module in (asyncio,)) + (
            threading.__file__,)
        while len(frames) > 1 and frames[0].filename.startswith(machinery):
            del frames[0]
        return "".join(traceback.format_list(frames))

    def wait_for(self, awaitable):
        """Await on the loop from another thread (a plain handler that returned
        an awaitable)."""
        return asyncio.run_coroutine_threadsafe(handler.awaited(awaitable), self.loop).result()

    def close(self) -> None:
        self._closed.set()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


class Threads:
    """A thread per running run of a plain handler."""

    def __init__(self, loop: EventLoop):
        self._loop = loop

    def run(self, target: Callable, flight, begin: Begin, ended: Ended) -> None:
        def body():
            if not begin(flight):
                return
            RUN.set(flight)  # the loop's tasks it awaits through wait_for work for it
            started = time.monotonic()
            result = handler.call(target, flight.run.events, flight.ctx, self._loop.wait_for)
            ended(flight, result, time.monotonic() - started)

        threading.Thread(target=body, name=f"agent-inbox-run-{flight.run.user}"[:60],
                         daemon=True).start()

    def close(self) -> None:
        """Nothing to stop: a run's thread ends with its handler."""


class Quarantine:
    """Up to `size` handler processes, each running one run at a time."""

    def __init__(self, reference: str, size: int):
        self.reference, self.size = reference, size
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lanes: list[tuple[threading.Thread, quarantine.HandlerProcess]] = []
        self._guard = threading.Lock()

    def run(self, target: Callable, flight, begin: Begin, ended: Ended) -> None:
        """Queue `flight` for the next free process, which imports the handler
        by its reference (`target` is that handler, not sent)."""
        with self._guard:
            if len(self._lanes) < self.size:  # a lane's process starts with its first run
                self._add_lane(begin, ended)
        self._queue.put(flight)

    def _add_lane(self, begin: Begin, ended: Ended) -> None:
        process = quarantine.HandlerProcess(self.reference, f"agent-inbox-quarantine-{len(self._lanes)}")
        thread = threading.Thread(target=self._serve, args=(process, begin, ended),
                                  name=f"agent-inbox-quarantine-{len(self._lanes)}", daemon=True)
        self._lanes.append((thread, process))
        thread.start()

    def _serve(self, process: quarantine.HandlerProcess, begin: Begin, ended: Ended) -> None:
        while True:
            flight = self._queue.get()
            if flight is None:
                process.close()  # between runs: its app's shutdown hooks run
                return
            if not begin(flight):
                continue
            try:
                outcome, seconds = process.run(flight.run.events, flight.ctx)
            except Exception as exc:  # the pipe or the process start failed: this run's error
                outcome, seconds = quarantine.Crashed(f"the quarantine process failed: {exc!r}"), 0.0
            ended(flight, outcome, seconds)

    def pids(self) -> list[int]:
        return [process.pid for _, process in self._lanes if process.pid is not None]

    def close(self) -> None:
        for _ in self._lanes:
            self._queue.put(None)
        for thread, _ in self._lanes:
            thread.join(timeout=10)
