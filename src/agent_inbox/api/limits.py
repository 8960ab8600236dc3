"""Limits shared by the fleet: `await ctx.limit("llm", cost=1)` waits until the
named budget allows it.

A limit is a token bucket kept in PostgreSQL (table `limits`, store/limits.py):
`rate` tokens come in per `per` seconds, and the bucket holds at most `burst`
(what may go at once after a quiet spell; `limits set` makes it the rate unless
told). Every worker on every host takes from the same row, by the database's
clock, so the fleet as a whole stays within `burst + rate * T / per` over any
span of T seconds.

In a process, one `Limiter` (per Inbox: `Inbox.limiter`) serves every run:

- callers queue per limit, first come first served; a waiting run holds no
  connection (an async one awaits a future, a thread waits on an event);
- the limiter's own thread asks the database for tokens, one statement per
  grant, for everything waiting at once (a chunk), and hands them out in
  arrival order as soon as they come: no tokens are kept in the process for
  later, so a token the database gave is used at once (the fleet bound above
  holds for what the callers are let through, not only for the grants);
- when the bucket is short, it waits (without the database) until the refill
  covers what waits, CHUNK_SECONDS of the rate at most, and asks again: a
  busy process pays about one statement per CHUNK_SECONDS, however many calls
  it serves; it asks at least every MAX_SLEEP seconds while callers wait, so
  a change by `limits set` is seen within that, at the next grant.

A cost above the limit's burst could never be granted: it fails at once
(`errors.CostAboveBurst`), as does a limit the database does not hold
(`errors.UnknownLimit`); neither takes anything.

Tokens taken for a caller that gave up meanwhile (its run was cancelled) go to
the next caller in line, or, if nobody waits, are dropped: they count as used,
which keeps the bound. With costs above 1, a process may keep a few tokens
(fewer than its next caller's cost) until its next grant.

Fairness across processes is the row's: a process that asks when tokens are
there gets them, and each asks again as soon as the refill covers what waits
for it; within a process it is arrival order.
"""

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from agent_inbox import db, errors, validate
from agent_inbox.store import limits as store

log = logging.getLogger("agent_inbox.limits")

MAX_NAME_BYTES = 200
# A process short of tokens asks again once the refill covers what waits, or
# this many seconds' worth of the rate if less waits... whichever is less.
CHUNK_SECONDS = 0.25
# ... and at least this often while callers wait (a changed limit is seen).
MAX_SLEEP = 1.0
# The limiter's thread ends after this long with nobody waiting (the next
# caller starts another).
IDLE_EXIT = 30.0
# Backoff when the database does not answer a grant (callers keep waiting).
RETRY_FIRST, RETRY_CAP = 0.1, 2.0
# Whoever changes a limit from code (declare, set_limit without an actor).
APP_ACTOR = "app"


def check_name(name: object) -> str:
    return validate.text("limit name", name, MAX_NAME_BYTES)


def check_cost(cost: object) -> int:
    if isinstance(cost, bool) or not isinstance(cost, int) or cost <= 0:
        raise errors.InvalidInput("cost", cost, "must be a positive whole number of tokens")
    return cost


def check_limit(name: object, rate: object, per: object,
                burst: object = None) -> tuple[str, int, int, int]:
    """(name, rate, per, burst) checked; burst None means the rate."""
    name = check_name(name)
    rate = validate.positive_int("rate", rate)
    per = validate.positive_int("per", per)
    burst = rate if burst is None else validate.positive_int("burst", burst)
    return name, rate, per, burst


# --- the database side, for operators and apps ---------------------------------------


def set_limit(inbox, name: str, rate: int, per: int, burst: int | None = None, *,
              actor: str = APP_ACTOR) -> dict:
    """Make or change a limit (what `agent-inbox limits set` does): `rate`
    tokens per `per` seconds, at most `burst` at once (default: the rate). A new
    limit starts full; a changed one keeps what its bucket holds (no more than
    the new burst). Every worker uses it from its next grant. Returns
    {"name", "before": {rate, per_seconds, burst} or None, "after": {...}}."""
    name, rate, per, burst = check_limit(name, rate, per, burst)
    actor = validate.text("actor", actor)
    with db.connection(inbox.pool) as conn:
        return store.set_limit(conn, name, rate, per, burst, actor)


def declare(inbox, name: str, rate: int, per: int, burst: int | None = None) -> bool:
    """An application's default for a limit: made (full) if the database has
    none of that name, else left as it stands, so an operator's `limits set`
    wins over the code. True if it was made. Safe to call from every process
    at start."""
    name, rate, per, burst = check_limit(name, rate, per, burst)
    with db.connection(inbox.pool) as conn:
        return store.declare(conn, name, rate, per, burst, APP_ACTOR)


