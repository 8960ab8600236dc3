"""The run path's two implementations behind one interface, chosen once.

`Inbox` and the objects it holds (api/inbox.py, runs.py, scheduling.py,
delivery.py) say *what* a call does: they check arguments, build the rows and
read the answers. *How* the run path's transactions are cut is the `RunPath`
the Inbox was given or asked the database for (`for_pool`), and nothing else
in the package asks which database it is on:

- `SetBased`, on one PostgreSQL server: a call about many users is one
  set-based statement (or one pipeline) in one transaction: a take, a batch of
  finishes, a renewal, a give-back. The `events_inserted` trigger makes each new
  event's lease row and wake.
- `PerBucket`, on a Citus coordinator (backend/citus/): every transaction is about
  one bucket, so it runs on the one node that holds it (backend/citus/statements.py):
  work is taken one bucket at a time, a run is finished in a transaction of its
  own, and renewals, releases and give-backs are sent once per bucket. The code
  that inserts events makes their lease rows and wakes (no trigger on Citus).
  A worker node that does not answer holds up only its own users: work is
  found on the nodes that answer (citus_nodes.NodeMap sets aside a node that timed
  out a moment ago), and a take, a batch of finishes or a renewal that met a
  silent node raises PartlyDone with what it did on the others.

Both keep the same invariants (RULES.md; store/lease.py states the fence):
every run-path transaction locks the lease rows it is about first, and a
finish commits only behind its run's fence.
"""

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import psycopg
from psycopg_pool import ConnectionPool

from agent_inbox import db
from agent_inbox.backend.citus import layout
from agent_inbox.backend.citus.path import PerBucket, PerBucketStatements
from agent_inbox.backend.plain import SetBased, SetBasedStatements
from agent_inbox.records import ClaimPolicy, Compaction, StepRecord, Taken
from agent_inbox.store import inbox, timers

T = TypeVar("T")  # an item of a call about several users
R = TypeVar("R")  # what a piece of work answers


class Statements(Protocol):
    """How the statements of a call written once (db.Queries) are cut, with no
    connection of its own: what an `Inbox` and an `AsyncInbox` (which has no
    RunPath: `statements_for`) drive on their connections, or on the caller's."""

    distributed: bool
    """True on a Citus coordinator (PerBucket)."""

    one_statement_ingest: bool
    """Whether storing one event is one statement (the events_inserted
    trigger makes its lease row and wake), which needs no transaction."""

    def groups(self, items: Sequence[T], user_of: Callable[[T], str]) -> list[list[T]]:
        """`items` in the groups a statement about several users is sent in."""

    def events_inserted(self, users: list[str]) -> db.Queries[None]:
        """In an open transaction that inserted events of `users`: their lease
        rows and wakes, and the notification."""

    def answer_approval(self, user: str, request_id: str, answer: str,
                        now: int | None) -> db.Queries[str]:
        """In an open transaction: store the answer unless expired; the one that stands."""


