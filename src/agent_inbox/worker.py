"""The worker runtime: many runs at once in one process, on a fixed few connections.

Four parts, each on a thread of its own, share one table of in-flight runs
(`InFlight`, one object per run, from its take to its commit):

- the **producer** takes as many users as the worker has free capacity
  (`concurrency` minus the runs taken or running), TAKE_CHUNK at most per
  statement (leases taken over, batches claimed), and starts their handlers;
- the **executors** (executors.py) run them: `async def` handlers as tasks on
  one event loop, plain ones on threads, and a run whose last attempt ended
  without a finish in a quarantine process of its own;
- the **completer** commits every run that ended since its last commit in one
  transaction, each behind its own fence (a refused run writes nothing, the
  others commit); runs abandoned (timed out, crashed in quarantine, stopped at
  shutdown) are released, runs never started are given back;
- the **keeper** extends every lease in flight in one statement per TTL/4, and
  stops runs whose lease was lost or that ran past `run_timeout`.

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

import asyncio
import concurrent.futures
import logging
import math
import os
import queue
import secrets
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable

from agent_inbox import (blame, db, errors, executors, handler, metrics, supervisor, tracing,
                         validate)
from agent_inbox.handler import Context, Crashed
from agent_inbox.inbox import Inbox
from agent_inbox.result import Result
from agent_inbox.runs import Outcome, Run
from agent_inbox.service import Listener, Stop, Waker, backoff_delays, jittered
from agent_inbox.steps import RunSteps
from agent_inbox.store import notify, stats
from agent_inbox.store.steps import RecordedStep, StepRecord

log = logging.getLogger("agent_inbox.worker")

# Connections of a worker's pool: the producer, the completer and the keeper use
# one each at a time. LISTEN takes one more of its own.
POOL_SIZE = 3
# How often the keeper looks for runs past their deadline, at most.
WATCH_INTERVAL = 1.0
# Seconds between two takes while there is work, at least, and how long the
# completer gathers endings after the first before it commits them together:
# both trade a few milliseconds of a run's latency for far fewer statements.
TAKE_COOLDOWN = 0.05
COMMIT_WINDOW = 0.02
# On Citus, a finish whose worker node did not answer is tried again after
# about this long, by the completer, between the batches of runs that end
# meanwhile (those do not wait for it).
FINISH_RETRY = 1.0
# ... unless at least this share of the worker's places is free: then at once.
TAKE_AT_ONCE = 0.1
# Most users one take holds: when a thousand places free at once, the first
# hundreds start after one short statement rather than all after one long one.
TAKE_CHUNK = 200


def holder_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


@dataclass(eq=False)
class InFlight:
    """One run from its take to its commit: all the worker keeps of it.

    state: taken (not started) -> running -> ended (a result to commit), or
    -> stopped (lost, timed out, crashed, shut down: to release or give back).
    It leaves the table once the completer has written its ending."""

    run: Run
    ctx: Context
    lease_renewed: float  # host monotonic time just before its lease was last extended
    state: str = "taken"
    deadline: float = float("inf")  # monotonic time past which it is stopped
    cancel: Callable[[], None] | None = None  # stops its handler, where that can be done

    @property
    def label(self) -> str:
        run = self.run
        return f"user={run.user} holder={run.holder} gen={run.gen}"


@dataclass(frozen=True)
class Ending:
    """What the completer writes for a run: `finish` (its result), `release`
    (abandoned after it started: attempt counted, `error` recorded), `give_back`
    (never started: claim undone), or `lost` (nothing: the lease is gone)."""

    flight: InFlight
    kind: str
    result: Result | None = None
    error: str | None = None
    at_once: bool = False


@dataclass(eq=False)
class StepWork:
    """A run's durable-step read (`record` None) or record, for the completer,
    which answers `reply` once it has read or committed it (steps.py)."""

    flight: InFlight
    record: StepRecord | None
    reply: concurrent.futures.Future
    asked: float  # host monotonic time it was asked


class WorkerJournal:
    """A run's step journal in the worker: its reads and records go through the
    completer, which commits the records of every run in flight together."""

    def __init__(self, worker: "Worker", flight: InFlight):
        self._worker, self._flight = worker, flight

    def _ask(self, record: StepRecord | None) -> concurrent.futures.Future:
        reply = concurrent.futures.Future()
        self._worker._endings.put(StepWork(self._flight, record, reply, time.monotonic()))
        return reply

    def recorded(self) -> list[RecordedStep]:
        return self._ask(None).result()

    def record(self, record: StepRecord) -> None:
        self._ask(record).result()

    async def recorded_async(self) -> list[RecordedStep]:
        return await asyncio.wrap_future(self._ask(None))

    async def record_async(self, record: StepRecord) -> None:
        await asyncio.wrap_future(self._ask(record))


class Worker:
    def __init__(self, inbox: Inbox, handler_reference: str, *, concurrency: int = 1,
                 poll_interval: float = 1.0, grace: float = 30.0, run_timeout: float = 900.0,
                 quarantine: int = 2, holder: str | None = None, stop: Stop | None = None,
                 max_memory: int | None = None, slot: blame.Slot | None = None):
        self.inbox = inbox
        self.handler = handler.load(handler_reference)
        self.concurrency = validate.positive_int("concurrency", concurrency)
        self.run_timeout = _positive_seconds("run_timeout", run_timeout)
        quarantine = validate.positive_int("quarantine", quarantine)
        self.poll_interval = poll_interval
        self.grace = grace
        self.holder = holder or holder_id()
        self.stop = stop or Stop()
        self.waker = Waker(1)
        self._flights: dict[tuple[str, int], InFlight] = {}
        self._executing = 0  # flights taken or running: what --concurrency bounds
        self._guard = threading.Condition()  # the table, the count and every flight's state
        self._endings: queue.SimpleQueue[Ending] = queue.SimpleQueue()
        self._unsure = False  # a take lost its answer: it may have taken runs unseen
        # Started runs whose ending could not be written (the database was away):
        # their leases expire on their own; never given back as orphans.
        self._unwritten: dict[tuple[str, int], tuple[Run, float]] = {}
        # Finishes a silent Citus node refused, and when to try each again
        # (the completer thread's own).
        self._retries: list[tuple[float, Ending]] = []
        # Counts not yet added to this process's run_stats row (under _guard).
        self._stats = dict.fromkeys(stats.FIELDS, 0)
        self.loop = executors.EventLoop(slot)  # slot: the run stepping, for the supervisor
        # first attempts: on the loop (async def) or a thread each
        self._executor = (self.loop if handler.is_async(self.handler)
                          else executors.Threads(self.loop))
        self.quarantine = executors.Quarantine(handler_reference, quarantine)
        # --max-memory (MiB): past it, the runtime stops taking work, lets its
        # runs end and exits to be replaced (recycled).
        self.max_memory = (None if max_memory is None
                           else validate.positive_int("max_memory", max_memory))
        self.recycled = False  # it stopped to be recycled, not on a signal
        self._ran = False  # a run began in this runtime (a fresh one would be smaller)
        self._memory_warned = False
        # Runs whose blocking of the event loop was logged (once per run), and
        # what the runtime does when one blocks it past its timeout: exit, as if
        # that run had crashed (replaceable in tests).
        self._blockers: weakref.WeakSet[InFlight] = weakref.WeakSet()
        self.exit: Callable[[int], None] = os._exit

    # --- the producer ------------------------------------------------------------------

    def take(self, users: int, *, now: int | None = None) -> list[InFlight]:
        """Take up to `users` users' runs in one statement and start them."""
        if self._unsure:
            self._give_back_orphans(now)
        started = time.monotonic()
        try:
            runs = self.inbox.take_runs(self.holder, users=users, now=now)
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
        with self._guard:
            self._flights.update((f.run.key, f) for f in flights)
            self._executing += len(flights)
        self._count(takeovers=sum(1 for r in runs if r.unfinished), died=sum(r.died for r in runs))
        for flight in flights:
            self._taken(flight.run)
            try:
                self._start(flight)
            except Exception:  # a thread or a process could not be had: nothing ran
                log.exception("could not start the run %s; giving it back", flight.label)
                self.stop_run(flight, "not started")
        return flights

    def _flight(self, run: Run, taken_at: float) -> InFlight:
        run = tracing.start_run(run)  # its span, ended with its ending's commit
        flight = InFlight(run, Context(run.user, run.holder, run.gen), taken_at)
        flight.ctx.steps = RunSteps(run.user, run.holder, run.gen, [e.id for e in run.events],
                                    may_resume=any(e.attempts > 1 for e in run.events),
                                    journal=WorkerJournal(self, flight),
                                    max_result_bytes=self.inbox.max_payload_bytes)
        flight.ctx.steps.trace = run.trace
        return flight

    def _free(self) -> int:
        with self._guard:
            return self.concurrency - self._executing

    def _produce(self) -> None:
        """Take whenever there is room, TAKE_CHUNK users at most per statement:
        at once when TAKE_AT_ONCE of the places are free, else at most once per
        TAKE_COOLDOWN while there is work (so runs that end one by one are
        replaced by one take, not one each); after a notification or the
        polling interval when there was none."""
        delays = backoff_delays()
        while not self.stop.is_set():
            with self._guard:
                while self._executing >= self.concurrency and not self.stop.is_set():
                    self._guard.wait()
            if self.stop.is_set():
                return
            if self.check_memory():  # past --max-memory: no more takes
                return
            began = time.monotonic()
            try:
                flights = self.take(min(self._free(), TAKE_CHUNK))
                delays = backoff_delays()
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
            with self._guard:  # a few places free: let more free up before the next take
                while (self._executing > self.concurrency * (1 - TAKE_AT_ONCE)
                       and time.monotonic() < began + TAKE_COOLDOWN and not self.stop.is_set()):
                    self._guard.wait(max(0.0, began + TAKE_COOLDOWN - time.monotonic()))

    def _give_back_orphans(self, now: int | None) -> None:
        """Give back the leases this holder holds beyond the runs in flight: runs
        a take committed whose answer the lost connection never brought."""
        cutoff = time.monotonic() - self.inbox.lease_ttl
        with self._guard:
            known = [f.run for f in self._flights.values()]
            self._unwritten = {k: v for k, v in self._unwritten.items() if v[1] > cutoff}
            known += [run for run, _ in self._unwritten.values()]
        orphans = self.inbox.hand_back_orphans(self.holder, known, now=now)
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

    # --- the executors -------------------------------------------------------------------

    def _start(self, flight: InFlight) -> None:
        if not flight.run.events:  # only exhausted events were due: they are dead now
            if self._begin(flight):
                self._ended(flight, Result(), 0.0)
        elif flight.run.unfinished:
            log.info("run in quarantine %s: %d events whose last run ended without a finish",
                     flight.label, flight.run.unfinished)
            metrics.QUARANTINED.inc()
            self.quarantine.run(flight, self._begin, self._ended)
        else:
            self._executor.run(self.handler, flight, self._begin, self._ended)

    def _begin(self, flight: InFlight) -> bool:
        with self._guard:
            if flight.state != "taken":
                return False
            flight.state = "running"
            flight.deadline = time.monotonic() + self.run_timeout
            self._ran = True
            return True

    def _ended(self, flight: InFlight, outcome, seconds: float) -> None:
        with self._guard:
            if flight.state != "running":
                return  # stopped meanwhile: its ending is on its way
            flight.state = "ended"
            self._executing -= 1
            self._guard.notify_all()
        metrics.RUN_SECONDS.observe(seconds)
        if isinstance(outcome, Crashed):
            log.warning("quarantine run crashed %s: %s", flight.label, outcome.error)
            self._endings.put(Ending(flight, "release", error=outcome.error))
            return
        if outcome is None:  # an async handler cancelled by something else than the worker
            outcome = Result(error="the handler's task was cancelled")
        self._endings.put(Ending(flight, "finish", result=outcome))

    def stop_run(self, flight: InFlight, reason: str) -> bool:
        """Stop a run not yet ended: `lost` (its lease is gone), `timed out`,
        `not started` (it could not be), or `shutdown`. Its handler is told
        and, where possible, stopped; the completer releases its lease (or
        gives it back if it never started)."""
        with self._guard:
            if flight.state not in ("taken", "running"):
                return False
            started, flight.state = flight.state == "running", "stopped"
            self._executing -= 1
            self._guard.notify_all()
        flight.ctx.lease_lost.set()
        if flight.cancel is not None:
            flight.cancel()
        if reason == "lost":
            ending = Ending(flight, "lost")
        elif not started:
            ending = Ending(flight, "give_back")
        elif reason == "timed out":
            ending = Ending(flight, "release",
                            error=f"the run timed out after {self.run_timeout:g} s")
        else:
            ending = Ending(flight, "release", at_once=True)
        self._endings.put(ending)
        return True

    # --- the completer -------------------------------------------------------------------

    def complete(self, endings: list[Ending], *, now: int | None = None) -> dict[str, int]:
        """Write what the runs in `endings` came to, then drop them from the
        table. Counts: runs (handlers that ran), events, accepted (finishes)."""
        finishes = [e for e in endings if e.kind == "finish"]
        accepted, later = self._finish(finishes, now)
        self._retries += [(time.monotonic() + jittered(FINISH_RETRY), e) for e in later]
        for error, at_once in {(e.error, e.at_once) for e in endings if e.kind == "release"}:
            self._release([e.flight for e in endings
                           if e.kind == "release" and (e.error, e.at_once) == (error, at_once)],
                          error, at_once, now)
        self._give_back([e.flight for e in endings if e.kind == "give_back"], now)
        for ending in endings:
            if ending.kind == "lost":
                log.warning("lease lost %s: nothing committed", ending.flight.label)
                metrics.FINISHES.labels("lease_lost").inc()
        with self._guard:
            for ending in endings:
                if ending not in later:
                    self._flights.pop(ending.flight.run.key, None)
            self._guard.notify_all()
        for ending in endings:
            if ending not in later:
                tracing.end_run(ending.flight.run, ending.kind,
                                ending.error or getattr(ending.result, "error", None))
        self._count(finished=sum(accepted), refused=len(accepted) - sum(accepted))
        ran = [e.flight.run for e in endings
               if e.kind in ("finish", "release") and e not in later]
        return {"runs": len(ran), "events": sum(len(run.events) for run in ran),
                "accepted": sum(accepted)}

    def steps(self, work: list[StepWork], *, now: int | None = None) -> None:
        """Answer durable-step reads and records of runs in flight: the reads in
        one statement, the records in one commit, each behind its run's fence.
        A refused record stops its run as a lost lease does (StepRefused for the
        handler); a failed statement fails the steps that asked (the handler
        raises; its next attempt calls those steps again)."""
        work = [w for w in work if w.reply.set_running_or_notify_cancel()]  # not cancelled
        reads = [w for w in work if w.record is None]
        writes = [w for w in work if w.record is not None]
        if reads:
            try:
                answers = self.inbox.recorded_steps(
                    [(w.flight.run.user, w.flight.ctx.steps.event_ids) for w in reads])
            except Exception as exc:
                log.warning("reading the durable steps of %d runs failed: %s", len(reads), exc)
                for w in reads:
                    w.reply.set_exception(_step_failure(exc))
            else:
                for w, answer in zip(reads, answers):
                    if answer:
                        log.info("resuming %s: %d steps recorded by an earlier attempt",
                                 w.flight.label, len(answer))
                        metrics.STEPS.labels("replayed").inc(len(answer))
                    w.reply.set_result(answer)
        if not writes:
            return
        try:
            stored = self.inbox.record_steps([w.record for w in writes], now=now)
        except Exception as exc:
            log.warning("recording %d durable steps failed: %s", len(writes), exc)
            for w in writes:
                w.reply.set_exception(_step_failure(exc))
            return
        committed = time.monotonic()
        for w, ok in zip(writes, stored):
            if ok:
                metrics.STEPS.labels("recorded").inc()
                metrics.STEP_COMMIT_SECONDS.observe(committed - w.asked)
                w.reply.set_result(None)
                continue
            metrics.STEPS.labels("refused").inc()
            if self.stop_run(w.flight, "lost"):
                log.warning("lease lost %s (a step's record was refused by the fence)",
                            w.flight.label)
            w.reply.set_exception(errors.StepRefused(
                f"step {w.record.name!r} of {w.flight.label} refused: the run's lease is lost"))

    def _count(self, **counts: int) -> None:
        """Add counts to this process's run_stats row (the console's chart), in a
        statement of its own; kept for the next write if this one fails."""
        with self._guard:
            for name, value in counts.items():
                self._stats[name] += value
            pending, self._stats = self._stats, dict.fromkeys(stats.FIELDS, 0)
        if not any(pending.values()):
            return
        try:
            with db.connection(self.inbox.pool) as conn:
                stats.record(conn, self.holder, pending)
        except Exception as exc:  # statistics never stop a run's path
            log.warning("run statistics not written (%s); kept for the next write", exc)
            with self._guard:
                for name, value in pending.items():
                    self._stats[name] += value

    def _finish(self, finishes: list[Ending],
                now: int | None) -> tuple[list[bool], list[Ending]]:
        """The fenced finishes in one transaction, retried through database
        faults while their leases may still be valid. If the commit fails for
        another reason (a result the database refuses), each run is committed
        alone, a refused result as its run's error: it costs only its own run.
        The flags of the finishes decided, and those to try again later: on
        Citus, the runs whose worker node did not answer while the others
        committed (retried by the completer, so that they hold up no other run)."""
        pending = [(e.flight, self._outcome(e.flight, e.result)) for e in finishes]
        accepted: dict[InFlight, bool] = {}
        later: set[InFlight] = set()
        delays = backoff_delays(cap=5.0)
        while pending:
            try:
                flags = self.inbox.finish_runs([outcome for _, outcome in pending], now=now)
            except (errors.DatabaseUnavailable, errors.TransactionConflict) as exc:
                log.warning("finish failed for %d runs (%s); retrying", len(pending), exc)
                if isinstance(exc, errors.PartlyDone):
                    for (flight, outcome), flag in zip(pending, exc.done):
                        if flag is not None:
                            accepted[flight] = flag
                            self._finished(outcome, flag)
                    later = {flight for (flight, _), flag in zip(pending, exc.done)
                             if flag is None}
                    pending = []
                for flight, _ in pending + [(f, None) for f in later]:
                    if not self._may_hold(flight):
                        log.warning("lease lost %s: expired while the database was away",
                                    flight.label)
                        metrics.FINISHES.labels("lease_lost").inc()
                later = {f for f in later if self._may_hold(f)}
                pending = [(f, o) for f, o in pending if self._may_hold(f)]
                if pending:
                    time.sleep(next(delays))
                continue
            except Exception:
                log.exception("the finish of %d runs failed; committing them one at a time",
                              len(pending))
                for flight, outcome in pending:
                    accepted[flight] = self._finish_alone(flight, outcome, now)
                break
            for (flight, outcome), flag in zip(pending, flags):
                accepted[flight] = flag
                self._finished(outcome, flag)
            break
        return ([accepted.get(e.flight, False) for e in finishes if e.flight not in later],
                [e for e in finishes if e.flight in later])

    def _finish_alone(self, flight: InFlight, outcome: Outcome, now: int | None) -> bool:
        run = flight.run
        try:
            [accepted] = self.inbox.finish_runs([outcome], now=now)
        except (errors.DatabaseUnavailable, errors.TransactionConflict) as exc:
            log.warning("finish of %s failed (%s): its lease expires", flight.label, exc)
            self._remember_unwritten([flight])
            return False
        except Exception as exc:
            log.exception("the result of user=%s gen=%s cannot be committed", run.user, run.gen)
            outcome = self.inbox.outcome(
                run, Result(error=f"the run's result could not be committed: {exc!r}"[:2000]))
            try:
                [accepted] = self.inbox.finish_runs([outcome], now=now)
            except Exception as again:
                log.warning("finish of %s failed again (%s): its lease expires", flight.label, again)
                self._remember_unwritten([flight])
                return False
        self._finished(outcome, accepted)
        return accepted

    def _remember_unwritten(self, flights: list[InFlight]) -> None:
        now = time.monotonic()
        with self._guard:
            self._unwritten.update((f.run.key, (f.run, now)) for f in flights)

    def _outcome(self, flight: InFlight, result: Result) -> Outcome:
        run, recorded = flight.run, flight.ctx.steps.written > 0
        try:
            return self.inbox.outcome(run, result, steps_recorded=recorded)
        except errors.InvalidInput as exc:  # the handler's result was malformed
            log.error("handler result rejected user=%s gen=%s: %s", run.user, run.gen, exc)
            return self.inbox.outcome(run, Result(error=f"invalid handler result: {exc}"),
                                      steps_recorded=recorded)

    @staticmethod
    def _finished(outcome: Outcome, accepted: bool) -> None:
        run = outcome.run
        metrics.FINISHES.labels("accepted" if accepted else "refused").inc()
        if accepted:
            log.info("finished user=%s holder=%s gen=%s events=%d error=%s", run.user,
                     run.holder, run.gen, len(run.events), outcome.error is not None)
        else:
            log.warning("finish refused by the fence user=%s holder=%s gen=%s",
                        run.user, run.holder, run.gen)

    def _release(self, flights: list[InFlight], error: str | None, at_once: bool,
                 now: int | None) -> None:
        """Abandon started runs: leases expired now, attempts kept. On failure
        the leases expire after their TTL, with the same effect."""
        try:
            released = set(self.inbox.release_runs([f.run for f in flights], error=error,
                                                   at_once=at_once, now=now))
        except Exception as exc:
            log.warning("could not release %d runs (%s): their leases expire", len(flights), exc)
            self._remember_unwritten(flights)
            released = set()
        why = error or "stopped at shutdown"
        for flight in flights:
            done = "released" if flight.run.user in released else "already lost"
            log.warning("lease %s %s (%s)", done, flight.label, why)

    def _give_back(self, flights: list[InFlight], now: int | None) -> None:
        if not flights:
            return
        try:
            given = set(self.inbox.hand_back([f.run for f in flights], now=now))
        except Exception as exc:
            log.warning("could not give back %d runs (%s): their leases expire", len(flights), exc)
            given = set()
        for flight in flights:
            log.info("lease %s %s (never started)",
                     "given back" if flight.run.user in given else "not given back", flight.label)

    def _may_hold(self, flight: InFlight) -> bool:
        """Whether the run's lease may still be valid, by this host's clock."""
        return time.monotonic() - flight.lease_renewed <= self.inbox.lease_ttl

    def _complete_forever(self, done: threading.Event) -> None:
        """Commit endings as they come: everything that ended within
        COMMIT_WINDOW of the first one waiting, in one commit."""
        while not (done.is_set() and self._endings.empty() and not self._retries):
            batch = self._due_retries()
            if not batch:
                try:
                    batch = [self._endings.get(timeout=self._retry_wait())]
                except queue.Empty:
                    continue
            window = time.monotonic() + COMMIT_WINDOW
            while (wait := window - time.monotonic()) > 0:
                try:
                    batch.append(self._endings.get(timeout=wait))
                except queue.Empty:
                    break
            work = [item for item in batch if isinstance(item, StepWork)]
            batch = [item for item in batch if not isinstance(item, StepWork)]
            if work:
                self.steps(work)
            if not batch:
                continue
            try:
                began = time.monotonic()
                self.complete(batch)
                log.debug("completed %d runs in %.1f ms", len(batch),
                          1000 * (time.monotonic() - began))
            except Exception:  # never lose the completer: the leases expire at worst
                log.exception("completer: writing %d endings failed", len(batch))
                self._remember_unwritten([e.flight for e in batch if e.kind != "give_back"])
                with self._guard:
                    for ending in batch:
                        self._flights.pop(ending.flight.run.key, None)
                    self._guard.notify_all()
                for ending in batch:
                    tracing.end_run(ending.flight.run, ending.kind, "its ending was not written")

    def _due_retries(self) -> list[Ending]:
        now = time.monotonic()
        due = [ending for at, ending in self._retries if at <= now]
        self._retries = [(at, ending) for at, ending in self._retries if at > now]
        return due

    def _retry_wait(self) -> float:
        """How long the completer may wait for an ending: until the next retry."""
        soonest = min((at for at, _ in self._retries), default=math.inf)
        return max(0.0, min(0.2, soonest - time.monotonic()))

    # --- the keeper ------------------------------------------------------------------------

    def renew(self) -> None:
        """Extend every lease in flight in one statement; stop the runs whose
        lease is lost (refused, or failing for longer than the TTL)."""
        with self._guard:
            flights = [f for f in self._flights.values() if f.state in ("taken", "running", "ended")]
        if not flights:
            return
        asked = time.monotonic()
        keys = {f.run.key for f in flights}
        try:
            renewed, unknown = self.inbox.renew_runs([f.run for f in flights]), set()
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
            elif flight.state != "ended" and (key not in unknown or not self._may_hold(flight)):
                if self.stop_run(flight, "lost"):
                    log.warning("lease lost %s (renewal %s)", flight.label,
                                "failed past the TTL" if key in unknown else "refused")
                    metrics.RENEWALS_FAILED.inc()

    def time_out(self) -> None:
        """Stop the runs still going past their deadline, and those whose lease
        may have lapsed by this host's clock (renewals failing)."""
        now = time.monotonic()
        with self._guard:
            going = [f for f in self._flights.values() if f.state in ("taken", "running")]
        for flight in going:
            if flight.state == "running" and flight.deadline < now:
                if self._held_up(flight):
                    continue
                if self.stop_run(flight, "timed out"):
                    log.warning("run timed out after %g s %s", self.run_timeout, flight.label)
                    metrics.RUNS_TIMED_OUT.inc()
            elif not self._may_hold(flight) and self.stop_run(flight, "lost"):
                log.warning("lease lost %s (not renewed for longer than the TTL)", flight.label)
                metrics.RENEWALS_FAILED.inc()

    def _keep(self, done: threading.Event) -> None:
        renew_every = max(0.2, self.inbox.lease_ttl / 4)
        watch_every = min(WATCH_INTERVAL, renew_every, self.run_timeout / 4)
        next_renewal = time.monotonic() + renew_every
        while not done.wait(watch_every):
            try:
                self.time_out()
                self.check_memory()
                if time.monotonic() >= next_renewal:
                    next_renewal = time.monotonic() + renew_every
                    self.renew()
            except Exception:
                log.exception("keeper: unexpected error; going on")

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
        if not self._ran:
            if not self._memory_warned:
                self._memory_warned = True
                log.warning("memory: the runtime's RSS is %.0f MiB before any run, past "
                            "--max-memory %d MiB: not recycled (a fresh one would be no smaller)",
                            rss, self.max_memory)
            return False
        self.recycled = True
        with self._guard:
            going = sum(1 for f in self._flights.values() if f.state in ("taken", "running"))
        log.warning("memory: the runtime's RSS is %.0f MiB, past --max-memory %d MiB: recycling "
                    "it: no more takes, runs in flight: %d (given --grace %g s to end), then a "
                    "fresh runtime starts", rss, self.max_memory, going, self.grace)
        self.stop.event.set()
        return True

    # --- the event loop's watchdog ------------------------------------------------------

    def _held_up(self, flight: InFlight) -> bool:
        """Whether a run's handler waits on an event loop another run blocks:
        not timed out meanwhile (the watchdog deals with the one that blocks)."""
        return (self._executor is self.loop and self.loop.blocked_since is not None
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

    # --- in step, for tests ------------------------------------------------------------------

    def run_once(self, *, now: int | None = None, timeout: float = 60.0) -> dict[str, int]:
        """One take of up to `concurrency` users, their handlers run to their end,
        their endings committed: what serve() does, in step (for tests and
        simulations with an explicit `now`). Counts as `complete` returns."""
        flights = self.take(self.concurrency, now=now)
        endings: list[Ending] = []
        deadline = time.monotonic() + timeout
        while len(endings) < len(flights):
            try:
                item = self._endings.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                for flight in flights:
                    self.stop_run(flight, "timed out")
                continue
            if isinstance(item, StepWork):
                self.steps([item], now=now)
            else:
                endings.append(item)
        return self.complete(endings, now=now)

    # --- the service ------------------------------------------------------------------------

    def serve(self, url: str | None, *, predecessor: str | None = None,
              predecessor_fate: str = "died", suspect: tuple[str, int] | None = None) -> None:
        """Run until SIGTERM/SIGINT, then shut down gracefully, LISTENing on
        `url` (None: polling only). `predecessor` is the holder of the worker
        process this one replaces: its leases are released first (it died with
        its runs; `suspect`, the run it was executing then, if known: see
        Inbox.release_holder)."""
        if predecessor:
            self._release_predecessor(predecessor, predecessor_fate, suspect)
        Listener(url, [notify.WORK], self.waker.wake_one, self.stop).start()
        done = threading.Event()
        parts = [threading.Thread(target=self._complete_forever, args=(done,),
                                  name="agent-inbox-completer", daemon=True),
                 threading.Thread(target=self._keep, args=(done,), name="agent-inbox-keeper",
                                  daemon=True)]
        producer = threading.Thread(target=self._produce, name="agent-inbox-producer", daemon=True)
        for thread in parts + [producer]:
            thread.start()
        self.loop.watch(self.loop_blocked)
        log.info("worker started: holder %s, concurrency %d, %s handler", self.holder,
                 self.concurrency, "async" if self._executor is self.loop else "plain")
        self.stop.event.wait()
        with self._guard:
            self._guard.notify_all()
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
                users = self.inbox.release_holder(
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
        with self._guard:
            waiting = [f for f in self._flights.values() if f.state == "taken"]
        for flight in waiting:
            self.stop_run(flight, "shutdown")
        deadline = time.monotonic() + self.grace
        with self._guard:
            while (any(f.state == "running" for f in self._flights.values())
                   and time.monotonic() < deadline):
                self._guard.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            running = [f for f in self._flights.values() if f.state == "running"]
        for flight in running:
            self.stop_run(flight, "shutdown")
        with self._guard:
            drain_by = time.monotonic() + 30
            while self._flights and time.monotonic() < drain_by:
                self._guard.wait(0.1)

    def in_flight(self) -> list[InFlight]:
        with self._guard:
            return list(self._flights.values())

    def close(self) -> None:
        """Stop the quarantine processes and the event loop."""
        self.quarantine.close()
        self.loop.close()


def _step_failure(exc: Exception) -> Exception:
    """What a step's handler gets when its read or record failed: the
    database's error as agent-inbox names it."""
    if isinstance(exc, errors.AgentInboxError):
        return exc
    return errors.DatabaseUnavailable(f"a durable step could not be read or recorded: {exc}")


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


def _positive_seconds(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise errors.InvalidInput(name, value, "must be a positive number of seconds")
    return float(value)
