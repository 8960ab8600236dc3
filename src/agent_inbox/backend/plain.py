"""The run path on one PostgreSQL server (`SetBased`): a call about many users
is one set-based statement (or one pipeline) in one transaction: a take, a
batch of finishes, a renewal, a give-back. The `events_inserted` trigger makes
each new event's lease row and wake. path.py states the interface.
"""


from typing import Any

import psycopg

from agent_inbox import db
from agent_inbox.store import (admin, approvals, compaction, inbox, lease, outbox, steps, timers,
                               wake_rings)
from agent_inbox.store.keys import user_key, users_key

class SetBasedStatements:
    """One PostgreSQL server's statements (path.Statements): a call about many
    users is one statement; the events_inserted trigger makes new events'
    lease rows and wakes."""

    distributed = False
    one_statement_ingest = True

    def groups(self, items, user_of):
        return [list(items)] if items else []

    def events_inserted(self, users):
        """The events_inserted trigger did it."""
        return (yield from ())

    def answer_approval(self, user, request_id, answer, now):
        return approvals.answer(user, request_id, answer, now)


class SetBased(SetBasedStatements):
    """One PostgreSQL server: set-based statements, one transaction per call."""

    adopts_held_messages = True

    def __init__(self, pool):
        self._pool = pool
        self._rings = wake_rings.Given()  # the wake rings takes name (store/wake_rings.py)

    def close(self):
        pass

    def take(self, holder, users, ttl, policy, now):
        with db.connection(self._pool) as conn:
            return inbox.take_work(conn, holder, ttl, policy, now, self._rings, users,
                                   pipelined=db.pipelined_transaction), None

    def renew(self, holder, keys, ttl, now):
        if not keys:
            return set()
        with db.connection(self._pool) as conn:
            return lease.renew(conn, holder, keys, ttl, now)

    def release(self, conn: psycopg.Connection[Any], holder, keys, now, **options):
        return lease.release(conn, holder, keys, now, **options) if keys else []

    def held_by(self, conn: psycopg.Connection[Any], holder, now):
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
        def record(conn: psycopg.Connection[Any], group):
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

    def timer_firings(self, conn: psycopg.Connection[Any], now):
        return [lambda now, limit, fire=fire: fire(conn, now, limit)
                for fire in (timers.fire_due_batch, timers.fire_due_cron)]

    def repair_dead(self, conn: psycopg.Connection[Any], pairs, requeue, actor, now):
        if requeue:
            return admin.requeue(conn, pairs, now, actor)
        return admin.discard(conn, pairs, actor)

    def compact(self, **options):
        with db.translated(), self._pool.connection() as conn:
            return [compaction.compact(conn, table, **options) for table in compaction.TABLES]
