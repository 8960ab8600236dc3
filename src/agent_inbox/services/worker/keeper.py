"""The keeper: extends every lease in flight in one statement per TTL/4, and
stops runs whose lease was lost or that ran past `run_timeout`, and those an
operator cancelled (store/pauses.py): at once on the cancel's notification
(`cancelled`, from the worker's listener), else at its next look, every
CANCEL_LOOK seconds (a read of the runs' lease rows: behind a transaction
pooler, with no LISTEN). It reports cancelled handlers that go on running, and
logs the fleet's pause as it sees it come and go. It also watches
what would make the runtime itself unfit to go on: its memory past
--max-memory (it stops taking work, to be recycled) and an event loop that one
run blocks past its timeout (it exits, as if that run had crashed).

It owns the runtime's recycling state and the runs whose blocking of the loop
was logged.
"""

import json
import logging
import os
import threading
import time
import weakref
from typing import Callable

from agent_inbox import errors, metrics
from agent_inbox.services.worker import supervisor
from agent_inbox.services.worker.executors import EventLoop
from agent_inbox.api.inbox import Inbox
from agent_inbox.services.service import Stop
from agent_inbox.services.worker.flight import GOING, Flights, InFlight, State, StopReason

log = logging.getLogger("agent_inbox.worker")

# How often the keeper looks for runs past their deadline, at most.
WATCH_INTERVAL = 1.0
# How often it reads its runs' lease rows for cancels, and the fleet's pause.
CANCEL_LOOK = 2.0


