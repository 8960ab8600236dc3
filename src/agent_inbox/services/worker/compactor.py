"""The compactor: every worker looks at `wakes` and `leases` every INTERVAL
seconds and compacts them when their dead tuples call for it
(store/compaction.py: one compactor at a time across the fleet, a lock asked
for briefly and given up if not granted).

It is a thread of its own, on one of the worker's pool connections taken for
each look, so a look that waits for its lock never holds up a renewal, a take
or a finish of this worker beyond what it does to everyone's (LOCK_TIMEOUT_MS).

A table whose rewrite has been refused its lock for `warn_after` seconds in a
row (a pg_dump holds ACCESS SHARE on every table it dumps until it ends) is
reported: the gauge agent_inbox_compaction_refused_seconds{table} says for how
long, and a warning names the sessions holding a lock on it (horizon.lockers),
at most once per table every `repeat` seconds; an info line says when it is
no longer refused.
"""

import logging
import os
import threading
import time
from collections.abc import Callable

from agent_inbox.services.worker import horizon
from agent_inbox import metrics
from agent_inbox.api.inbox import Inbox
from agent_inbox import records

log = logging.getLogger("agent_inbox.worker")

# seconds between looks (AGENT_INBOX_COMPACT_INTERVAL; 0 turns it off)
INTERVAL = float(os.environ.get("AGENT_INBOX_COMPACT_INTERVAL", "1"))
# What `look` answers where compaction is not done (Inbox.compact: None).
NOT_HERE = "not done on this database"


# seconds a table's rewrite may be refused its lock before a warning, and
# before the same table is warned about again
WARN_AFTER = 60.0
REPEAT = 600.0


class Compactor(threading.Thread):
    """`options` go to Inbox.compact (store/compaction.py's)."""

    def __init__(self, inbox: Inbox, stop: threading.Event, *, interval: float = INTERVAL,
                 warn_after: float = WARN_AFTER, repeat: float = REPEAT,
                 clock: Callable[[], float] = time.monotonic, **options):
        super().__init__(name="agent-inbox-compactor", daemon=True)
        self.inbox, self.stop, self.interval, self.options = inbox, stop, interval, options
        self.warn_after, self.repeat, self.clock = warn_after, repeat, clock
        self._refused_since: dict[str, float] = {}  # table -> first refusal in a row
        self._warned_at: dict[str, float] = {}

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            if self.look() is NOT_HERE:
                return

    def look(self):
        """One look: a Compaction per table; None if it failed (logged);
        NOT_HERE where compaction is not done (Citus: the thread then ends)."""
        try:
            looks = self.inbox.compact(**self.options)
        except Exception as exc:  # a failed look must not end the thread
            log.warning("compaction failed: %s", str(exc).strip() or type(exc).__name__)
            return None
        if looks is None:
            return NOT_HERE
        for done in looks:
            if done.outcome == records.COMPACTED:
                metrics.COMPACTIONS.labels(done.table, "compacted").inc()
                log.debug("%s compacted: %d dead tuples dropped, %d rows kept", done.table,
                          done.dead, done.kept)
            elif done.outcome == records.NOT_GRANTED:
                metrics.COMPACTIONS.labels(done.table, "lock_not_granted").inc()
            self._watch_refusals(done)
        return looks

    def _watch_refusals(self, done: records.Compaction) -> None:
        """Keep the refused-lock gauge and warning of `done.table` (see the module)."""
        table, now = done.table, self.clock()
        if done.outcome == records.BUSY:  # another worker's compactor looks meanwhile
            return
        if done.outcome != records.NOT_GRANTED:
            if table in self._refused_since:
                log.info("compaction of %s is no longer refused its lock (%s) after %.0f s",
                         table, done.outcome, now - self._refused_since.pop(table))
                self._warned_at.pop(table, None)
                metrics.COMPACTION_REFUSED_SECONDS.labels(table).set(0)
            return
        since = self._refused_since.setdefault(table, now)
        metrics.COMPACTION_REFUSED_SECONDS.labels(table).set(now - since)
        warned = self._warned_at.get(table)
        if now - since < self.warn_after or (warned is not None and now - warned < self.repeat):
            return
        self._warned_at[table] = now
        try:
            with self.inbox.pool.connection(timeout=10) as conn:
                holders = horizon.lockers(conn, table)
        except Exception as exc:  # the warning goes out without its names
            holders = []
            log.debug("could not read who holds %s: %s", table, exc)
        log.warning(
            "compaction of %s has been refused its table lock for %.0f s, so its dead row "
            "versions pile up while the xmin horizon is held back: %s (a pg_dump holds "
            "ACCESS SHARE on every table until it ends; docs: A transaction held open "
            "elsewhere)", table, now - since,
            "; ".join(f"{holder.describe()} holds {modes}" for holder, modes in holders)
            or "no session holds a lock on it now")
