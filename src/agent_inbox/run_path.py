"""The run path's two implementations behind one interface, chosen once.

`Inbox` (inbox.py, runs.py, scheduling.py, delivery.py) says *what* a call
does: it checks arguments, builds the rows and reads the answers. *How* the
run path's transactions are cut is the `RunPath` it chose when it connected
(`for_pool`), and nothing else in the package asks which database it is on:

- `SetBased`, on one PostgreSQL server: a call about many users is one
  set-based statement (or one pipeline) in one transaction: a take, a batch of
  finishes, a renewal, a give-back. The `events_inserted` trigger makes each new
  event's lease row and wake.
- `PerBucket`, on a Citus coordinator (citus.py): every transaction is about
  one bucket, so it runs on the one node that holds it (store/bucketed.py):
  work is taken one bucket at a time, a run is finished in a transaction of its
  own, and renewals, releases and give-backs are sent once per bucket. The code
  that inserts events makes their lease rows and wakes (no trigger on Citus).
  A worker node that does not answer holds up only its own users: work is
  found on the nodes that answer (citus.NodeMap sets aside a node that timed
  out a moment ago), and a take, a batch of finishes or a renewal that met a
  silent node raises PartlyDone with what it did on the others.

Both keep the same invariants (RULES.md; store/lease.py states the fence):
every run-path transaction locks the lease rows it is about first, and a
finish commits only behind its run's fence.
"""

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

from agent_inbox import citus, db, errors
from agent_inbox.records import ClaimPolicy
from agent_inbox.store import (admin, approvals, bucketed, compaction, delegated, inbox, lease,
                               outbox, steps, timers, wake_rings)
from agent_inbox.store.keys import bucket as bucket_of, user_key, users_key

# Why a call left a node's users alone without asking it (citus.NodeMap.hung).
HUNG = "their worker node timed out a moment ago (set aside for a while)"

# A taken run as the store answers it:
# (user, gen, claimed_at, died, unfinished, memory, events).
Taken = tuple


class RunPath(Protocol):
    """What the run path's calls need from the database, whichever it is."""

    distributed: bool
    """True on a Citus coordinator (PerBucket)."""

    adopts_held_messages: bool
    """Whether a dispatcher looks for held messages of users with no delivery
    due (queued by a worker older than the deliveries schema: never on Citus)."""

    def groups(self, items: list, user_of: Callable[[Any], str]) -> list[list]:
        """`items` in the groups a statement about several users is sent in."""

    def ingest(self, user: str, insert: Callable[[Any], bool]) -> bool:
        """Run `insert(conn)` (True if it stored an event of `user`) and make
        the user's lease row and wake for a stored event."""

    def events_inserted(self, conn, users: list[str]) -> None:
        """In an open transaction that inserted events of `users`: their lease
        rows and wakes, and the notification."""

    def take(self, holder: str, users: int, ttl: int, policy: ClaimPolicy,
             now: int | None) -> tuple[list[Taken], Exception | None]:
        """Take up to `users` runs, longest waiting first: what was taken
        (committed) and the failure that cut the take short (None if none)."""

    def renew(self, holder: str, keys: list[tuple[str, int]], ttl: int,
              now: int | None) -> set:
        """The (user, gen) keys extended; PartlyDone if some are unknown."""

    def release(self, conn, holder: str, keys: list[tuple[str, int]], now: int | None,
                **options) -> list[str]:
        """Expire held leases (store/lease.release's options); the users released."""

    def held_by(self, conn, holder: str, now: int | None) -> list[tuple[str, int]]:
        """The (user, gen) of the unexpired leases `holder` holds."""

    def finish_one(self, finish: inbox.Finish, now: int | None) -> bool:
        """One run's fenced finish, its lease kept."""

    def finish_many(self, finishes: list[inbox.Finish], release: bool, now: int | None,
                    writes_timers: list[bool], write_timers: Callable[[Any, int], None]
                    ) -> list[bool]:
        """Fenced finishes: a flag per finish; `write_timers(conn, i)` is called,
        in the finish's transaction, for each accepted finish i that
        `writes_timers[i]`."""

    def in_groups(self, items: list, user_of: Callable[[Any], str],
                  work: Callable[[Any, list], list]) -> list:
        """`work(conn, group)` (an answer per item of the group, in its order)
        in a transaction per group of `items`: the answers in the items' order.
        PerBucket: a group whose node does not answer is left undone and the
        others are done: PartlyDone, whose `done` holds the answers (None where
        undone) and `unknown` the indices of the items left undone."""

    def record_steps(self, records: list[steps.StepRecord], now: int | None) -> list[bool]:
        """Step records behind their runs' fences: a flag per record (in_groups)."""

    def hand_back(self, runs: list[tuple[str, str, int, bool]], now: int | None) -> list[str]:
        """Give back runs (user, holder, gen, unfinished) whose handlers never
        started; the users given back."""

    def hand_back_orphans(self, holder: str, known: list[tuple[str, int]],
                          now: int | None) -> list[str]:
        """Give back every unexpired lease of `holder` but the `known` keys."""

    def claim_due_deliveries(self, limit: int, now: int | None,
                             claim: Callable[[Any, list[str]], list]) -> tuple[int, list]:
        """Lock up to `limit` users whose delivery is due and `claim(conn,
        users)` their batches in the same transaction: (users locked, batches)."""

    def timer_firings(self, conn, now: int | None) -> list[Callable[[int | None, int], Any]]:
        """The calls `fire(now, limit)` that fire due timers, each a batch per
        transaction until it fires fewer than `limit`."""

    def answer_approval(self, conn, user: str, request_id: str, answer: str,
                        now: int | None) -> str:
        """In an open transaction: store the answer unless expired; the one that stands."""

    def repair_dead(self, conn, pairs: list[tuple[str, int]], requeue: bool, actor: str,
                    now: int | None) -> list[dict]:
        """In an open transaction: requeue or discard the dead events among
        (user, id) pairs (store/admin.py); the rows repaired."""

    def close(self) -> None:
        """Close what the run path opened besides the pool (Inbox.close)."""

    def compact(self, **options) -> list[compaction.Compaction] | None:
        """Rewrite each table of compaction.TABLES without its dead tuples if
        they call for it (store/compaction.py's options); None where it is
        not done."""


