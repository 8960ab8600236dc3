"""A user's memory (table `memory`): one JSON document an agent keeps between runs.

Invariant: the document changes only in a transaction that holds the user's
lease row: a run's fenced finish (store/inbox.py FINISH, backend/citus/statements.py's
finish), whose fence refuses a stale run, or an operator's change made while no
run holds the lease (OPERATOR_LOCK). So a stale run can never overwrite a newer
run's memory, and an operator's change is never overwritten by a run that read
the document before it: a run reads it with its claim (TAKE_WORK), after its
lease was taken.
"""

from typing import Any

import psycopg

from agent_inbox.db import Queries, Query
from agent_inbox.store.clock import NOW
from agent_inbox.store.keys import user_key

# One user's document replaced (json text) or deleted (None), in the caller's
# transaction, which holds the user's lease row.
# How a new document takes a user's memory row's place: here, and in a
# finish's `remembered` (store/inbox.py).
REPLACES = """ON CONFLICT ON CONSTRAINT pk_memory DO UPDATE
   SET doc = excluded.doc, updated_at = excluded.updated_at, updated_by = excluded.updated_by,
       gen = excluded.gen"""

UPSERT = f"""
INSERT INTO memory AS m (bucket, user_id, doc, updated_at, updated_by, gen)
VALUES (%(bucket)s, %(user)s, %(doc)s::jsonb, {NOW}, %(by)s, %(gen)s)
    {REPLACES}
"""

DELETE = "DELETE FROM memory m WHERE m.bucket = %(bucket)s AND m.user_id = %(user)s RETURNING m.doc"


def replace(conn: psycopg.Connection[Any], user: str, doc: str | None, by: str, gen: int | None, now: int | None) -> None:
    if doc is None:
        conn.execute(DELETE, user_key(user))
    else:
        conn.execute(UPSERT, user_key(user, doc=doc, by=by, gen=gen, now=now))


GET = """
SELECT m.doc, m.updated_at, m.updated_by, m.gen FROM memory m
 WHERE m.bucket = %(bucket)s AND m.user_id = %(user)s
"""


def get(user: str) -> Queries[dict[str, Any] | None]:
    """The user's memory row: doc, updated_at, updated_by, gen; None if none."""
    rows = yield Query(GET, user_key(user))
    return dict(zip(("doc", "updated_at", "updated_by", "gen"), rows[0])) if rows else None


# An operator's change: the user's lease row locked, and its state read (a
# held, unexpired lease means a run in flight, whose finish would replace the
# change: the operator is told to try again). No lease row: no run ever.
OPERATOR_LOCK = f"""
SELECT l.holder, l.gen, l.until - {NOW} AS expires_in
  FROM leases l WHERE l.bucket = %(bucket)s AND l.user_id = %(user)s
   FOR UPDATE
"""
