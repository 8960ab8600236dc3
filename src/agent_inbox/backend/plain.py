"""The run path on one PostgreSQL server (`SetBased`): a call about many users
is one set-based statement (or one pipeline) in one transaction: a take, a
batch of finishes, a renewal, a give-back. The `events_inserted` trigger makes
each new event's lease row and wake. path.py states the interface.
"""


import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg_pool import ConnectionPool

from agent_inbox import db
from agent_inbox.records import ClaimPolicy, Compaction, StepRecord, Taken
from agent_inbox.store import (admin, approvals, compaction, inbox, lease, outbox, steps, timers,
                               wake_rings)
from agent_inbox.store.keys import user_key, users_key

T = TypeVar("T")  # an item of a call about several users (path.py)
R = TypeVar("R")  # what a piece of work answers (path.py)

class SetBasedStatements:
    """One PostgreSQL server's statements (path.Statements): a call about many
    users is one statement; the events_inserted trigger makes new events'
    lease rows and wakes."""

    distributed = False
    one_statement_ingest = True

    def groups(self, items: Sequence[T], user_of: Callable[[T], str]) -> list[list[T]]:
        return [list(items)] if items else []

    def events_inserted(self, users: list[str]) -> db.Queries[None]:
        """The events_inserted trigger did it."""
        return (yield from ())

    def answer_approval(self, user: str, request_id: str, answer: str,
                        now: int | None) -> db.Queries[str]:
        return approvals.answer(user, request_id, answer, now)


class SetBased(SetBasedStatements):
    """One PostgreSQL server: set-based statements, one transaction per call."""

    adopts_held_messages = True

    def __init__(self, pool: ConnectionPool[Any]) -> None:
        self._pool = pool
        self._rings = wake_rings.Given()  # the wake rings takes name (store/wake_rings.py)

    def close(self) -> None:
        pass

    def take(self, holder: str, users: int, ttl: int, policy: ClaimPolicy,
             now: int | None) -> tuple[list[Taken], Exception | None]:
        with db.connection(self._pool) as conn:
            return inbox.take_work(conn, holder, ttl, policy, now, self._rings, users,
                                   pipelined=db.pipelined_transaction), None

    def renew(self, holder: str, keys: list[tuple[str, int]], ttl: int,
              now: int | None) -> set[tuple[str, int]]:
        if not keys:
            return set()
        with db.connection(self._pool) as conn:
            return lease.renew(conn, holder, keys, ttl, now)

    def release(self, conn: psycopg.Connection[Any], holder: str, keys: list[tuple[str, int]],
                now: int | None, **options: Any) -> list[str]:
        return lease.release(conn, holder, keys, now, **options) if keys else []

    def held_by(self, conn: psycopg.Connection[Any], holder: str,
                now: int | None) -> list[tuple[str, int]]:
        return lease.held_by(conn, holder, now)

    def finish_one(self, finish: inbox.Finish, now: int | None) -> bool:
        with db.connection(self._pool) as conn:
            with db.pipelined_transaction(conn):
                conn.execute(inbox.GENERIC_PLAN)
                conn.execute(lease.LOCK, user_key(finish.user))
                verdict = inbox.send_finish(conn, [finish], now)
            [accepted] = inbox.read_verdicts(verdict)
            return accepted

    def finish_many(self, finishes: list[inbox.Finish], release: bool, now: int | None,
                    writes_timers: list[bool],
                    write_timers: Callable[[psycopg.Connection[Any], int], None]) -> list[bool]:
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

    def in_groups(self, items: Sequence[T], user_of: Callable[[T], str],
                  work: Callable[[psycopg.Connection[Any], list[T]], list[R]]) -> list[R]:
        if not items:
            return []
        with db.transaction(self._pool) as conn:
            return work(conn, list(items))

    def record_steps(self, records: list[StepRecord], now: int | None) -> list[bool]:
        def record(conn: psycopg.Connection[Any], group: list[StepRecord]) -> list[bool]:
            kept = steps.record(conn, group, now)
            return [(r.user, r.gen, r.position) in kept for r in group]
        return self.in_groups(records, lambda record: record.user, record)

    def hand_back(self, runs: list[tuple[str, str, int, bool]], now: int | None) -> list[str]:
        with db.transaction(self._pool) as conn:
            conn.execute(lease.LOCK_MANY, users_key(sorted(user for user, *_ in runs)))
            # one HAND_BACK per holder, all sent before any is read
            answers: list[psycopg.Cursor[Any]] = []
            for holder in sorted({holder for _, holder, _, _ in runs}):
                mine = [run for run in runs if run[1] == holder]
                answers.append(conn.execute(lease.HAND_BACK, {
                    "holder": holder, "users": [user for user, *_ in mine],
                    "gens": [gen for _, _, gen, _ in mine],
                    "unfinished": [unfinished for *_, unfinished in mine], "now": now}))
            return [user for answer in answers for user, in answer.fetchall()]

    def hand_back_orphans(self, holder: str, known: list[tuple[str, int]],
                          now: int | None) -> list[str]:
        params = {"holder": holder, "users": [user for user, _ in known],
                  "gens": [gen for _, gen in known], "now": now}
        with db.transaction(self._pool) as conn:
            return [user for user, in conn.execute(lease.HAND_BACK_ORPHANS, params).fetchall()]

    def claim_due_deliveries(self, limit: int, now: int | None,
                             claim: Callable[[psycopg.Connection[Any], list[str]], list[R]]
                             ) -> tuple[int, list[R]]:
        with db.transaction(self._pool) as conn:
            locked = outbox.lock_due(conn, limit, now)
            return len(locked), claim(conn, locked)

    def timer_firings(self, conn: psycopg.Connection[Any], now: int | None
                      ) -> list[Callable[[int | None, int], timers.Batch]]:
        return [functools.partial(fire, conn)  # fire(now, limit): fire(conn, now, limit)
                for fire in (timers.fire_due_batch, timers.fire_due_cron)]

    def repair_dead(self, conn: psycopg.Connection[Any], pairs: list[tuple[str, int]],
                    requeue: bool, actor: str, now: int | None) -> list[dict[str, Any]]:
        if requeue:
            return admin.requeue(conn, pairs, now, actor)
        return admin.discard(conn, pairs, actor)

    def compact(self, **options: Any) -> list[Compaction]:
        with db.translated(), self._pool.connection() as conn:
            return [compaction.compact(conn, table, **options) for table in compaction.TABLES]
