"""Run statistics (table `run_stats`): what each worker process did, per minute.

Written by the worker runtime after its takes and commits: one upsert of the
process's own (minute, process) row, adding the counts since its last write,
so no row is shared by the fleet. The counts follow commits the worker already
made, in a statement of their own: a process that dies between a commit and
this write loses that commit's counts (the chart is a view of the fleet's
activity, not an account of it; the events table remains the record).
"""

from typing import Any

import psycopg

from agent_inbox.store.clock import NOW

FIELDS = ("finished", "refused", "takeovers", "died")

RECORD = f"""
INSERT INTO run_stats (minute, process, finished, refused, takeovers, died)
VALUES ({NOW} / 60 * 60, %(process)s, %(finished)s, %(refused)s, %(takeovers)s, %(died)s)
    ON CONFLICT (minute, process) DO UPDATE
   SET finished = run_stats.finished + excluded.finished,
       refused = run_stats.refused + excluded.refused,
       takeovers = run_stats.takeovers + excluded.takeovers,
       died = run_stats.died + excluded.died
"""


def record(conn: psycopg.Connection[Any], process: str, counts: dict[str, int], now: int | None = None) -> None:
    """Add `counts` (any of FIELDS) to this process's row for the current minute."""
    conn.execute(RECORD, {"process": process, "now": now,
                          **{name: counts.get(name, 0) for name in FIELDS}})


# Spans processes (operator view): the fleet's counts per minute over the last
# `minutes` minutes, oldest first, one row for every minute (zeros where none).
# Reads the primary key's range for those minutes only.
LAST_MINUTES = f"""
WITH clock AS (
    SELECT {NOW} / 60 * 60 AS minute
), span AS (
    SELECT generate_series(clock.minute - (%(minutes)s - 1) * 60, clock.minute, 60) AS minute
      FROM clock
)
SELECT s.minute,
       coalesce(sum(r.finished), 0)::bigint AS finished,
       coalesce(sum(r.refused), 0)::bigint AS refused,
       coalesce(sum(r.takeovers), 0)::bigint AS takeovers,
       coalesce(sum(r.died), 0)::bigint AS died
  FROM span s
  LEFT JOIN run_stats r ON r.minute = s.minute
 GROUP BY s.minute
 ORDER BY s.minute
"""


def last_minutes(conn: psycopg.Connection[Any], minutes: int = 60, now: int | None = None) -> list[dict[str, Any]]:
    """[{"minute", "finished", "refused", "takeovers", "died"}], oldest first."""
    rows = conn.execute(LAST_MINUTES, {"minutes": minutes, "now": now}).fetchall()
    return [dict(zip(("minute", *FIELDS), row)) for row in rows]
