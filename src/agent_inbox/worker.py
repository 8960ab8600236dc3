"""The worker service: slots that find users with work, run their handlers, finish.

Each slot has its own holder id, unique across hosts and restarts
(host:pid:slot:random). A slot takes work in one statement (the users whose
oldest claimable event waited longest, leases taken over, batches claimed), runs
the handlers while a renewer thread extends the leases, and commits everything
in one transaction of fenced finishes (one fence per run) that also releases
the leases and takes the slot's next work. Invariants kept here:

- a run whose lease was lost commits nothing: `ctx.lease_lost` is set, the
  worker skips its finish (the fence would refuse it anyway) and moves on;
- each slot runs its handlers in a process of its own (see handler.py), so a
  poison event cannot take other users' runs in this worker down with it;
- a slot takes several users at once only while its handlers are quick: the
  next take holds as many users as its last runs' mean time fits into
  TAKE_BUDGET (at least 1, at most --max-users-per-take), so a user taken
  behind others waits for them about that long at most, and slow handlers
  (an LLM call) are taken one user at a time;
- on SIGTERM/SIGINT the slots stop taking work, running handlers get a grace
  period, then their leases are released so another worker takes over at once.
"""

import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass

from agent_inbox import errors, handler, metrics, validate
from agent_inbox.handler import Context
from agent_inbox.inbox import Inbox
from agent_inbox.runs import Outcome, Run
from agent_inbox.result import Result
from agent_inbox.service import Listener, Stop, Waker, backoff_delays, jittered
from agent_inbox.store import notify

log = logging.getLogger("agent_inbox.worker")


def holder_id(slot: int) -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{slot}:{secrets.token_hex(3)}"


# Seconds of handler time a take may queue up in one slot (see the invariants).
TAKE_BUDGET = 0.05


@dataclass
class ActiveRun:
    run: Run
    ctx: Context
    wake: threading.Event
    lease_started: float  # host monotonic time just before the lease was last extended
    started: bool = False  # its handler was called: it can no longer be given back
    finishing: bool = False  # the fenced finish has begun: it decides, not renewal
    settled: bool = False  # finished, given back, released or lost: nothing left to do