class Keeper:
    def __init__(self, inbox: Inbox, flights: Flights, *, run_timeout: float, grace: float,
                 max_memory: int | None, stop: Stop, loop: EventLoop, on_loop: bool):
        self.inbox, self.flights = inbox, flights
        self.run_timeout, self.grace, self.stop = run_timeout, grace, stop
        # --max-memory (MiB): past it, the runtime stops taking work, lets its
        # runs end and exits to be replaced (recycled).
        self.max_memory = max_memory
        self.recycled = False  # it stopped to be recycled, not on a signal
        self._memory_warned = False
        self.loop, self._on_loop = loop, on_loop  # first attempts run on the loop
        # Runs whose blocking of the event loop was logged (once per run), and
        # what the runtime does when one blocks it past its timeout: exit, as if
        # that run had crashed (replaceable in tests).
        self._blockers: weakref.WeakSet[InFlight] = weakref.WeakSet()
        self.exit: Callable[[int], None] = os._exit
        self._ignoring_reported: weakref.WeakSet[InFlight] = weakref.WeakSet()
        self._fleet_paused: dict | None = None  # the fleet's pause as last seen

    def serve(self, done: threading.Event) -> None:
        """Look for runs past their deadline and at the memory every
        WATCH_INTERVAL at most, renew the leases every TTL/4: until `done`."""
        renew_every = max(0.2, self.inbox.settings.lease_ttl / 4)
        watch_every = min(WATCH_INTERVAL, renew_every, self.run_timeout / 4)
        watch_every = min(watch_every, CANCEL_LOOK)
        next_renewal = time.monotonic() + renew_every
        next_look = time.monotonic() + CANCEL_LOOK
        while not done.wait(watch_every):
            try:
                self.time_out()
                self.check_memory()
                self.report_ignoring()
                if time.monotonic() >= next_renewal:
                    next_renewal = time.monotonic() + renew_every
                    self.renew()
                if time.monotonic() >= next_look:
                    next_look = time.monotonic() + CANCEL_LOOK
                    self.look_for_cancels()
            except Exception:
                log.exception("keeper: unexpected error; going on")

    def cancelled(self, payload: str) -> None:
        """A cancel's notification (notify.CANCEL: {"user", "gen"}, sent at its
        commit): stop that run at once if it is one of this worker's."""
        try:
            named = json.loads(payload)
            flight = self.flights.find(str(named["user"]), int(named["gen"]))
        except (ValueError, KeyError, TypeError):
            log.warning("a cancel notification this worker cannot read: %r", payload[:200])
            return
        if flight is not None:
            self._stop_cancelled(flight)

    def look_for_cancels(self) -> None:
        """Stop the runs whose lease no longer names them (an operator's
        cancel whose notification did not come, or a takeover), and log a
        change of the fleet's pause."""
        flights = self.flights.where(*GOING)
        try:
            gone, fleet = self.inbox.runs.fenced_off([f.run for f in flights])
        except errors.DatabaseUnavailable as exc:
            log.warning("look for cancelled runs failed (%s)", exc)
            return
        for flight in flights:
            if gone.get(flight.run.key) == "cancelled":
                self._stop_cancelled(flight)
            elif gone.get(flight.run.key) == "lost" and self.flights.stop(flight, StopReason.LOST):
                log.warning("lease lost %s (taken over)", flight.label)
                metrics.RENEWALS_FAILED.inc()
        if (fleet is None) != (self._fleet_paused is None):
            if fleet is not None:
                log.warning("the fleet is paused (by %s, reason: %s): no run starts until "
                            "`agent-inbox resume --all`", fleet["actor"], fleet["reason"] or "none")
            else:
                log.warning("the fleet is resumed: runs start again")
        self._fleet_paused = fleet

    def _stop_cancelled(self, flight: InFlight) -> None:
        if self.flights.stop(flight, StopReason.CANCELLED):
            log.warning("run cancelled %s: its handler is stopped", flight.label)
            metrics.RUNS_CANCELLED.inc()

    def report_ignoring(self) -> None:
        """Report, once each, the cancelled runs whose handler still runs."""
        for flight, seconds in self.flights.ignoring():
            if flight not in self._ignoring_reported:
                self._ignoring_reported.add(flight)
                metrics.CANCELS_IGNORED.inc()
                log.warning("the handler of a cancelled run still runs %.0f s after the cancel "
                            "%s (a blocking call in a thread cannot be stopped): whatever it "
                            "returns is refused, its lease is fenced off", seconds, flight.label)

    def renew(self) -> None:
        """Extend every lease in flight in one statement; stop the runs whose
        lease is lost (refused, or failing for longer than the TTL)."""
        flights = self.flights.where(*GOING, State.ENDED)
        if not flights:
            return
        asked, ttl = time.monotonic(), self.inbox.settings.lease_ttl
        keys = {f.run.key for f in flights}
        try:
            renewed, unknown = self.inbox.runs.renew_runs([f.run for f in flights]), set()
        except errors.PartlyDone as exc:  # Citus: a node did not answer for its users
            log.warning("lease renewal failed for %d runs (%s)", len(exc.unknown), exc)
            renewed, unknown = exc.done, exc.unknown
        except errors.DatabaseUnavailable as exc:
            log.warning("lease renewal failed (%s)", exc)
            renewed, unknown = set(), keys
        for flight in flights:
            key = flight.run.key
            if key in renewed:
                flight.lease_renewed = asked
            elif (flight.state is not State.ENDED
                  and (key not in unknown or not flight.may_hold(ttl))):
                if self.flights.stop(flight, StopReason.LOST):
                    log.warning("lease lost %s (renewal %s)", flight.label,
                                "failed past the TTL" if key in unknown else "refused")
                    metrics.RENEWALS_FAILED.inc()

    def time_out(self) -> None:
        """Stop the runs still going past their deadline, and those whose lease
        may have lapsed by this host's clock (renewals failing)."""
        now, ttl = time.monotonic(), self.inbox.settings.lease_ttl
        for flight in self.flights.where(*GOING):
            if flight.state is State.RUNNING and flight.deadline < now:
                if self._held_up(flight):
                    continue
                if self.flights.stop(flight, StopReason.TIMED_OUT):
                    log.warning("run timed out after %g s %s", self.run_timeout, flight.label)
                    metrics.RUNS_TIMED_OUT.inc()
            elif not flight.may_hold(ttl) and self.flights.stop(flight, StopReason.LOST):
                log.warning("lease lost %s (not renewed for longer than the TTL)", flight.label)
                metrics.RENEWALS_FAILED.inc()

    def check_memory(self) -> bool:
        """Past --max-memory, stop taking work to be recycled: the runs in
        flight end within the grace (serve's shutdown), then the runtime exits
        with supervisor.EXIT_RECYCLE and the supervisor starts a fresh one. Not
        before a run began here: a fresh runtime would be no smaller. True when
        it stops."""
        rss = rss_mib()
        metrics.RSS.set(rss * 2**20)
        if self.max_memory is None or self.recycled or rss <= self.max_memory:
            return False
        if not self.flights.began:
            if not self._memory_warned:
                self._memory_warned = True
                log.warning("memory: the runtime's RSS is %.0f MiB before any run, past "
                            "--max-memory %d MiB: not recycled (a fresh one would be no smaller)",
                            rss, self.max_memory)
            return False
        self.recycled = True
        going = self.flights.count(*GOING)
        log.warning("memory: the runtime's RSS is %.0f MiB, past --max-memory %d MiB: recycling "
                    "it: no more takes, runs in flight: %d (given --grace %g s to end), then a "
                    "fresh runtime starts", rss, self.max_memory, going, self.grace)
        self.stop.event.set()
        return True

    # --- the event loop's watchdog ------------------------------------------------------

    def _held_up(self, flight: InFlight) -> bool:
        """Whether a run's handler waits on an event loop another run blocks:
        not timed out meanwhile (the watchdog deals with the one that blocks)."""
        return (self._on_loop and self.loop.blocked_since is not None
                and not flight.run.unfinished)

    def loop_blocked(self, flight: InFlight | None, seconds: float, stack: str,
                     first: bool) -> None:
        """From the loop's watchdog, at every look while one run's task (or a
        callback outside any run, `flight` None) holds the loop: counted once
        per block, logged once per run with its stack; past the run's timeout
        (or --run-timeout, for no known run) the runtime exits, as if that run
        had crashed: a blocked task cannot be cancelled."""
        if first:
            metrics.LOOP_BLOCKED.inc()
        label = flight.label if flight is not None else "no known run (a callback on the loop)"
        if (flight is None and first) or (flight is not None and flight not in self._blockers):
            if flight is not None:
                self._blockers.add(flight)
            log.warning("event loop blocked for %.1f s by %s: every async run waits meanwhile "
                        "(time.sleep or a blocking client in an async handler? use "
                        "asyncio.to_thread); the loop's stack:\n%s", seconds, label,
                        stack.rstrip())
        if (time.monotonic() > flight.deadline if flight is not None
                else seconds > self.run_timeout):
            log.error("event loop blocked for %.1f s by %s, past --run-timeout %g s: the runtime "
                      "exits (code %d) as if that run had crashed; its supervisor starts another",
                      seconds, label, self.run_timeout, supervisor.EXIT_LOOP_BLOCKED)
            self.exit(supervisor.EXIT_LOOP_BLOCKED)


def rss_mib() -> float:
    """This process's resident set size in MiB (Linux: now; elsewhere: its peak)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB; bytes on macOS
        return peak / (2**20 if sys.platform == "darwin" else 2**10)
