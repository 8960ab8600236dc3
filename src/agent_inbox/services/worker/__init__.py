"""The worker runtime: many runs at once in one process, on a fixed few connections.

Four parts, each on a thread of its own, share one table of the runs in flight
(`Flights`, flight.py: one `InFlight` per run, from its take to its commit, its
state an enum that moves only along MOVES, so that each run reports exactly one
ending):

- the **producer** (producer.py) takes as many users as the worker has free
  places and starts their handlers, each on the executor `Worker.start` picks;
- the **executors** (executors.py, one `Executor` protocol) run them: `async
  def` handlers as tasks on one event loop, plain ones on threads, and a run
  whose last attempt ended without a finish in a quarantine process of its own;
- the **completer** (completer.py) commits the runs that ended, together, each
  behind its own fence, releases or gives back the others, and answers the
  runs' durable-step reads and records;
- the **keeper** (keeper.py) extends every lease in flight, stops runs whose
  lease was lost or that ran past `run_timeout`, and recycles the runtime past
  --max-memory or exits when one run blocks the event loop past its timeout.

`Worker` builds them, picks each run's executor, and serves: it starts the
parts, and at shutdown gives back the runs not started, gives the running ones
the grace period, stops the rest and lets the completer drain.

Invariants kept here:

- at most `concurrency` handlers run at once (runs that ended wait for the
  completer's next commit without holding a place), and the worker's pool
  never holds more than POOL_SIZE connections, whatever `concurrency` is;
- a run whose lease is lost, or that is stopped, commits nothing: its
  `ctx.lease_lost` is set, an async handler is cancelled, a quarantine process
  is killed, and whatever it returns is ignored;
- only a run whose handler never started is given back (claim undone); every
  other unfinished run is released with its attempt counted, and the claim that
  retries it runs it in quarantine.
"""

import gc
import logging
import os
import queue
import secrets
import socket
import threading
import time

from agent_inbox.services.worker import blame, executors, horizon
from agent_inbox import errors, metrics, validate
from agent_inbox.agent import handler
from agent_inbox.api import limits
from agent_inbox.api.inbox import Inbox
from agent_inbox.agent.result import Result
from agent_inbox.services.service import Listener, Stop, Waker, backoff_delays
from agent_inbox import notify
from agent_inbox.agent.app import as_app
from agent_inbox.services.worker import compactor
from agent_inbox.services.worker.completer import Completer, RunLine, StepWork
from agent_inbox.services.worker.flight import MOVES, Ending, Flights, InFlight, State, StopReason
from agent_inbox.services.worker.keeper import Keeper, rss_mib
from agent_inbox.services.worker.producer import Producer
from agent_inbox.api.run_stats import RunStats

__all__ = ["POOL_SIZE", "Ending", "InFlight", "MOVES", "State", "StepWork", "Worker",
           "RunLine", "holder_id", "rss_mib"]

log = logging.getLogger("agent_inbox.worker")

# Connections of a worker's pool: the producer, the completer and the keeper use
# one each at a time. LISTEN takes one more of its own.
POOL_SIZE = 3


