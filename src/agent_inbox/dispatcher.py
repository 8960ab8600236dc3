"""The dispatcher service: held outbox messages go out through a channel, paced.

A channel is `send(user, text, key)`; `key` names the batch of outbox rows
(`<user>:<batch>`), the same when a batch is resent after a crash, so a channel
can drop the repeat. Delivery is at-least-once (send, then mark sent) unless the
dispatcher runs with --at-most-once (mark, then send). Per user, at most
one send per outbox gap, except that an urgent message goes at once (with
whatever else is held). Safe to run as many copies as you like: each user's
dispatch holds a per-user lock from choosing its batch to marking it sent
(store/outbox.py).
"""

import logging

from agent_inbox import db, errors, metrics
from agent_inbox.inbox import Inbox
from agent_inbox.service import Listener, Stop, Waker, serve
from agent_inbox.store import notify, outbox

log = logging.getLogger("agent_inbox.dispatcher")

# Users looked at per pass; a pass that fills it runs again at once.
USERS_PER_PASS = 1000


class Dispatcher:
    def __init__(self, inbox: Inbox, channel, *, poll_interval: float = 5.0,
                 at_most_once: bool = False, stop: Stop | None = None):
        self.inbox = inbox
        self.channel = channel
        self.at_most_once = at_most_once
        self.poll_interval = poll_interval
        self.stop = stop or Stop()
        self.waker = Waker(1)

    def run_once(self, *, now: int | None = None) -> float | None:
        """Dispatch for every user with a send due; 0 to run again at once when the
        pass was full, else None (sleep the polling interval)."""
        with db.connection(self.inbox.pool) as conn:
            users = outbox.users_due(conn, self.inbox.outbox_gap, now, USERS_PER_PASS)
        for user in users:
            try:
                sent = self.inbox.dispatch_batch(
                    user, lambda text, key, user=user: self.channel(user, text, key),
                    at_most_once=self.at_most_once, now=now)
            except errors.DatabaseUnavailable:
                raise
            except Exception as exc:  # the channel failed: this user's batch waits
                log.warning("send failed user=%s: %s", user, exc)
                continue
            if sent:
                metrics.SENDS.inc()
                metrics.MESSAGES_SENT.inc(sent)
                log.info("sent user=%s messages=%d", user, sent)
        return 0.0 if len(users) == USERS_PER_PASS else None

    def serve(self, url: str) -> None:
        Listener(url, [notify.OUTBOX], self.waker.wake_one, self.stop).start()
        serve("dispatcher", self.run_once, self.waker.wait, self.stop, self.poll_interval)
