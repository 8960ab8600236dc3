"""The runs in flight: one `InFlight` per run, from its take to its commit, in
one table (`Flights`) that the producer, the executors, the completer and the
keeper share.

A run's state moves only along MOVES, under the table's guard:

    TAKEN -> RUNNING -> ENDED     (its handler returned: a result to commit)
      |         |
      +---------+----> STOPPED    (lost, cancelled, timed out, crashed, shut down: released,
                                   or given back if it never started)

ENDED and STOPPED are final. A run reaches one of them once (`Flights._settle`,
the only move into them), and that move alone reports its ending to the
completer (`Flights._report`, which checks it): the completer gets exactly one
`Ending` per run, and the run leaves the table once its ending is written.
Only TAKEN and RUNNING runs hold a place (what --concurrency bounds).
"""

import enum
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from agent_inbox import metrics
from agent_inbox.agent.handler import Context
from agent_inbox.services.worker.quarantine import Crashed
from agent_inbox.agent.result import Result
from agent_inbox.api.runs import Run

log = logging.getLogger("agent_inbox.worker")

# Seconds after its cancel past which a handler still running is reported as
# ignoring it (Flights.ignoring).
IGNORED_AFTER = 5.0


class State(enum.StrEnum):
    """Where a run is, from its take to its commit (see MOVES)."""

    TAKEN = "taken"      # taken, its handler not started
    RUNNING = "running"  # its handler started
    ENDED = "ended"      # its handler returned: a result to commit
    STOPPED = "stopped"  # lost, cancelled, timed out, crashed, shut down: to release or give back


# The moves a run's state may make, and the only ones.
MOVES: dict[State, tuple[State, ...]] = {
    State.TAKEN: (State.RUNNING, State.STOPPED),
    State.RUNNING: (State.ENDED, State.STOPPED),
    State.ENDED: (),
    State.STOPPED: (),
}
GOING = (State.TAKEN, State.RUNNING)  # a place each: what --concurrency counts
SETTLED = (State.ENDED, State.STOPPED)  # an ending each, reported once


class Line(Protocol):
    """A run's line to the completer for its questions (completer.RunLine)."""

    def cut(self) -> None:
        """The run left the table: hold its flight no longer, refuse its questions."""


@dataclass(eq=False)
class InFlight:
    """One run from its take to its commit: all the worker keeps of it.

    While it is in the table it is part of reference cycles (its context's
    step journal and permits reach it through its `line`, its handler's task
    through `cancel`); `leave` breaks them as it leaves the table, so that a
    run's objects are freed by reference counting, at once, and the cyclic
    garbage collector is not left to find thousands of them."""

    run: Run
    ctx: Context
    lease_renewed: float  # host monotonic time just before its lease was last extended
    state: State = State.TAKEN
    deadline: float = float("inf")  # monotonic time past which it is stopped
    cancel: Callable[[], None] | None = None  # stops its handler, where that can be done
    reported: bool = False  # its ending went to the completer
    stopped_at: float | None = None  # monotonic time it was stopped while running
    line: Line | None = None  # its questions' way to the completer

    def leave(self) -> None:
        """Out of the table (its ending is written): break its reference cycles."""
        self.cancel = None
        if self.line is not None:
            self.line.cut()

    @property
    def label(self) -> str:
        run = self.run
        return f"user={run.user} holder={run.holder} gen={run.gen}"

    def move(self, to: State) -> bool:
        """Move to `to` if the state allows it (the caller holds the table's
        guard): False when it does not, e.g. a run stopped meanwhile."""
        if to not in MOVES[self.state]:
            return False
        self.state = to
        return True

    def may_hold(self, lease_ttl: float) -> bool:
        """Whether its lease may still be valid, by this host's clock."""
        return time.monotonic() - self.lease_renewed <= lease_ttl


