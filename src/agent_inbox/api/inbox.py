"""The programmatic API: `Inbox`, one object per process, owning a connection pool.

Every method checks its arguments before any SQL runs (bad input raises an
`errors.InvalidInput` and stores nothing) and runs as one transaction. Methods on
a run's path (acquire, claim_batch, finish) first lock the user's lease row, so
one user's run-path transactions are serialised across every host. `now=None`
means the database server's clock; an explicit `now` (integer epoch seconds) is
for tests and simulations.
"""

import functools
from collections.abc import Callable, Iterable
from typing import Any

from agent_inbox.backend.citus import layout as citus
from agent_inbox.backend.citus import nodes as routing
from agent_inbox import db, errors, metrics, tracing, validate
from agent_inbox.backend import path as run_path
from agent_inbox.api.delivery import Delivery
from agent_inbox.api.permissions import Permissions
from agent_inbox.records import EVENT_STATUSES, ClaimPolicy, Event, SendPolicy
from agent_inbox.api.runs import Run, Runs
from agent_inbox.api.scheduling import Scheduling
from agent_inbox.store import admin, compaction, inbox, lease, outbox, retention, steps
from agent_inbox.store import memory as memories
from agent_inbox.records import RecordedStep
from agent_inbox.store.keys import user_key

__all__ = ["Inbox", "Run"]

DEFAULT_MAX_PAYLOAD_BYTES = 1 << 20
# A user's memory is read with every claim: kept small by default.
DEFAULT_MAX_MEMORY_BYTES = 256 << 10
# Events per statement in ingest_many.
INGEST_CHUNK = 1000


