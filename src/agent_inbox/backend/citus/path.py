"""The run path on a Citus coordinator (`PerBucket`): every transaction is
about one bucket, so it runs on the one node that holds it (statements.py,
functions.py); a node that does not answer holds up only its own users.
../path.py states the interface.
"""

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import psycopg
from psycopg_pool import ConnectionPool

from agent_inbox.backend.citus import nodes as citus_nodes
from agent_inbox.backend.citus import statements as citus_statements
from agent_inbox import db, errors
from agent_inbox.records import ClaimPolicy, StepRecord, Taken
from agent_inbox.store import inbox, lease, timers
from agent_inbox.backend.citus import statements as bucketed, functions as delegated
from agent_inbox.store.keys import bucket as bucket_of

# Why a call left a node's users alone without asking it (citus_nodes.NodeMap.hung).
HUNG = "their worker node timed out a moment ago (set aside for a while)"

T = TypeVar("T")  # an item of a call about several users (../path.py)
R = TypeVar("R")  # what a piece of work answers (../path.py)


class PerBucketStatements:
    """A Citus coordinator's statements (../path.Statements): one bucket per
    statement; the code that inserts events makes their lease rows and wakes."""

    distributed = True
    one_statement_ingest = False

    def groups(self, items: Sequence[T], user_of: Callable[[T], str]) -> list[list[T]]:
        return citus_nodes.by_bucket(items, user_of) if items else []

    def events_inserted(self, users: list[str]) -> db.Queries[None]:
        return citus_statements.events_inserted(users)

    def answer_approval(self, user: str, request_id: str, answer: str,
                        now: int | None) -> db.Queries[str]:
        return bucketed.answer(user, request_id, answer, now)


