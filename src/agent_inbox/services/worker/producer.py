"""The producer: takes as many users as the worker has free places
(`concurrency` minus the runs taken or running), TAKE_CHUNK at most per
statement (leases taken over, batches claimed), and starts their handlers
(through the worker, which picks each run's executor).

It owns what a take leaves unsure: a take whose answer was lost may have taken
runs unseen, given back (as orphans) before the next take.
"""

import logging
import time
from typing import Callable

from agent_inbox import errors, metrics, tracing
from agent_inbox.agent.handler import Context
from agent_inbox.api.inbox import Inbox
from agent_inbox.api.runs import Run
from agent_inbox.services.service import Stop, Waker, backoff_delays, jittered
from agent_inbox.agent.steps import RunSteps
from agent_inbox.services.worker.completer import RunLine
from agent_inbox.services.worker.flight import Flights, InFlight, StopReason
from agent_inbox.api.run_stats import RunStats

log = logging.getLogger("agent_inbox.worker")

# Seconds between two takes while there is work, at least: trades a few
# milliseconds of a run's latency for far fewer statements ...
TAKE_COOLDOWN = 0.05
# ... unless at least this share of the worker's places is free: then at once.
TAKE_AT_ONCE = 0.1
# Most users one take holds: when a thousand places free at once, the first
# hundreds start after one short statement rather than all after one long one.
TAKE_CHUNK = 200

# Seconds between the error lines a worker logs while the run path's state is
# damaged (errors.RunPathDamaged): it takes nothing until it is repaired.
DAMAGE_REPEAT = 60.0