def for_pool(pool) -> RunPath:
    """The run path for `pool`, as Inbox.connect marked it: `pool.citus` on a
    Citus coordinator, and there `pool.connect_node` (a node's URL -> a new
    connection) with `citus_nodes="direct"`: the take and finish calls then go
    straight to their bucket's node (citus.NodePools)."""
    if not getattr(pool, "citus", False):
        return SetBased(pool)
    return PerBucket(pool, getattr(pool, "connect_node", None))


class SetBased:
    """One PostgreSQL server: set-based statements, one transaction per call."""

    distributed = False
    adopts_held_messages = True

    def __init__(self, pool):
        self._pool = pool
        self._rings = wake_rings.Given()  # the wake rings takes name (store/wake_rings.py)

    def close(self):
        pass

    def groups(self, items, user_of):
        return [list(items)] if items else []

    def ingest(self, user, insert):
        with db.connection(self._pool) as conn:  # one statement; the trigger does the rest
            return insert(conn)

    def events_inserted(self, conn, users):
        """The events_inserted trigger did it."""

    def take(self, holder, users, ttl, policy, now):
        with db.connection(self._pool) as conn:
            return inbox.take_work(conn, holder, ttl, policy, now, self._rings, users,
                                   pipelined=db.pipelined_transaction), None

    def renew(self, holder, keys, ttl, now):
        if not keys:
            return set()
        with db.connection(self._pool) as conn:
            return lease.renew(conn, holder, keys, ttl, now)

    def release(self, conn, holder, keys, now, **options):
        return lease.release(conn, holder, keys, now, **options) if keys else []

    def held_by(self, conn, holder, now):
        return lease.held_by(conn, holder, now)

    def finish_one(self, finish, now):
        with db.connection(self._pool) as conn:
            with db.pipelined_transaction(conn):
                conn.execute(inbox.GENERIC_PLAN)
                conn.execute(lease.LOCK, user_key(finish.user))
                verdict = inbox.send_finish(conn, [finish], now)
            [accepted] = inbox.read_verdicts(verdict)
            return accepted

    def finish_many(self, finishes, release, now, writes_timers, write_timers):
        users = sorted(f.user for f in finishes)
        with db.connection(self._pool) as conn:
            if any(writes_timers):
                # Timers and approvals are written only once their fence has said yes.
                with conn.transaction():
                    conn.execute(inbox.GENERIC_PLAN)
                    conn.execute(lease.LOCK_MANY, users_key(users))
                    accepted = inbox.finish(conn, finishes, now, release=release)
                    for i, ok in enumerate(accepted):
                        if ok and writes_timers[i]:
                            write_timers(conn, i)
                    return accepted
            # Locks, fenced finishes and commit, sent as one pipeline: one round trip.
            with db.pipelined_transaction(conn):
                conn.execute(inbox.GENERIC_PLAN)
                conn.execute(lease.LOCK_MANY, users_key(users))
                verdicts = inbox.send_finish(conn, finishes, now, release=release)
            return inbox.read_verdicts(verdicts)

    def in_groups(self, items, user_of, work):
        if not items:
            return []
        with db.transaction(self._pool) as conn:
            return work(conn, list(items))

    def record_steps(self, records, now):
        def record(conn, group):
            kept = steps.record(conn, group, now)
            return [(r.user, r.gen, r.position) in kept for r in group]
        return self.in_groups(records, lambda record: record.user, record)

    def hand_back(self, runs, now):
        with db.transaction(self._pool) as conn:
            conn.execute(lease.LOCK_MANY, users_key(sorted(user for user, *_ in runs)))
            answers = []  # one HAND_BACK per holder, all sent before any is read
            for holder in sorted({holder for _, holder, _, _ in runs}):
                mine = [run for run in runs if run[1] == holder]
                answers.append(conn.execute(lease.HAND_BACK, {
                    "holder": holder, "users": [user for user, *_ in mine],
                    "gens": [gen for _, _, gen, _ in mine],
                    "unfinished": [unfinished for *_, unfinished in mine], "now": now}))
            return [user for answer in answers for user, in answer.fetchall()]

    def hand_back_orphans(self, holder, known, now):
        params = {"holder": holder, "users": [user for user, _ in known],
                  "gens": [gen for _, gen in known], "now": now}
        with db.transaction(self._pool) as conn:
            return [user for user, in conn.execute(lease.HAND_BACK_ORPHANS, params).fetchall()]

    def claim_due_deliveries(self, limit, now, claim):
        with db.transaction(self._pool) as conn:
            locked = outbox.lock_due(conn, limit, now)
            return len(locked), claim(conn, locked)

    def timer_firings(self, conn, now):
        return [lambda now, limit, fire=fire: fire(conn, now, limit)
                for fire in (timers.fire_due_batch, timers.fire_due_cron)]

    def answer_approval(self, conn, user, request_id, answer, now):
        return approvals.answer(conn, user, request_id, answer, now)

    def repair_dead(self, conn, pairs, requeue, actor, now):
        if requeue:
            return admin.requeue(conn, pairs, now, actor)
        return admin.discard(conn, pairs, actor)

    def compact(self, **options):
        with db.translated(), self._pool.connection() as conn:
            return [compaction.compact(conn, table, **options) for table in compaction.TABLES]


