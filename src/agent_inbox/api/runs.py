"""The run-level calls of the worker runtime: take work, renew, release, give
back, and the fenced finish of everything a run produced.

Invariant 3: a run's outcome, messages, timers and approval requests commit in
one transaction that locks the user's lease row first and whose finish
statement checks holder, generation, expiry and the events' claim, or nothing of
that run commits. Several runs may share that transaction (the worker's
completer commits every run that ended since its last commit), each behind its
own fence: a refused run writes nothing, the others commit.

How each call's transactions are cut (one set-based statement on one server,
one bucket per transaction on Citus, where a silent worker node makes a take, a
batch of finishes or a renewal raise PartlyDone with what it did on the
others) is the Inbox's RunPath (backend/path.py).
"""

import asyncio
from dataclasses import dataclass, field
from typing import Any

from agent_inbox import db, errors, tracing, validate
from agent_inbox.agent.permits import Decision, PermitAsk
from agent_inbox.agent.result import KEEP, ApprovalRequest, Message, Result, TimerRequest
from agent_inbox.api import scheduling
from agent_inbox.api.settings import Settings
from agent_inbox.backend.path import RunPath
from agent_inbox.records import Event, RecordedStep, StepRecord
from agent_inbox.store import approvals, inbox, pauses, policies, steps, timers


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


