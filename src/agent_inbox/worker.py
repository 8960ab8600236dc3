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
    finishing: bool = False  # the fenced finish has begun: it decides, not renewal


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
        self._lock = threading.Lock()

    # --- one take ---------------------------------------------------------------

    def run_once(self, slot: int = 0, *, now: int | None = None) -> dict[str, int]:
        """Run the users' work this slot holds, one run per user, and finish it.
        The work is what the slot's previous finish took (one commit per take),
        else a fresh take. Counts: runs, events, accepted (finishes accepted)."""
        carried = self._carried.pop(slot, None)
        if carried is None:
            started = time.monotonic()
            runs = self.inbox.take_runs(self.holders[slot], users=self._take_size[slot], now=now)
        else:
            runs, started = carried
        actives = [ActiveRun(run, Context(run.user, run.holder, run.gen), threading.Event(), started)
                   for run in runs]
        for active in actives:
            self._taken(active.run)
        with self._lock:
            self._active.update(((a.run.holder, a.run.user), a) for a in actives)
        try:
            results, handler_seconds = self._execute(actives, slot)
            self._size_next_take(slot, handler_seconds, len(actives))
            accepted = self._finish(actives, results, slot, now) if actives else []
        finally:
            with self._lock:
                for active in actives:
                    self._active.pop((active.run.holder, active.run.user), None)
        return {"runs": len(runs), "events": sum(len(run.events) for run in runs),
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

    def _execute(self, actives: list[ActiveRun], slot: int) -> tuple[list[Result | None], float]:
        """Each run's result (None: its lease was lost), handlers one after another,
        and the seconds the handlers took."""
        results: list[Result | None] = [Result()] * len(actives)  # no events: only dead ones were due
        working = [n for n, active in enumerate(actives) if active.run.events]
        if self.processes and working:
            answers = self.processes[slot].run([(actives[n].run.events, actives[n].ctx)
                                                for n in working])
        else:
            answers = [self._in_thread(actives[n]) for n in working]
        for n, (result, seconds) in zip(working, answers):
            results[n] = result
            metrics.RUN_SECONDS.observe(seconds)
        return results, sum(seconds for _, seconds in answers)

    def _in_thread(self, active: ActiveRun) -> tuple[Result | None, float]:
        started = time.monotonic()
        result = handler.run_in_thread(self.handler, active.run.events, active.ctx, active.wake)
        return result, time.monotonic() - started

    def _size_next_take(self, slot: int, seconds: float, runs: int) -> None:
        if runs:
            fits = int(TAKE_BUDGET * runs / max(seconds, 1e-6))
            self._take_size[slot] = max(1, min(self.max_users_per_take, fits))

    def close(self) -> None:
        """Stop the slots' handler processes."""
        for process in self.processes or ():
            process.stop()

    def _finish(self, actives: list[ActiveRun], results: list[Result | None], slot: int,
                now: int | None) -> list[bool]:
        """The fenced finishes, in one transaction, retried through database
        faults for the runs whose leases may still be valid. Unless stopping, the
        same transaction takes the slot's next work. Accepted flags, in order."""
        decided: dict[int, bool] = {}
        pending = [(n, self._outcome(actives[n], result))
                   for n, result in enumerate(results) if result is not None]
        for n, _ in pending:
            actives[n].finishing = True
        delays = backoff_delays(cap=5.0)
        while True:
            pending = [(n, o) for n, o in pending if not actives[n].ctx.lease_lost.is_set()]
            if not pending:
                break
            started = time.monotonic()
            take_as = None if self.stop.is_set() else self.holders[slot]
            try:
                flags, following = self.inbox.finish_runs(
                    [o for _, o in pending], take_as=take_as, take_users=self._take_size[slot],
                    now=now)
            except errors.DatabaseUnavailable as exc:
                log.warning("finish failed for %d runs of holder=%s (%s); retrying",
                            len(pending), self.holders[slot], exc)
                pending = [(n, o) for n, o in pending
                           if time.monotonic() - actives[n].lease_started <= self.inbox.lease_ttl]
                if pending:
                    time.sleep(next(delays))
                continue
            if following:
                self._carried[slot] = (following, started)
            for (n, outcome), flag in zip(pending, flags):
                decided[n] = flag
                self._finished(outcome, flag)
            break
        for n, active in enumerate(actives):
            if n not in decided:
                run = active.run
                log.warning("lease lost user=%s holder=%s gen=%s: nothing committed",
                            run.user, run.holder, run.gen)
                metrics.FINISHES.labels("lease_lost").inc()
        return [decided.get(n, False) for n in range(len(actives))]

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
            if not counts["runs"]:
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
        """Release the leases of runs still going: another worker takes over now."""
        with self._lock:
            running = list(self._active.values())
        running += [ActiveRun(run, Context(run.user, run.holder, run.gen), threading.Event(), started)
                    for runs, started in self._carried.values() for run in runs]  # not yet started
        for active in running:
            run = active.run
            active.ctx.lease_lost.set()
            active.wake.set()
            try:
                released = self.inbox.release(run.user, run.holder, run.gen)
            except errors.DatabaseUnavailable:
                released = False
            log.warning("shutdown: lease %s user=%s holder=%s gen=%s",
                        "released" if released else "left to expire", run.user, run.holder, run.gen)