class Worker:
    def __init__(self, inbox: Inbox, handler_reference: str, *, concurrency: int = 1,
                 poll_interval: float = 1.0, grace: float = 30.0, isolation: str = "process",
                 max_users_per_take: int = 32, stop: Stop | None = None):
        self.inbox = inbox
        self.reference = handler_reference
        self.handler = handler.load(handler_reference)
        self.holders = [holder_id(slot) for slot in range(concurrency)]
        self.poll_interval = poll_interval
        self.grace = grace
        if isolation not in ("process", "thread"):
            raise errors.InvalidInput("isolation", isolation, "must be 'process' or 'thread'")
        self.max_users_per_take = validate.positive_int("max_users_per_take", max_users_per_take)
        self.processes = ([handler.HandlerProcess(handler_reference, f"agent-inbox-slot-{n}")
                           for n in range(concurrency)] if isolation == "process" else None)
        self.stop = stop or Stop()
        self.waker = Waker(concurrency)
        self._take_size = [1] * concurrency  # users per take, per slot (see TAKE_BUDGET)
        self._active: dict[tuple[str, str], ActiveRun] = {}  # (holder, user) -> run
        self._carried: dict[int, tuple[list[Run], float]] = {}  # slot -> (next runs, lease start)
        # Slots whose last take or finish lost its connection: a take may have
        # committed unseen, so its runs are given back before the next take.
        self._unsure: set[int] = set()
        # Started runs whose release failed (slot -> (run, when)): never given
        # back as orphans (their handlers may have acted); their leases expire.
        self._stranded: dict[int, list[tuple[Run, float]]] = {}
        self._lock = threading.Lock()

    # --- one take ---------------------------------------------------------------

    def run_once(self, slot: int = 0, *, now: int | None = None) -> dict[str, int]:
        """Run the users' work this slot holds, one run per user, and finish it.
        The work is what the slot's previous finish took (one commit per take),
        else a fresh take. Whatever this does not settle (an error midway) is
        released, or given back if its handler never started. Counts: runs (handlers
        called, or runs of dead events only), events, accepted (finishes accepted)."""
        carried = self._carried.pop(slot, None)
        if carried is None:
            if slot in self._unsure:
                self._give_back_orphans(slot, [], now)
            started = time.monotonic()
            try:
                runs = self.inbox.take_runs(self.holders[slot], users=self._take_size[slot], now=now)
            except errors.DatabaseUnavailable:
                self._unsure.add(slot)
                raise
        else:
            runs, started = carried
        actives = [ActiveRun(run, Context(run.user, run.holder, run.gen), threading.Event(), started)
                   for run in runs]
        for active in actives:
            self._taken(active.run)
        with self._lock:
            self._active.update(((a.run.holder, a.run.user), a) for a in actives)
        try:
            results = self._execute(actives, slot)
            accepted = self._finish(actives, results, slot, now)
        finally:
            self._abandon([a for a in actives if not a.settled], "abandoned", now)
            with self._lock:
                for active in actives:
                    self._active.pop((active.run.holder, active.run.user), None)
        ran = [actives[n].run for n in results]
        return {"runs": len(ran), "events": sum(len(run.events) for run in ran),
                "accepted": sum(accepted)}

    @staticmethod
    def _taken(run: Run) -> None:
        log.info("lease taken user=%s holder=%s gen=%s events=%d",
                 run.user, run.holder, run.gen, len(run.events))
        metrics.RUNS.inc()
        metrics.CLAIMED.inc(len(run.events))
        if run.died:
            metrics.DEAD.inc(run.died)
            log.warning("events dead user=%s gen=%s count=%d", run.user, run.gen, run.died)

    def _execute(self, actives: list[ActiveRun], slot: int) -> dict[int, Result | None]:
        """Run the handlers one after another: each started run's result (None:
        its lease was lost meanwhile), by position. A run is not started once
        its lease is lost, the worker is stopping, or the handlers before it
        have used up TAKE_BUDGET; the finish gives those back. The seconds the
        handlers took size the slot's next take."""
        results: dict[int, Result | None] = {}
        began, seconds, called = time.monotonic(), 0.0, 0
        for n, active in enumerate(actives):
            if not active.run.events:  # only exhausted events were due: they are dead now
                results[n] = Result()
                continue
            if (self.stop.is_set() or active.ctx.lease_lost.is_set()
                    or (called and time.monotonic() - began > TAKE_BUDGET)):
                continue
            active.started = True
            try:
                result, took = self._call_handler(active, slot)
            except Exception as exc:  # the worker's side failed (a pipe, a thread): this run's error
                log.exception("running the handler failed user=%s gen=%s", active.run.user,
                              active.run.gen)
                result, took = Result(error=f"the worker could not run the handler: {exc!r}"), 0.0
            results[n] = result
            seconds, called = seconds + took, called + 1
            metrics.RUN_SECONDS.observe(took)
        if called:
            fits = int(TAKE_BUDGET * called / max(seconds, 1e-6))
            grown = min(fits, 2 * self._take_size[slot], self.max_users_per_take)
            self._take_size[slot] = max(1, grown)
        return results

    def _call_handler(self, active: ActiveRun, slot: int) -> tuple[Result | None, float]:
        if self.processes:
            return self.processes[slot].run(active.run.events, active.ctx)
        started = time.monotonic()
        result = handler.run_in_thread(self.handler, active.run.events, active.ctx, active.wake)
        return result, time.monotonic() - started

    def close(self) -> None:
        """Stop the slots' handler processes."""
        for process in self.processes or ():
            process.stop()

    def _finish(self, actives: list[ActiveRun], results: dict[int, Result | None], slot: int,
                now: int | None) -> list[bool]:
        """The fenced finishes and the give-backs, in one transaction, retried
        through database faults while the leases may still be valid. Unless
        stopping, the same transaction takes the slot's next work. If the commit
        fails for another reason (a run's result the database refuses), each run
        is committed alone, a refused result as its run's error, so one bad
        result costs only its own run, one attempt.
        Accepted flags, by position."""
        outcomes = [(n, self._outcome(actives[n], result))
                    for n, result in results.items() if result is not None]
        give_back = [n for n in range(len(actives)) if n not in results]
        for n in [n for n, _ in outcomes] + give_back:
            actives[n].finishing = True
        accepted = [False] * len(actives)
        delays, retrying = backoff_delays(cap=5.0), False
        while True:
            outcomes = [(n, o) for n, o in outcomes if not actives[n].ctx.lease_lost.is_set()]
            if not outcomes and not give_back:
                break
            started = time.monotonic()
            take_as = None if self.stop.is_set() else self.holders[slot]
            try:
                if retrying:  # the lost commit may have taken runs unseen
                    self._give_back_orphans(slot, [a.run for a in actives], now)
                flags, following = self.inbox.finish_runs(
                    [o for _, o in outcomes], hand_back=[actives[n].run for n in give_back],
                    take_as=take_as, take_users=self._take_size[slot], now=now)
            except (errors.DatabaseUnavailable, errors.TransactionConflict) as exc:
                log.warning("finish failed for %d runs of holder=%s (%s); retrying",
                            len(outcomes) + len(give_back), self.holders[slot], exc)
                if isinstance(exc, errors.DatabaseUnavailable):
                    self._unsure.add(slot)
                outcomes = [(n, o) for n, o in outcomes if self._may_hold(actives[n])]
                give_back = [n for n in give_back if self._may_hold(actives[n])]
                if outcomes or give_back:
                    time.sleep(next(delays))
                retrying = True
                continue
            except Exception:
                log.exception("the finish of %d runs failed; committing them one at a time",
                              len(outcomes) + len(give_back))
                for n, outcome in outcomes:
                    accepted[n] = self._finish_alone(actives[n], outcome, now)
                if give_back:
                    self.inbox.hand_back([actives[n].run for n in give_back], now=now)
                    for n in give_back:
                        actives[n].settled = True
                break
            if following:
                self._carried[slot] = (following, started)
            for n in give_back:
                actives[n].settled = True
            for (n, outcome), flag in zip(outcomes, flags):
                accepted[n], actives[n].settled = flag, True
                self._finished(outcome, flag)
            break
        for n, active in enumerate(actives):
            if n in results and not active.settled and active.ctx.lease_lost.is_set():
                run = active.run
                log.warning("lease lost user=%s holder=%s gen=%s: nothing committed",
                            run.user, run.holder, run.gen)
                metrics.FINISHES.labels("lease_lost").inc()
                active.settled = True
        return accepted

    def _finish_alone(self, active: ActiveRun, outcome: Outcome, now: int | None) -> bool:
        """One run's finish in a transaction of its own; if the database refuses
        its result, the run is finished with that error instead (a retry later)."""
        run = active.run
        try:
            [accepted], _ = self.inbox.finish_runs([outcome], now=now)
        except (errors.DatabaseUnavailable, errors.TransactionConflict):
            return False  # unsettled: released by run_once
        except Exception as exc:
            log.exception("the result of user=%s gen=%s cannot be committed", run.user, run.gen)
            outcome = self.inbox.outcome(
                run, Result(error=f"the run's result could not be committed: {exc!r}"[:2000]))
            [accepted], _ = self.inbox.finish_runs([outcome], now=now)
        active.settled = True
        self._finished(outcome, accepted)
        return accepted

    def _give_back_orphans(self, slot: int, known: list[Run], now: int | None) -> None:
        """Give back the leases this slot's holder holds beyond `known` and the
        runs whose release failed: runs a commit took whose answer the lost
        connection never brought."""
        fresh = [(run, at) for run, at in self._stranded.get(slot, ())
                 if time.monotonic() - at <= self.inbox.lease_ttl]
        self._stranded[slot] = fresh
        known = list(known) + [run for run, _ in fresh]
        orphans = self.inbox.hand_back_orphans(self.holders[slot], known, now=now)
        self._unsure.discard(slot)
        if orphans:
            log.warning("gave back %d runs taken by a commit whose answer was lost: users %s",
                        len(orphans), ", ".join(orphans))

    def _may_hold(self, active: ActiveRun) -> bool:
        """Whether the run's lease may still be valid, by this host's clock."""
        return time.monotonic() - active.lease_started <= self.inbox.lease_ttl

    def _outcome(self, active: ActiveRun, result: Result) -> Outcome:
        try:
            return self.inbox.outcome(active.run, result)
        except errors.InvalidInput as exc:  # the handler's result was malformed
            run = active.run
            log.error("handler result rejected user=%s gen=%s: %s", run.user, run.gen, exc)
            return self.inbox.outcome(run, Result(error=f"invalid handler result: {exc}"))

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

    def _abandon(self, actives: list[ActiveRun], reason: str, now: int | None = None) -> None:
        """Let other workers have these runs now: a run whose handler started is
        released (its attempt stays counted: the handler may have acted), one
        that never started is given back. Never raises: at worst the leases
        expire after their TTL."""
        for active in actives:
            active.settled = True
            active.ctx.lease_lost.set()
            active.wake.set()
        unstarted = [a.run for a in actives if not a.started]
        try:
            given_back = set(self.inbox.hand_back(unstarted, now=now)) if unstarted else set()
        except Exception as exc:  # the database is away, or worse: the TTL decides
            log.warning("%s: could not give back %d runs (%s)", reason, len(unstarted), exc)
            given_back = set()
        for active in actives:
            run = active.run
            if active.started:
                try:
                    done = "released" if self.inbox.release(run.user, run.holder, run.gen,
                                                             now=now) else "already lost"
                except Exception as exc:
                    done = f"left to expire ({exc})"
                    slot = self.holders.index(run.holder)
                    self._stranded.setdefault(slot, []).append((run, time.monotonic()))
            else:
                done = "given back" if run.user in given_back else "not given back"
            log.warning("%s: lease %s user=%s holder=%s gen=%s", reason, done, run.user,
                        run.holder, run.gen)

    # --- renewal ------------------------------------------------------------------

    def renew_all(self) -> None:
        """Extend every running lease; mark the ones that are lost."""
        with self._lock:
            running = list(self._active.values())
        for active in running:
            run = active.run
            started = time.monotonic()
            try:
                renewed = self.inbox.renew(run.user, run.holder, run.gen) is not None
            except errors.DatabaseUnavailable:
                renewed = None
            if renewed:
                active.lease_started = started
            elif active.finishing:
                continue  # the finish released the lease, or its fence will refuse
            elif renewed is False or started - active.lease_started > self.inbox.lease_ttl:
                log.warning("lease lost user=%s holder=%s gen=%s (renewal %s)", run.user,
                            run.holder, run.gen, "refused" if renewed is False else "failed")
                metrics.RENEWALS_FAILED.inc()
                active.ctx.lease_lost.set()
                active.wake.set()

    def _renewer(self, done: threading.Event) -> None:
        """Renews until the service is done, through the shutdown grace period."""
        interval = max(0.2, self.inbox.lease_ttl / 4)
        while not done.wait(interval):
            self.renew_all()

    # --- the service ----------------------------------------------------------------

    def _slot(self, slot: int) -> None:
        delays = backoff_delays()
        while not self.stop.is_set() or slot in self._carried:  # a taken run is run
            try:
                counts = self.run_once(slot)
                delays = backoff_delays()
            except errors.DatabaseUnavailable as exc:
                pause = next(delays)
                log.warning("slot %d: database unavailable (%s); retrying in %.1f s", slot, exc, pause)
                self.stop.wait(pause)
                continue
            except Exception:  # a bug must not silently cost the worker a slot
                pause = next(delays)
                log.exception("slot %d: unexpected error; going on in %.1f s", slot, pause)
                self.stop.wait(pause)
                continue
            if not counts["runs"] and slot not in self._carried:
                self.waker.wait(jittered(self.poll_interval))

    def serve(self, url: str) -> None:
        """Run every slot until SIGTERM/SIGINT, then shut down gracefully."""
        for process in self.processes or ():
            process.start()
        Listener(url, [notify.WORK], self.waker.wake_one, self.stop).start()
        done = threading.Event()
        threading.Thread(target=self._renewer, args=(done,), name="agent-inbox-renewer",
                         daemon=True).start()
        slots = [threading.Thread(target=self._slot, args=(n,), name=f"slot-{n}", daemon=True)
                 for n in range(len(self.holders))]
        for thread in slots:
            thread.start()
        log.info("worker started: %d slots, holders %s", len(slots), ", ".join(self.holders))
        self.stop.event.wait()
        self.waker.wake_all()
        deadline = time.monotonic() + self.grace
        for thread in slots:
            thread.join(max(0.0, deadline - time.monotonic()))
        done.set()
        self.release_running()
        self.close()

    def release_running(self) -> None:
        """On shutdown: runs still going are released and runs taken but not
        started are given back, so other workers take over now."""
        with self._lock:
            running = list(self._active.values())
        carried = list(self._carried.values())  # one C call: slot threads may still pop
        running += [ActiveRun(run, Context(run.user, run.holder, run.gen), threading.Event(), started)
                    for runs, started in carried for run in runs]
        self._carried.clear()
        self._abandon(running, "shutdown")
