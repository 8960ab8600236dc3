"""The worker service: slots that find a user with work, run its handler, finish.

Each slot has its own holder id, unique across hosts and restarts
(host:pid:slot:random). A slot takes work in one statement (the user whose
oldest claimable event waited longest, lease taken over, batch claimed), runs
the handler while a renewer thread extends the lease, and commits everything in
one fenced finish that also releases the lease. Invariants kept here:

- a run whose lease was lost commits nothing: `ctx.lease_lost` is set, the
  worker skips the finish (the fence would refuse it anyway) and moves on;
- each slot runs its handlers in a process of its own (see handler.py), so a
  poison event cannot take other users' runs in this worker down with it;
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

from agent_inbox import errors, handler, metrics
from agent_inbox.handler import Context
from agent_inbox.inbox import Inbox, Run
from agent_inbox.result import Result
from agent_inbox.service import Listener, Stop, Waker, backoff_delays, jittered
from agent_inbox.store import notify

log = logging.getLogger("agent_inbox.worker")


def holder_id(slot: int) -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{slot}:{secrets.token_hex(3)}"


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
                 stop: Stop | None = None):
        self.inbox = inbox
        self.reference = handler_reference
        self.handler = handler.load(handler_reference)
        self.holders = [holder_id(slot) for slot in range(concurrency)]
        self.poll_interval = poll_interval
        self.grace = grace
        if isolation not in ("process", "thread"):
            raise errors.InvalidInput("isolation", isolation, "must be 'process' or 'thread'")
        self.processes = ([handler.HandlerProcess(handler_reference, f"agent-inbox-slot-{n}")
                           for n in range(concurrency)] if isolation == "process" else None)
        self.stop = stop or Stop()
        self.waker = Waker(concurrency)
        self._active: dict[str, ActiveRun] = {}
        self._carried: dict[int, tuple[Run, float]] = {}  # slot -> (next run, lease start)
        self._lock = threading.Lock()

    # --- one run ----------------------------------------------------------------

    def run_once(self, slot: int = 0, *, now: int | None = None) -> dict[str, int]:
        """Run one user's work with this slot's holder and finish it. The work is
        the run taken by the slot's previous finish (one commit per run), else a
        fresh take. Counts: runs (0 or 1), events, accepted (finishes accepted)."""
        carried = self._carried.pop(slot, None)
        if carried is None:
            started = time.monotonic()
            run = self.inbox.take_work(self.holders[slot], now=now)
        else:
            run, started = carried
        if run is None:
            return {"runs": 0, "events": 0, "accepted": 0}
        active = ActiveRun(run, Context(run.user, run.holder, run.gen), threading.Event(), started)
        log.info("lease taken user=%s holder=%s gen=%s events=%d",
                 run.user, run.holder, run.gen, len(run.events))
        metrics.RUNS.inc()
        metrics.CLAIMED.inc(len(run.events))
        if run.died:
            metrics.DEAD.inc(run.died)
            log.warning("events dead user=%s gen=%s count=%d", run.user, run.gen, run.died)
        with self._lock:
            self._active[run.holder] = active
        try:
            with metrics.RUN_SECONDS.time():
                result = self._execute(active, slot)
            accepted = result is not None and self._finish(active, result, slot, now)
        finally:
            with self._lock:
                self._active.pop(run.holder, None)
        return {"runs": 1, "events": len(run.events), "accepted": int(accepted)}

    def _execute(self, active: ActiveRun, slot: int) -> Result | None:
        run = active.run
        if not run.events:  # only exhausted events were due: they are dead now
            return Result()
        if self.processes:
            return self.processes[slot].run(run.events, active.ctx)
        return handler.run_in_thread(self.handler, run.events, active.ctx, active.wake)

    def close(self) -> None:
        """Stop the slots' handler processes."""
        for process in self.processes or ():
            process.stop()

    def _finish(self, active: ActiveRun, result: Result, slot: int, now: int | None) -> bool:
        """The fenced finish, retried through database faults while the lease may
        still be valid. Unless stopping, it also takes the slot's next run."""
        run = active.run
        active.finishing = True
        delays = backoff_delays(cap=5.0)
        while not active.ctx.lease_lost.is_set():
            started = time.monotonic()
            try:
                if self.stop.is_set():
                    accepted = self.inbox.finish_run(run, result, now=now)
                else:
                    accepted, following = self.inbox.finish_and_take(run, result, now=now)
                    if following is not None:
                        self._carried[slot] = (following, started)
            except errors.DatabaseUnavailable as exc:
                if time.monotonic() - active.lease_started > self.inbox.lease_ttl:
                    break
                log.warning("finish failed user=%s holder=%s gen=%s (%s); retrying",
                            run.user, run.holder, run.gen, exc)
                time.sleep(next(delays))
                continue
            except errors.InvalidInput as exc:  # the handler's result was malformed
                log.error("handler result rejected user=%s gen=%s: %s", run.user, run.gen, exc)
                result = Result(error=f"invalid handler result: {exc}")
                continue
            metrics.FINISHES.labels("accepted" if accepted else "refused").inc()
            if accepted:
                log.info("finished user=%s holder=%s gen=%s events=%d error=%s", run.user,
                         run.holder, run.gen, len(run.events), result.error is not None)
            else:
                log.warning("finish refused by the fence user=%s holder=%s gen=%s",
                            run.user, run.holder, run.gen)
            return accepted
        log.warning("lease lost user=%s holder=%s gen=%s: nothing committed",
                    run.user, run.holder, run.gen)
        metrics.FINISHES.labels("lease_lost").inc()
        return False

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
                    for run, started in self._carried.values()]  # taken, not yet started
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
