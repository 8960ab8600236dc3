"""The outbox, seen from the API: paced dispatch of held messages and the list
of a user's messages (store/outbox.py holds the rules)."""

from collections.abc import Callable
from typing import Any

from agent_inbox import db, errors, validate
from agent_inbox.records import OutboxMessage
from agent_inbox.store import outbox


class Delivery:
    """Mixed into `agent_inbox.Inbox` (which owns `_pool`, `outbox_gap`)."""

    def dispatch(self, user: str, send: Callable[[str], Any], *, now: int | None = None) -> int:
        """Send the user's held messages as one text, at most once per outbox_gap
        (an urgent message goes at once); the number of messages sent. `send(text)`
        is called at most once, inside the transaction that marks the rows sent:
        if it raises, nothing is marked."""
        if not callable(send):
            raise errors.InvalidInput("send", send, "must be callable")
        return self.dispatch_batch(user, lambda text, key: send(text), now=now)

    def dispatch_batch(self, user: str, deliver: Callable[[str, str], Any], *,
                       at_most_once: bool = False, now: int | None = None) -> int:
        """As `dispatch`, with `deliver(text, key)`: `key` (`<user>:<batch>`) names
        the batch of rows, and a batch resent after a crash keeps its rows and key,
        so a channel can drop the repeat. At-least-once (the default): send, then
        mark sent; a crash in between sends the batch again. At-most-once: mark,
        then send; a crash in between loses the batch."""
        user = validate.text("user", user)
        now = validate.optional_epoch("now", now)
        if not callable(deliver):
            raise errors.InvalidInput("deliver", deliver, "must be callable")
        with db.connection(self._pool) as conn, outbox.user_lock(conn, user) as locked:
            if not locked:
                return 0  # another dispatcher is sending to this user
            with conn.transaction():
                chosen = outbox.choose_batch(conn, user, self.outbox_gap, now)
                if chosen is not None and at_most_once:
                    outbox.mark_sent(conn, user, chosen[0], now)
            if chosen is None:
                return 0
            batch, ids, bodies = chosen
            deliver("\n\n".join(bodies), f"{user}:{batch}")
            if not at_most_once:
                outbox.mark_sent(conn, user, batch, now)
            return len(ids)

    def outbox(self, user: str) -> list[OutboxMessage]:
        user = validate.text("user", user)
        with db.connection(self._pool) as conn:
            return outbox.list_messages(conn, user)
