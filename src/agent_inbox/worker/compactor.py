"""The compactor: every worker looks at `wakes` and `leases` every INTERVAL
seconds and compacts them when their dead tuples call for it
(store/compaction.py: one compactor at a time across the fleet, a lock asked
for briefly and given up if not granted).

It is a thread of its own, on one of the worker's pool connections taken for
each look, so a look that waits for its lock never holds up a renewal, a take
or a finish of this worker beyond what it does to everyone's (LOCK_TIMEOUT_MS).
"""

import logging
import os
import threading

from agent_inbox import metrics
from agent_inbox.inbox import Inbox
from agent_inbox.store import compaction

log = logging.getLogger("agent_inbox.worker")

# seconds between looks (AGENT_INBOX_COMPACT_INTERVAL; 0 turns it off)
INTERVAL = float(os.environ.get("AGENT_INBOX_COMPACT_INTERVAL", "1"))
# What `look` answers where compaction is not done (Inbox.compact: None).
NOT_HERE = "not done on this database"


class Compactor(threading.Thread):
    def __init__(self, inbox: Inbox, stop: threading.Event, *, interval: float = INTERVAL,
                 **options):
        super().__init__(name="agent-inbox-compactor", daemon=True)
        self.inbox, self.stop, self.interval, self.options = inbox, stop, interval, options

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
            if done.outcome == compaction.COMPACTED:
                metrics.COMPACTIONS.labels(done.table, "compacted").inc()
                log.debug("%s compacted: %d dead tuples dropped, %d rows kept", done.table,
                          done.dead, done.kept)
            elif done.outcome == compaction.NOT_GRANTED:
                metrics.COMPACTIONS.labels(done.table, "lock_not_granted").inc()
        return looks
