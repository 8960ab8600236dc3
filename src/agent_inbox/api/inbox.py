"""The programmatic API: `Inbox`, one object per process, owning a connection pool.

`Inbox` is a facade: its methods are the user's calls (ingest, read, repair,
timers, approvals, permissions, a run without a worker), and it holds typed
objects for the services' protocols: `runs` (the worker's: take, renew,
release, finish, steps, permits), `delivery` (the dispatcher's) and
`scheduling` (the scheduler's), each sharing only the Inbox's pool, run path
(backend/path.py) and `settings` (api/settings.py).

Every method checks its arguments before any SQL runs (bad input raises an
`errors.InvalidInput` and stores nothing) and runs as one transaction. Methods on
a run's path (acquire, claim_batch, finish) first lock the user's lease row, so
one user's run-path transactions are serialised across every host. `now=None`
means the database server's clock; an explicit `now` (integer epoch seconds) is
for tests and simulations.
"""

import asyncio
import functools
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from agent_inbox import db, errors, validate
from agent_inbox.agent.handler import Context
from agent_inbox.agent.permits import (MAX_TOOL_BYTES, Decision, PermitAsk, RunPermits,
                                       check_answer)
from agent_inbox.agent.result import Result
from agent_inbox.agent.steps import RunSteps
from agent_inbox.api.calls import Call, Calls
from agent_inbox.api.delivery import Delivery, channel_of
from agent_inbox.api.limits import Limiter
from agent_inbox.api.runs import DirectJournal, Run, Runs
from agent_inbox.api.scheduling import Scheduling, checked_approval, checked_timer
from agent_inbox.api.settings import Settings
from agent_inbox.backend import path as run_path
from agent_inbox.backend.citus import layout as citus
from agent_inbox.backend.citus import nodes as routing
from agent_inbox.records import Approval, Event, OutboxMessage, RecordedStep, Timer
from agent_inbox.store import (admin, approvals, compaction, inbox, lease, outbox, pauses, policies,
                               retention, steps, timers)
from agent_inbox.store import memory as memories
from agent_inbox.store.keys import user_key

__all__ = ["Inbox", "Run"]

T = TypeVar("T")


