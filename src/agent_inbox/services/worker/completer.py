"""The completer: commits every run that ended since its last commit in one
transaction, each behind its own fence (a refused run writes nothing, the
others commit); runs abandoned (timed out, crashed in quarantine, stopped at
shutdown) are released, runs never started are given back, runs whose lease is
lost write nothing. Then they leave the table of flights.

It also answers the runs' questions, asked on the same queue as the endings:
durable-step reads and records (`StepWork`, through a run's `RunLine`):
the reads in one statement, the records of every run in flight in one commit;
and permit calls (`PermitWork`, through the same line), decided and recorded
together in one transaction.

It owns the finishes to try again: on Citus, those a silent worker node did not
answer, retried after FINISH_RETRY between the batches that end meanwhile.
"""

import asyncio
import concurrent.futures
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass

import psycopg

from agent_inbox import db, errors, metrics, tracing
from agent_inbox.api.inbox import Inbox
from agent_inbox.agent.permits import PermitAsk, RunPermits
from agent_inbox.agent.result import Result
from agent_inbox.api.runs import Outcome, Run
from agent_inbox.services.service import backoff_delays, jittered
from agent_inbox.records import RecordedStep, StepRecord
from agent_inbox.services.worker.flight import Ending, EndingKind, Flights, InFlight, StopReason
from agent_inbox.api.run_stats import RunStats

log = logging.getLogger("agent_inbox.worker")

# How long the completer gathers endings after the first before it commits them
# together: a few milliseconds of a finish's latency for far fewer statements
# (a run's place is free once its handler returned: the wait holds no run up).
# A question (a durable step, a permit call) ends the gathering: its run waits
# for the answer, so it is answered with what is queued, at once.
COMMIT_WINDOW = 0.02
# Most endings and questions one commit takes: the rest wait in the queue for the
# next. Without a bound, runs that end while a commit is slow (thousands in
# flight) pile into one statement that outlasts the statement timeout and is
# retried whole, again and again, until the runs' leases expire and they run
# again elsewhere.
COMMIT_MOST = 1000
# On Citus, a finish whose worker node did not answer is tried again after
# about this long, by the completer, between the batches of runs that end
# meanwhile (those do not wait for it).
FINISH_RETRY = 1.0


@dataclass(eq=False)
class StepWork:
    """A run's durable-step read (`record` None) or record, for the completer,
    which answers `reply` once it has read or committed it (steps.py)."""

    flight: InFlight
    record: StepRecord | None
    reply: concurrent.futures.Future
    asked: float  # host monotonic time it was asked


@dataclass(eq=False)
class PermitWork:
    """A run's `ctx.permit` question, for the completer, which answers `reply`
    with its Decision (None: the run's lease is lost) once decided and recorded."""

    flight: InFlight
    question: PermitAsk
    reply: concurrent.futures.Future