def list_limits(inbox) -> list[dict]:
    """Every limit: name, rate, per_seconds, burst, tokens (in the bucket now),
    updated_at, updated_by."""
    with db.connection(inbox.pool) as conn:
        return store.list_limits(conn)


# --- the process side ------------------------------------------------------------------


@dataclass(eq=False)
class _Waiter:
    cost: int
    deliver: Callable[[BaseException | None], None]
    queued: bool = True


@dataclass(eq=False)
class _Bucket:
    """One limit as this process sees it."""

    queue: collections.deque = field(default_factory=collections.deque)
    balance: int = 0          # taken from the database, not handed out yet
    due: float = 0.0          # when to ask the database next (monotonic)
    retry: float = 0.0        # the current backoff, while the database fails


class Limiter:
    """A process's side of the fleet's limits (see the module). Thread-safe;
    callers on any event loop or thread."""

    def __init__(self, pool, *, clock: Callable[[], float] = time.monotonic):
        self._pool = pool
        self._clock = clock
        self._guard = threading.Condition()
        self._buckets: dict[str, _Bucket] = {}
        self._thread: threading.Thread | None = None
        self._closed = False
        self.statements = 0   # grant statements sent
        self.tokens = 0       # tokens the database granted
        self.calls = 0        # callers let through
        # (name, taken, at: the database's clock) of every grant, if a list
        # (tests and benchmarks set one)
        self.grant_log: list | None = None

    def stats(self) -> dict:
        with self._guard:
            return {"statements": self.statements, "tokens": self.tokens, "calls": self.calls,
                    "waiting": sum(len(b.queue) for b in self._buckets.values())}

    # --- callers

    async def acquire(self, name: str, cost: int = 1) -> None:
        """Wait until limit `name` lets `cost` tokens through."""
        name, cost = check_name(name), check_cost(cost)
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def deliver(problem):
            loop.call_soon_threadsafe(_settle, future, problem)

        waiter = self._enqueue(name, cost, deliver)
        try:
            await future
        except asyncio.CancelledError:
            self._withdraw(name, waiter)
            raise

    def acquire_blocking(self, name: str, cost: int = 1, *,
                         abandoned: Callable[[], bool] | None = None,
                         poll: float = 0.1) -> None:
        """`acquire` for a thread: blocks until let through. With `abandoned`,
        asked every `poll` seconds meanwhile: once it is true the caller leaves
        the queue and gets errors.LimitAbandoned."""
        name, cost = check_name(name), check_cost(cost)
        done = threading.Event()
        outcome: list[BaseException | None] = []

        def deliver(problem):
            outcome.append(problem)
            done.set()

        waiter = self._enqueue(name, cost, deliver)
        while not done.wait(poll if abandoned is not None else None):
            if abandoned():
                if self._withdraw(name, waiter):
                    raise LimitAbandoned(f"stopped waiting for limit {name!r}: the run was "
                                         "stopped (its lease is lost)")
        if outcome[0] is not None:
            raise outcome[0]

    def _enqueue(self, name: str, cost: int, deliver) -> _Waiter:
        waiter = _Waiter(cost, deliver)
        with self._guard:
            if self._closed:
                raise errors.AgentInboxError("the limiter is closed")
            bucket = self._buckets.setdefault(name, _Bucket())
            if not bucket.queue:
                bucket.due = self._clock()  # nobody waited: ask now
            bucket.queue.append(waiter)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="agent-inbox-limiter",
                                                daemon=True)
                self._thread.start()
            self._guard.notify_all()
        return waiter

    def _withdraw(self, name: str, waiter: _Waiter) -> bool:
        """Take a caller that gives up out of the queue; False if it was let
        through (or failed) meanwhile."""
        with self._guard:
            if not waiter.queued:
                return False
            waiter.queued = False
            bucket = self._buckets.get(name)
            if bucket is not None:
                bucket.queue.remove(waiter)
            return True

    def close(self) -> None:
        """Stop the thread; callers still waiting get an error."""
        with self._guard:
            self._closed = True
            failed = [w for b in self._buckets.values() for w in self._drop_all(b)]
            self._guard.notify_all()
            thread = self._thread
        for waiter in failed:
            waiter.deliver(errors.AgentInboxError("the limiter was closed"))
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    # --- the limiter's thread

    def _serve(self) -> None:
        idle_since = self._clock()
        while True:
            with self._guard:
                while True:
                    if self._closed:
                        self._thread = None
                        return
                    now = self._clock()
                    waiting = [(b.due, name) for name, b in self._buckets.items() if b.queue]
                    due = [name for when, name in waiting if when <= now]
                    if due:
                        break
                    if waiting:
                        idle_since = now
                        self._guard.wait(min(when for when, _ in waiting) - now)
                    elif now - idle_since >= IDLE_EXIT:
                        self._thread = None
                        return
                    else:
                        self._guard.wait(IDLE_EXIT - (now - idle_since))
            for name in due:
                try:
                    self._ask(name)
                except Exception:  # never lose the thread: the callers would wait for ever
                    log.exception("limit %r: granting failed; trying again", name)
                    with self._guard:
                        self._buckets[name].due = self._clock() + RETRY_CAP
            idle_since = self._clock()

    def _ask(self, name: str) -> None:
        """One grant for limit `name`: everything waiting, if the bucket has it."""
        asked = least = 0
        with self._guard:
            bucket = self._buckets[name]
            let_through = self._hand_out(bucket)
            if bucket.queue:
                asked = sum(w.cost for w in bucket.queue) - bucket.balance
                least = bucket.queue[0].cost - bucket.balance
        _deliver(let_through)
        if not asked:
            return
        try:
            with db.connection(self._pool) as conn:
                row = store.grant(conn, name, asked, least)
        except errors.AgentInboxError as exc:
            with self._guard:
                self.statements += 1
                bucket.retry = min(RETRY_CAP, max(RETRY_FIRST, 2 * bucket.retry))
                bucket.due = self._clock() + bucket.retry
            log.warning("limit %r: the database did not grant (%s); asking again in %.1f s",
                        name, exc, bucket.retry)
            return
        with self._guard:
            self.statements += 1
            bucket.retry = 0.0
            if row is None:
                failed = self._drop_all(bucket)
                problem = errors.UnknownLimit(
                    "limit", name, f"{name!r} does not exist: make it with `agent-inbox limits set "
                    "NAME --rate N --per SECONDS` (or declare it in the app)")
                let_through = [(w, problem) for w in failed]
            else:
                taken, left, at, rate, per, burst = row
                self.tokens += taken
                if self.grant_log is not None:
                    self.grant_log.append((name, taken, at))
                bucket.balance += taken
                let_through = []
                for waiter in [w for w in bucket.queue if w.cost > burst]:
                    bucket.queue.remove(waiter)
                    waiter.queued = False
                    let_through.append((waiter, errors.CostAboveBurst(
                        "cost", waiter.cost, f"is above the burst of limit {name!r} ({burst}): "
                        "it could never be granted")))
                let_through += self._hand_out(bucket)
                if bucket.queue:
                    bucket.due = self._clock() + self._wait(bucket, left, rate / per, burst)
        _deliver(let_through)

    def _hand_out(self, bucket: _Bucket) -> list:
        """Let callers through, in arrival order, while the balance covers the
        first; with nobody left waiting, what is left is dropped (used)."""
        out = []
        while bucket.queue and bucket.queue[0].cost <= bucket.balance:
            waiter = bucket.queue.popleft()
            waiter.queued = False
            bucket.balance -= waiter.cost
            self.calls += 1
            out.append((waiter, None))
        if not bucket.queue:
            bucket.balance = 0
        return out

    def _drop_all(self, bucket: _Bucket) -> list[_Waiter]:
        failed = list(bucket.queue)
        for waiter in failed:
            waiter.queued = False
        bucket.queue.clear()
        bucket.balance = 0
        return failed

    @staticmethod
    def _wait(bucket: _Bucket, left: float, per_second: float, burst: int) -> float:
        """Seconds until the bucket (`left` now) holds what to ask for next:
        everything waiting, at most CHUNK_SECONDS of the rate and the burst, at
        least the first caller's need; MAX_SLEEP at most."""
        need = bucket.queue[0].cost - bucket.balance
        waiting = sum(w.cost for w in bucket.queue) - bucket.balance
        target = max(need, min(waiting, per_second * CHUNK_SECONDS, burst))
        return min(MAX_SLEEP, max(0.0, (target - left) / per_second))


class LimitAbandoned(errors.AgentInboxError):
    """A thread's wait for a limit ended because its run was stopped."""


def _settle(future: asyncio.Future, problem: BaseException | None) -> None:
    if future.done():
        return
    if problem is None:
        future.set_result(None)
    else:
        future.set_exception(problem)


def _deliver(outcomes: list) -> None:
    for waiter, problem in outcomes:
        try:
            waiter.deliver(problem)
        except RuntimeError:  # the caller's loop is closed: nobody waits any more
            pass
