"""The chaos suite's workload, and the database probe it waits on.

Users and events (a few of them poison), recurring timers, a preload ingested
before the services start and a paced feed that keeps ingesting through the
faults, so the faults land on runs in flight. Ingest is retried through a server
restart; a retry after a commit whose reply was lost is a duplicate delivery,
which the inbox must absorb (the final check counts every event key once).
Every wait in the suite polls the database through `Probe`, with a deadline.
"""

import random
import threading
import time
from dataclasses import dataclass

import psycopg

from agent_inbox import DatabaseUnavailable, Inbox

SOURCE = "chat"


@dataclass(frozen=True)
class Item:
    user: str
    source_id: str
    payload: dict


@dataclass(frozen=True)
class TimerSpec:
    user: str
    timer_id: str
    every: int
    first_due: int = 0


def user_name(n: int) -> str:
    return f"user-{n:04d}"


def build_events(rng: random.Random, *, users: int, healthy: int, poison: int,
                 preload: int) -> tuple[list[Item], list[Item], list[Item]]:
    """(preloaded, streamed, poison) items: `healthy` events spread over `users`,
    the first `preload` of them ingested up front; `poison` events for distinct
    users, ingested by the fault schedule."""
    items = [Item(user_name(rng.randrange(users)), f"m{n}", {"n": n, "text": f"hello {n}"})
             for n in range(healthy)]
    poison_items = [Item(user_name(user), f"poison{k}", {"poison": True, "k": k})
                    for k, user in enumerate(rng.sample(range(users), poison))]
    return items[:preload], items[preload:], poison_items


def ingest_retrying(inbox: Inbox, item: Item, retry_for: float) -> tuple[bool, bool]:
    """(stored, retried): ingest once, retrying while the database is away."""
    deadline = time.monotonic() + retry_for
    retried = False
    while True:
        try:
            return inbox.ingest(item.user, SOURCE, item.source_id, item.payload), retried
        except DatabaseUnavailable:
            if time.monotonic() > deadline:
                raise
            retried = True
            time.sleep(0.2)


def ingest_now(url: str, items: list[Item]) -> None:
    """Ingest a few items at once (the poison faults)."""
    with Inbox.connect(url, pool_size=1, application_name="chaos-poisoner") as inbox:
        for item in items:
            ingest_retrying(inbox, item, 30.0)


def db_now(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute("SELECT floor(extract(epoch FROM clock_timestamp()))::bigint").fetchone()[0]


def add_timers(url: str, specs: list[TimerSpec], *, start_in: int = 2) -> list[TimerSpec]:
    """Arm recurring timers, first due `start_in` seconds from the database's now;
    the specs with their first due time (the grid each occurrence must sit on)."""
    due = db_now(url) + start_in
    armed = [TimerSpec(s.user, s.timer_id, s.every, due) for s in specs]
    with Inbox.connect(url, pool_size=1) as inbox:
        for spec in armed:
            inbox.add_timer(spec.user, spec.timer_id, spec.first_due, {"timer": spec.timer_id},
                            every=spec.every)
    return armed


class Feeder:
    """Ingest `items` over `seconds` (0: as fast as possible) from `threads`
    connections, item k not before start + k * seconds / len(items)."""

    def __init__(self, url: str, items: list[Item], *, seconds: float, threads: int = 4,
                 retry_for: float = 60.0):
        self.url, self.items, self.seconds = url, items, seconds
        self.retry_for = retry_for
        self.stored = self.duplicates = self.retries = 0
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._feed, args=(i, threads), daemon=True,
                                          name=f"chaos-feeder-{i}") for i in range(threads)]
        self._start = 0.0

    def start(self) -> "Feeder":
        self._start = time.monotonic()
        for thread in self._threads:
            thread.start()
        return self

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), "the feeder did not finish in time"
        if self.errors:
            raise self.errors[0]

    def done(self) -> bool:
        return not any(t.is_alive() for t in self._threads)

    def _feed(self, first: int, step: int) -> None:
        try:
            with Inbox.connect(self.url, pool_size=1, application_name="chaos-feeder") as inbox:
                pace = self.seconds / max(1, len(self.items))
                for k in range(first, len(self.items), step):
                    delay = self._start + k * pace - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    self._ingest(inbox, self.items[k])
        except BaseException as exc:  # reported by join()
            self.errors.append(exc)

    def _ingest(self, inbox: Inbox, item: Item) -> None:
        stored, retried = ingest_retrying(inbox, item, self.retry_for)
        with self._lock:
            self.retries += retried
            if stored:
                self.stored += 1
            else:
                self.duplicates += 1


# done / open / running / dead events, poison ones dead, messages not yet sent, and healthy
# events with a retry outstanding: pending after an attempt, running a retry, or
# left running by a run whose lease is gone (its takeover has not come yet).
COUNTS = """
SELECT count(*) FILTER (WHERE status = 'done'),
       count(*) FILTER (WHERE status IN ('pending', 'running')),
       count(*) FILTER (WHERE status = 'running'),
       count(*) FILTER (WHERE status = 'dead'),
       count(*) FILTER (WHERE status = 'dead' AND payload ? 'poison'),
       (SELECT count(*) FROM outbox WHERE sent_at IS NULL),
       (SELECT count(*) FROM events e JOIN leases l USING (user_id)
         WHERE e.status IN ('pending', 'running') AND NOT e.payload ? 'poison'
           AND (e.status = 'pending' AND e.attempts > 0
                OR e.status = 'running'
                   AND (e.attempts > 1 OR e.claim_gen <> l.gen
                        OR l.until < floor(extract(epoch FROM clock_timestamp())))))
  FROM events
"""


class Probe:
    """Counts read from the database; survives the server going away."""

    def __init__(self, url: str):
        self.url = url
        self._conn = None

    def counts(self) -> dict | None:
        try:
            if self._conn is None or self._conn.closed:
                self._conn = psycopg.connect(self.url, autocommit=True, connect_timeout=2,
                                             application_name="chaos-probe")
            done, open_, running, dead, poison_dead, unsent, retrying = \
                self._conn.execute(COUNTS).fetchone()
        except psycopg.Error:
            self.close()
            return None
        return {"done": done, "open": open_, "running": running, "dead": dead, "poison_dead": poison_dead,
                "unsent": unsent, "retrying": retrying}

    def wait(self, what: str, predicate, timeout: float) -> dict:
        """Poll until `predicate(counts)` holds; AssertionError after `timeout`."""
        deadline = time.monotonic() + timeout
        counts = None
        while True:
            counts = self.counts() or counts
            if counts is not None and predicate(counts):
                return counts
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; "
                                     f"last counts {counts}")
            time.sleep(0.2)

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except psycopg.Error:
                pass
            self._conn = None