class StopReason(enum.StrEnum):
    """Why a run not yet ended is stopped (`Flights.stop`)."""

    LOST = "lost"                # its lease is gone
    TIMED_OUT = "timed out"      # past --run-timeout
    NOT_STARTED = "not started"  # its handler could not be started
    SHUTDOWN = "shutdown"        # the worker is stopping
    CANCELLED = "cancelled"      # an operator fenced its lease off (store/pauses.py)


class EndingKind(enum.StrEnum):
    """What the completer writes for a run (see `Ending`)."""

    FINISH = "finish"        # its result, behind the fence
    RELEASE = "release"      # abandoned after it started: attempt counted, error recorded
    GIVE_BACK = "give_back"  # never started: its claim undone
    LOST = "lost"            # nothing: the lease is gone
    CANCELLED = "cancelled"  # nothing: an operator fenced it off, its events are pending again


@dataclass(frozen=True)
class Ending:
    """What the completer writes for a run: its `kind`, and with it the
    result (FINISH), or the error recorded and whether the events are due at
    once (RELEASE)."""

    flight: InFlight
    kind: EndingKind
    result: Result | None = None
    error: str | None = None
    at_once: bool = False


class Flights:
    """The table of runs in flight, the count of those that hold a place, and
    the queue to the completer (endings, and durable-step work: completer.py),
    behind one guard (`guard`, a Condition notified whenever a place frees or
    a run leaves the table)."""

    def __init__(self, run_timeout: float):
        self.run_timeout = run_timeout
        self.guard = threading.Condition()  # the table, the count and every flight's state
        self._table: dict[tuple[str, int], InFlight] = {}
        self.executing = 0  # flights taken or running: what --concurrency bounds
        self.endings: queue.SimpleQueue = queue.SimpleQueue()  # to the completer
        self.began = False  # a run began in this runtime (a fresh one would be smaller)
        # Started runs whose ending could not be written (the database was away):
        # their leases expire on their own; never given back as orphans.
        self._unwritten: dict[tuple[str, int], tuple[Run, float]] = {}
        # Runs cancelled while their handler ran, until the handler returns: one
        # that does not within IGNORED_AFTER ignored its cancellation (`ignoring`).
        self._cancelled: dict[tuple[str, int], InFlight] = {}

    # --- the table ---------------------------------------------------------------------

    def add(self, flights: list[InFlight]) -> None:
        """Runs just taken: each holds a place."""
        with self.guard:
            self._table.update((f.run.key, f) for f in flights)
            self.executing += len(flights)

    def drop(self, flights: list[InFlight]) -> None:
        """Runs whose ending was written (or could not be): out of the table."""
        with self.guard:
            for flight in flights:
                self._table.pop(flight.run.key, None)
                flight.leave()
            self.guard.notify_all()

    def where(self, *states: State) -> list[InFlight]:
        """The runs in flight (in `states`, if given)."""
        with self.guard:  # reentrant: callable under the guard
            return [f for f in self._table.values() if not states or f.state in states]

    def count(self, *states: State) -> int:
        """How many runs are in flight (in `states`, if given)."""
        return len(self.where(*states))

    def unwritten(self, flights: list[InFlight]) -> None:
        """Remember started runs whose ending could not be written."""
        now = time.monotonic()
        with self.guard:
            self._unwritten.update((f.run.key, (f.run, now)) for f in flights)

    def known(self, lease_ttl: float) -> list[Run]:
        """The runs this holder may hold: those in flight, and those whose
        ending could not be written within the lease's TTL."""
        cutoff = time.monotonic() - lease_ttl
        with self.guard:
            self._unwritten = {k: v for k, v in self._unwritten.items() if v[1] > cutoff}
            return [f.run for f in self._table.values()] + [r for r, _ in self._unwritten.values()]

    # --- a run's moves -------------------------------------------------------------------

    def begin(self, flight: InFlight) -> bool:
        """An executor's `begin`: True if the run may start (it was not
        stopped meanwhile); its deadline runs from now."""
        with self.guard:
            if not flight.move(State.RUNNING):
                return False
            flight.deadline = time.monotonic() + self.run_timeout
            flight.ctx.deadline = time.time() + self.run_timeout  # the handler's view
            self.began = True
            return True

    def ended(self, flight: InFlight, outcome, seconds: float) -> None:
        """An executor's `ended`: the run's result (or crash) for the completer,
        unless it was stopped meanwhile."""
        if self._settle(flight, State.ENDED) is None:  # stopped meanwhile: its ending is on its way
            with self.guard:
                cancelled = self._cancelled.pop(flight.run.key, None)
            late = time.monotonic() - (flight.stopped_at or time.monotonic())
            if cancelled is not None and late > IGNORED_AFTER:
                log.warning("the handler of a cancelled run returned %.1f s after it was "
                            "cancelled %s: its result is refused", late, flight.label)
            return
        metrics.RUN_SECONDS.observe(seconds)
        if isinstance(outcome, Crashed):
            log.warning("quarantine run crashed %s: %s", flight.label, outcome.error)
            self._report(Ending(flight, EndingKind.RELEASE, error=outcome.error))
            return
        if outcome is None:  # an async handler cancelled by something else than the worker
            outcome = Result(error="the handler's task was cancelled")
        self._report(Ending(flight, EndingKind.FINISH, result=outcome))

    def stop(self, flight: InFlight, reason: StopReason) -> bool:
        """Stop a run not yet ended, for `reason`. Its handler is told
        and, where possible, stopped; the completer releases its lease (or
        gives it back if it never started). False if it had ended already."""
        reason = StopReason(reason)  # a plain string names the same reason
        was = self._settle(flight, State.STOPPED)
        if was is None:
            return False
        flight.ctx.lease_lost.set()
        if was is State.RUNNING:
            flight.stopped_at = time.monotonic()
            if reason is StopReason.CANCELLED:
                with self.guard:
                    self._cancelled[flight.run.key] = flight
        if flight.cancel is not None:
            flight.cancel()
        if reason is StopReason.CANCELLED:
            ending = Ending(flight, EndingKind.CANCELLED)
        elif reason is StopReason.LOST:
            ending = Ending(flight, EndingKind.LOST)
        elif was is State.TAKEN:
            ending = Ending(flight, EndingKind.GIVE_BACK)
        elif reason is StopReason.TIMED_OUT:
            ending = Ending(flight, EndingKind.RELEASE,
                            error=f"the run timed out after {self.run_timeout:g} s")
        else:
            ending = Ending(flight, EndingKind.RELEASE, at_once=True)
        self._report(ending)
        return True

    def ignoring(self) -> list[tuple[InFlight, float]]:
        """The cancelled runs whose handler still runs IGNORED_AFTER seconds
        after the cancel (a blocking call in a thread, a task that catches
        CancelledError), with how long since: each reported by the keeper.
        Their results are refused whatever they return (the lease is fenced off)."""
        now = time.monotonic()
        with self.guard:
            return [(f, now - f.stopped_at) for f in self._cancelled.values()
                    if f.stopped_at is not None and now - f.stopped_at > IGNORED_AFTER]

    def find(self, user: str, gen: int) -> InFlight | None:
        """The run in flight of `user` in generation `gen`, if this worker has it."""
        with self.guard:
            return self._table.get((user, gen))

    def _settle(self, flight: InFlight, to: State) -> State | None:
        """Move a run that goes on to its final state (ENDED or STOPPED), which
        frees its place: the state it left, None if it had settled already."""
        with self.guard:
            was = flight.state
            if not flight.move(to):
                return None
            self.executing -= 1
            self.guard.notify_all()
            return was

    def _report(self, ending: Ending) -> None:
        """Hand a settled run's ending to the completer: the one way an ending
        goes there, exactly once per run."""
        flight = ending.flight
        if flight.state not in SETTLED or flight.reported:
            raise RuntimeError(f"a second ending, or one before its run settled: {flight.label} "
                               f"{flight.state}: {ending.kind}")
        flight.reported = True
        self.endings.put(ending)
