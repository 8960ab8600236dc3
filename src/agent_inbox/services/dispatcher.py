"""The dispatcher service: held outbox messages go out through a channel, paced,
up to `concurrency` users' batches at once, with no database connection or lock
held while a channel sends.

A channel is `send(user, text, key)`; `key` names the batch of outbox rows
(`<user>:<batch>`), the same when a batch is resent, so a channel can drop the
repeat. A channel raises to refuse a batch: `PermanentSendError` parks it
`failed` at once, anything else is retried with backoff until
`max_send_attempts`. A pass claims due users in one short transaction
(store/outbox.py: each batch claimed until its send deadline), sends their
batches on a pool of threads, and records what happened as sends end, many per
transaction; it claims more as places free up. Safe to run as many copies as
you like: a claim is fenced, so two dispatchers never send one batch inside its
deadline, and per user at most one batch per outbox gap (an urgent message goes
at once, with whatever else is held).
"""

import logging
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from agent_inbox import errors, metrics, tracing, validate
from agent_inbox.api.delivery import describe
from agent_inbox.api.inbox import Inbox
from agent_inbox.services.service import Listener, Stop, Waker, serve, wake_on_stop
from agent_inbox import notify
from agent_inbox.records import Batch, Failure

log = logging.getLogger("agent_inbox.dispatcher")

# Most users one claim statement looks at.
CLAIM_CAP = 500
# Sends that end within this long of the first one waiting are recorded together.
GATHER_SECONDS = 0.02
# Between passes at least this long: users still due after a pass are held by
# other dispatchers (a new message wakes this one through its notification).
CONTENDED_PAUSE = 0.5
# Held messages of users with no delivery row (queued by a worker older than
# this schema) are looked for this often.
ADOPT_EVERY = 60.0
# While sends are in flight a pass claims again at least this often (and at
# once when a notification says a message was queued): one slow send never
# holds back the users queued behind it.
RECLAIM_SECONDS = 1.0


@dataclass
class Sent:
    batch: Batch
    error: BaseException | None


# Put on the queue of ended sends by a notification: claim again now.
WAKE = None


