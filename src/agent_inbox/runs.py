"""The run-level calls of the worker runtime: take work, renew, release, give
back, and the fenced finish of everything a run produced.

Invariant 3: a run's outcome, messages, timers and approval requests commit in
one transaction that locks the user's lease row first and whose finish
statement checks holder, generation, expiry and the events' claim, or nothing of
that run commits. Several runs may share that transaction (the worker's
completer commits every run that ended since its last commit), each behind its
own fence: a refused run writes nothing, the others commit.

On a Citus cluster (Inbox.citus) every transaction here is about one bucket,
so that it runs on one node: work is taken one bucket at a time and a run is
finished in a transaction of its own (store/bucketed.py); renewals, releases
and give-backs are sent once per bucket. A worker node that does not answer
holds up only its own users: work is found on the nodes that answer, and a
take, a batch of finishes or a renewal that met a silent node raises
PartlyDone with what it did on the others.
"""

import asyncio
from dataclasses import dataclass, field
from typing import Any

from agent_inbox import citus, db, errors, limits, tracing, validate
from agent_inbox.handler import Context
from agent_inbox.records import Event
from agent_inbox.result import KEEP, ApprovalRequest, Message, Result, TimerRequest
from agent_inbox.steps import RunSteps
from agent_inbox.store import approvals, bucketed, inbox, lease, steps, timers
from agent_inbox.store.steps import RecordedStep, StepRecord


@dataclass(frozen=True)
class Run:
    """A user's lease taken by `holder` in generation `gen`, and the events claimed."""

    user: str
    holder: str
    gen: int
    claimed_at: int
    events: list[Event]
    died: int = 0  # events this claim parked as dead (out of attempts)
    unfinished: int = 0  # events claimed again after a run that ended without a finish
    memory: Any = None  # the user's memory document as the claim read it (None: none)
    # its OpenTelemetry span, if the worker traces it (tracing.start_run)
    trace: Any = field(default=None, repr=False, compare=False)

    @property
    def key(self) -> tuple[str, int]:
        return self.user, self.gen


@dataclass(frozen=True)
class Outcome:
    """A run and its handler's result, checked and ready to commit."""

    run: Run
    error: str | None
    messages: list[tuple[str, bool]]  # (body, urgent)
    timer_rows: list[dict]
    approval_rows: list[tuple[str, dict]]  # (request id, timer row)
    forget_steps: bool = True  # see inbox.Finish
    memory: tuple[str | None] | None = None  # see inbox.Finish

    @property
    def writes_timers(self) -> bool:
        return self.error is None and bool(self.timer_rows or self.approval_rows)

    @property
    def finish(self) -> inbox.Finish:
        run = self.run
        return inbox.Finish(run.user, run.holder, run.gen, [e.id for e in run.events],
                            self.messages, self.error, self.forget_steps, self.memory,
                            tracing.run_traceparent(run) if self.messages else None)


# Why a call left a node's users alone without asking it (citus.NodeMap.hung).
HUNG = "their worker node timed out a moment ago (set aside for a while)"