class RunLine:
    """A run's line to the completer: its durable-step reads and records (it is
    the run's step journal, steps.py) and its permit questions (`permits`) go
    through it, to be answered together with those of every run in flight.

    It holds the run's flight only while the run is in the table: `Flights.drop`
    cuts it (`cut`) once the run's ending is written, and whatever the run asks
    after that is refused, as a stopped run's questions are. So the run's
    objects (flight, context, steps, permits) hold no reference cycle through
    it and are freed as the run leaves the table, not by the cyclic garbage
    collector, which, with thousands of runs in flight, spent most of the
    worker's time finding them."""

    def __init__(self, completer_queue: queue.SimpleQueue, flight: InFlight):
        self._queue, self._flight, self.label = completer_queue, flight, flight.label

    def cut(self) -> None:
        self._flight = None

    def _asking(self) -> InFlight | None:
        """The run's flight, None once it was stopped or left the table."""
        flight = self._flight
        return None if flight is None or flight.ctx.lease_lost.is_set() else flight

    # --- the step journal (steps.Journal) ---------------------------------------------------

    def _ask_step(self, record: StepRecord | None) -> concurrent.futures.Future:
        reply: concurrent.futures.Future = concurrent.futures.Future()
        flight = self._asking()
        if flight is None:  # stopped: nothing it records would stand
            reply.set_exception(errors.StepRefused(
                f"{self.label} was stopped: its steps are no longer recorded"))
            return reply
        self._queue.put(StepWork(flight, record, reply, time.monotonic()))
        return reply

    def recorded(self) -> list[RecordedStep]:
        return self._ask_step(None).result()

    def record(self, record: StepRecord) -> None:
        self._ask_step(record).result()

    async def recorded_async(self) -> list[RecordedStep]:
        return await asyncio.wrap_future(self._ask_step(None))

    async def record_async(self, record: StepRecord) -> None:
        await asyncio.wrap_future(self._ask_step(record))

    # --- ctx.permit ----------------------------------------------------------------------------

    def permits(self, run: Run) -> RunPermits:
        """The run's `ctx.permit`, asking through this line."""
        return RunPermits(run.user, run.holder, run.gen, self._ask_permit_blocking,
                          self._ask_permit_async)

    def _ask_permit(self, question: PermitAsk) -> concurrent.futures.Future:
        reply: concurrent.futures.Future = concurrent.futures.Future()
        flight = self._asking()
        if flight is None:  # stopped: the answer is LeaseLost
            reply.set_result(None)
            return reply
        self._queue.put(PermitWork(flight, question, reply))
        return reply

    def _ask_permit_blocking(self, question: PermitAsk):
        return self._ask_permit(question).result()

    async def _ask_permit_async(self, question: PermitAsk):
        return await asyncio.wrap_future(self._ask_permit(question))