class Producer:
    def __init__(self, inbox: Inbox, flights: Flights, run_stats: RunStats, *, holder: str,
                 concurrency: int, poll_interval: float, stop: Stop, waker: Waker,
                 start: Callable[[InFlight], None], memory_full: Callable[[], bool]):
        self.inbox, self.flights, self.run_stats = inbox, flights, run_stats
        self.holder, self.concurrency, self.poll_interval = holder, concurrency, poll_interval
        self.stop, self.waker = stop, waker
        self._start = start  # starts a run's handler (Worker.start)
        self._memory_full = memory_full  # past --max-memory: no more takes (Keeper.check_memory)
        self._unsure = False  # a take lost its answer: it may have taken runs unseen
        # Since when (host monotonic) the run path's state is damaged, None if it is
        # not, and when that was last logged.
        self._damaged_since: float | None = None
        self._damaged_said = 0.0

    def take(self, users: int, *, now: int | None = None) -> list[InFlight]:
        """Take up to `users` users' runs in one statement and start them."""
        if self._unsure:
            self._give_back_orphans(now)
        started = time.monotonic()
        try:
            runs = self.inbox.runs.take_runs(self.holder, users=users, now=now)
        except errors.PartlyDone as exc:  # Citus: a node did not answer; start what was taken
            log.warning("took %d runs; the take stopped short: %s", len(exc.done), exc)
            self._unsure = True
            runs = exc.done
        except errors.DatabaseUnavailable:
            self._unsure = True
            raise
        log.debug("took %d runs of %d asked in %.1f ms", len(runs), users,
                  1000 * (time.monotonic() - started))
        flights = [self._flight(run, started) for run in runs]
        self.flights.add(flights)
        self.run_stats.count(takeovers=sum(1 for r in runs if r.unfinished),
                             died=sum(r.died for r in runs))
        for flight in flights:
            self._taken(flight.run)
            try:
                self._start(flight)
            except Exception:  # a thread or a process could not be had: nothing ran
                log.exception("could not start the run %s; giving it back", flight.label)
                self.flights.stop(flight, StopReason.NOT_STARTED)
        return flights

    def _flight(self, run: Run, taken_at: float) -> InFlight:
        run = tracing.start_run(run)  # its span, ended with its ending's commit
        ctx = Context(run.user, run.holder, run.gen, memory=run.memory,
                      attempt=max((e.attempts for e in run.events), default=1),
                      limiter=self.inbox.limiter)
        flight = InFlight(run, ctx, taken_at)
        flight.line = line = RunLine(self.flights.endings, flight)
        ctx.permits = line.permits(run)
        flight.ctx.steps = RunSteps(run.user, run.holder, run.gen, [e.id for e in run.events],
                                    may_resume=any(e.ran_before for e in run.events),
                                    journal=line,
                                    max_result_bytes=self.inbox.settings.max_payload_bytes)
        flight.ctx.steps.trace = run.trace
        return flight

    def _free(self) -> int:
        with self.flights.guard:
            return self.concurrency - self.flights.executing

    def serve(self) -> None:
        """Take whenever there is room, TAKE_CHUNK users at most per statement:
        at once when TAKE_AT_ONCE of the places are free, else at most once per
        TAKE_COOLDOWN while there is work (so runs that end one by one are
        replaced by one take, not one each); after a notification or the
        polling interval when there was none. Until the worker stops."""
        guard, delays = self.flights.guard, backoff_delays()
        while not self.stop.is_set():
            with guard:
                while self.flights.executing >= self.concurrency and not self.stop.is_set():
                    guard.wait()
            if self.stop.is_set():
                return
            if self._memory_full():
                return
            began = time.monotonic()
            try:
                flights = self.take(min(self._free(), TAKE_CHUNK))
                delays = backoff_delays()
                if self._damaged_since is not None:
                    log.warning("producer: the run path's state is repaired; taking work again")
                    self._damaged_since = None
                    metrics.RUN_PATH_DAMAGED.set(0)
            except errors.RunPathDamaged as exc:  # loud, never idle in silence
                now = time.monotonic()
                if self._damaged_since is None or now - self._damaged_said >= DAMAGE_REPEAT:
                    log.error("producer: taking no work: %s", exc)
                    self._damaged_said = now
                if self._damaged_since is None:
                    self._damaged_since = now
                    metrics.RUN_PATH_DAMAGED.set(1)
                self.stop.wait(jittered(self.poll_interval))
                continue
            except errors.DatabaseUnavailable as exc:
                pause = next(delays)
                log.warning("producer: database unavailable (%s); retrying in %.1f s", exc, pause)
                self.stop.wait(pause)
                continue
            except Exception:  # a bug must not silently stop the worker taking work
                pause = next(delays)
                log.exception("producer: unexpected error; going on in %.1f s", pause)
                self.stop.wait(pause)
                continue
            if not flights:
                self.waker.wait(jittered(self.poll_interval))
                continue
            with guard:  # a few places free: let more free up before the next take
                while (self.flights.executing > self.concurrency * (1 - TAKE_AT_ONCE)
                       and time.monotonic() < began + TAKE_COOLDOWN and not self.stop.is_set()):
                    guard.wait(max(0.0, began + TAKE_COOLDOWN - time.monotonic()))

    def _give_back_orphans(self, now: int | None) -> None:
        """Give back the leases this holder holds beyond the runs in flight: runs
        a take committed whose answer the lost connection never brought."""
        known = self.flights.known(self.inbox.settings.lease_ttl)
        orphans = self.inbox.runs.hand_back_orphans(self.holder, known, now=now)
        self._unsure = False
        if orphans:
            log.warning("gave back %d runs taken by a statement whose answer was lost: users %s",
                        len(orphans), ", ".join(orphans))

    @staticmethod
    def _taken(run: Run) -> None:
        log.info("lease taken user=%s holder=%s gen=%s events=%d", run.user, run.holder, run.gen,
                  len(run.events))
        metrics.RUNS.inc()
        metrics.CLAIMED.inc(len(run.events))
        if run.died:
            metrics.DEAD.inc(run.died)
            log.warning("events dead user=%s gen=%s count=%d", run.user, run.gen, run.died)