class PerBucket(PerBucketStatements):
    """A Citus coordinator: one bucket per transaction, so one node per
    transaction; a node that does not answer holds up only its own users."""

    adopts_held_messages = False

    def __init__(self, pool: ConnectionPool[Any],
                 connect_node: Callable[[str], psycopg.Connection[Any]] | None = None) -> None:
        self._pool = pool
        self._nodes = citus_nodes.NodeMap()  # which buckets each worker node holds; hung ones
        # pool.conninfo is a URL (db.open_pool's), not psycopg_pool's callable that makes one
        url = cast(str, pool.conninfo)
        self._node_pools = (citus_nodes.NodePools(url, self._nodes, connect_node,
                                            size=pool.max_size, wait=pool.timeout)
                            if connect_node is not None else None)

    def close(self) -> None:
        if self._node_pools is not None:
            self._node_pools.close()

    def _on_node(self, conn: psycopg.Connection[Any] | None, bucket: int, failures: list[Exception],
                 call: Callable[[psycopg.Connection[Any]], R]) -> R | None:
        """`call(conn)`, one piece of work about `bucket` (a call that is a
        transaction of its own), on a connection straight to its node with
        `citus_nodes="direct"` once the map knows the node (citus_nodes.NodePools),
        else on `conn` (the coordinator's; None: one from the pool); what it
        answered. As citus_nodes.node_may_fail: if the node does not answer (or the
        work deadlocks), the error is added to `failures`, the node is set
        aside if it timed out, and None is answered. On a connection straight
        to the node, a lost connection is the node's failure too, and so is
        one that cannot be opened."""
        if self._node_pools is None or self._nodes.address(bucket) is None:
            with contextlib.ExitStack() as stack:
                if conn is None:
                    conn = stack.enter_context(db.connection(self._pool))
                with citus_nodes.node_may_fail(conn, failures, self._nodes, [bucket]):
                    return call(conn)
            return None
        return self._node_pools.call([bucket], failures, call)

    def take(self, holder: str, users: int, ttl: int, policy: ClaimPolicy,
             now: int | None) -> tuple[list[Taken], Exception | None]:
        """The buckets with due wakes, longest waiting first (read per node, no
        lock; with `citus_nodes="direct"` on each node itself), each taken from
        in one call on its node (backend/citus/functions.py: a transaction of its own)
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
                taken += cast(list[Taken], got)  # not None: no failure
                if len(taken) >= users:
                    break
        return taken, (failures[0] if failures else None)

    def renew(self, holder: str, keys: list[tuple[str, int]], ttl: int,
              now: int | None) -> set[tuple[str, int]]:
        """One statement per bucket: if a node does not answer, PartlyDone with
        the keys extended and, as `unknown`, those of that node."""
        renewed: set[tuple[str, int]] = set()
        unknown: set[tuple[str, int]] = set()
        failures: list[Exception] = []
        with db.Connections(self._pool) as conns:
            for group in self.groups(keys, lambda key: key[0]):
                bucket = bucket_of(group[0][0])
                conn = conns.get()  # another if a hung node's statement was cut
                if self._nodes.hung(bucket):  # its node timed out a moment ago: not waited for
                    unknown.update(group)
                    continue
                failed = len(failures)
                with citus_nodes.node_may_fail(conn, failures, self._nodes, [bucket]):
                    renewed |= lease.renew(conn, holder, group, ttl, now)
                if len(failures) > failed:
                    unknown.update(group)
        if unknown:
            why = errors.first_line(failures[0]) if failures else HUNG
            raise errors.PartlyDone(f"{len(unknown)} leases not renewed: {why}", renewed, unknown)
        return renewed

    def release(self, conn: psycopg.Connection[Any], holder: str, keys: list[tuple[str, int]],
                now: int | None, **options: Any) -> list[str]:
        released: list[str] = []
        for group in self.groups(keys, lambda key: key[0]):  # one node's transaction each
            with conn.transaction():
                released += bucketed.release(conn, holder, group, now, **options)
        return released

    def held_by(self, conn: psycopg.Connection[Any], holder: str,
                now: int | None) -> list[tuple[str, int]]:
        """On the nodes that answer."""
        return bucketed.held_by(conn, self._nodes, holder, now, self._node_pools)

    def finish_one(self, finish: inbox.Finish, now: int | None) -> bool:
        if self._goes_direct(finish, writes_timers=False):
            failures: list[Exception] = []
            accepted = self._on_node(None, bucket_of(finish.user), failures, lambda node:
                                     delegated.finish(node, finish, now, release=False))
            if failures:
                with db.translated():  # as a finish through the coordinator would raise it
                    raise failures[0]
            return cast(bool, accepted)  # not None: no failure
        with db.connection(self._pool) as conn:  # one call: a transaction of its own
            return delegated.finish(conn, finish, now, release=False)

    def _goes_direct(self, finish: inbox.Finish, writes_timers: bool) -> bool:
        """Whether `finish` is sent straight to its node (citus_nodes="direct"):
        not if it queues messages (their ids come from the coordinator's
        sequence, which orders them, and the dispatchers' NOTIFY is heard
        there) or writes timers (their NOTIFY, likewise)."""
        return (self._node_pools is not None and not writes_timers
                and not (finish.error is None and finish.messages))

    def finish_many(self, finishes: list[inbox.Finish], release: bool, now: int | None,
                    writes_timers: list[bool],
                    write_timers: Callable[[psycopg.Connection[Any], int], None]) -> list[bool]:
        """Each run's finish in a transaction of its own (one node): one call
        (backend/citus/functions.py), with the run's timers in the same transaction if
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
                    # called at once, on this iteration's finish
                    accepted = self._on_node(None, bucket, failures, lambda node:
                                             delegated.finish(node, finish, now, release=release))
                    flags.append(None if len(failures) > failed else accepted)
                    continue
                conn = conns.get()  # another if a hung node's statement was cut
                try:
                    with citus_nodes.node_may_fail(conn, failures, self._nodes, [bucket]), \
                            (conn.transaction() if writes_timers[i] else contextlib.nullcontext()):
                        accepted = delegated.finish(conn, finish, now, release=release)
                        if accepted and writes_timers[i]:
                            write_timers(conn, i)
                except delegated.RefusedInTransaction:  # its transaction rolled back
                    accepted = False
                flags.append(None if len(failures) > failed else accepted)  # committed, or not
        if None in flags:
            why = errors.first_line(failures[0]) if failures else HUNG
            raise errors.PartlyDone(f"{flags.count(None)} of {len(flags)} finishes not committed: "
                                    f"{why}", flags) from (failures[0] if failures else None)
        return cast(list[bool], flags)  # None in none: each committed

    def in_groups(self, items: Sequence[T], user_of: Callable[[T], str],
                  work: Callable[[psycopg.Connection[Any], list[T]], list[R]]) -> list[R]:
        """One transaction per bucket, each on its node; a node set aside as
        hung is not asked (its items are undone)."""
        answers: list[R | None] = [None] * len(items)
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
                with citus_nodes.node_may_fail(conn, failures, self._nodes, [bucket]), \
                        conn.transaction():
                    got = work(conn, [items[i] for i in group])
                if len(failures) > failed:
                    undone.update(group)
                    continue
                for i, answer in zip(group, got):
                    answers[i] = answer
        if undone:
            why = errors.first_line(failures[0]) if failures else HUNG
            raise errors.PartlyDone(f"{len(undone)} of {len(items)} not done: {why}", answers,
                                    undone) from (failures[0] if failures else None)
        return cast(list[R], answers)  # None in none: each group done

    def record_steps(self, records: list[StepRecord], now: int | None) -> list[bool]:
        # the lease rows locked in user order
        def record(conn: psycopg.Connection[Any], group: list[StepRecord]) -> list[bool]:
            order = sorted(range(len(group)), key=lambda k: group[k].user)
            flags = dict(zip(order, bucketed.record_steps(conn, [group[k] for k in order], now)))
            return [flags[k] for k in range(len(group))]
        return self.in_groups(records, lambda record: record.user, record)

    def hand_back(self, runs: list[tuple[str, str, int, bool]], now: int | None) -> list[str]:
        """One node's transaction per bucket."""
        given: list[str] = []
        for group in self.groups(runs, lambda run: run[0]):
            with db.transaction(self._pool) as conn:
                given += bucketed.hand_back(conn, group, now)
        return given

    def hand_back_orphans(self, holder: str, known: list[tuple[str, int]],
                          now: int | None) -> list[str]:
        """HAND_BACK_ORPHANS locks across shards: the orphans are found first
        (per node, no lock), then given back by bucket."""
        with db.connection(self._pool) as conn:
            held = self.held_by(conn, holder, now)
        mine = set(known)
        return self.hand_back([(user, holder, gen, True) for user, gen in held
                               if (user, gen) not in mine], now)

    def claim_due_deliveries(self, limit: int, now: int | None,
                             claim: Callable[[psycopg.Connection[Any], list[str]], list[R]]
                             ) -> tuple[int, list[R]]:
        """The buckets with due users, longest due first (one read across
        shards, no lock), each claimed from in a transaction of its own."""
        with db.connection(self._pool) as conn:
            buckets = bucketed.due_delivery_buckets(conn, self._nodes, now, self._node_pools)
        looked = 0
        batches: list[R] = []
        for bucket in buckets:
            with db.transaction(self._pool) as conn:
                locked = bucketed.lock_due_deliveries(conn, bucket, limit - looked, now)
                batches += claim(conn, locked)
            looked += len(locked)
            if looked >= limit:
                break
        return looked, batches

    def timer_firings(self, conn: psycopg.Connection[Any], now: int | None
                      ) -> list[Callable[[int | None, int], timers.Batch]]:
        """One bucket's timers per transaction (backend/citus/statements.py)."""
        return [functools.partial(bucketed.fire_timers, conn, bucket)  # (now, limit)
                for bucket in bucketed.due_timer_buckets(conn, self._nodes, now,
                                                         self._node_pools)]

    def repair_dead(self, conn: psycopg.Connection[Any], pairs: list[tuple[str, int]],
                    requeue: bool, actor: str, now: int | None) -> list[dict[str, Any]]:
        return bucketed.repair_dead(conn, pairs, requeue=requeue, actor=actor, now=now)

    def compact(self, **options: Any) -> None:
        """Not on Citus: each bucket's rows live in a shard on a worker node,
        and locking and truncating a distributed table would stop every node's
        takes at once (and take a distributed lock across the nodes). A held
        horizon there is left to the worker nodes' own VACUUM (docs/citus.md)."""
        return None