class Runs:
    """The worker runtime's protocol (`Inbox.runs`): take, renew, release, give
    back and finish runs, record their steps, decide their permit calls. It
    shares only the Inbox's pool, run path and settings."""

    def __init__(self, pool, path: RunPath, settings: Settings):
        self._pool, self._path, self._settings = pool, path, settings

    def take_runs(self, holder: str, *, users: int, now: int | None = None) -> list[Run]:
        """`take_work` for up to `users` users at once, longest waiting first,
        each its own run under its own lease; empty if there is no work."""
        holder = validate.text("holder", holder)
        users = validate.positive_int("users", users)
        now = validate.optional_epoch("now", now)
        taken, failure = self._path.take(holder, users, self._settings.lease_ttl,
                                            self._settings.claim, now)
        if failure is not None:
            raise errors.PartlyDone(f"a take stopped short: {errors.first_line(failure)}",
                                    self._as_runs(holder, taken)) from failure
        return self._as_runs(holder, taken)

    def renew_runs(self, runs: list[Run], *, now: int | None = None) -> set:
        """Extend by lease_ttl, in one statement, every lease of `runs` (one
        holder's) still held; the (user, gen) keys extended (the others are lost).
        On Citus one statement per bucket: if a node does not answer, PartlyDone
        with the keys extended and, as `unknown`, those of that node."""
        holder = _holder_of(runs)
        now = validate.optional_epoch("now", now)
        return self._path.renew(holder, [run.key for run in runs], self._settings.lease_ttl,
                                now)

    def fenced_off(self, runs: list[Run]) -> tuple[dict[tuple[str, int], str], dict | None]:
        """What a worker looks at between renewals (services/worker/keeper.py):
        the (user, gen) keys of `runs` (one holder's) whose lease no longer
        names them, each "cancelled" (by an operator) or "lost" (taken over),
        and the fleet's pause (store/pauses.py; None while it runs). Reads only."""
        with db.connection(self._pool) as conn:
            fleet = db.run(conn, pauses.fleet())
            if not runs:
                return {}, fleet
            return db.run(conn, pauses.fenced_off(_holder_of(runs), [r.key for r in runs])), fleet

    def release(self, user: str, holder: str, gen: int, *, now: int | None = None) -> bool:
        """Expire a held lease at once (gen kept, so it still fences this holder)."""
        user, holder = validate.text("user", user), validate.text("holder", holder)
        gen = validate.positive_int("gen", gen)
        now = validate.optional_epoch("now", now)
        with db.connection(self._pool) as conn:
            return bool(self._release(conn, holder, [(user, gen)], now))

    def _release(self, conn, holder: str, keys: list[tuple[str, int]], now: int | None,
                 **options) -> list[str]:
        return self._path.release(conn, holder, keys, now, **options)

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
        return self._path.held_by(conn, holder, now)

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
            else validate.payload("result.memory", result.memory, self._settings.max_memory_bytes),)
        return Outcome(run, error, messages, timer_rows, approval_rows, forget, memory)

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
        return self._path.finish_many(
            [o.finish for o in outcomes], release, now, [o.writes_timers for o in outcomes],
            lambda conn, i: self._write_timers(conn, outcomes[i], now))

    # --- durable steps (steps.py, store/steps.py) ---------------------------------------

    def record_steps(self, records: list[StepRecord], *, now: int | None = None) -> list[bool]:
        """Commit step records (of any runs of one holder), each behind its run's
        fence; a flag per record, in order: False where the fence refused it (its
        run's lease is lost) and nothing of it was stored. On Citus one
        transaction per bucket, and a bucket whose node does not answer is left
        undone: PartlyDone (`done`: the flags, None where undone; `unknown`: the
        indices of the records left undone)."""
        now = validate.optional_epoch("now", now)
        if not records:
            return []
        return self._path.record_steps(records, now)

    def recorded_steps(self, runs: list[tuple[str, tuple[int, ...]]]) -> list[list[RecordedStep]]:
        """For each (user, event ids): the steps recorded for exactly those events,
        in order. One read (on Citus one per bucket: PartlyDone as in record_steps
        if a node does not answer)."""
        if not runs:
            return []
        return self._path.in_groups(runs, lambda run: run[0], steps.recorded)

    # --- permits (agent/permits.py, store/policies.py) ----------------------------------

    def decide_permits(self, asks: list[PermitAsk], *,
                       now: int | None = None) -> list[Decision | None]:
        """Decide and record runs' permit calls in one transaction (on Citus one
        per bucket), a Decision each, or None where the run's lease is lost. On
        Citus a bucket whose node does not answer is left undone: PartlyDone
        (`done`: the answers; `unknown`: the indices of the asks left undone)."""
        now = validate.optional_epoch("now", now)

        def decide(conn, group: list[PermitAsk]) -> list[Decision | None]:
            answers: dict[int, Decision | None] = {}
            for k in sorted(range(len(group)), key=lambda k: group[k].user):  # locks in order
                a = group[k]
                answer = policies.decide(conn, a.user, a.holder, a.gen, a.tool, a.args_digest,
                                         now)
                answers[k] = None if answer is None else Decision(*answer)
            return [answers[k] for k in range(len(group))]
        return self._path.in_groups(asks, lambda ask: ask.user, decide)

    # --- giving back ----------------------------------------------------------------------

    def hand_back(self, runs: list[Run], *, now: int | None = None) -> list[str]:
        """Give back runs whose handlers never started: leases expired at once,
        claims undone (attempts included). A run whose lease is no longer held
        is left alone. The users given back."""
        now = validate.optional_epoch("now", now)
        return self._path.hand_back([(r.user, r.holder, r.gen, r.unfinished > 0)
                                     for r in runs], now)

    def hand_back_orphans(self, holder: str, known: list[Run] = (), *,
                          now: int | None = None) -> list[str]:
        """Give back every unexpired lease `holder` holds other than the runs in
        `known` (runs a lost commit may have taken unseen); the users given back."""
        holder = validate.text("holder", holder)
        now = validate.optional_epoch("now", now)
        return self._path.hand_back_orphans(holder, [run.key for run in known], now)

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
        return scheduling.checked_timer(
            timer.timer_id, timer.due, timer.payload, timer.every, timer.key, cron=timer.cron,
            timezone=timer.timezone, missed=timer.missed, catch_up_limit=timer.catch_up_limit,
            max_payload_bytes=self._settings.max_payload_bytes)

    def _approval_row(self, approval) -> tuple[str, dict]:
        if not isinstance(approval, ApprovalRequest):
            raise errors.InvalidInput("approvals item", approval,
                                      "must be an agent_inbox.ApprovalRequest")
        return scheduling.checked_approval(approval.request_id, approval.expires_in,
                                           approval.action, self._settings.max_payload_bytes)


def _holder_of(runs: list[Run]) -> str:
    holders = {run.holder for run in runs}
    if len(holders) > 1:
        raise errors.InvalidInput("runs", sorted(holders), "must all be one holder's")
    return holders.pop() if holders else "-"


class DirectJournal:
    """A run's step journal without a worker (`Inbox.context`): each read and
    record is a transaction of its own, on the Inbox's pool."""

    def __init__(self, runs: Runs, user: str, event_ids: list[int]):
        self._runs, self._key = runs, (user, tuple(sorted(event_ids)))

    def recorded(self) -> list[RecordedStep]:
        return self._runs.recorded_steps([self._key])[0]

    def record(self, record: StepRecord) -> None:
        if not self._runs.record_steps([record])[0]:
            raise errors.StepRefused(f"step {record.name!r} of user={record.user} "
                                     f"gen={record.gen} refused: the run's lease is lost")

    async def recorded_async(self) -> list[RecordedStep]:
        return await asyncio.to_thread(self.recorded)

    async def record_async(self, record: StepRecord) -> None:
        await asyncio.to_thread(self.record, record)