class Runs:
    """Mixed into `agent_inbox.Inbox` (which owns `_pool`, `policy`, `lease_ttl`,
    `citus`, `_by_bucket`, `_nodes`)."""

    def take_work(self, holder: str, *, now: int | None = None) -> Run | None:
        """Find the user whose oldest claimable event has waited longest among
        users whose lease is free or expired, take the lease over and claim, in
        one statement; None if there is no such user. The run may hold no events
        (only exhausted ones were due, now parked dead): finish it all the same."""
        runs = self.take_runs(holder, users=1, now=now)
        return runs[0] if runs else None

    def take_runs(self, holder: str, *, users: int, now: int | None = None) -> list[Run]:
        """`take_work` for up to `users` users at once, longest waiting first,
        each its own run under its own lease; empty if there is no work."""
        holder = validate.text("holder", holder)
        users = validate.positive_int("users", users)
        now = validate.optional_epoch("now", now)
        if self.citus:
            taken, failure = self._take_by_bucket(holder, users, now)
            if failure is not None:
                raise errors.PartlyDone(f"a take stopped short: {citus.first_line(failure)}",
                                        self._as_runs(holder, taken)) from failure
            return self._as_runs(holder, taken)
        with db.connection(self._pool) as conn:
            return self._as_runs(holder, inbox.take_work(conn, holder, self.lease_ttl,
                                                         self.policy, now, users))

    def _take_by_bucket(self, holder: str, users: int,
                        now: int | None) -> tuple[list[tuple], Exception | None]:
        """On Citus: the buckets with due wakes, longest waiting first (read per
        node, no lock), each taken from in a transaction of its own until
        `users` are taken; what was taken (committed), and the failure of a
        bucket whose node did not answer (which ends the take; None if none
        did). A take whose commit failed may have taken runs unseen, as
        anywhere: the caller gives back orphans."""
        taken: list[tuple] = []
        failures: list[Exception] = []
        with db.connection(self._pool) as conn:
            for bucket in bucketed.due_buckets(conn, self._nodes, now):
                if conn.closed:  # cut under a read of a node that hangs
                    break
                with citus.node_may_fail(conn, failures, self._nodes, [bucket]), \
                        conn.transaction():
                    got = bucketed.take(conn, bucket, holder, self.lease_ttl, self.policy,
                                        now, users - len(taken))
                if failures:
                    break
                taken += got
                if len(taken) >= users:
                    break
        return taken, (failures[0] if failures else None)

    def renew_runs(self, runs: list[Run], *, now: int | None = None) -> set:
        """Extend by lease_ttl, in one statement, every lease of `runs` (one
        holder's) still held; the (user, gen) keys extended (the others are lost).
        On Citus one statement per bucket: if a node does not answer, PartlyDone
        with the keys extended and, as `unknown`, those of that node."""
        holder = _holder_of(runs)
        now = validate.optional_epoch("now", now)
        renewed, unknown, failures = set(), set(), []
        if not self.citus:
            with db.connection(self._pool) as conn:
                return lease.renew(conn, holder, [run.key for run in runs], self.lease_ttl,
                                   now) if runs else set()
        with db.Connections(self._pool) as conns:
            for keys in self._by_bucket([run.key for run in runs]):
                bucket = citus.bucket(keys[0][0])
                conn = conns.get()  # another if a hung node's statement was cut
                if self._nodes.hung(bucket):  # its node timed out a moment ago: not waited for
                    unknown.update(keys)
                    continue
                failed = len(failures)
                with citus.node_may_fail(conn, failures, self._nodes, [bucket]):
                    renewed |= lease.renew(conn, holder, keys, self.lease_ttl, now)
                if len(failures) > failed:
                    unknown.update(keys)
        if unknown:
            why = citus.first_line(failures[0]) if failures else HUNG
            raise errors.PartlyDone(f"{len(unknown)} leases not renewed: {why}", renewed, unknown)
        return renewed

    def release(self, user: str, holder: str, gen: int, *, now: int | None = None) -> bool:
        """Expire a held lease at once (gen kept, so it still fences this holder)."""
        user, holder = validate.text("user", user), validate.text("holder", holder)
        gen = validate.positive_int("gen", gen)
        now = validate.optional_epoch("now", now)
        with db.connection(self._pool) as conn:
            return bool(self._release(conn, holder, [(user, gen)], now))

    def _release(self, conn, holder: str, keys: list[tuple[str, int]], now: int | None,
                 **options) -> list[str]:
        if not self.citus:
            return lease.release(conn, holder, keys, now, **options) if keys else []
        released = []
        for group in self._by_bucket(keys):  # one node's transaction each
            with conn.transaction():
                released += bucketed.release(conn, holder, group, now, **options)
        return released

    def release_runs(self, runs: list[Run], *, error: str | None = None,
                     at_once: bool = True, now: int | None = None) -> list[str]:
        """Abandon runs (one holder's) whose handlers may have acted: their
        leases expired at once, their events left claimable (now, or after their
        backoff unless `at_once`) with the attempt counted and `error` recorded;
        the next claim sees them unfinished. The users released (leases still held)."""
        holder = _holder_of(runs)
        now = validate.optional_epoch("now", now)
        if error is not None:
            error = validate.text("error", error)
        with db.connection(self._pool) as conn:
            return self._release(conn, holder, [run.key for run in runs], now, error=error,
                                 at_once=at_once)

    def release_holder(self, holder: str, *, error: str, suspect: tuple[str, int] | None = None,
                       now: int | None = None) -> list[str]:
        """Release every lease `holder` still holds (its worker process died), as
        `release_runs` does; the users released.

        `suspect` is the run (user, gen) that was executing when the process
        died, if that is known (blame.py): it alone is released as above (its
        retry is unfinished: it runs in quarantine). The holder's other runs are
        spared: their events on their first attempt go back pending, the attempt
        counted, so their retries run in a worker at full concurrency; those on a
        later attempt (died in a crash before, failed before, or were running in
        quarantine) are released as above. So a run wrongly blamed costs the
        culprit at most one more crash, on a retry, which puts it in quarantine.
        Without a suspect, or if `holder` no longer holds it, every run is
        released as above."""
        holder = validate.text("holder", holder)
        error = validate.text("error", error)
        now = validate.optional_epoch("now", now)
        with db.connection(self._pool) as conn:
            held = self._held_by(conn, holder, now)
            if suspect is None or tuple(suspect) not in held:
                return self._release(conn, holder, held, now, error=error, at_once=False)
            spared = [key for key in held if key != tuple(suspect)]
            return (self._release(conn, holder, [tuple(suspect)], now, error=error, at_once=False)
                    + self._release(conn, holder, spared, now, error=error, at_once=False,
                                    spare=True))

    def _held_by(self, conn, holder: str, now: int | None) -> list[tuple[str, int]]:
        """The (user, gen) of the leases `holder` holds; on Citus, on the nodes
        that answer."""
        if self.citus:
            return bucketed.held_by(conn, self._nodes, holder, now)
        return lease.held_by(conn, holder, now)

    def outcome(self, run: Run, result: Result, *, steps_recorded: bool = True) -> Outcome:
        """Check a handler's result for committing; InvalidInput names what is wrong.
        `steps_recorded=False` says the run recorded no durable step: a first
        attempt's finish then has no step to delete (and does not look)."""
        if not isinstance(result, Result):
            raise errors.InvalidInput("result", result, "must be an agent_inbox.Result")
        error = None if result.error is None else validate.text("result.error", result.error)
        messages = [self._message(m) for m in validate.sequence("result.messages", result.messages)]
        timer_rows = [self._timer_row(t) for t in validate.sequence("result.timers", result.timers)]
        approval_rows = [self._approval_row(a)
                         for a in validate.sequence("result.approvals", result.approvals)]
        forget = steps_recorded or any(event.attempts > 1 for event in run.events)
        memory = None if result.memory is KEEP else (
            None if result.memory is None
            else validate.payload("result.memory", result.memory, self.max_memory_bytes),)
        return Outcome(run, error, messages, timer_rows, approval_rows, forget, memory)

    def finish_run(self, run: Run, result: Result, *, release: bool = True,
                   now: int | None = None) -> bool:
        """Commit everything a run produced (its events' outcome, messages, timers,
        approval requests) in one fenced transaction, and by default release the
        lease in the same commit. False, with nothing written, if the fence refuses."""
        [accepted] = self.finish_runs([self.outcome(run, result)], release=release, now=now)
        return accepted

    def finish_runs(self, outcomes: list[Outcome], *, release: bool = True,
                    now: int | None = None) -> list[bool]:
        """Commit several runs in one transaction, each behind its own fence (a
        refused run writes nothing; the others commit), by default releasing
        their leases in the same commit. The accepted flags, in the order given."""
        now = validate.optional_epoch("now", now)
        if not outcomes:
            return []
        with tracing.finish(outcomes) as traced:  # a span per traced run
            flags = self._finish_runs(outcomes, release, now)
            traced.accepted(flags)
            return flags

    def _finish_runs(self, outcomes: list[Outcome], release: bool, now: int | None) -> list[bool]:
        if self.citus:
            return self._finish_each(outcomes, release, now)
        users = sorted(o.run.user for o in outcomes)
        finishes = [o.finish for o in outcomes]
        with db.connection(self._pool) as conn:
            if any(o.writes_timers for o in outcomes):
                # Timers and approvals are written only once their fence has said yes.
                with conn.transaction():
                    conn.execute(lease.LOCK_MANY, {"users": users})
                    accepted = inbox.finish(conn, finishes, now, release=release)
                    for o, ok in zip(outcomes, accepted):
                        if ok:
                            self._write_timers(conn, o, now)
                    return accepted
            # Locks, fenced finishes and commit, sent as one pipeline: one round trip.
            with db.pipelined_transaction(conn):
                conn.execute(lease.LOCK_MANY, {"users": users})
                verdicts = inbox.send_finish(conn, finishes, now, release=release)
            return inbox.read_verdicts(verdicts)

    def _finish_each(self, outcomes: list[Outcome], release: bool,
                     now: int | None) -> list[bool]:
        """On Citus: each run's finish in a transaction of its own (one node).
        A run whose node does not answer (or that deadlocks) commits nothing
        and the others commit: PartlyDone, whose `done` has a flag per outcome,
        None where nothing was committed."""
        flags: list[bool | None] = []
        failures: list[Exception] = []
        with db.Connections(self._pool) as conns:
            for o in outcomes:
                bucket = citus.bucket(o.run.user)
                conn = conns.get()  # another if a hung node's statement was cut
                if self._nodes.hung(bucket):  # its node timed out a moment ago: not waited for
                    flags.append(None)
                    continue
                failed = len(failures)
                with citus.node_may_fail(conn, failures, self._nodes, [bucket]), \
                        conn.transaction():
                    accepted = bucketed.finish(conn, o.finish, now, release=release)
                    if accepted:
                        self._write_timers(conn, o, now)
                flags.append(None if len(failures) > failed else accepted)  # committed, or not
        if None in flags:
            why = citus.first_line(failures[0]) if failures else HUNG
            raise errors.PartlyDone(f"{flags.count(None)} of {len(flags)} finishes not committed: "
                                    f"{why}", flags) from (failures[0] if failures else None)
        return flags

    # --- durable steps (steps.py, store/steps.py) ---------------------------------------

    def record_steps(self, records: list[StepRecord], *, now: int | None = None) -> list[bool]:
        """Commit step records (of any runs of one holder), each behind its run's
        fence; a flag per record, in order: False where the fence refused it (its
        run's lease is lost) and nothing of it was stored. On Citus one
        transaction per bucket."""
        now = validate.optional_epoch("now", now)
        if not records:
            return []
        order = sorted(range(len(records)), key=lambda i: records[i].user)
        stored: dict[int, bool] = {}
        with db.connection(self._pool) as conn:
            if self.citus:
                for group in citus.by_bucket(order, lambda i: records[i].user):
                    with conn.transaction():
                        flags = bucketed.record_steps(conn, [records[i] for i in group], now)
                    stored.update(zip(group, flags))
            else:
                with conn.transaction():
                    kept = steps.record(conn, records, now)
                stored = {i: (r.user, r.gen, r.position) in kept for i, r in enumerate(records)}
        return [stored[i] for i in range(len(records))]

    def recorded_steps(self, runs: list[tuple[str, tuple[int, ...]]]) -> list[list[RecordedStep]]:
        """For each (user, event ids): the steps recorded for exactly those events,
        in order. One read (on Citus one per bucket)."""
        if not runs:
            return []
        answers: dict[int, list[RecordedStep]] = {}
        with db.connection(self._pool) as conn:
            for group in citus.groups(conn, list(range(len(runs))), lambda i: runs[i][0]):
                answers.update(zip(group, steps.recorded(conn, [runs[i] for i in group])))
        return [answers[i] for i in range(len(runs))]

    def context(self, run: Run, *, max_step_bytes: int | None = None) -> Context:
        """A handler's context for `run`, taken without a worker (take_work,
        claim_batch): its memory as the claim read it; its durable steps and
        permit calls through this Inbox, one transaction each; its limits
        (`ctx.limit`) through this process's limiter on this Inbox."""
        limit = self.max_payload_bytes if max_step_bytes is None else max_step_bytes
        ctx = Context(run.user, run.holder, run.gen, memory=run.memory,
                      attempt=max((e.attempts for e in run.events), default=1),
                      limiter=limits.limiter_for(self))
        ctx.permits = self._direct_permits(run.user, run.holder, run.gen)
        ctx.steps = RunSteps(run.user, run.holder, run.gen, [e.id for e in run.events],
                             may_resume=any(e.attempts > 1 for e in run.events),
                             journal=DirectJournal(self, run.user, [e.id for e in run.events]),
                             max_result_bytes=limit)
        return ctx

    def hand_back(self, runs: list[Run], *, now: int | None = None) -> list[str]:
        """Give back runs whose handlers never started: leases expired at once,
        claims undone (attempts included). A run whose lease is no longer held
        is left alone. The users given back."""
        now = validate.optional_epoch("now", now)
        if self.citus:  # one node's transaction per bucket
            given = []
            for group in self._by_bucket([(r.user, r.holder, r.gen, r.unfinished > 0)
                                          for r in runs]):
                with db.transaction(self._pool) as conn:
                    given += bucketed.hand_back(conn, group, now)
            return given
        with db.transaction(self._pool) as conn:
            conn.execute(lease.LOCK_MANY, {"users": sorted(run.user for run in runs)})
            answers = self._send_hand_back(conn, runs, now)
            return [user for answer in answers for user, in answer.fetchall()]

    def hand_back_orphans(self, holder: str, known: list[Run] = (), *,
                          now: int | None = None) -> list[str]:
        """Give back every unexpired lease `holder` holds other than the runs in
        `known` (runs a lost commit may have taken unseen); the users given back."""
        holder = validate.text("holder", holder)
        now = validate.optional_epoch("now", now)
        if self.citus:  # HAND_BACK_ORPHANS locks across shards: found first, given back by bucket
            with db.connection(self._pool) as conn:
                held = self._held_by(conn, holder, now)
            mine = {run.key for run in known}
            orphans = [Run(user, holder, gen, 0, [], unfinished=1) for user, gen in held
                       if (user, gen) not in mine]
            return self.hand_back(orphans, now=now)
        params = {"holder": holder, "users": [r.user for r in known],
                  "gens": [r.gen for r in known], "now": now}
        with db.transaction(self._pool) as conn:
            return [user for user, in conn.execute(lease.HAND_BACK_ORPHANS, params).fetchall()]

    @staticmethod
    def _send_hand_back(conn, runs: list[Run], now: int | None) -> list:
        """One HAND_BACK per holder; the cursors answer the users given back."""
        answers = []
        for holder in sorted({run.holder for run in runs}):
            mine = [run for run in runs if run.holder == holder]
            answers.append(conn.execute(lease.HAND_BACK, {
                "holder": holder, "users": [r.user for r in mine], "gens": [r.gen for r in mine],
                "unfinished": [r.unfinished > 0 for r in mine], "now": now}))
        return answers

    @staticmethod
    def _write_timers(conn, o: Outcome, now: int | None) -> None:
        for row in o.timer_rows:
            timers.upsert(conn, o.run.user, **row)
        for request_id, row in o.approval_rows:
            timers.upsert(conn, o.run.user, approvals.expiry_timer_id(request_id), base=now, **row)

    @staticmethod
    def _as_runs(holder: str, taken: list[tuple]) -> list[Run]:
        return [Run(user, holder, gen, claimed_at, events, died, unfinished, memory)
                for user, gen, claimed_at, died, unfinished, memory, events in taken]

    def _message(self, message) -> tuple[str, bool]:
        if isinstance(message, Message):
            return validate.text("message body", message.body), bool(message.urgent)
        return validate.text("message", message), False

    def _timer_row(self, timer) -> dict:
        if not isinstance(timer, TimerRequest):
            raise errors.InvalidInput("timers item", timer, "must be an agent_inbox.TimerRequest")
        return self._checked_timer(timer.timer_id, timer.due, timer.payload, timer.every, timer.key,
                                   cron=timer.cron, timezone=timer.timezone, missed=timer.missed,
                                   catch_up_limit=timer.catch_up_limit)

    def _approval_row(self, approval) -> tuple[str, dict]:
        if not isinstance(approval, ApprovalRequest):
            raise errors.InvalidInput("approvals item", approval,
                                      "must be an agent_inbox.ApprovalRequest")
        return self._checked_approval(approval.request_id, approval.expires_in, approval.action)


def _holder_of(runs: list[Run]) -> str:
    holders = {run.holder for run in runs}
    if len(holders) > 1:
        raise errors.InvalidInput("runs", sorted(holders), "must all be one holder's")
    return holders.pop() if holders else "-"


class DirectJournal:
    """A run's step journal through an Inbox (`Inbox.context`): each read and
    record is a transaction of its own, on the Inbox's pool."""

    def __init__(self, inbox: Runs, user: str, event_ids: list[int]):
        self._inbox, self._key = inbox, (user, tuple(sorted(event_ids)))

    def recorded(self) -> list[RecordedStep]:
        return self._inbox.recorded_steps([self._key])[0]

    def record(self, record: StepRecord) -> None:
        if not self._inbox.record_steps([record])[0]:
            raise errors.StepRefused(f"step {record.name!r} of user={record.user} "
                                     f"gen={record.gen} refused: the run's lease is lost")

    async def recorded_async(self) -> list[RecordedStep]:
        return await asyncio.to_thread(self.recorded)

    async def record_async(self, record: StepRecord) -> None:
        await asyncio.to_thread(self.record, record)