class Dispatcher:
    def __init__(self, inbox: Inbox, channel, *, concurrency: int = 16,
                 poll_interval: float = 5.0, at_most_once: bool = False,
                 stop: Stop | None = None):
        self.inbox = inbox
        self.channel = channel
        self.concurrency = validate.positive_int("concurrency", concurrency)
        self.at_most_once = at_most_once
        self.poll_interval = poll_interval
        self.stop = stop or Stop()
        self.waker = Waker(1)
        self._senders = ThreadPoolExecutor(self.concurrency, thread_name_prefix="agent-inbox-send")
        self._ended: queue.SimpleQueue[Sent | None] = queue.SimpleQueue()
        self._unrecorded: list[Sent] = []
        self._in_flight = 0
        self._adopted_at = float("-inf")
        self._repaced_at = float("-inf")

    def run_once(self, *, now: int | None = None) -> float | None:
        """Send every batch that is due, `concurrency` at a time, recording each
        outcome, until none is left to claim and every send has ended; then the
        seconds until a user is next due (None: nothing held). The first pass,
        and one a minute after, applies this dispatcher's gap to users paced by
        a longer one (`Inbox.delivery.repace`): lowering --outbox-gap releases messages
        already held."""
        self._record(now)
        self.repace(now=now)
        while True:
            free = self.concurrency - self._in_flight
            if free and not self.stop.is_set() and (
                    self._in_flight == 0 or free >= max(1, self.concurrency // 10)):
                asked = min(free, CLAIM_CAP)
                looked, batches = self.inbox.delivery.claim_due(asked, now=now)
                for batch in batches:
                    self._start(batch, now)
                if looked < asked and self._in_flight == 0:
                    break
            elif self._in_flight == 0:
                break
            self._gather(timeout=RECLAIM_SECONDS if self._in_flight else 0)
            self._record(now)
        self._record(now)
        pause = self.inbox.delivery.seconds_to_next_delivery(now=now)
        return None if pause is None else max(pause, CONTENDED_PAUSE)

    def _start(self, batch: Batch, now: int | None) -> None:
        if self.at_most_once and not self.inbox.delivery.mark_sent([batch], now=now):
            return  # its claim was taken over: the other dispatcher sends it
        self._in_flight += 1
        self._senders.submit(self._send, batch)

    def _send(self, batch: Batch) -> None:
        try:
            with tracing.send(batch):  # a child of its first message's run
                self.channel(batch.user, batch.text, batch.key)
            self._ended.put(Sent(batch, None))
        except BaseException as exc:  # any failure is this batch's, never the dispatcher's
            self._ended.put(Sent(batch, exc))

    def _wake(self) -> None:
        """A message was queued: wake the idle loop, or a pass waiting on sends."""
        self.waker.wake_one()
        self._ended.put(WAKE)

    def _take(self, ended: Sent | None) -> bool:
        """Keep an ended send's outcome; False for a wake-up."""
        if ended is WAKE:
            return False
        self._unrecorded.append(ended)
        self._in_flight -= 1
        return True

    def _gather(self, timeout: float | None) -> None:
        """Wait for a send to end or a wake-up (at most `timeout` seconds),
        then take every other send that ends within GATHER_SECONDS."""
        try:
            first = self._ended.get(timeout=timeout) if timeout != 0 else self._ended.get_nowait()
        except queue.Empty:
            return
        if not self._take(first):
            return
        deadline = time.monotonic() + GATHER_SECONDS
        while (left := deadline - time.monotonic()) > 0:
            try:
                self._take(self._ended.get(timeout=left))
            except queue.Empty:
                break

    def _record(self, now: int | None) -> None:
        """Write the outcomes of ended sends (kept for the next pass if the
        database is unavailable: the sends' claims hold meanwhile; dropped if
        PostgreSQL refuses them, so they cannot wedge every later pass: their
        batches go again under the same keys once their claims run out)."""
        while True:
            try:
                self._take(self._ended.get_nowait())
            except queue.Empty:
                break
        if not self._unrecorded:
            return
        ended, self._unrecorded = self._unrecorded, []
        try:
            self._write(ended, now)
        except errors.DatabaseRefused as exc:
            log.error("%d send outcomes not recorded (%s): their batches go again after "
                      "their claims run out", len(ended), exc)
        except BaseException:
            self._unrecorded = ended + self._unrecorded
            raise

    def _write(self, ended: list[Sent], now: int | None) -> None:
        sent = [s.batch for s in ended if s.error is None]
        failed = [Failure(s.batch, describe(s.error), isinstance(s.error, errors.PermanentSendError))
                  for s in ended if s.error is not None]
        if not self.at_most_once:  # else they were marked sent before they were sent
            marked = {(b.user, b.batch) for b in self.inbox.delivery.mark_sent(sent, now=now)}
            for b in sent:
                if (b.user, b.batch) not in marked:
                    log.warning("sent user=%s batch=%s after its claim ran out: another "
                                "dispatcher sends it again under the same key", b.user, b.batch)
        outcomes = {} if self.at_most_once else self.inbox.delivery.record_failed(failed, now=now)
        for b in sent:
            metrics.SENDS.inc()
            metrics.MESSAGES_SENT.inc(len(b.ids))
            log.info("sent user=%s messages=%d key=%s", b.user, len(b.ids), b.key)
        for f in failed:
            parked = outcomes.get((f.batch.user, f.batch.batch))
            if self.at_most_once:
                metrics.SEND_FAILURES.labels("lost").inc()
                log.error("send failed user=%s key=%s: %s; batch lost (--at-most-once marked "
                          "it sent first)", f.batch.user, f.batch.key, f.error)
                continue
            metrics.SEND_FAILURES.labels("parked" if parked else "retried").inc()
            if parked is None:
                log.warning("send failed user=%s key=%s after its claim ran out: %s",
                            f.batch.user, f.batch.key, f.error)
            elif parked:
                log.error("send failed user=%s key=%s: %s; batch parked failed (agent-inbox "
                          "outbox retry %d)", f.batch.user, f.batch.key, f.error, f.batch.batch)
            else:
                log.warning("send failed user=%s key=%s: %s; retried after a backoff",
                            f.batch.user, f.batch.key, f.error)

    def repace(self, *, now: int | None = None) -> None:
        """At most every ADOPT_EVERY seconds (the first pass at once): users paced
        by a longer gap than this dispatcher's are due by its gap."""
        if time.monotonic() - self._repaced_at < ADOPT_EVERY:
            return
        repaced = self.inbox.delivery.repace(now=now)
        self._repaced_at = time.monotonic()
        if repaced:
            log.info("%d users paced by a longer gap than %d s: due by this one", repaced,
                     self.inbox.settings.outbox_gap)

    def adopt_held(self, *, now: int | None = None) -> None:
        """At most every ADOPT_EVERY seconds: make users due whose held messages
        no dispatcher is due to look at (queued by a worker older than this schema;
        never on Citus, which no such worker ran on)."""
        if not self.inbox.delivery.adopts_held_messages or time.monotonic() - self._adopted_at < ADOPT_EVERY:
            return
        adopted = self.inbox.delivery.adopt_held(now=now)
        self._adopted_at = time.monotonic()
        if adopted:
            log.info("%d users with held messages and no delivery due: looked at now", adopted)

    def _pass(self) -> float | None:
        self.adopt_held()
        return self.run_once()

    def serve(self, url: str | None) -> None:
        """Until stopped; then the sends in flight end and are recorded. LISTEN
        on `url` (None: poll only, as behind a transaction pooler)."""
        Listener(url, [notify.OUTBOX], self._wake, self.stop).start()
        wake_on_stop(self.stop, self.waker)
        log.info("dispatcher started: concurrency %d, outbox gap %d s, send timeout %d s, %s, "
                 "%s", self.concurrency, self.inbox.settings.outbox_gap, self.inbox.settings.send.timeout,
                 "at most once" if self.at_most_once else "at least once",
                 "listening" if url else f"polling every {self.poll_interval:g} s")
        try:
            serve("dispatcher", self._pass, self.waker.wait, self.stop, self.poll_interval)
            self._drain()
        finally:
            self._senders.shutdown(wait=False)

    def _drain(self) -> None:
        """At shutdown: wait for the sends in flight, and record them."""
        while self._in_flight or self._unrecorded:
            if self._in_flight:
                log.info("stopping: waiting for %d sends in flight", self._in_flight)
                self._gather(timeout=None)
            try:
                self._record(None)
            except errors.DatabaseUnavailable as exc:
                log.warning("stopping: %d outcomes not recorded (%s); their batches are sent "
                            "again after their claims run out", len(self._unrecorded), exc)
                return

