"""The compactor: every worker looks at `wakes` every INTERVAL seconds and
compacts it when its dead tuples call for it (store/wakes.py: one compactor at
a time across the fleet, a lock asked for briefly and given up if not granted).

It is a thread of its own, on one of the worker's pool connections taken for
each look, so a look that waits for its lock never holds up a renewal, a take
or a finish of this worker beyond what it does to everyone's (LOCK_TIMEOUT_MS).
"""

import logging
import os
import threading

from agent_inbox import metrics
from agent_inbox.inbox import Inbox
from agent_inbox.store import wakes

log = logging.getLogger("agent_inbox.worker")

# seconds between looks (AGENT_INBOX_COMPACT_INTERVAL; 0 turns it off)
INTERVAL = float(os.environ.get("AGENT_INBOX_COMPACT_INTERVAL", "1"))
# What `look` answers where compaction is not done (Inbox.compact_wakes: None).
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
        """One look: its Compaction; None if it failed (logged); NOT_HERE
        where compaction is not done (Citus: the thread then ends)."""
        try:
            done = self.inbox.compact_wakes(**self.options)
        except Exception as exc:  # a failed look must not end the thread
            log.warning("compacting wakes failed: %s", str(exc).strip() or type(exc).__name__)
            return None
        if done is None:
            return NOT_HERE
        if done.outcome == wakes.COMPACTED:
            metrics.WAKES_COMPACTED.labels("compacted").inc()
            log.debug("wakes compacted: %d dead tuples dropped, %d wakes kept", done.dead,
                      done.kept)
        elif done.outcome == wakes.NOT_GRANTED:
            metrics.WAKES_COMPACTED.labels("lock_not_granted").inc()
        return done
