"""This process's counts for its run_stats row (the console's chart), added by
the producer (takeovers, dead events) and the completer (finished, refused)."""

import logging
import threading

from agent_inbox import db
from agent_inbox.store import stats

log = logging.getLogger("agent_inbox.worker")


class RunStats:
    def __init__(self, inbox, holder: str):
        self._inbox, self._holder = inbox, holder
        self._guard = threading.Lock()
        self._pending = dict.fromkeys(stats.FIELDS, 0)  # not yet added to the row

    def count(self, **counts: int) -> None:
        """Add counts to the row, in a statement of its own; kept for the next
        write if this one fails."""
        with self._guard:
            for name, value in counts.items():
                self._pending[name] += value
            pending, self._pending = self._pending, dict.fromkeys(stats.FIELDS, 0)
        if not any(pending.values()):
            return
        try:
            with db.connection(self._inbox.pool) as conn:
                stats.record(conn, self._holder, pending)
        except Exception as exc:  # statistics never stop a run's path
            log.warning("run statistics not written (%s); kept for the next write", exc)
            with self._guard:
                for name, value in pending.items():
                    self._pending[name] += value
