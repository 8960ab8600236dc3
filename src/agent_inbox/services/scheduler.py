"""The scheduler service: due timers become inbox events, across all users.

Safe to run on every host at once, with no leader: due rows are taken with FOR
UPDATE SKIP LOCKED and each occurrence has its own event key (store/timers.py).
Between passes it sleeps until the next due timer, a notification that a timer
was created or replaced, or the polling interval, whichever comes first; due
timers another scheduler holds are retried after a short backoff, not at once.
"""

import logging

from agent_inbox.api.inbox import Inbox
from agent_inbox.services.service import Listener, Stop, Waker, jittered, serve, wake_on_stop
from agent_inbox import notify

log = logging.getLogger("agent_inbox.scheduler")

# Seconds a scheduler waits for due timers another scheduler holds.
HELD_BACKOFF = 1.0


class Scheduler:
    def __init__(self, inbox: Inbox, *, poll_interval: float = 5.0, stop: Stop | None = None):
        self.inbox = inbox
        self.poll_interval = poll_interval
        self.stop = stop or Stop()
        self.waker = Waker(1)

    def run_once(self, *, now: int | None = None) -> float | None:
        """Fire every due timer it can take; the seconds to sleep (None: no timer
        left). A due timer left after the pass is held by another scheduler's
        transaction (or fell due just now): never 0 then, but HELD_BACKOFF
        (jittered), or less if a later timer falls due sooner."""
        fired = self.inbox.run_scheduler(now=now)
        if fired:
            log.info("fired %d timers", fired)
        left, seconds = self.inbox.scheduling.next_timer(now=now)
        if not left:
            return seconds
        backoff = jittered(HELD_BACKOFF)
        return backoff if seconds is None else min(seconds, backoff)

    def serve(self, url: str | None) -> None:
        Listener(url, [notify.TIMERS], self.waker.wake_one, self.stop).start()
        wake_on_stop(self.stop, self.waker)
        log.info("scheduler started: %s", "listening" if url
                 else f"polling every {self.poll_interval:g} s")
        serve("scheduler", self.run_once, self.waker.wait, self.stop, self.poll_interval)
