"""The outbox, seen from the API: paced dispatch of one user's held messages,
the dispatcher's claims and outcomes for many users (store/outbox.py holds the
rules), what a channel is and how a failed send is recorded."""

import inspect
from collections.abc import Callable
from typing import Any

from agent_inbox import db, errors, tracing, validate
from agent_inbox.api.settings import Settings
from agent_inbox.backend.path import RunPath
from agent_inbox.records import Batch, Failure
from agent_inbox.store import outbox, pauses


# Longest failure text recorded (a channel's error may quote a peer's whole body).
ERROR_CHARS = 2000


def describe(exc: BaseException) -> str:
    """A failed send as its record says it: the exception's type and text, cut
    to ERROR_CHARS, with what PostgreSQL cannot store in text (NUL, unpaired
    surrogates) replaced, so that recording a failure cannot fail."""
    text = str(exc).strip()
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    if len(text) > ERROR_CHARS:
        text = text[:ERROR_CHARS - 1] + "\u2026"
    return text.encode("utf-8", "replace").decode("utf-8").replace("\x00", "\ufffd")


def channel_of(send: Callable[..., Any]) -> Callable[[str, str, str], Any]:
    """`send` as a channel, `send(user, text, key)`: whatever can be called
    with three positional arguments is one (or has no signature to read); one
    that takes a single argument is `send(text)`, the older shape of
    `Inbox.dispatch`, and is called with the text alone."""
    if not callable(send):
        raise errors.InvalidInput("send", send, "must be callable")
    try:
        signature = inspect.signature(send)
    except (TypeError, ValueError):
        return send
    for shape in (("user", "text", "key"), ("text",)):
        try:
            signature.bind(*shape)
        except TypeError:
            continue
        return send if len(shape) == 3 else (lambda user, text, key: send(text))
    raise errors.InvalidInput("send", send, "must be callable as send(user, text, key), as a "
                              "channel is (or send(text))")


class Delivery:
    """The dispatcher's protocol (`Inbox.delivery`): claim due deliveries,
    mark them sent or failed, repace, adopt held messages; and one user's
    paced send (`dispatch_batch`, which `Inbox.dispatch` is). It shares only
    the Inbox's pool, run path and settings. On Citus a dispatcher's claims and
    outcomes are one transaction per bucket (backend/citus/path.py), each on
    one node."""

    def __init__(self, pool, path: RunPath, settings: Settings):
        self._pool, self._path, self._settings = pool, path, settings

    @property
    def adopts_held_messages(self) -> bool:
        """Whether a dispatcher looks for held messages no delivery is due for
        (queued by a worker older than the deliveries schema; never on Citus)."""
        return self._path.adopts_held_messages

    def dispatch_batch(self, user: str, deliver: Callable[[str, str], Any], *,
                       at_most_once: bool = False, now: int | None = None) -> int:
        """As `dispatch`, with `deliver(text, key)`: `key` (`<user>:<batch>`) names
        the batch of rows, and a batch resent after a crash keeps its rows and key,
        so a channel can drop the repeat. At-least-once (the default): send, then
        mark sent; a crash in between sends the batch again. At-most-once: mark,
        then send; a crash in between loses the batch. A user another dispatcher
        is sending to gets 0 at once, and so does every user while the fleet is
        paused (store/pauses.py). Unlike the dispatcher service, this sends a
        batch backing off after a failure at once: the caller asked."""
        user = validate.text("user", user)
        now = validate.optional_epoch("now", now)
        if not callable(deliver):
            raise errors.InvalidInput("deliver", deliver, "must be callable")
        with db.transaction(self._pool) as conn:
            if db.run(conn, pauses.fleet()) is not None:
                return 0
            batches = self._claim(conn, outbox.lock_user(conn, user), now)
        if not batches:
            return 0
        batch = batches[0]
        if at_most_once and not self.mark_sent(batches, now=now):
            return 0
        try:
            with tracing.send(batch):
                deliver(batch.text, batch.key)
        except Exception as exc:
            if not at_most_once:
                self.record_failed([Failure(batch, describe(exc),
                                            isinstance(exc, errors.PermanentSendError))], now=now)
            raise
        if not at_most_once:
            self.mark_sent(batches, now=now)
        return len(batch.ids)

    def claim_due(self, limit: int, *, now: int | None = None) -> tuple[int, list[Batch]]:
        """Claim up to `limit` users whose delivery is due (the dispatcher's
        scan), in one short transaction: (users looked at, the batches to send
        now). Users looked at with nothing to send yet are due again when they can."""
        return self._path.claim_due_deliveries(
            limit, now, lambda conn, locked: self._claim(conn, locked, now))

    def _claim(self, conn, locked: list[str], now: int | None) -> list[Batch]:
        if not locked:
            return []
        return outbox.claim(conn, locked, gap=self._settings.outbox_gap,
                            send_timeout=self._settings.send.timeout, now=now)

    def mark_sent(self, batches: list[Batch], *, now: int | None = None) -> list[Batch]:
        """Mark claimed batches sent, in one transaction; those whose claim was
        still theirs (a batch whose claim ran out and was claimed again is the
        other dispatcher's to mark)."""
        marked: set[tuple[str, int]] = set()
        for group in self._path.groups(batches, lambda b: b.user):
            with db.transaction(self._pool) as conn:
                marked |= outbox.mark_sent(conn, group, gap=self._settings.outbox_gap, now=now)
        return [b for b in batches if (b.user, b.batch) in marked]

    def record_failed(self, failures: list[Failure], *, now: int | None = None) -> dict:
        """Record failed sends in one transaction: {(user, batch): parked} for
        those whose claim was still theirs; parked batches are `failed`."""
        policy = self._settings.send
        recorded = {}
        for group in self._path.groups(failures, lambda f: f.batch.user):
            with db.transaction(self._pool) as conn:
                recorded |= outbox.record_failed(conn, group, max_attempts=policy.max_attempts,
                                                 backoff_base=policy.backoff_base,
                                                 backoff_cap=policy.backoff_cap, now=now)
        return recorded

    def repace(self, *, now: int | None = None) -> int:
        """Apply this inbox's `outbox_gap` to users paced by a longer one (the
        dispatcher does this at start and once a minute): their held messages
        are due at their last send + this gap. The number of users changed."""
        with db.connection(self._pool) as conn:
            users = outbox.stale_pace_users(conn, self._settings.outbox_gap, now)
            changed = 0
            for group in self._path.groups(users, lambda user: user):
                with conn.transaction():
                    changed += outbox.repace(conn, group, self._settings.outbox_gap, now)
        return changed

    def adopt_held(self, *, now: int | None = None) -> int:
        """Users with held messages and no delivery due (queued by a worker
        older than the deliveries schema) made due now; how many. Only where
        `adopts_held_messages` (one server: never on Citus)."""
        with db.connection(self._pool) as conn:
            return outbox.adopt_held(conn, now)

    def seconds_to_next_delivery(self, *, now: int | None = None) -> int | None:
        """Seconds until a user's delivery is next due (None: nothing held)."""
        with db.connection(self._pool) as conn:
            return outbox.seconds_to_next_due(conn, now)