class RunPath(Statements, Protocol):
    """What the run path's calls need from the database, whichever it is."""

    adopts_held_messages: bool
    """Whether a dispatcher looks for held messages of users with no delivery
    due (queued by a worker older than the deliveries schema: never on Citus)."""

    def take(self, holder: str, users: int, ttl: int, policy: ClaimPolicy,
             now: int | None) -> tuple[list[Taken], Exception | None]:
        """Take up to `users` runs, longest waiting first: what was taken
        (committed) and the failure that cut the take short (None if none)."""

    def renew(self, holder: str, keys: list[tuple[str, int]], ttl: int,
              now: int | None) -> set[tuple[str, int]]:
        """The (user, gen) keys extended; PartlyDone if some are unknown."""

    def release(self, conn: psycopg.Connection[Any], holder: str, keys: list[tuple[str, int]],
                now: int | None, **options: Any) -> list[str]:
        """Expire held leases (store/lease.release's options); the users released."""

    def held_by(self, conn: psycopg.Connection[Any], holder: str,
                now: int | None) -> list[tuple[str, int]]:
        """The (user, gen) of the unexpired leases `holder` holds."""

    def finish_one(self, finish: inbox.Finish, now: int | None) -> bool:
        """One run's fenced finish, its lease kept."""

    def finish_many(self, finishes: list[inbox.Finish], release: bool, now: int | None,
                    writes_timers: list[bool],
                    write_timers: Callable[[psycopg.Connection[Any], int], None]) -> list[bool]:
        """Fenced finishes: a flag per finish; `write_timers(conn, i)` is called,
        in the finish's transaction, for each accepted finish i that
        `writes_timers[i]`."""

    def in_groups(self, items: Sequence[T], user_of: Callable[[T], str],
                  work: Callable[[psycopg.Connection[Any], list[T]], list[R]]) -> list[R]:
        """`work(conn, group)` (an answer per item of the group, in its order)
        in a transaction per group of `items`: the answers in the items' order.
        PerBucket: a group whose node does not answer is left undone and the
        others are done: PartlyDone, whose `done` holds the answers (None where
        undone) and `unknown` the indices of the items left undone."""

    def record_steps(self, records: list[StepRecord], now: int | None) -> list[bool]:
        """Step records behind their runs' fences: a flag per record (in_groups)."""

    def hand_back(self, runs: list[tuple[str, str, int, bool]], now: int | None) -> list[str]:
        """Give back runs (user, holder, gen, unfinished) whose handlers never
        started; the users given back."""

    def hand_back_orphans(self, holder: str, known: list[tuple[str, int]],
                          now: int | None) -> list[str]:
        """Give back every unexpired lease of `holder` but the `known` keys."""

    def claim_due_deliveries(self, limit: int, now: int | None,
                             claim: Callable[[psycopg.Connection[Any], list[str]], list[R]]
                             ) -> tuple[int, list[R]]:
        """Lock up to `limit` users whose delivery is due and `claim(conn,
        users)` their batches in the same transaction: (users locked, batches)."""

    def timer_firings(self, conn: psycopg.Connection[Any], now: int | None
                      ) -> list[Callable[[int | None, int], timers.Batch]]:
        """The calls `fire(now, limit)` that fire due timers, each a batch per
        transaction until it fires fewer than `limit`."""

    def repair_dead(self, conn: psycopg.Connection[Any], pairs: list[tuple[str, int]],
                    requeue: bool, actor: str, now: int | None) -> list[dict[str, Any]]:
        """In an open transaction: requeue or discard the dead events among
        (user, id) pairs (store/admin.py); the rows repaired."""

    def close(self) -> None:
        """Close what the run path opened besides the pool (Inbox.close)."""

    def compact(self, **options: Any) -> list[Compaction] | None:
        """Rewrite each table of compaction.TABLES without its dead tuples if
        they call for it (store/compaction.py's options); None where it is
        not done."""


def statements_for(distributed: bool) -> Statements:
    """The statements' cut on a Citus coordinator whose events table is
    distributed (per bucket), or on one server (set-based)."""
    return PerBucketStatements() if distributed else SetBasedStatements()


def for_pool(pool: ConnectionPool[Any], *, distributed: bool | None = None,
             connect_node: Callable[[str], psycopg.Connection[Any]] | None = None) -> RunPath:
    """The run path for `pool`: one bucket per transaction on a Citus
    coordinator whose events table is distributed (`distributed`, asked of
    the database when None), and there, given `connect_node` (a node's URL ->
    a new connection), the take and finish calls go straight to their
    bucket's node (citus/nodes.py's NodePools); else set-based."""
    if distributed is None:
        with db.connection(pool) as conn:
            distributed = layout.is_distributed(conn)
    if not distributed:
        return SetBased(pool)
    return PerBucket(pool, connect_node)