def holder_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class Worker:
    def __init__(self, inbox: Inbox, handler_reference: str, *, concurrency: int = 1,
                 poll_interval: float = 1.0, grace: float = 30.0, run_timeout: float = 900.0,
                 quarantine: int = 2, holder: str | None = None, stop: Stop | None = None,
                 max_memory: int | None = None, slot: blame.Slot | None = None,
                 horizon_warn: float | None = horizon.WARN_AFTER,
                 compact_held_for: float | None = None):
        self.inbox = inbox
        self.app = as_app(handler.load(handler_reference, what="handler or app"),
                          handler_reference)
        self.handler = self.app.handler
        self._app_started = False
        self.concurrency = validate.positive_int("concurrency", concurrency)
        self.run_timeout = _positive_seconds("run_timeout", run_timeout)
        quarantine = validate.positive_int("quarantine", quarantine)
        self.poll_interval = poll_interval
        self.grace = grace
        self.horizon_warn = horizon_warn  # None or 0: no horizon check (horizon.py)
        # None: compact whatever the horizon; else only while it has been held
        # back this many seconds (store/compaction.py, held_for)
        self.compact_held_for = (None if compact_held_for is None
                                 else _positive_seconds("compact_held_for", compact_held_for))
        self.holder = holder or holder_id()
        self.stop = stop or Stop()
        self.waker = Waker(1)
        self.max_memory = (None if max_memory is None
                           else validate.positive_int("max_memory", max_memory))
        self.loop = executors.EventLoop(slot)  # slot: the run stepping, for the supervisor
        # first attempts: on the loop (async def) or a thread each
        self._executor: executors.Executor = (
            self.loop if handler.is_async(self.handler) else executors.Threads(self.loop))
        self.quarantine = executors.Quarantine(handler_reference, quarantine)
        self.flights = Flights(self.run_timeout)
        self._endings = self.flights.endings  # to the completer: Endings and StepWork
        run_stats = RunStats(inbox, self.holder)
        self.keeper = Keeper(inbox, self.flights, run_timeout=self.run_timeout, grace=grace,
                             max_memory=self.max_memory, stop=self.stop, loop=self.loop,
                             on_loop=self._executor is self.loop)
        self.completer = Completer(inbox, self.flights, run_stats)
        self.producer = Producer(inbox, self.flights, run_stats, holder=self.holder,
                                 concurrency=self.concurrency, poll_interval=poll_interval,
                                 stop=self.stop, waker=self.waker, start=self.start,
                                 memory_full=self.keeper.check_memory)

    @property
    def recycled(self) -> bool:
        """It stopped to be recycled (--max-memory), not on a signal."""
        return self.keeper.recycled

    def take(self, users: int, *, now: int | None = None) -> list[InFlight]:
        """Take up to `users` users' runs in one statement and start them."""
        return self.producer.take(users, now=now)

    def complete(self, endings: list[Ending], *, now: int | None = None) -> dict[str, int]:
        """Write what the runs in `endings` came to (see Completer.complete)."""
        return self.completer.complete(endings, now=now)

    def stop_run(self, flight: InFlight, reason: StopReason) -> bool:
        """Stop a run not yet ended (see Flights.stop)."""
        return self.flights.stop(flight, reason)

    def in_flight(self) -> list[InFlight]:
        return self.flights.where()

    # --- where a run runs ---------------------------------------------------------------

    def start(self, flight: InFlight) -> None:
        """Start a run just taken, on the executor it runs on."""
        if not flight.run.events:  # only exhausted events were due: they are dead now
            if self.flights.begin(flight):
                self.flights.ended(flight, Result(), 0.0)
            return
        self._executor_for(flight).run(self.handler, flight, self.flights.begin,
                                       self.flights.ended)

    def _executor_for(self, flight: InFlight) -> executors.Executor:
        """Where a run runs: in quarantine if its last attempt ended without a
        finish, else on the loop (async def) or a thread (plain)."""
        if flight.run.unfinished:
            log.info("run in quarantine %s: %d events whose last run ended without a finish",
                     flight.label, flight.run.unfinished)
            metrics.QUARANTINED.inc()
            return self.quarantine
        return self._executor

    # --- in step, for tests ------------------------------------------------------------------

    def run_once(self, *, now: int | None = None, timeout: float = 60.0) -> dict[str, int]:
        """One take of up to `concurrency` users, their handlers run to their end,
        their endings committed: what serve() does, in step (for tests and
        simulations with an explicit `now`). Counts as `complete` returns."""
        if not self._app_started:
            self.start_app()
        flights = self.producer.take(self.concurrency, now=now)
        endings: list[Ending] = []
        deadline = time.monotonic() + timeout
        while len(endings) < len(flights):
            try:
                item = self._endings.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                for flight in flights:
                    self.flights.stop(flight, StopReason.TIMED_OUT)
                continue
            endings += self.completer.answer([item], now=now)
        return self.completer.complete(endings, now=now)

    # --- the service ------------------------------------------------------------------------

    def serve(self, url: str | None, *, predecessor: str | None = None,
              predecessor_fate: str = "died", suspect: tuple[str, int] | None = None) -> None:
        """Run until SIGTERM/SIGINT, then shut down gracefully, LISTENing on
        `url` (None: polling only). `predecessor` is the holder of the worker
        process this one replaces: its leases are released first (it died with
        its runs; `suspect`, the run it was executing then, if known: see
        Inbox.runs.release_holder)."""
        if predecessor:
            self._release_predecessor(predecessor, predecessor_fate, suspect)
        try:
            self.start_app()
        except BaseException:
            self.close()
            raise
        collect_rarely()
        Listener(url, [notify.WORK], self.waker.wake_one, self.stop,
                 on_payload={notify.CANCEL: self.keeper.cancelled}).start()
        if self.horizon_warn:
            horizon.Checker.for_pool(self.inbox.pool, self.stop.event,
                                     warn_after=self.horizon_warn).start()
        if compactor.INTERVAL > 0:
            compactor.Compactor(self.inbox, self.stop.event,
                                held_for=self.compact_held_for).start()
        done = threading.Event()
        parts = [threading.Thread(target=self.completer.serve, args=(done,),
                                  name="agent-inbox-completer", daemon=True),
                 threading.Thread(target=self.keeper.serve, args=(done,),
                                  name="agent-inbox-keeper", daemon=True)]
        producer = threading.Thread(target=self.producer.serve, name="agent-inbox-producer",
                                    daemon=True)
        for thread in parts + [producer]:
            thread.start()
        self.loop.watch(self.keeper.loop_blocked)
        log.info("worker started: holder %s, concurrency %d, %s handler", self.holder,
                 self.concurrency, "async" if self._executor is self.loop else "plain")
        self.stop.event.wait()
        with self.flights.guard:
            self.flights.guard.notify_all()
        self.waker.wake_all()
        producer.join()
        self._shut_down()
        done.set()
        for thread in parts:
            thread.join(timeout=30)
        self.close()

    def _release_predecessor(self, predecessor: str, fate: str,
                             suspect: tuple[str, int] | None = None) -> None:
        delays = backoff_delays()
        while not self.stop.is_set():
            try:
                users = self.inbox.runs.release_holder(
                    predecessor, error=f"the worker process running it {fate}", suspect=suspect)
                break
            except errors.DatabaseUnavailable as exc:
                log.warning("releasing the leases of %s failed (%s); retrying", predecessor, exc)
                self.stop.wait(next(delays))
        else:
            return
        log.warning("the worker process before this one %s: released its %d leases (%s); %s", fate,
                    len(users), ", ".join(users[:20]) + (" ..." if len(users) > 20 else ""),
                    f"it was executing user={suspect[0]} gen={suspect[1]}: that run is retried "
                    "in quarantine, the others' first attempts as ordinary runs" if suspect else
                    "the run it was executing is not known: every run is retried in quarantine")

    def _shut_down(self) -> None:
        """Runs not started are given back now; running ones get the grace
        period to end, then are stopped and released; then the completer drains."""
        flights, guard = self.flights, self.flights.guard
        for flight in flights.where(State.TAKEN):
            flights.stop(flight, StopReason.SHUTDOWN)
        deadline = time.monotonic() + self.grace
        with guard:
            while flights.count(State.RUNNING) and time.monotonic() < deadline:
                guard.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            running = flights.where(State.RUNNING)
        for flight in running:
            flights.stop(flight, StopReason.SHUTDOWN)
        with guard:
            drain_by = time.monotonic() + 30
            while flights.count() and time.monotonic() < drain_by:
                guard.wait(0.1)

    def start_app(self) -> None:
        """The app's declared defaults stored where the database has none yet,
        then its startup hooks (async ones on the handlers' event loop). A hook
        that raises is bad configuration: InvalidInput, nothing taken."""
        app = self.app
        if app.policies:
            self.inbox.declare_policies(dict(app.policies))
        for name, limit in dict(app.limits).items():
            limits.declare(self.inbox, name, limit.rate, limit.per, limit.burst)
        try:
            app.start(self.loop.wait_for)
        except Exception as exc:
            raise errors.InvalidInput("app", app.handler,
                                      f"startup hook failed: {handler.describe(exc)}") from exc
        self._app_started = True

    def close(self) -> None:
        """The app's shutdown hooks (after the last run), then the executors:
        the quarantine processes, then the event loop."""
        try:
            if self._app_started:
                self.app.stop(self.loop.wait_for)
        except Exception:
            log.exception("an app's shutdown hook failed")
        for executor in dict.fromkeys((self.quarantine, self._executor, self.loop)):
            executor.close()


# The cyclic garbage collector's thresholds in a serving worker (Python's default:
# 700, 10, 10): see `collect_rarely`.
GC_THRESHOLDS = (50_000, 20, 20)


def collect_rarely() -> None:
    """Set the serving worker's process to collect cyclic garbage rarely: what is
    alive once its app has started (modules, the app's clients) is frozen out of
    the collector's scans (gc.freeze), and a young collection waits for 50,000
    new objects rather than 700 (GC_THRESHOLDS).

    With thousands of runs in flight, each a few hundred objects alive for its
    handler's second or more, the default thresholds made the collector scan
    them again and again: 62 % of the runtime's time at 5,000 in flight
    (py-spy --native, docs/benchmarks). A run's own objects hold no reference
    cycle once it leaves the table (InFlight.leave), so they are freed at once
    whatever the collector does; what a handler leaves in cycles is still
    collected, later, and counts towards --max-memory meanwhile."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _positive_seconds(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise errors.InvalidInput(name, value, "must be a positive number of seconds")
    return float(value)