class Inbox:
    """Durable per-user inboxes, leases, timers, approvals and outboxes: the
    user's calls, and the services' protocols as `runs`, `delivery` and
    `scheduling`."""

    def __init__(self, pool, *, path: run_path.RunPath | None = None, **options):
        """An Inbox on `pool`. `path` is how its run path's transactions are
        cut (backend/path.py); by default asked of the database: per bucket on
        a Citus coordinator whose events table is distributed, else set-based.
        `options` are `Settings.checked`'s (see `connect`)."""
        self.settings = Settings.checked(**options)
        self._pool = pool
        self._path = path if path is not None else run_path.for_pool(pool)
        self._calls = Calls(self._path, self.settings)
        self.runs = Runs(pool, self._path, self.settings)
        self.delivery = Delivery(pool, self._path, self.settings)
        self.scheduling = Scheduling(pool, self._path)
        self._limiter: Limiter | None = None
        self._limiter_guard = threading.Lock()
        self._citus_nodes: str | None = None  # connect's choice, "auto" resolved

    @classmethod
    def connect(cls, url: str, *, pool_size: int = 4, application_name: str = "agent-inbox",
                pooler: str = "none",
                statement_timeout: float | None = db.DEFAULT_STATEMENT_TIMEOUT,
                connect_timeout: float | None = db.DEFAULT_CONNECT_TIMEOUT,
                citus_nodes: str = "auto", **options) -> "Inbox":
        """Open a pool to `url` (any libpq connection string or URI). With
        `pooler="transaction"`, `url` may be a transaction pooler's (PgBouncer in
        `pool_mode = transaction`): no statement is prepared on the server.
        `statement_timeout` (seconds, 5 by default; None: no bound) bounds every
        wait for the database's answer, `connect_timeout` (5) a connection's
        opening and, on Citus, the coordinator's to a worker node
        (citus.node_connection_timeout): see db.py. An operator's long work
        (prune) lifts the statement bound for itself. On Citus, `citus_nodes=
        "direct"` sends the run path's take and finish calls straight to the
        worker node that holds each bucket, at the address the coordinator has
        for it, on up to `pool_size` connections per node opened when needed
        (routing.NodePools; needs a direct `url`, no pooler), "coordinator"
        through the coordinator; "auto" (the default) is "direct" when every
        node answers from here as the Inbox opens, else "coordinator", and logs
        which and why (routing.choose; `citus_nodes` on the Inbox says it).
        `options` are the constructor's: max_attempts=3, lease_ttl=120,
        outbox_gap=3600, max_payload_bytes=1 MiB, max_memory_bytes=256 KiB, retry_backoff=5,
        retry_backoff_cap=300, max_batch=100, send_timeout=120, max_send_attempts=10,
        send_backoff=5, send_backoff_cap=300."""
        validate.text("url", url)
        validate.positive_int("pool_size", pool_size)
        if citus_nodes not in routing.NODES:
            raise errors.InvalidInput("citus_nodes", citus_nodes,
                                      f"must be one of {', '.join(routing.NODES)}")
        if citus_nodes == "direct" and pooler != "none":
            raise errors.InvalidInput("citus_nodes", citus_nodes,
                                      "needs a direct URL of the coordinator, not a pooler's: "
                                      "the nodes' addresses are the coordinator's own")
        detector = citus.Detector(node_connection_timeout=connect_timeout
                                  if pooler == "none" else None)
        pool = db.open_pool(url, size=pool_size, name=application_name, pooler=pooler,
                            configure=detector, statement_timeout=statement_timeout,
                            connect_timeout=connect_timeout)
        connect_node = functools.partial(
            db.connect, name=application_name,
            configure=citus.Detector(node_connection_timeout=connect_timeout),
            statement_timeout=statement_timeout, connect_timeout=connect_timeout)
        try:
            distributed = detector.distributed
            if distributed is None:  # the pool's first connection is not made yet
                with pool.connection() as conn:
                    distributed = citus.is_distributed(conn)
            if not distributed:
                citus_nodes = "none"
            elif citus_nodes == "auto":
                with pool.connection() as conn:
                    citus_nodes = routing.choose(conn, url, pooler, connect_node)
            path = run_path.for_pool(pool, distributed=distributed,
                                     connect_node=connect_node if citus_nodes == "direct"
                                     else None)
            inbox = cls(pool, path=path, **options)
            inbox._citus_nodes = citus_nodes
            return inbox
        except BaseException:
            pool.close()
            raise

    @property
    def pool(self):
        """The connection pool, for services' own cross-user scans."""
        return self._pool

    @property
    def citus_nodes(self) -> str:
        """Where the run path's take and finish calls go: "direct" or
        "coordinator" on Citus (connect's `citus_nodes`, "auto" resolved),
        "none" on plain PostgreSQL."""
        if self._citus_nodes is not None:
            return self._citus_nodes
        return "coordinator" if self._path.distributed else "none"

    @property
    def citus(self) -> bool:
        """Whether the database is a Citus coordinator (a distributed layout)."""
        return self._path.distributed

    @property
    def limiter(self) -> Limiter:
        """This Inbox's limiter (api/limits.py): one per process serves every
        run's `ctx.limit`; made on first use, closed with the Inbox."""
        with self._limiter_guard:
            if self._limiter is None:
                self._limiter = Limiter(self._pool)
            return self._limiter

    def compact(self, **options) -> list[compaction.Compaction] | None:
        """Leave the dead row versions of `wakes` (moved to a clean ring:
        store/wake_rings.py) and `leases` (rewritten) behind where they call
        for it (store/compaction.py: what, when, and why no row is lost or
        changed); what each look came to, or None on Citus, where it is not
        done. Workers call it every second."""
        return self._path.compact(**options)

    @property
    def max_attempts(self) -> int:
        return self.settings.claim.max_attempts

    def close(self) -> None:
        with self._limiter_guard:
            limiter, self._limiter = self._limiter, None
        if limiter is not None:
            limiter.close()
        self._path.close()
        self._pool.close()

    def __enter__(self) -> "Inbox":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- inbox ---------------------------------------------------------------

    def _run(self, call: Call[T], connection: Any = None) -> T:
        """Drive `call` (api/calls.py): in the caller's open transaction on
        `connection`, else on a pooled connection, in a transaction of its own
        (again from the start after a deadlock) if it needs one."""
        if connection is not None:
            with db.callers_transaction(connection) as conn:
                result = db.run(conn, call.queries())
        elif call.transaction:
            result = db.in_transaction(self._pool, lambda conn: db.run(conn, call.queries()))
        else:
            with db.connection(self._pool) as conn:
                result = db.run(conn, call.queries())
        return call.done(result)

    def ingest(self, user: str, source: str, source_id: str, payload: Any, *,
               kind: str | None = None, traceparent: str | None = None,
               connection: Any = None) -> bool:
        """Store an event once. False for a duplicate delivery (nothing stored).
        `kind` is what the provider calls the event (GitHub's "push"), if any.
        `traceparent` is the W3C trace context it came with (its run's span is
        a child of it; one that is malformed is ignored, never an error); by
        default the current OpenTelemetry span's, if any (tracing.py).

        With `connection` (a psycopg Connection, a SQLAlchemy Connection or ORM
        Session on postgresql+psycopg://), the event, its lease row and its
        wake are written in the caller's open transaction and exist only if it
        commits (the workers are notified at that commit); anything else is
        InvalidInput, nothing stored. docs/from-your-application.md says what
        the caller's isolation level means for a duplicate.

        Call it after the provider's signature check, then acknowledge."""
        return self._run(self._calls.ingest(user, source, source_id, payload, kind=kind,
                                            traceparent=traceparent), connection)

    def ingest_many(self, events: Iterable[tuple], *, connection: Any = None) -> list[bool]:
        """Store many events (user, source, source_id, payload[, kind[,
        traceparent]]) in one transaction; for each, True if stored, False for a
        duplicate (of a stored event or of an earlier one in the batch). Every
        event is checked first: one bad event raises and nothing is stored (a
        malformed traceparent is ignored, as in `ingest`). With `connection`,
        in the caller's open transaction, as `ingest` says."""
        return self._run(self._calls.ingest_many(events), connection)

    def events(self, user: str, *, status: str | None = None) -> list[Event]:
        """A user's events, ordered by id; for operators and tests."""
        return self._run(self._calls.events(user, status=status))

    def memory(self, user: str) -> Any:
        """The user's memory document (None if it has none)."""
        return self._run(self._calls.memory(user))

    def approvals(self, user: str, *, limit: int = 100) -> list[Approval]:
        """The user's approval requests (records.Approval: the answer that
        stands, or None while it waits), latest deadline first, at most `limit`."""
        return self._run(self._calls.approvals(user, limit=limit))

    def set_memory(self, user: str, doc: Any, *, actor: str, now: int | None = None) -> None:
        """Replace the user's memory as an operator (None deletes it), recorded
        in operator_actions with the document it replaced. Refused with
        UserBusy while a run holds the user's lease (its finish would replace
        the change); nothing is changed then."""
        user, actor = validate.text("user", user), validate.text("actor", actor)
        encoded = None if doc is None else validate.payload("memory", doc,
                                                            self.settings.max_memory_bytes)
        now = validate.optional_epoch("now", now)
        with db.transaction(self._pool) as conn:
            held = conn.execute(memories.OPERATOR_LOCK, user_key(user, now=now)).fetchone()
            if held is not None and held[2] >= 0:
                holder, gen, expires_in = held
                raise errors.UserBusy(
                    f"user {user!r} has a run in flight (holder {holder}, generation {gen}, "
                    f"lease expires in {expires_in} s): its finish would replace the memory; "
                    "try again once it has ended")
            previous = db.run(conn, memories.get(user))
            memories.replace(conn, user, encoded, f"operator:{actor}", None, now)
            admin.record_memory_change(conn, user, actor, previous and previous["doc"], doc,
                                       now)

    # --- stopping an agent (store/pauses.py, docs/operating/stopping.md) -------

    def pause(self, user: str, *, actor: str, reason: str | None = None, cancel: bool = False,
              now: int | None = None) -> dict:
        """Pause `user`: its events are still stored (dedup as usual), its
        timers still fire and its approvals can still be answered, but no run
        starts and its outbox messages are held until `resume` (a batch
        already handed to the channel is not recalled). A run in flight goes
        on to its end, unless `cancel`: then its lease is fenced off (nothing
        it would commit commits), its events go back to pending with the
        attempt undone and its worker stops it within seconds. Recorded in
        operator_actions. {"user", "paused_at", "reason", "already",
        "cancelled": {"gen", "events"} or None}. InvalidInput for an unknown
        user (one with no events), nothing changed."""
        return self._run(self._calls.pause(user, actor=actor, reason=reason, cancel=cancel,
                                           now=now))

    def resume(self, user: str, *, actor: str, now: int | None = None) -> dict:
        """Resume a paused user: its events are taken again and its held
        messages sent, in order. {"user", "resumed"}: False if it was not paused."""
        return self._run(self._calls.resume(user, actor=actor, now=now))

    def cancel(self, user: str, *, actor: str, reason: str | None = None,
               now: int | None = None) -> dict:
        """Cancel `user`'s run in flight without pausing it (see `pause`):
        its events are taken again by the next take. {"user", "cancelled"}:
        None if no run held the lease."""
        return self._run(self._calls.cancel(user, actor=actor, reason=reason, now=now))

    def pause_fleet(self, *, actor: str, reason: str | None = None, cancel: bool = False,
                    now: int | None = None) -> dict:
        """The emergency brake: no take anywhere starts a run and no
        dispatcher sends, from the commit on (every take reads the pause),
        until `resume_fleet`. Runs in flight end, or with `cancel` are all
        cancelled (each as `cancel` does), in store/pauses.py's
        CANCEL_PASSES looks after the pause's commit.
        {"paused_at", "actor", "reason", "already", "cancelled": [users]}."""
        cancel = validate.boolean("cancel", cancel)
        state = self._run(self._calls.pause_fleet(actor=actor, reason=reason, now=now))
        cancelled: list[str] = []
        for _ in range(pauses.CANCEL_PASSES if cancel else 0):
            cancelled += self._run(self._calls.cancel_held(actor=actor, reason=reason, now=now))
        return {**state, "cancelled": cancelled}

    def resume_fleet(self, *, actor: str, now: int | None = None) -> dict:
        """Lift the fleet's pause. {"resumed"}: False if it was not paused."""
        return self._run(self._calls.resume_fleet(actor=actor, now=now))

    def pauses(self, *, limit: int = 100) -> dict:
        """{"fleet": {"paused_at", "actor", "reason"} or None, "users": [{"user",
        "paused_at", "reason"}] longest paused first (at most `limit`), "users_total"}."""
        return self._run(self._calls.pauses(limit=limit))

    # --- durable steps, operators' view ---------------------------------------

    def steps(self, user: str) -> list[RecordedStep]:
        """A user's recorded durable steps (of runs in flight or that never
        finished successfully), by event set and position; for operators."""
        user = validate.text("user", user)
        with db.connection(self._pool) as conn:
            return steps.list_steps(conn, user)

    # --- operators' repairs ---------------------------------------------------

    def repair_dead(self, pairs: list[tuple[str, int]], *, requeue: bool, actor: str,
                    now: int | None = None) -> list[dict]:
        """Requeue (attempts 0, claimable now, the workers woken) or discard
        (row and key deleted) the dead events among (user, id) `pairs`, in one
        transaction, each recorded in operator_actions, and their durable steps
        deleted; the rows repaired, as they were. Events no longer dead are left
        alone."""
        checked = []
        for n, pair in enumerate(validate.sequence("pairs", pairs)):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise errors.InvalidInput(f"pairs[{n}]", pair, "must be a (user, event id) pair")
            checked.append((validate.text(f"pairs[{n}] user", pair[0]),
                            validate.positive_int(f"pairs[{n}] id", pair[1])))
        actor = validate.text("actor", actor)
        now = validate.optional_epoch("now", now)
        with db.transaction(self._pool) as conn:
            return self._path.repair_dead(conn, checked, requeue, actor, now)

    def repair_failed_batches(self, batches: list[int], *, retry: bool, actor: str,
                              now: int | None = None) -> list[dict]:
        """Retry (due at once) or discard the failed outbox batches among
        `batches`, in one transaction, recorded in operator_actions; the
        batches repaired, as they were."""
        batches = validate.ids("batches", batches)
        actor = validate.text("actor", actor)
        now = validate.optional_epoch("now", now)
        with db.transaction(self._pool) as conn:
            return outbox.repair_failed(conn, batches, retry=retry, actor=actor, now=now,
                                        groups=self._path.groups)

    # --- lease, claim, finish --------------------------------------------------

    def acquire(self, user: str, holder: str, *, now: int | None = None) -> int | None:
        """Take or renew the user's lease: the generation, or None if another
        holder's lease is still valid. Renewal keeps the generation; any takeover
        of an expired lease, by anyone, increments it."""
        user, holder = validate.text("user", user), validate.text("holder", holder)
        now = validate.optional_epoch("now", now)
        with db.transaction(self._pool) as conn:
            return lease.acquire(conn, user, holder, self.settings.lease_ttl, now)

    def claim_batch(self, user: str, holder: str, gen: int, *, now: int | None = None) -> list[Event]:
        """Claim the work for one run (at most max_batch fresh events), ordered
        by id; empty unless this holder holds the lease in generation `gen`,
        and while the user or the fleet is paused. Call once per run, after
        the previous run's finish."""
        user, holder = validate.text("user", user), validate.text("holder", holder)
        gen = validate.positive_int("gen", gen)
        now = validate.optional_epoch("now", now)
        with db.connection(self._pool) as conn:
            with db.pipelined_transaction(conn):
                conn.execute(lease.LOCK, user_key(user))
                claimed = inbox.send_claim(conn, user, holder, gen, self.settings.claim, now)
            return claimed.fetchall()

    def finish(self, user: str, holder: str, gen: int, ids: Iterable[int], *,
               messages: Iterable[str] = (), error: str | None = None,
               now: int | None = None) -> bool:
        """Commit a run's outcome and queue its messages, in one fenced transaction.

        True if committed. False, with nothing written, unless this holder still
        holds the lease in generation `gen`, unexpired, and every event in `ids`
        is still running under `gen`. With `error`, the events go back to pending
        (their attempts already counted) and no message is queued."""
        user, holder = validate.text("user", user), validate.text("holder", holder)
        gen = validate.positive_int("gen", gen)
        ids = validate.ids("ids", ids)
        messages = [(body, False) for body in validate.messages("messages", messages)]
        if error is not None:
            error = validate.text("error", error)
        now = validate.optional_epoch("now", now)
        return self._path.finish_one(inbox.Finish(user, holder, gen, ids, messages, error), now)

    # --- a run without a worker -------------------------------------------------

    def take_work(self, holder: str, *, now: int | None = None) -> Run | None:
        """Find the user whose oldest claimable event has waited longest among
        users whose lease is free or expired, take the lease over and claim, in
        one statement; None if there is no such user. The run may hold no events
        (only exhausted ones were due, now parked dead): finish it all the same.
        (The worker takes many at once: `runs.take_runs`.)"""
        runs = self.runs.take_runs(holder, users=1, now=now)
        return runs[0] if runs else None

    def context(self, run: Run, *, max_step_bytes: int | None = None) -> Context:
        """A handler's context for `run`, taken without a worker (take_work,
        claim_batch): its memory as the claim read it; its durable steps and
        permit calls through this Inbox, one transaction each; its limits
        (`ctx.limit`) through this Inbox's limiter."""
        limit = self.settings.max_payload_bytes if max_step_bytes is None else max_step_bytes
        event_ids = [e.id for e in run.events]
        ctx = Context(run.user, run.holder, run.gen, memory=run.memory,
                      attempt=max((e.attempts for e in run.events), default=1),
                      limiter=self.limiter)
        ctx.permits = self._direct_permits(run.user, run.holder, run.gen)
        ctx.steps = RunSteps(run.user, run.holder, run.gen, event_ids,
                             may_resume=any(e.ran_before for e in run.events),
                             journal=DirectJournal(self.runs, run.user, event_ids),
                             max_result_bytes=limit)
        return ctx

    def _direct_permits(self, user: str, holder: str, gen: int) -> RunPermits:
        """`ctx.permit` through this Inbox: one transaction per call."""
        def ask(question: PermitAsk) -> Decision | None:
            return self.runs.decide_permits([question])[0]

        async def ask_async(question: PermitAsk) -> Decision | None:
            return await asyncio.to_thread(ask, question)

        return RunPermits(user, holder, gen, ask, ask_async)

    def finish_run(self, run: Run, result: Result, *, release: bool = True,
                   now: int | None = None) -> bool:
        """Commit everything a run produced (its events' outcome, messages, timers,
        approval requests) in one fenced transaction, and by default release the
        lease in the same commit. False, with nothing written, if the fence refuses.
        (The worker commits many at once: `runs.finish_runs`.)"""
        [accepted] = self.runs.finish_runs([self.runs.outcome(run, result)], release=release,
                                           now=now)
        return accepted

    def prune(self, *, older_than: int, dedup_window: int = 7 * 86400, include_dead: bool = False,
              now: int | None = None, progress: Callable[[int, int, int], Any] | None = None,
              users_per_transaction: int = 200) -> tuple[int, int]:
        """Delete finished events older than `older_than` seconds, except that an
        event inside `dedup_window` keeps its row (and key: a redelivery is still a
        duplicate) and only loses its payload. Dead events too with include_dead.
        Durable steps recorded before `older_than` go too (a successful finish
        deletes its own: these are of runs that never finished). Returns (deleted, compacted); `progress(users, deleted, compacted)` is
        called after each chunk of users."""
        older_than = validate.epoch("older_than", older_than)
        dedup_window = validate.epoch("dedup_window", dedup_window)
        now = validate.optional_epoch("now", now)
        statuses = ["done", "dead"] if include_dead else ["done"]
        deleted = compacted = users_seen = 0
        last_user = ""
        with db.connection(self._pool) as conn:
            while True:
                with conn.transaction(), db.unbounded(conn):
                    users = retention.users_after(conn, last_user, users_per_transaction)
                    if not users:
                        return deleted, compacted
                    gone = emptied = 0
                    for group in self._path.groups(users, lambda user: user):
                        pruned = retention.prune_users(
                            conn, group, older_than=older_than, window=dedup_window,
                            statuses=statuses, now=now)
                        gone, emptied = gone + pruned[0], emptied + pruned[1]
                deleted, compacted = deleted + gone, compacted + emptied
                users_seen, last_user = users_seen + len(users), users[-1]
                if progress:
                    progress(users_seen, deleted, compacted)


    # --- timers and approvals (api/scheduling.py, store/timers.py, store/approvals.py) ---

    def add_timer(self, user: str, timer_id: str, due: int, payload: Mapping[str, Any], *,
                  every: int | None = None, key: tuple[str, str] | None = None,
                  cron: str | None = None, timezone: str = "UTC", missed: str = "coalesce",
                  catch_up_limit: int = 100) -> None:
        """Create or replace a timer. Recurring with `every` seconds or a `cron`
        expression (evaluated in `timezone`; the first occurrence is the first at
        or after `due`), else one-off; a one-off may fix its event key (source,
        source_id), a recurring one may not (each occurrence needs its own key).
        Missed occurrences of a recurring timer: missed="coalesce" (one event for
        the latest, with `skipped`) or "catch_up" (one event each, at most
        catch_up_limit per firing, `overflow` counting the ones left out)."""
        user = validate.text("user", user)
        row = checked_timer(timer_id, due, payload, every, key, cron=cron, timezone=timezone,
                            missed=missed, catch_up_limit=catch_up_limit,
                            max_payload_bytes=self.settings.max_payload_bytes)
        with db.connection(self._pool) as conn:
            timers.upsert(conn, user, **row)

    def timers(self, user: str) -> list[Timer]:
        user = validate.text("user", user)
        with db.connection(self._pool) as conn:
            return timers.list_timers(conn, user)

    def request_approval(self, user: str, request_id: str, *, expires_in: int, action: Any,
                         now: int | None = None) -> int:
        """Arm the approval's expiry timer; returns the deadline (epoch seconds).
        The answer or the expiry comes back as the event ('approval', request_id)."""
        user = validate.text("user", user)
        request_id, row = checked_approval(request_id, expires_in, action,
                                           self.settings.max_payload_bytes)
        now = validate.optional_epoch("now", now)
        with db.connection(self._pool) as conn:
            return timers.upsert(conn, user, approvals.expiry_timer_id(request_id), base=now, **row)

    def answer_approval(self, user: str, request_id: str, answer: str, *,
                        now: int | None = None) -> str:
        """Store an answer unless the deadline has passed; returns the answer that
        stands: 'yes', 'no', 'expired', or 'unknown' for a request never made."""
        return self._run(self._calls.answer_approval(user, request_id, answer, now=now))

    def run_scheduler(self, *, now: int | None = None) -> int:
        """Turn every due timer, across all users, into an inbox event; the number
        fired. A timer whose firing raises is parked with its error (logged,
        counted, shown by `timers(user)`) and the others fire. Safe to run as
        many copies at once as you like. (The scheduler service's call.)"""
        return self.scheduling.fire_due(now=now)

    # --- the outbox (api/delivery.py, store/outbox.py) ---------------------------

    def dispatch(self, user: str, send: Callable[..., Any], *, now: int | None = None) -> int:
        """Send the user's held messages as one text, at most once per outbox_gap
        (an urgent message goes at once); the number of messages sent. `send` is
        a channel, as the dispatcher service takes: `send(user, text, key)`
        (see `dispatch_batch` for `key`); a one-argument `send(text)`, this
        call's older shape, is still called with the text alone (see
        `channel_of`). It is called at most once, with no database lock or
        connection held; if it raises, nothing is marked sent, the failure is
        recorded (the batch goes again, same rows and key, on the next
        dispatch), and the exception propagates."""
        channel = channel_of(send)
        return self.delivery.dispatch_batch(user, lambda text, key: channel(user, text, key), now=now)

    def outbox(self, user: str) -> list[OutboxMessage]:
        """A user's outbox messages, in order."""
        user = validate.text("user", user)
        with db.connection(self._pool) as conn:
            return outbox.list_messages(conn, user)

    # --- permissions (agent/permits.py, store/policies.py) -------------------------

    def set_policy(self, tool: str, answer: str, *, user: str | None = None,
                   ask_expires_in: int = policies.DEFAULT_ASK_EXPIRES_IN, actor: str,
                   now: int | None = None) -> None:
        """Set the rule for `tool` ('*': every tool) of `user`, or the default
        rule (user None): 'allow', 'deny' or 'ask' (an approval request that
        waits `ask_expires_in` seconds). Audited; applies to every call decided
        after it commits."""
        tool = validate.text("tool", tool, MAX_TOOL_BYTES)
        answer = check_answer(answer)
        user = None if user is None else validate.text("user", user)
        ask_expires_in = validate.positive_int("ask_expires_in", ask_expires_in)
        actor = validate.text("actor", actor)
        now = validate.optional_epoch("now", now)
        with db.transaction(self._pool) as conn:
            policies.change(conn, user, tool, answer, ask_expires_in, actor, now)

    def clear_policy(self, tool: str, *, user: str | None = None, actor: str,
                     now: int | None = None) -> bool:
        """Remove a rule (audited); False if there was none."""
        tool = validate.text("tool", tool, MAX_TOOL_BYTES)
        user = None if user is None else validate.text("user", user)
        actor = validate.text("actor", actor)
        now = validate.optional_epoch("now", now)
        with db.transaction(self._pool) as conn:
            return policies.change(conn, user, tool, None, policies.DEFAULT_ASK_EXPIRES_IN,
                                   actor, now)

    def declare_policies(self, rules: dict[str, str], *, actor: str = "app") -> list[str]:
        """An app's default rules (tool -> answer), each stored only where the
        database has no default rule for that tool yet (an operator's wins);
        the tools stored."""
        checked = {validate.text("tool", tool, MAX_TOOL_BYTES): check_answer(answer)
                   for tool, answer in rules.items()}
        stored = []
        with db.transaction(self._pool) as conn:
            for tool, answer in sorted(checked.items()):
                if conn.execute(policies.DECLARE_DEFAULT, {
                        "tool": tool, "answer": answer, "actor": actor, "now": None,
                        "ask_expires_in": policies.DEFAULT_ASK_EXPIRES_IN}).fetchone():
                    stored.append(tool)
        return stored

    def policies(self, user: str | None = None) -> list[dict]:
        """A user's rules (None: the default rules), by tool."""
        user = None if user is None else validate.text("user", user)
        with db.connection(self._pool) as conn:
            return policies.rules(conn, user)

    def permit_decisions(self, user: str, *, limit: int = 100) -> list[dict]:
        """The answers given to a user's runs, newest first."""
        user = validate.text("user", user)
        limit = validate.positive_int("limit", limit)
        with db.connection(self._pool) as conn:
            return policies.decisions(conn, user, limit)