class PerBucket:
    """A Citus coordinator: one bucket per transaction, so one node per
    transaction; a node that does not answer holds up only its own users."""

    distributed = True
    adopts_held_messages = False

    def __init__(self, pool, connect_node: Callable[[str], Any] | None = None):
        self._pool = pool
        self._nodes = citus.NodeMap()  # which buckets each worker node holds; hung ones
        self._node_pools = (citus.NodePools(pool.conninfo, self._nodes, connect_node,
                                            size=pool.max_size, wait=pool.timeout)
                            if connect_node is not None else None)

    def close(self):
        if self._node_pools is not None:
            self._node_pools.close()

    def _on_node(self, conn, bucket: int, failures: list, call: Callable[[Any], Any]):
        """`call(conn)`, one piece of work about `bucket` (a call that is a
        transaction of its own), on a connection straight to its node with
        `citus_nodes="direct"` once the map knows the node (citus.NodePools),
        else on `conn` (the coordinator's; None: one from the pool); what it
        answered. As citus.node_may_fail: if the node does not answer (or the
        work deadlocks), the error is added to `failures`, the node is set
        aside if it timed out, and None is answered. On a connection straight
        to the node, a lost connection is the node's failure too, and so is
        one that cannot be opened."""
        if self._node_pools is None or self._nodes.address(bucket) is None:
            with contextlib.ExitStack() as stack:
                if conn is None:
                    conn = stack.enter_context(db.connection(self._pool))
                with citus.node_may_fail(conn, failures, self._nodes, [bucket]):
                    return call(conn)
            return None
        return self._node_pools.call([bucket], failures, call)

    def groups(self, items, user_of):
        return citus.by_bucket(items, user_of) if items else []

    def ingest(self, user, insert):
        with db.transaction(self._pool) as conn:
            stored = insert(conn)
            self.events_inserted(conn, [user] if stored else [])
            return stored

    def events_inserted(self, conn, users):
        citus.events_inserted(conn, users)

    def take(self, holder, users, ttl, policy, now):
        """The buckets with due wakes, longest waiting first (read per node, no
        lock; with `citus_nodes="direct"` on each node itself), each taken from
        in one call on its node (store/delegated.py: a transaction of its own)
        until `users` are taken. A take whose commit
        failed may have taken runs unseen, as anywhere: the caller gives back
        orphans."""
        taken: list[Taken] = []
        failures: list[Exception] = []
        with db.connection(self._pool) as conn:
            for bucket in bucketed.due_buckets(conn, self._nodes, now, self._node_pools):
                if conn.closed:  # cut under a read of a node that hangs
                    break
                got = self._on_node(conn, bucket, failures, lambda node: delegated.take(
                    node, bucket, holder, ttl, policy, now, users - len(taken)))
                if failures:
                    break
                taken += got
                if len(taken) >= users:
                    break
        return taken, (failures[0] if failures else None)

    def renew(self, holder, keys, ttl, now):
        """One statement per bucket: if a node does not answer, PartlyDone with
        the keys extended and, as `unknown`, those of that node."""
        renewed, unknown, failures = set(), set(), []
        with db.Connections(self._pool) as conns:
            for group in self.groups(keys, lambda key: key[0]):
                bucket = bucket_of(group[0][0])
                conn = conns.get()  # another if a hung node's statement was cut
                if self._nodes.hung(bucket):  # its node timed out a moment ago: not waited for
                    unknown.update(group)
                    continue
                failed = len(failures)
                with citus.node_may_fail(conn, failures, self._nodes, [bucket]):
                    renewed |= lease.renew(conn, holder, group, ttl, now)
                if len(failures) > failed:
                    unknown.update(group)
        if unknown:
            why = citus.first_line(failures[0]) if failures else HUNG
            raise errors.PartlyDone(f"{len(unknown)} leases not renewed: {why}", renewed, unknown)
        return renewed

    def release(self, conn, holder, keys, now, **options):
        released = []
        for group in self.groups(keys, lambda key: key[0]):  # one node's transaction each
            with conn.transaction():
                released += bucketed.release(conn, holder, group, now, **options)
        return released

    def held_by(self, conn, holder, now):
        """On the nodes that answer."""
        return bucketed.held_by(conn, self._nodes, holder, now, self._node_pools)

    def finish_one(self, finish, now):
        if self._goes_direct(finish, writes_timers=False):
            failures: list[Exception] = []
            accepted = self._on_node(None, bucket_of(finish.user), failures, lambda node:
                                     delegated.finish(node, finish, now, release=False))
            if failures:
                with db.translated():  # as a finish through the coordinator would raise it
                    raise failures[0]
            return accepted
        with db.connection(self._pool) as conn:  # one call: a transaction of its own
            return delegated.finish(conn, finish, now, release=False)

    def _goes_direct(self, finish, writes_timers: bool) -> bool:
        """Whether `finish` is sent straight to its node (citus_nodes="direct"):
        not if it queues messages (their ids come from the coordinator's
        sequence, which orders them, and the dispatchers' NOTIFY is heard
        there) or writes timers (their NOTIFY, likewise)."""
        return (self._node_pools is not None and not writes_timers
                and not (finish.error is None and finish.messages))

    def finish_many(self, finishes, release, now, writes_timers, write_timers):
        """Each run's finish in a transaction of its own (one node): one call
        (store/delegated.py), with the run's timers in the same transaction if
        it writes any. A run whose node does not answer (or that deadlocks)
        commits nothing and the others commit: PartlyDone, whose `done` has a
        flag per finish, None where nothing was committed."""
        flags: list[bool | None] = []
        failures: list[Exception] = []
        with db.Connections(self._pool) as conns:
            for i, finish in enumerate(finishes):
                bucket = bucket_of(finish.user)
                if self._nodes.hung(bucket):  # its node timed out a moment ago: not waited for
                    flags.append(None)
                    continue
                failed = len(failures)
                if self._goes_direct(finish, writes_timers[i]):
                    accepted = self._on_node(None, bucket, failures, lambda node, f=finish:
                                             delegated.finish(node, f, now, release=release))
                    flags.append(None if len(failures) > failed else accepted)
                    continue
                conn = conns.get()  # another if a hung node's statement was cut
                try:
                    with citus.node_may_fail(conn, failures, self._nodes, [bucket]), \
                            (conn.transaction() if writes_timers[i] else contextlib.nullcontext()):
                        accepted = delegated.finish(conn, finish, now, release=release)
                        if accepted and writes_timers[i]:
                            write_timers(conn, i)
                except delegated.RefusedInTransaction:  # its transaction rolled back
                    accepted = False
                flags.append(None if len(failures) > failed else accepted)  # committed, or not
        if None in flags:
            why = citus.first_line(failures[0]) if failures else HUNG
            raise errors.PartlyDone(f"{flags.count(None)} of {len(flags)} finishes not committed: "
                                    f"{why}", flags) from (failures[0] if failures else None)
        return flags

    def in_groups(self, items, user_of, work):
        """One transaction per bucket, each on its node; a node set aside as
        hung is not asked (its items are undone)."""
        answers: list = [None] * len(items)
        undone: set[int] = set()
        failures: list[Exception] = []
        with db.Connections(self._pool) as conns:
            for group in self.groups(list(range(len(items))), lambda i: user_of(items[i])):
                bucket = bucket_of(user_of(items[group[0]]))
                conn = conns.get()  # another if a hung node's statement was cut
                if self._nodes.hung(bucket):
                    undone.update(group)
                    continue
                failed, got = len(failures), None
                with citus.node_may_fail(conn, failures, self._nodes, [bucket]), \
                        conn.transaction():
                    got = work(conn, [items[i] for i in group])
                if len(failures) > failed:
                    undone.update(group)
                    continue
                for i, answer in zip(group, got):
                    answers[i] = answer
        if undone:
            why = citus.first_line(failures[0]) if failures else HUNG
            raise errors.PartlyDone(f"{len(undone)} of {len(items)} not done: {why}", answers,
                                    undone) from (failures[0] if failures else None)
        return answers

    def record_steps(self, records, now):
        def record(conn, group):  # the lease rows locked in user order
            order = sorted(range(len(group)), key=lambda k: group[k].user)
            flags = dict(zip(order, bucketed.record_steps(conn, [group[k] for k in order], now)))
            return [flags[k] for k in range(len(group))]
        return self.in_groups(records, lambda record: record.user, record)

    def hand_back(self, runs, now):
        """One node's transaction per bucket."""
        given = []
        for group in self.groups(runs, lambda run: run[0]):
            with db.transaction(self._pool) as conn:
                given += bucketed.hand_back(conn, group, now)
        return given

    def hand_back_orphans(self, holder, known, now):
        """HAND_BACK_ORPHANS locks across shards: the orphans are found first
        (per node, no lock), then given back by bucket."""
        with db.connection(self._pool) as conn:
            held = self.held_by(conn, holder, now)
        mine = set(known)
        return self.hand_back([(user, holder, gen, True) for user, gen in held
                               if (user, gen) not in mine], now)

    def claim_due_deliveries(self, limit, now, claim):
        """The buckets with due users, longest due first (one read across
        shards, no lock), each claimed from in a transaction of its own."""
        with db.connection(self._pool) as conn:
            buckets = bucketed.due_delivery_buckets(conn, self._nodes, now, self._node_pools)
        looked, batches = 0, []
        for bucket in buckets:
            with db.transaction(self._pool) as conn:
                locked = bucketed.lock_due_deliveries(conn, bucket, limit - looked, now)
                batches += claim(conn, locked)
            looked += len(locked)
            if looked >= limit:
                break
        return looked, batches

    def timer_firings(self, conn, now):
        """One bucket's timers per transaction (store/bucketed.py)."""
        return [lambda now, limit, bucket=bucket: bucketed.fire_timers(conn, bucket, now, limit)
                for bucket in bucketed.due_timer_buckets(conn, self._nodes, now,
                                                         self._node_pools)]

    def answer_approval(self, conn, user, request_id, answer, now):
        return bucketed.answer(conn, user, request_id, answer, now)

    def repair_dead(self, conn, pairs, requeue, actor, now):
        return bucketed.repair_dead(conn, pairs, requeue=requeue, actor=actor, now=now)

    def compact(self, **options):
        """Not on Citus: each bucket's rows live in a shard on a worker node,
        and locking and truncating a distributed table would stop every node's
        takes at once (and take a distributed lock across the nodes). A held
        horizon there is left to the worker nodes' own VACUUM (docs/citus.md)."""
        return None
