"""The programmatic API: `Inbox`, one object per process, owning a connection pool.

Every method checks its arguments before any SQL runs (bad input raises an
`errors.InvalidInput` and stores nothing) and runs as one transaction. Methods on
a run's path (acquire, claim_batch, finish) first lock the user's lease row, so
one user's run-path transactions are serialised across every host. `now=None`
means the database server's clock; an explicit `now` (integer epoch seconds) is
for tests and simulations.
"""

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from dataclasses import dataclass

from agent_inbox import cron as cron_schedule
from agent_inbox import db, errors, metrics, validate
from agent_inbox.records import ClaimPolicy, Event, OutboxMessage, Timer
from agent_inbox.result import ApprovalRequest, Message, Result, TimerRequest
from agent_inbox.schema import EVENT_STATUSES
from agent_inbox.store import approvals, inbox, lease, outbox, retention, timers

DEFAULT_MAX_PAYLOAD_BYTES = 1 << 20
# Timers fired per scheduler transaction; a pass loops until none are due.
SCHEDULER_BATCH = 500
# Events per statement in ingest_many.
INGEST_CHUNK = 1000


@dataclass(frozen=True)
class Run:
    """A user's lease taken by `holder` in generation `gen`, and the events claimed."""

    user: str
    holder: str
    gen: int
    claimed_at: int
    events: list[Event]
    died: int = 0  # events this claim parked as dead (out of attempts)