class Completer:
    def __init__(self, inbox: Inbox, flights: Flights, run_stats: RunStats):
        self.inbox, self.flights, self.run_stats = inbox, flights, run_stats
        self.queue = flights.endings  # Endings and StepWork, as they come
        # Finishes a silent Citus node refused, and when to try each again
        # (the completer thread's own).
        self._retries: list[tuple[float, Ending]] = []

    def complete(self, endings: list[Ending], *, now: int | None = None) -> dict[str, int]:
        """Write what the runs in `endings` came to, then drop them from the
        table. Counts: runs (handlers that ran), events, accepted (finishes)."""
        finishes = [e for e in endings if e.kind is EndingKind.FINISH]
        accepted, later = self._finish(finishes, now)
        self._retries += [(time.monotonic() + jittered(FINISH_RETRY), e) for e in later]
        for error, at_once in {(e.error, e.at_once) for e in endings if e.kind is EndingKind.RELEASE}:
            self._release([e.flight for e in endings
                           if e.kind is EndingKind.RELEASE and (e.error, e.at_once) == (error, at_once)],
                          error, at_once, now)
        self._give_back([e.flight for e in endings if e.kind is EndingKind.GIVE_BACK], now)
        for ending in endings:
            if ending.kind is EndingKind.LOST:
                log.warning("lease lost %s: nothing committed", ending.flight.label)
                metrics.FINISHES.labels("lease_lost").inc()
            elif ending.kind is EndingKind.CANCELLED:
                log.warning("run cancelled by an operator %s: nothing committed, its events "
                            "are pending again", ending.flight.label)
                metrics.FINISHES.labels("cancelled").inc()
        self.flights.drop([e.flight for e in endings if e not in later])
        for ending in endings:
            if ending not in later:
                tracing.end_run(ending.flight.run, ending.kind,
                                ending.error or getattr(ending.result, "error", None))
        self.run_stats.count(finished=sum(accepted), refused=len(accepted) - sum(accepted))
        ran = [e.flight.run for e in endings
               if e.kind in (EndingKind.FINISH, EndingKind.RELEASE) and e not in later]
        return {"runs": len(ran), "events": sum(len(run.events) for run in ran),
                "accepted": sum(accepted)}

    def steps(self, work: list[StepWork], *, now: int | None = None) -> None:
        """Answer durable-step reads and records of runs in flight: the reads in
        one statement, the records in one commit, each behind its run's fence.
        A refused record stops its run as a lost lease does (StepRefused for the
        handler); a failed statement fails the steps that asked (the handler
        raises; its next attempt calls those steps again): on Citus only the
        steps of the users whose worker node did not answer."""
        work = [w for w in work if w.reply.set_running_or_notify_cancel()]  # not cancelled
        if not work:
            return
        reads = [w for w in work if w.record is None]
        writes = [w for w in work if w.record is not None]
        if reads:
            answers, undone, failure = _as_far_as_done(lambda: self.inbox.runs.recorded_steps(
                [(w.flight.run.user, w.flight.ctx.steps.event_ids) for w in reads]), len(reads))
            if failure is not None:
                log.warning("reading the durable steps of %d runs failed: %s", len(undone),
                            failure)
            for i, (w, answer) in enumerate(zip(reads, answers)):
                if i in undone:
                    w.reply.set_exception(_step_failure(failure))
                    continue
                if answer:
                    log.info("resuming %s: %d steps recorded by an earlier attempt",
                             w.flight.label, len(answer))
                    metrics.STEPS.labels("replayed").inc(len(answer))
                w.reply.set_result(answer)
        if not writes:
            return
        stored, undone, failure = _as_far_as_done(
            lambda: self.inbox.runs.record_steps([w.record for w in writes], now=now), len(writes))
        if failure is not None:
            log.warning("recording %d durable steps failed: %s", len(undone), failure)
        committed = time.monotonic()
        for i, (w, ok) in enumerate(zip(writes, stored)):
            if i in undone:
                w.reply.set_exception(_step_failure(failure))
                continue
            if ok:
                metrics.STEPS.labels("recorded").inc()
                metrics.STEP_COMMIT_SECONDS.observe(committed - w.asked)
                w.reply.set_result(None)
                continue
            metrics.STEPS.labels("refused").inc()
            if self.flights.stop(w.flight, StopReason.LOST):
                log.warning("lease lost %s (a step's record was refused by the fence)",
                            w.flight.label)
            w.reply.set_exception(errors.StepRefused(
                f"step {w.record.name!r} of {w.flight.label} refused: the run's lease is lost"))

    def permits(self, work: list[PermitWork], *, now: int | None = None) -> None:
        """Decide and record the permit calls of runs in flight in one
        transaction (permissions.py). A run whose lease is lost is stopped as
        for a lost lease (its handler gets LeaseLost); a failed statement fails
        the calls that asked (on Citus, those of the node that did not answer)."""
        work = [w for w in work if w.reply.set_running_or_notify_cancel()]
        if not work:
            return
        decisions, undone, failure = _as_far_as_done(
            lambda: self.inbox.runs.decide_permits([w.question for w in work], now=now), len(work))
        if failure is not None:
            log.warning("deciding %d permit calls failed: %s", len(undone), failure)
        for i, (w, decision) in enumerate(zip(work, decisions)):
            if i in undone:
                w.reply.set_exception(_step_failure(failure))
                continue
            if decision is None and self.flights.stop(w.flight, StopReason.LOST):
                log.warning("lease lost %s (a permit call found it gone)", w.flight.label)
            w.reply.set_result(decision)

    def answer(self, items: list, *, now: int | None = None) -> list[Ending]:
        """Answer the runs' questions among `items` (durable steps, permit
        calls); the endings left."""
        self.steps([item for item in items if isinstance(item, StepWork)], now=now)
        self.permits([item for item in items if isinstance(item, PermitWork)], now=now)
        return [item for item in items if isinstance(item, Ending)]

    def serve(self, done: threading.Event) -> None:
        """Commit endings as they come: everything that ended within
        COMMIT_WINDOW of the first one waiting, in one commit; as soon as a
        run's question is in the batch, the window ends and what is queued
        then joins it at once (natural group commit: under load, what is asked
        while a commit is under way is the next commit's batch). At most
        COMMIT_MOST items a commit. Until `done` is set and nothing is left to
        write."""
        try:
            self._serve(done)
        finally:  # a question asked after the last drain is answered, never left waiting
            left = []
            while not self.queue.empty():
                left.append(self.queue.get_nowait())
            _fail_unanswered(left, errors.LeaseLost("the worker is stopping: the run is over"))

    def _serve(self, done: threading.Event) -> None:
        while not (done.is_set() and self.queue.empty() and not self._retries):
            batch = self._due_retries()
            if not batch:
                try:
                    batch = [self.queue.get(timeout=self._retry_wait())]
                except queue.Empty:
                    continue
            window = time.monotonic() + COMMIT_WINDOW
            asked = any(not isinstance(item, Ending) for item in batch)
            while len(batch) < COMMIT_MOST:
                wait = 0.0 if asked else window - time.monotonic()
                try:
                    item = self.queue.get(timeout=wait) if wait > 0 else self.queue.get_nowait()
                except queue.Empty:
                    break
                batch.append(item)
                asked = asked or not isinstance(item, Ending)
            try:
                batch = self.answer(batch)
            except Exception as exc:  # never lose the completer: fail the questions asked
                log.exception("completer: answering the runs' questions failed")
                _fail_unanswered(batch, exc)
                batch = [item for item in batch if isinstance(item, Ending)]
            if not batch:
                continue
            try:
                began = time.monotonic()
                self.complete(batch)
                log.debug("completed %d runs in %.1f ms", len(batch),
                          1000 * (time.monotonic() - began))
            except Exception:  # never lose the completer: the leases expire at worst
                log.exception("completer: writing %d endings failed", len(batch))
                self.flights.unwritten([e.flight for e in batch if e.kind is not EndingKind.GIVE_BACK])
                self.flights.drop([e.flight for e in batch])
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

    def _finish(self, finishes: list[Ending],
                now: int | None) -> tuple[list[bool], list[Ending]]:
        """The fenced finishes in one transaction, retried through database
        faults while their leases may still be valid. If the commit fails for
        another reason (a result the database refuses), each run is committed
        alone, a refused result as its run's error: it costs only its own run.
        The flags of the finishes decided, and those to try again later
        (retried by the completer after FINISH_RETRY, so that they hold up no
        other run): on Citus, the runs whose worker node did not answer while
        the others committed; anywhere, a run whose finish outlasted the
        statement timeout alone (its lease row locked by someone, a lock its
        events wait for)."""
        ttl = self.inbox.settings.lease_ttl
        pending = [(e.flight, self._outcome(e.flight, e.result)) for e in finishes]
        accepted: dict[InFlight, bool] = {}
        later: set[InFlight] = set()
        delays = backoff_delays(cap=5.0)
        while pending:
            try:
                flags = self.inbox.runs.finish_runs([outcome for _, outcome in pending], now=now)
            except (errors.DatabaseUnavailable, errors.TransactionConflict) as exc:
                if len(pending) > 1 and not accepted and not later and _outlasted(exc):
                    log.warning("the finish of %d runs outlasted the statement timeout; "
                                "committing them in two halves", len(pending))
                    return self._finish_in_halves(finishes, [f for f, _ in pending], now)
                if (len(pending) == 1 and not accepted and not later and _outlasted(exc)
                        and not isinstance(exc, errors.PartlyDone)):
                    log.warning("the finish of %s outlasted the statement timeout alone;"
                                " trying it again after the others", pending[0][0].label)
                    later, pending = {pending[0][0]}, []
                else:
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
                    if not flight.may_hold(ttl):
                        log.warning("lease lost %s: expired while the database was away",
                                    flight.label)
                        metrics.FINISHES.labels("lease_lost").inc()
                later = {f for f in later if f.may_hold(ttl)}
                pending = [(f, o) for f, o in pending if f.may_hold(ttl)]
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

    def _finish_in_halves(self, finishes: list[Ending], flights: list[InFlight],
                          now: int | None) -> tuple[list[bool], list[Ending]]:
        """`_finish` of the runs of `flights` in two halves, one after the
        other (each halved again while it outlasts the statement timeout):
        what one slow run holds up, or a batch too large for the timeout, costs
        only its own half. Its answer for `finishes` (a run not in `flights`
        was dropped as lost: False)."""
        half = len(flights) // 2
        by_flight = {e.flight: e for e in finishes}
        accepted: dict[InFlight, bool] = {}
        later: list[Ending] = []
        for part in ([by_flight[f] for f in flights[:half]], [by_flight[f] for f in flights[half:]]):
            flags, part_later = self._finish(part, now)
            waiting = {e.flight for e in part_later}
            accepted.update(zip([e.flight for e in part if e.flight not in waiting], flags))
            later += part_later
        waiting = {e.flight for e in later}
        return ([accepted.get(e.flight, False) for e in finishes if e.flight not in waiting], later)

    def _finish_alone(self, flight: InFlight, outcome: Outcome, now: int | None) -> bool:
        run = flight.run
        try:
            [accepted] = self.inbox.runs.finish_runs([outcome], now=now)
        except (errors.DatabaseUnavailable, errors.TransactionConflict) as exc:
            log.warning("finish of %s failed (%s): its lease expires", flight.label, exc)
            self.flights.unwritten([flight])
            return False
        except Exception as exc:
            log.exception("the result of user=%s gen=%s cannot be committed", run.user, run.gen)
            outcome = self.inbox.runs.outcome(
                run, Result(error=f"the run's result could not be committed: {exc!r}"[:2000]))
            try:
                [accepted] = self.inbox.runs.finish_runs([outcome], now=now)
            except Exception as again:
                log.warning("finish of %s failed again (%s): its lease expires", flight.label,
                            again)
                self.flights.unwritten([flight])
                return False
        self._finished(outcome, accepted)
        return accepted

    def _outcome(self, flight: InFlight, result: Result) -> Outcome:
        run, recorded = flight.run, flight.ctx.steps.written > 0
        try:
            return self.inbox.runs.outcome(run, result, steps_recorded=recorded)
        except errors.InvalidInput as exc:  # the handler's result was malformed
            log.error("handler result rejected user=%s gen=%s: %s", run.user, run.gen, exc)
            return self.inbox.runs.outcome(run, Result(error=f"invalid handler result: {exc}"),
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
            released = set(self.inbox.runs.release_runs([f.run for f in flights], error=error,
                                                   at_once=at_once, now=now))
        except Exception as exc:
            log.warning("could not release %d runs (%s): their leases expire", len(flights), exc)
            self.flights.unwritten(flights)
            released = set()
        why = error or "stopped at shutdown"
        for flight in flights:
            done = "released" if flight.run.user in released else "already lost"
            log.warning("lease %s %s (%s)", done, flight.label, why)

    def _give_back(self, flights: list[InFlight], now: int | None) -> None:
        if not flights:
            return
        try:
            given = set(self.inbox.runs.hand_back([f.run for f in flights], now=now))
        except Exception as exc:
            log.warning("could not give back %d runs (%s): their leases expire", len(flights), exc)
            given = set()
        for flight in flights:
            log.info("lease %s %s (never started)",
                     "given back" if flight.run.user in given else "not given back", flight.label)


def _outlasted(exc: BaseException) -> bool:
    """Whether a statement failed for outlasting the statement timeout (the
    server's, or the client's bound on the wait: db.StatementCut)."""
    return isinstance(exc.__cause__, (psycopg.errors.QueryCanceled, db.StatementCut))


def _fail_unanswered(items: list, exc: Exception) -> None:
    """Fail the durable-step and permit questions among `items` that are not
    answered yet (their runs' handlers wait on them)."""
    for item in items:
        if isinstance(item, (StepWork, PermitWork)) and not item.reply.done():
            try:
                item.reply.set_exception(_step_failure(exc))
            except concurrent.futures.InvalidStateError:  # answered or cancelled meanwhile
                pass


def _as_far_as_done(call, n: int) -> tuple[list, set[int], Exception | None]:
    """`call()`'s answers for n questions, the indices of those left unanswered
    and the failure (None if none): on Citus a node that does not answer leaves
    only its users' questions unanswered (errors.PartlyDone); any other failure
    leaves them all."""
    try:
        return call(), set(), None
    except errors.PartlyDone as exc:
        return exc.done, set(exc.unknown), exc
    except Exception as exc:
        return [None] * n, set(range(n)), exc


def _step_failure(exc: Exception) -> Exception:
    """What a step's handler gets when its read or record failed: the
    database's error as agent-inbox names it."""
    if isinstance(exc, errors.AgentInboxError):
        return exc
    return errors.DatabaseUnavailable(f"a durable step could not be read or recorded: {exc}")
