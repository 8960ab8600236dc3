"""The scheduler service: due timers become inbox events, across all users.

Safe to run on every host at once, with no leader: due rows are taken with FOR
UPDATE SKIP LOCKED and each occurrence has its own event key (store/timers.py).
Between passes it sleeps until the next due timer, a notification that a timer
was created or replaced, or the polling interval, whichever comes first.
"""

import logging

from agent_inbox import db
from agent_inbox.inbox import Inbox
from agent_inbox.service import Listener, Stop, Waker, serve
from agent_inbox.store import notify, timers

log = logging.getLogger("agent_inbox.scheduler")


class Scheduler:
    def __init__(self, inbox: Inbox, *, poll_interval: float = 5.0, stop: Stop | None = None):
        self.inbox = inbox
        self.poll_interval = poll_interval
        self.stop = stop or Stop()
        self.waker = Waker(1)

    def run_once(self, *, now: int | None = None) -> float | None:
        """Fire every due timer; the seconds until the next one is due (None: none)."""
        fired = self.inbox.run_scheduler(now=now)
        if fired:
            log.info("fired %d timers", fired)
        with db.connection(self.inbox.pool) as conn:
            return timers.seconds_to_next_due(conn, now)

    def serve(self, url: str) -> None:
        Listener(url, [notify.TIMERS], self.waker.wake_one, self.stop).start()
        serve("scheduler", self.run_once, self.waker.wait, self.stop, self.poll_interval)
