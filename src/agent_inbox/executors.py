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

Every executor asks `begin(flight)` just before calling the handler (False: the
run was given back or stopped meanwhile, so it must not start) and reports the
end with `ended(flight, outcome, seconds)`: a `Result`, a `handler.Crashed`, or
None when the run was stopped.
"""

import asyncio
import queue
import threading
import time
from typing import Callable

from agent_inbox import blame, handler

Begin = Callable[[object], bool]
Ended = Callable[[object, object, float], None]


class EventLoop:
    """One asyncio loop on a thread of its own."""

    def __init__(self, slot: blame.Slot | None = None):
        self.loop = asyncio.new_event_loop()
        self._slot = slot
        if slot is not None:
            blame.trace(self.loop, slot)
        self._thread = threading.Thread(target=self.loop.run_forever, name="agent-inbox-loop",
                                        daemon=True)
        self._thread.start()

    def run(self, target: Callable, flight, begin: Begin, ended: Ended) -> None:
        """Start `flight`'s async handler as a task; `flight.cancel` stops it."""
        def start_task():
            if not begin(flight):
                return
            started = time.monotonic()
            run = flight.run
            task = self.loop.create_task(
                handler.call_async(target, run.events, flight.ctx),
                context=blame.run_context(run.user, run.gen) if self._slot else None)
            task.add_done_callback(lambda done: ended(
                flight, None if done.cancelled() else done.result(), time.monotonic() - started))
            flight.cancel = lambda: self.loop.call_soon_threadsafe(task.cancel)
            if flight.ctx.lease_lost.is_set():  # stopped before the cancel was in place
                task.cancel()

        self.loop.call_soon_threadsafe(start_task)

    def wait_for(self, awaitable):
        """Await on the loop from another thread (a plain handler that returned
        an awaitable)."""
        return asyncio.run_coroutine_threadsafe(handler.awaited(awaitable), self.loop).result()

    def close(self) -> None:
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
            started = time.monotonic()
            result = handler.call(target, flight.run.events, flight.ctx, self._loop.wait_for)
            ended(flight, result, time.monotonic() - started)

        threading.Thread(target=body, name=f"agent-inbox-run-{flight.run.user}"[:60],
                         daemon=True).start()


class Quarantine:
    """Up to `size` handler processes, each running one run at a time."""

    def __init__(self, reference: str, size: int):
        self.reference, self.size = reference, size
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lanes: list[tuple[threading.Thread, handler.HandlerProcess]] = []
        self._guard = threading.Lock()

    def run(self, flight, begin: Begin, ended: Ended) -> None:
        with self._guard:
            if len(self._lanes) < self.size:  # a lane's process starts with its first run
                self._add_lane(begin, ended)
        self._queue.put(flight)

    def _add_lane(self, begin: Begin, ended: Ended) -> None:
        process = handler.HandlerProcess(self.reference, f"agent-inbox-quarantine-{len(self._lanes)}")
        thread = threading.Thread(target=self._serve, args=(process, begin, ended),
                                  name=f"agent-inbox-quarantine-{len(self._lanes)}", daemon=True)
        self._lanes.append((thread, process))
        thread.start()

    def _serve(self, process: handler.HandlerProcess, begin: Begin, ended: Ended) -> None:
        while True:
            flight = self._queue.get()
            if flight is None:
                process.stop()
                return
            if not begin(flight):
                continue
            try:
                outcome, seconds = process.run(flight.run.events, flight.ctx)
            except Exception as exc:  # the pipe or the process start failed: this run's error
                outcome, seconds = handler.Crashed(f"the quarantine process failed: {exc!r}"), 0.0
            ended(flight, outcome, seconds)

    def pids(self) -> list[int]:
        return [process.pid for _, process in self._lanes if process.pid is not None]

    def close(self) -> None:
        for _ in self._lanes:
            self._queue.put(None)
        for thread, _ in self._lanes:
            thread.join(timeout=10)