class Inbox:
    """Durable per-user inboxes, leases, timers, approvals and outboxes."""

    def __init__(self, pool, *, max_attempts: int = 3, lease_ttl: int = 120,
                 outbox_gap: int = 3600, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
                 retry_backoff: int = 5, retry_backoff_cap: int = 300):
        self.policy = ClaimPolicy(
            max_attempts=validate.positive_int("max_attempts", max_attempts),
            backoff_base=validate.epoch("retry_backoff", retry_backoff),
            backoff_cap=validate.epoch("retry_backoff_cap", retry_backoff_cap))
        self.lease_ttl = validate.positive_int("lease_ttl", lease_ttl)
        self.outbox_gap = validate.epoch("outbox_gap", outbox_gap)
        self.max_payload_bytes = validate.positive_int("max_payload_bytes", max_payload_bytes)
        self._pool = pool

    @classmethod
    def connect(cls, url: str, *, pool_size: int = 4, application_name: str = "agent-inbox",
                **options) -> "Inbox":
        """Open a pool to `url` (any libpq connection string or URI). `options`
        are the constructor's: max_attempts=3, lease_ttl=120, outbox_gap=3600,
        max_payload_bytes=1 MiB, retry_backoff=5, retry_backoff_cap=300."""
        validate.text("url", url)
        validate.positive_int("pool_size", pool_size)
        pool = db.open_pool(url, size=pool_size, name=application_name)
        try:
            return cls(pool, **options)
        except BaseException:
            pool.close()
            raise

    @property
    def pool(self):
        """The connection pool, for services' own cross-user scans."""
        return self._pool

    @property
    def max_attempts(self) -> int:
        return self.policy.max_attempts

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> "Inbox":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- inbox ---------------------------------------------------------------

    def ingest(self, user: str, source: str, source_id: str, payload: Any) -> bool:
        """Store an event once. False for a duplicate delivery (nothing stored).

        Call it after the provider's signature check, then acknowledge."""
        user = validate.text("user", user)
        source = validate.text("source", source)
        source_id = validate.text("source_id", source_id)
        encoded = validate.payload("payload", payload, self.max_payload_bytes)
        with db.connection(self._pool) as conn:
            stored = inbox.insert(conn, user, source, source_id, encoded)
        metrics.count_ingested(source, stored)
        return stored

    def ingest_many(self, events: Iterable[tuple[str, str, str, Any]]) -> list[bool]:
        """Store many events (user, source, source_id, payload) in one transaction;
        for each, True if stored, False for a duplicate (of a stored event or of an
        earlier one in the batch). Every event is checked first: one bad event
        raises and nothing is stored."""
        if isinstance(events, (str, bytes)) or not isinstance(events, Iterable):
            raise errors.InvalidInput("events", events, "must be an iterable of 4-tuples")
        rows = []
        for n, item in enumerate(events):
            if not isinstance(item, (tuple, list)) or len(item) != 4:
                raise errors.InvalidInput(f"events[{n}]", item,
                                          "must be (user, source, source_id, payload)")
            user, source, source_id, payload = item
            rows.append((validate.text(f"events[{n}] user", user),
                         validate.text(f"events[{n}] source", source),
                         validate.text(f"events[{n}] source_id", source_id),
                         validate.payload(f"events[{n}] payload", payload, self.max_payload_bytes)))

        def insert_all(conn) -> list[bool]:
            stored: list[bool] = []
            for start in range(0, len(rows), INGEST_CHUNK):
                stored += inbox.insert_many(conn, rows[start:start + INGEST_CHUNK])
            return stored

        stored = db.in_transaction(self._pool, insert_all)
        for (_, source, _, _), was_stored in zip(rows, stored):
            metrics.count_ingested(source, was_stored)
        return stored

    def events(self, user: str, *, status: str | None = None) -> list[Event]:
        """A user's events, ordered by id; for operators and tests."""
        user = validate.text("user", user)
        if status is not None and status not in EVENT_STATUSES:
            raise errors.InvalidInput("status", status, f"must be one of {EVENT_STATUSES}")
        with db.connection(self._pool) as conn:
            return inbox.list_events(conn, user, status)

    # --- lease, claim, finish --------------------------------------------------

    def acquire(self, user: str, holder: str, *, now: int | None = None) -> int | None:
        """Take or renew the user's lease: the generation, or None if another
        holder's lease is still valid. Renewal keeps the generation; any takeover
        of an expired lease, by anyone, increments it."""
        user, holder = validate.text("user", user), validate.text("holder", holder)
        now = validate.optional_epoch("now", now)
        with db.transaction(self._pool) as conn:
            return lease.acquire(conn, user, holder, self.lease_ttl, now)

    def claim_batch(self, user: str, holder: str, gen: int, *, now: int | None = None) -> list[Event]:
        """Claim the work for one run, ordered by id; empty unless this holder
        holds the lease in generation `gen`. Call once per run, after the
        previous run's finish."""
        user, holder = validate.text("user", user), validate.text("holder", holder)
        gen = validate.positive_int("gen", gen)
        now = validate.optional_epoch("now", now)
        with db.connection(self._pool) as conn:
            with db.pipelined_transaction(conn):
                conn.execute(lease.LOCK, {"user": user})
                claimed = inbox.send_claim(conn, user, holder, gen, self.policy, now)
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
        with db.connection(self._pool) as conn:
            with db.pipelined_transaction(conn):
                conn.execute(lease.LOCK, {"user": user})
                verdict = inbox.send_finish(conn, user, holder, gen, ids, messages, error, now)
            return verdict.fetchone()[0]

    # --- runs, for the worker runtime ---------------------------------------------

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
        messages = [self._message(m) for m in result.messages]
        timer_rows = [self._timer_row(t) for t in result.timers]
        approval_rows = [self._approval_row(a) for a in result.approvals]
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

    # --- timers and approvals --------------------------------------------------

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
        row = self._checked_timer(timer_id, due, payload, every, key, cron=cron,
                                  timezone=timezone, missed=missed, catch_up_limit=catch_up_limit)
        with db.connection(self._pool) as conn:
            timers.upsert(conn, user, **row)

    def _checked_timer(self, timer_id, due, payload, every, key, *, cron=None, timezone="UTC",
                       missed="coalesce", catch_up_limit=100) -> dict:
        """add_timer's arguments, checked, as timers.upsert's keyword arguments."""
        timer_id = validate.text("timer_id", timer_id)
        due = validate.epoch("due", due)
        if every is not None:
            every = validate.positive_int("every", every)
        if every is not None and cron is not None:
            raise errors.InvalidTimer("cron", cron, "cannot be combined with every")
        if (every is not None or cron is not None) and key is not None:
            raise errors.InvalidTimer(
                "key", key, "cannot be fixed on a recurring timer (every or cron is set)")
        if key is not None:
            key = validate.event_key("key", key)
        if missed not in ("coalesce", "catch_up"):
            raise errors.InvalidTimer("missed", missed, "must be 'coalesce' or 'catch_up'")
        catch_up_limit = validate.positive_int("catch_up_limit", catch_up_limit)
        if cron is not None:
            due = cron_schedule.parse(cron, timezone).next_after(due - 1)
        encoded = validate.mapping_payload("payload", payload, self.max_payload_bytes)
        return {"timer_id": timer_id, "base": due, "delay": 0, "every": every,
                "payload_json": encoded, "key": key, "cron": cron,
                "timezone": timezone if cron is not None else None, "missed": missed,
                "catch_up_limit": catch_up_limit}

    def _checked_approval(self, request_id, expires_in, action) -> tuple[str, dict]:
        """request_approval's arguments, checked: the request id and the expiry
        timer's upsert arguments (all but its base time)."""
        request_id = validate.text("request_id", request_id)
        expires_in = validate.epoch("expires_in", expires_in)
        encoded = validate.mapping_payload(
            "action", {"approval": request_id, "answer": "expired", "action": action},
            self.max_payload_bytes)
        return request_id, {"delay": expires_in, "every": None, "payload_json": encoded,
                            "key": ("approval", request_id)}

    def timers(self, user: str) -> list[Timer]:
        user = validate.text("user", user)
        with db.connection(self._pool) as conn:
            return timers.list_timers(conn, user)

    def run_scheduler(self, *, now: int | None = None) -> int:
        """Turn every due timer, across all users, into an inbox event; the number
        fired. Safe to run as many copies at once as you like."""
        now = validate.optional_epoch("now", now)
        fired_total = 0
        skipped_total = 0
        with db.connection(self._pool) as conn:
            for fire in (timers.fire_due, timers.fire_due_cron):
                while True:
                    with conn.transaction():
                        fired, skipped = fire(conn, now, SCHEDULER_BATCH)
                    fired_total += fired
                    skipped_total += skipped
                    if fired < SCHEDULER_BATCH:
                        break
        metrics.TIMERS_FIRED.inc(fired_total)
        metrics.OCCURRENCES_SKIPPED.inc(skipped_total)
        return fired_total

    def request_approval(self, user: str, request_id: str, *, expires_in: int, action: Any,
                         now: int | None = None) -> int:
        """Arm the approval's expiry timer; returns the deadline (epoch seconds).
        The answer or the expiry comes back as the event ('approval', request_id)."""
        user = validate.text("user", user)
        request_id, row = self._checked_approval(request_id, expires_in, action)
        now = validate.optional_epoch("now", now)
        with db.connection(self._pool) as conn:
            return timers.upsert(conn, user, approvals.expiry_timer_id(request_id), base=now, **row)

    def answer_approval(self, user: str, request_id: str, answer: str, *,
                        now: int | None = None) -> str:
        """Store an answer unless the deadline has passed; returns the answer that
        stands: 'yes', 'no', 'expired', or 'unknown' for a request never made."""
        user = validate.text("user", user)
        request_id = validate.text("request_id", request_id)
        answer = validate.answer("answer", answer)
        now = validate.optional_epoch("now", now)
        with db.transaction(self._pool) as conn:
            return approvals.answer(conn, user, request_id, answer, now)

    # --- outbox -------------------------------------------------------------

    def dispatch(self, user: str, send: Callable[[str], Any], *, now: int | None = None) -> int:
        """Send the user's held messages as one text, at most once per outbox_gap
        (an urgent message goes at once); the number of messages sent. `send(text)`
        is called at most once, inside the transaction that marks the rows sent:
        if it raises, nothing is marked."""
        if not callable(send):
            raise errors.InvalidInput("send", send, "must be callable")
        return self.dispatch_batch(user, lambda text, key: send(text), now=now)

    def dispatch_batch(self, user: str, deliver: Callable[[str, str], Any], *,
                       at_most_once: bool = False, now: int | None = None) -> int:
        """As `dispatch`, with `deliver(text, key)`: `key` (`<user>:<batch>`) names
        the batch of rows, and a batch resent after a crash keeps its rows and key,
        so a channel can drop the repeat. At-least-once (the default): send, then
        mark sent; a crash in between sends the batch again. At-most-once: mark,
        then send; a crash in between loses the batch."""
        user = validate.text("user", user)
        now = validate.optional_epoch("now", now)
        if not callable(deliver):
            raise errors.InvalidInput("deliver", deliver, "must be callable")
        with db.connection(self._pool) as conn, outbox.user_lock(conn, user) as locked:
            if not locked:
                return 0  # another dispatcher is sending to this user
            with conn.transaction():
                chosen = outbox.choose_batch(conn, user, self.outbox_gap, now)
                if chosen is not None and at_most_once:
                    outbox.mark_sent(conn, user, chosen[0], now)
            if chosen is None:
                return 0
            batch, ids, bodies = chosen
            deliver("\n\n".join(bodies), f"{user}:{batch}")
            if not at_most_once:
                outbox.mark_sent(conn, user, batch, now)
            return len(ids)

    def prune(self, *, older_than: int, dedup_window: int = 7 * 86400, include_dead: bool = False,
              now: int | None = None, progress: Callable[[int, int, int], Any] | None = None,
              users_per_transaction: int = 200) -> tuple[int, int]:
        """Delete finished events older than `older_than` seconds, except that an
        event inside `dedup_window` keeps its row (and key: a redelivery is still a
        duplicate) and only loses its payload. Dead events too with include_dead.
        Returns (deleted, compacted); `progress(users, deleted, compacted)` is
        called after each chunk of users."""
        older_than = validate.epoch("older_than", older_than)
        dedup_window = validate.epoch("dedup_window", dedup_window)
        now = validate.optional_epoch("now", now)
        statuses = ["done", "dead"] if include_dead else ["done"]
        deleted = compacted = users_seen = 0
        last_user = ""
        with db.connection(self._pool) as conn:
            while True:
                with conn.transaction():
                    users = retention.users_after(conn, last_user, users_per_transaction)
                    if not users:
                        return deleted, compacted
                    gone, emptied = retention.prune_users(
                        conn, users, older_than=older_than, window=dedup_window,
                        statuses=statuses, now=now)
                deleted, compacted = deleted + gone, compacted + emptied
                users_seen, last_user = users_seen + len(users), users[-1]
                if progress:
                    progress(users_seen, deleted, compacted)

    def outbox(self, user: str) -> list[OutboxMessage]:
        user = validate.text("user", user)
        with db.connection(self._pool) as conn:
            return outbox.list_messages(conn, user)
