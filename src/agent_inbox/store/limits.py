"""The fleet's rate budgets (table `limits`): a token bucket per name.

A limit lets `rate` tokens in per `per_seconds`, and holds at most `burst`:
`tokens` is what the bucket held at `refilled_at` (epoch seconds with a
fraction, the database server's clock). Nothing refills the row on a timer:
every statement that reads the bucket first adds what the time since
`refilled_at` brought (at most up to `burst`), by the server's clock read at
that moment (clock_timestamp), so every host counts the same time.

Every statement here touches `limits` alone (no join with a per-user table:
on Citus it stays a table of the coordinator's own), and keeps no session
state (one statement each, autocommit: it works through a transaction pooler).
"""

from typing import Any

import psycopg

from agent_inbox.store import one

# The server's clock, epoch seconds with a fraction.
CLOCK = "extract(epoch FROM clock_timestamp())::float8"

# The bucket of the locked row `l` as of `c.at` (never before its last refill:
# `refilled_at` only moves forward, so no span of time is counted twice).
_AT = "greatest(c.at, l.refilled_at)"
_AVAILABLE = (f"least(l.burst::float8, l.tokens + ({_AT} - l.refilled_at) "
              f"* l.rate / l.per_seconds)")

# Take up to %(asked)s whole tokens, but only if at least %(least)s are there
# (else none: a caller that cannot be served yet does not drain the bucket for
# nothing). The row is locked first, and the values computed from the locked
# (latest) version: concurrent grants queue on the row, each sees the last one's
# result. Returns what was taken, what is left, the server's clock, and the
# limit as it now stands (a change by `limits set` is seen at the next grant).
GRANT = f"""
WITH c AS (
    SELECT {CLOCK} AS at
), locked AS (
    SELECT l.name, {_AVAILABLE} AS available, {_AT} AS at
      FROM limits l, c
     WHERE l.name = %(name)s
       FOR UPDATE OF l
), took AS (
    SELECT name, at, available,
           CASE WHEN floor(available) >= %(least)s
                THEN least(%(asked)s::float8, floor(available)) ELSE 0 END AS taken
      FROM locked
)
UPDATE limits l
   SET tokens = t.available - t.taken, refilled_at = t.at
  FROM took t
 WHERE l.name = t.name
RETURNING t.taken::bigint, l.tokens, l.refilled_at, l.rate, l.per_seconds, l.burst
"""


def grant(conn: psycopg.Connection[Any], name: str, asked: int, least: int) -> tuple[Any, ...] | None:
    """(taken, tokens left, at, rate, per_seconds, burst), or None if there is
    no limit `name`. One statement."""
    return conn.execute(GRANT, {"name": name, "asked": asked, "least": least}).fetchone()


# A limit made or changed: a new one starts full; a changed one keeps what its
# bucket held (refilled to now under the old rate first), no more than its new
# burst. Returns the limit before (NULLs for a new one) and after.
SET = f"""
WITH c AS (
    SELECT {CLOCK} AS at
), before AS (
    SELECT l.name, l.rate, l.per_seconds, l.burst, {_AVAILABLE} AS available, {_AT} AS at
      FROM limits l, c
     WHERE l.name = %(name)s
       FOR UPDATE OF l
), changed AS (
    INSERT INTO limits AS l (name, rate, per_seconds, burst, tokens, refilled_at, updated_by)
    SELECT %(name)s, %(rate)s, %(per)s, %(burst)s,
           least(%(burst)s::float8, coalesce((SELECT available FROM before), %(burst)s)),
           coalesce((SELECT at FROM before), c.at), %(actor)s
      FROM c
        ON CONFLICT (name) DO UPDATE
       SET rate = excluded.rate, per_seconds = excluded.per_seconds, burst = excluded.burst,
           tokens = excluded.tokens, refilled_at = excluded.refilled_at,
           updated_at = floor(extract(epoch FROM clock_timestamp()))::bigint,
           updated_by = excluded.updated_by
    RETURNING l.name, l.rate, l.per_seconds, l.burst, l.tokens
)
SELECT b.rate, b.per_seconds, b.burst, n.rate, n.per_seconds, n.burst, n.tokens
  FROM changed n LEFT JOIN before b ON b.name = n.name
"""


def set_limit(conn: psycopg.Connection[Any], name: str, rate: int, per: int, burst: int, actor: str) -> dict[str, Any]:
    """Make or change limit `name`; {"before": {...} or None, "after": {...}}."""
    row = one(conn.execute(SET, {"name": name, "rate": rate, "per": per, "burst": burst,
                                 "actor": actor}))
    keys = ("rate", "per_seconds", "burst")
    before = None if row[0] is None else dict(zip(keys, row[:3]))
    return {"name": name, "before": before,
            "after": {**dict(zip(keys, row[3:6])), "tokens": row[6]}}


# An application's default: made if absent, left as it stands otherwise (an
# operator's `limits set` wins over the code's default).
DECLARE = f"""
INSERT INTO limits (name, rate, per_seconds, burst, tokens, refilled_at, updated_by)
VALUES (%(name)s, %(rate)s, %(per)s, %(burst)s, %(burst)s, {CLOCK}, %(actor)s)
    ON CONFLICT (name) DO NOTHING
RETURNING name
"""


def declare(conn: psycopg.Connection[Any], name: str, rate: int, per: int, burst: int, actor: str) -> bool:
    """True if the limit was made; False if one of that name stood (unchanged)."""
    return conn.execute(DECLARE, {"name": name, "rate": rate, "per": per, "burst": burst,
                                  "actor": actor}).fetchone() is not None


# Every limit, with its bucket as of now (read only: nothing is refilled).
LIST = f"""
SELECT l.name, l.rate, l.per_seconds, l.burst, {_AVAILABLE} AS tokens,
       l.updated_at, l.updated_by
  FROM limits l, (SELECT {CLOCK} AS at) c
 ORDER BY l.name
"""

LIST_FIELDS = ("name", "rate", "per_seconds", "burst", "tokens", "updated_at", "updated_by")


def list_limits(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    return [dict(zip(LIST_FIELDS, row)) for row in conn.execute(LIST).fetchall()]