class Inbox(Runs, Scheduling, Delivery, Permissions):
    """Durable per-user inboxes, leases, timers, approvals and outboxes.

    The per-user inbox, lease, claim and finish are here; the run-level calls of
    the worker runtime (runs.py), timers and approvals (scheduling.py), the
    outbox (delivery.py) and permissions (permissions.py) are mixed in from
    their own modules."""

    def __init__(self, pool, *, max_attempts: int = 3, lease_ttl: int = 120,
                 outbox_gap: int = 3600, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
                 max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
                 retry_backoff: int = 5, retry_backoff_cap: int = 300, max_batch: int = 100,
                 send_timeout: int = 120, max_send_attempts: int = 10, send_backoff: int = 5,
                 send_backoff_cap: int = 300):
        self.policy = ClaimPolicy(
            max_attempts=validate.positive_int("max_attempts", max_attempts),
            backoff_base=validate.epoch("retry_backoff", retry_backoff),
            backoff_cap=validate.epoch("retry_backoff_cap", retry_backoff_cap),
            max_batch=validate.positive_int("max_batch", max_batch))
        self.lease_ttl = validate.positive_int("lease_ttl", lease_ttl)
        self.outbox_gap = validate.epoch("outbox_gap", outbox_gap)
        self.send_policy = SendPolicy(
            timeout=validate.positive_int("send_timeout", send_timeout),
            max_attempts=validate.positive_int("max_send_attempts", max_send_attempts),
            backoff_base=validate.epoch("send_backoff", send_backoff),
            backoff_cap=validate.epoch("send_backoff_cap", send_backoff_cap))
        self.max_payload_bytes = validate.positive_int("max_payload_bytes", max_payload_bytes)
        self.max_memory_bytes = validate.positive_int("max_memory_bytes", max_memory_bytes)
        self._pool = pool
        # How the run path's transactions are cut: set-based on one server,
        # one bucket per transaction on a Citus coordinator (backend/path.py).
        self._path = run_path.for_pool(pool)

    @classmethod
    def connect(cls, url: str, *, pool_size: int = 4, application_name: str = "agent-inbox",
                pooler: str = "none",
                statement_timeout: float | None = db.DEFAULT_STATEMENT_TIMEOUT,
                connect_timeout: float | None = db.DEFAULT_CONNECT_TIMEOUT,
                citus_nodes: str = "coordinator", **options) -> "Inbox":
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
        (routing.NodePools; needs a direct `url`, no pooler), instead of through
        the coordinator ("coordinator", the default).
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
        pool.citus = detector.distributed
        if citus_nodes == "direct":
            pool.connect_node = functools.partial(
                db.connect, name=application_name,
                configure=citus.Detector(node_connection_timeout=connect_timeout),
                statement_timeout=statement_timeout, connect_timeout=connect_timeout)
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
    def citus(self) -> bool:
        """Whether the database is a Citus coordinator (a distributed layout)."""
        return self._path.distributed

    @property
    def adopts_held_messages(self) -> bool:
        """Whether a dispatcher looks for held messages no delivery is due for
        (queued by a worker older than the deliveries schema; never on Citus)."""
        return self._path.adopts_held_messages

    def compact(self, **options) -> list[compaction.Compaction] | None:
        """Leave the dead row versions of `wakes` (moved to a clean ring:
        store/wake_rings.py) and `leases` (rewritten) behind where they call
        for it (store/compaction.py: what, when, and why no row is lost or
        changed); what each look came to, or None on Citus, where it is not
        done. Workers call it every second."""
        return self._path.compact(**options)

    @property
    def max_attempts(self) -> int:
        return self.policy.max_attempts

    def close(self) -> None:
        self._path.close()
        self._pool.close()

    def _by_bucket(self, items: list, user_of=lambda item: item[0]) -> list[list]:
        """`items` (about users: `user_of(item)`) in one group, or on Citus in
        one group per bucket: a statement or transaction about several users
        is then sent once per group, each to one node. No items, no group."""
        return self._path.groups(items, user_of)

    def __enter__(self) -> "Inbox":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- inbox ---------------------------------------------------------------

    def ingest(self, user: str, source: str, source_id: str, payload: Any, *,
               kind: str | None = None, traceparent: str | None = None) -> bool:
        """Store an event once. False for a duplicate delivery (nothing stored).
        `kind` is what the provider calls the event (GitHub's "push"), if any.
        `traceparent` is the W3C trace context it came with (its run's span is
        a child of it; one that is malformed is ignored, never an error); by
        default the current OpenTelemetry span's, if any (tracing.py).

        Call it after the provider's signature check, then acknowledge."""
        user, source, source_id, kind = validate.event_names("", user, source, source_id, kind)
        encoded = validate.payload("payload", payload, self.max_payload_bytes)
        traceparent = _traceparent(traceparent)
        stored = self._path.ingest(user, lambda conn: inbox.insert(
            conn, user, source, source_id, encoded, kind, traceparent))
        metrics.count_ingested(source, stored)
        return stored

    def ingest_many(self, events: Iterable[tuple]) -> list[bool]:
        """Store many events (user, source, source_id, payload[, kind[,
        traceparent]]) in one transaction; for each, True if stored, False for a
        duplicate (of a stored event or of an earlier one in the batch). Every
        event is checked first: one bad event raises and nothing is stored (a
        malformed traceparent is ignored, as in `ingest`)."""
        if isinstance(events, (str, bytes)) or not isinstance(events, Iterable):
            raise errors.InvalidInput("events", events, "must be an iterable of tuples")
        rows = []
        for n, item in enumerate(events):
            if not isinstance(item, (tuple, list)) or len(item) not in (4, 5, 6):
                raise errors.InvalidInput(
                    f"events[{n}]", item,
                    "must be (user, source, source_id, payload[, kind[, traceparent]])")
            user, source, source_id, payload, kind, traceparent = (*item, None, None)[:6]
            user, source, source_id, kind = validate.event_names(f"events[{n}]", user, source,
                                                                 source_id, kind)
            rows.append((user, source, source_id,
                         validate.payload(f"events[{n}] payload", payload, self.max_payload_bytes),
                         kind, _traceparent(traceparent)))

        def insert_all(conn) -> list[bool]:
            stored: dict[int, bool] = {}
            # on Citus one statement per bucket (one node each; the transaction
            # spans the nodes the batch does)
            for group in self._by_bucket(list(enumerate(rows)), lambda item: item[1][0]):
                for start in range(0, len(group), INGEST_CHUNK):
                    chunk = group[start:start + INGEST_CHUNK]
                    flags = inbox.insert_many(conn, [row for _, row in chunk])
                    stored.update(zip((n for n, _ in chunk), flags))
                    self._path.events_inserted(conn, [row[0] for (_, row), ok
                                                      in zip(chunk, flags) if ok])
            return [stored[n] for n in range(len(rows))]

        stored = db.in_transaction(self._pool, insert_all)
        for (_, source, *_), was_stored in zip(rows, stored):
            metrics.count_ingested(source, was_stored)
        return stored

    def events(self, user: str, *, status: str | None = None) -> list[Event]:
        """A user's events, ordered by id; for operators and tests."""
        user = validate.text("user", user)
        if status is not None and status not in EVENT_STATUSES:
            raise errors.InvalidInput("status", status, f"must be one of {EVENT_STATUSES}")
        with db.connection(self._pool) as conn:
            return inbox.list_events(conn, user, status)

    def memory(self, user: str) -> Any:
        """The user's memory document (None if it has none)."""
        user = validate.text("user", user)
        with db.connection(self._pool) as conn:
            row = memories.get(conn, user)
        return None if row is None else row["doc"]

    def set_memory(self, user: str, doc: Any, *, actor: str, now: int | None = None) -> None:
        """Replace the user's memory as an operator (None deletes it), recorded
        in operator_actions with the document it replaced. Refused with
        UserBusy while a run holds the user's lease (its finish would replace
        the change); nothing is changed then."""
        user, actor = validate.text("user", user), validate.text("actor", actor)
        encoded = None if doc is None else validate.payload("memory", doc,
                                                            self.max_memory_bytes)
        now = validate.optional_epoch("now", now)
        with db.transaction(self._pool) as conn:
            held = conn.execute(memories.OPERATOR_LOCK, user_key(user, now=now)).fetchone()
            if held is not None and held[2] >= 0:
                holder, gen, expires_in = held
                raise errors.UserBusy(
                    f"user {user!r} has a run in flight (holder {holder}, generation {gen}, "
                    f"lease expires in {expires_in} s): its finish would replace the memory; "
                    "try again once it has ended")
            previous = memories.get(conn, user)
            memories.replace(conn, user, encoded, f"operator:{actor}", None, now)
            admin.record_memory_change(conn, user, actor, previous and previous["doc"], doc,
                                       now)

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
                                        groups=self._by_bucket)

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
        """Claim the work for one run (at most max_batch fresh events), ordered
        by id; empty unless this holder holds the lease in generation `gen`. Call once per run, after the
        previous run's finish."""
        user, holder = validate.text("user", user), validate.text("holder", holder)
        gen = validate.positive_int("gen", gen)
        now = validate.optional_epoch("now", now)
        with db.connection(self._pool) as conn:
            with db.pipelined_transaction(conn):
                conn.execute(lease.LOCK, user_key(user))
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
        return self._path.finish_one(inbox.Finish(user, holder, gen, ids, messages, error), now)

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
                    for group in self._by_bucket(users, lambda user: user):
                        pruned = retention.prune_users(
                            conn, group, older_than=older_than, window=dedup_window,
                            statuses=statuses, now=now)
                        gone, emptied = gone + pruned[0], emptied + pruned[1]
                deleted, compacted = deleted + gone, compacted + emptied
                users_seen, last_user = users_seen + len(users), users[-1]
                if progress:
                    progress(users_seen, deleted, compacted)


def _traceparent(given) -> str | None:
    """An event's traceparent: `given` if it is one (else none), or the current span's."""
    return tracing.valid_traceparent(given) if given is not None else tracing.current_traceparent()
