"""The run-level calls of the worker runtime: take work, renew, release, and the
fenced finish of everything a run produced.

Invariant 3: a run's outcome, messages, timers and approval requests commit in
one transaction whose first statement locks the user's lease row and whose
finish statement checks holder, generation, expiry and the events' claim, or
nothing commits. A worker pays one commit per run: the finish and the next take
share a transaction, sent as one pipeline when the result has no timers or
approvals.
"""

from dataclasses import dataclass

from agent_inbox import db, errors, validate
from agent_inbox.records import Event
from agent_inbox.result import ApprovalRequest, Message, Result, TimerRequest
from agent_inbox.store import approvals, inbox, lease, timers


@dataclass(frozen=True)
class Run:
    """A user's lease taken by `holder` in generation `gen`, and the events claimed."""

    user: str
    holder: str
    gen: int
    claimed_at: int
    events: list[Event]
    died: int = 0  # events this claim parked as dead (out of attempts)


class Runs:
    """Mixed into `agent_inbox.Inbox` (which owns `_pool`, `policy`, `lease_ttl`)."""

    def take_work(self, holder: str, *, now: int | None = None) -> Run | None:
        """Find the user whose oldest claimable event has waited longest among
        users whose lease is free or expired, take the lease over and claim, in
        one statement; None if there is no such user. The run may hold no events
        (only exhausted ones were due, now parked dead): finish it all the same."""
        holder = validate.text("holder", holder)
        now = validate.optional_epoch("now", now)
        with db.connection(self._pool) as conn:
            return self._as_run(holder, inbox.take_work(conn, holder, self.lease_ttl, self.policy, now))

    def renew(self, user: str, holder: str, gen: int, *, now: int | None = None) -> int | None:
        """Extend a held lease by lease_ttl; its new expiry, or None if it was lost."""
        user, holder = validate.text("user", user), validate.text("holder", holder)
        gen = validate.positive_int("gen", gen)
        now = validate.optional_epoch("now", now)
        with db.transaction(self._pool) as conn:
            lease.lock(conn, user)
            return lease.renew(conn, user, holder, gen, self.lease_ttl, now)

    def release(self, user: str, holder: str, gen: int, *, now: int | None = None) -> bool:
        """Expire a held lease at once (gen kept, so it still fences this holder)."""
        user, holder = validate.text("user", user), validate.text("holder", holder)
        gen = validate.positive_int("gen", gen)
        now = validate.optional_epoch("now", now)
        with db.transaction(self._pool) as conn:
            lease.lock(conn, user)
            return lease.release(conn, user, holder, gen, now)

    def finish_run(self, run: Run, result: Result, *, release: bool = True,
                   now: int | None = None) -> bool:
        """Commit everything a run produced (its events' outcome, messages, timers,
        approval requests) in one fenced transaction, and by default release the
        lease in the same commit. False, with nothing written, if the fence refuses."""
        accepted, _ = self._finish_run(run, result, release=release, now=now, next_holder=None)
        return accepted

    def finish_and_take(self, run: Run, result: Result, *,
                        now: int | None = None) -> tuple[bool, Run | None]:
        """`finish_run` (releasing the lease) and then `take_work` for the same
        holder, in one transaction and, when the result has no timers or
        approvals, one round trip: a worker pays one commit per run."""
        return self._finish_run(run, result, release=True, now=now, next_holder=run.holder)

    def _finish_run(self, run: Run, result: Result, *, release: bool, now: int | None,
                    next_holder: str | None) -> tuple[bool, Run | None]:
        if not isinstance(result, Result):
            raise errors.InvalidInput("result", result, "must be an agent_inbox.Result")
        now = validate.optional_epoch("now", now)
        error = None if result.error is None else validate.text("result.error", result.error)
        messages = [self._message(m) for m in validate.sequence("result.messages", result.messages)]
        timer_rows = [self._timer_row(t) for t in validate.sequence("result.timers", result.timers)]
        approval_rows = [self._approval_row(a)
                         for a in validate.sequence("result.approvals", result.approvals)]
        finish = (run.user, run.holder, run.gen, [e.id for e in run.events], messages, error, now)
        taken = None
        with db.connection(self._pool) as conn:
            if error is None and (timer_rows or approval_rows):
                # Timers and approvals are written only once the fence has said yes.
                with conn.transaction():
                    lease.lock(conn, run.user)
                    accepted = inbox.finish(conn, *finish, release=release)
                    if accepted:
                        for row in timer_rows:
                            timers.upsert(conn, run.user, **row)
                        for request_id, row in approval_rows:
                            timers.upsert(conn, run.user, approvals.expiry_timer_id(request_id),
                                          base=now, **row)
                    if next_holder:
                        taken = inbox.take_work(conn, next_holder, self.lease_ttl, self.policy, now)
            else:
                # Lock, fenced finish, next claim and commit, sent as one pipeline.
                with db.pipelined_transaction(conn):
                    conn.execute(lease.LOCK, {"user": run.user})
                    verdict = inbox.send_finish(conn, *finish, release=release)
                    pending = (inbox.send_take_work(conn, next_holder, self.lease_ttl, self.policy,
                                                    now) if next_holder else None)
                accepted = verdict.fetchone()[0]
                taken = inbox.read_taken(pending) if pending else None
        return accepted, self._as_run(next_holder, taken)

    @staticmethod
    def _as_run(holder: str | None, taken) -> Run | None:
        if taken is None:
            return None
        user, gen, claimed_at, died, events = taken
        return Run(user, holder, gen, claimed_at, events, died)

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
