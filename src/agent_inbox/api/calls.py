"""The calls an application makes that `Inbox` and `AsyncInbox` both offer,
written once.

Each method checks its arguments (bad input raises InvalidInput before any
SQL is sent, so nothing is stored) and returns a `Call`: its statements as a
`db.Queries` generator (made afresh for each attempt), whether they need a
transaction of their own, and what is done once they ran. `Inbox` drives a
Call with `db.run` (on its pool, or in the caller's transaction), `AsyncInbox`
with `db.run_async`: the SQL, the checks and the logic between statements
exist once, and the two classes differ only in how they wait.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from agent_inbox import db, errors, metrics, tracing, validate
from agent_inbox.api.settings import Settings
from agent_inbox.backend.path import Statements
from agent_inbox.records import EVENT_STATUSES, Approval, Event
from agent_inbox.store import inbox, pauses, views
from agent_inbox.store import memory as memories

T = TypeVar("T")

INGEST_CHUNK = 1000
"""Events per statement in ingest_many."""

MAX_APPROVALS = 1000
"""The most approval requests one `approvals` call answers."""


def _unchanged(result: Any) -> Any:
    return result


@dataclass(frozen=True)
class Call(Generic[T]):
    """One call's statements (`queries()`), whether they run in a
    transaction of their own (on the inbox's pool: one statement needs
    none), and `done(result)`: what the caller is answered, once they ran."""

    queries: Callable[[], db.Queries[Any]]
    transaction: bool
    done: Callable[[Any], T] = _unchanged


class Calls:
    """The shared calls of an inbox on `statements` (the run path's cut:
    backend/path.Statements) with `settings`."""

    def __init__(self, statements: Statements, settings: Settings):
        self._statements, self._settings = statements, settings

    def ingest(self, user: str, source: str, source_id: str, payload: Any, *,
               kind: str | None = None, traceparent: str | None = None) -> Call[bool]:
        """Store one event (and its lease row and wake); True if stored."""
        user, source, source_id, kind = validate.event_names("", user, source, source_id, kind)
        encoded = validate.payload("payload", payload, self._settings.max_payload_bytes)
        traceparent = _traceparent(traceparent)

        def queries() -> db.Queries[bool]:
            stored = yield from inbox.insert(user, source, source_id, encoded, kind, traceparent)
            yield from self._statements.events_inserted([user] if stored else [])
            return stored

        def done(stored: bool) -> bool:
            metrics.count_ingested(source, stored)
            return stored

        return Call(queries, not self._statements.one_statement_ingest, done)

    def ingest_many(self, events: Iterable[tuple]) -> Call[list[bool]]:
        """Store many events in one transaction; for each, True if stored."""
        if isinstance(events, (str, bytes)) or not isinstance(events, Iterable):
            raise errors.InvalidInput("events", events, "must be an iterable of tuples")
        rows = []
        for n, item in enumerate(events):
            if not isinstance(item, (tuple, list)) or len(item) not in (4, 5, 6):
                raise errors.InvalidInput(
                    f"events[{n}]", item,
                    "must be (user, source, source_id, payload[, kind[, traceparent]])")
            user, source, source_id, payload, kind, traceparent = (*item, None, None)[:6]
            user, source, source_id, kind = validate.event_names(f"events[{n}]", user, source,
                                                                 source_id, kind)
            rows.append((user, source, source_id,
                         validate.payload(f"events[{n}] payload", payload,
                                          self._settings.max_payload_bytes),
                         kind, _traceparent(traceparent)))

        def queries() -> db.Queries[list[bool]]:
            stored: dict[int, bool] = {}
            # on Citus one statement per bucket (one node each; the transaction
            # spans the nodes the batch does)
            for group in self._statements.groups(list(enumerate(rows)), lambda item: item[1][0]):
                for start in range(0, len(group), INGEST_CHUNK):
                    chunk = group[start:start + INGEST_CHUNK]
                    flags = yield from inbox.insert_many([row for _, row in chunk])
                    stored.update(zip((n for n, _ in chunk), flags))
                    yield from self._statements.events_inserted(
                        [row[0] for (_, row), ok in zip(chunk, flags) if ok])
            return [stored[n] for n in range(len(rows))]

        def done(stored: list[bool]) -> list[bool]:
            for (_, source, *_), was_stored in zip(rows, stored):
                metrics.count_ingested(source, was_stored)
            return stored

        return Call(queries, True, done)

    def events(self, user: str, *, status: str | None = None) -> Call[list[Event]]:
        """A user's events, ordered by id."""
        user = validate.text("user", user)
        if status is not None and status not in EVENT_STATUSES:
            raise errors.InvalidInput("status", status, f"must be one of {EVENT_STATUSES}")
        return Call(lambda: inbox.list_events(user, status), False)

    def memory(self, user: str) -> Call[Any]:
        """The user's memory document (None if it has none)."""
        user = validate.text("user", user)
        return Call(lambda: memories.get(user), False,
                    lambda row: None if row is None else row["doc"])

    def approvals(self, user: str, *, limit: int = 100) -> Call[list[Approval]]:
        """The user's approval requests, latest deadline first, at most `limit`."""
        user = validate.text("user", user)
        limit = validate.positive_int("limit", limit)
        if limit > MAX_APPROVALS:
            raise errors.InvalidInput("limit", limit, f"must be at most {MAX_APPROVALS}")
        return Call(lambda: views.user_approvals(user, limit), False, lambda rows: [
            Approval(row["request"], row["deadline"], row["action"], row["answer"],
                     row["answered_at"]) for row in rows])

    def answer_approval(self, user: str, request_id: str, answer: str, *,
                        now: int | None = None) -> Call[str]:
        """Store an answer unless the deadline has passed; the answer that
        stands: 'yes', 'no', 'expired', or 'unknown' for a request never made."""
        user = validate.text("user", user)
        request_id = validate.text("request_id", request_id)
        answer = validate.answer("answer", answer)
        now = validate.optional_epoch("now", now)
        return Call(lambda: self._statements.answer_approval(user, request_id, answer, now), True)


    # --- stopping an agent (store/pauses.py) ------------------------------------

    def pause(self, user: str, *, actor: str, reason: str | None = None, cancel: bool = False,
              now: int | None = None) -> Call[dict[str, Any]]:
        """Pause `user`: its events are stored and not run, its outbox held,
        until `resume`; with `cancel`, its run in flight is fenced off too."""
        user, actor = validate.text("user", user, validate.MAX_USER_BYTES), validate.text("actor", actor)
        reason = pauses.check_reason(reason)
        cancel = validate.boolean("cancel", cancel)
        now = validate.optional_epoch("now", now)
        return Call(lambda: pauses.pause(user, actor, reason, cancel, now), True)

    def resume(self, user: str, *, actor: str, now: int | None = None) -> Call[dict[str, Any]]:
        """Resume a paused user: what it held goes on, in order."""
        user, actor = validate.text("user", user, validate.MAX_USER_BYTES), validate.text("actor", actor)
        now = validate.optional_epoch("now", now)
        return Call(lambda: pauses.resume(user, actor, now), True)

    def cancel(self, user: str, *, actor: str, reason: str | None = None,
               now: int | None = None) -> Call[dict[str, Any]]:
        """Fence off `user`'s run in flight (its events are taken again)."""
        user, actor = validate.text("user", user, validate.MAX_USER_BYTES), validate.text("actor", actor)
        reason = pauses.check_reason(reason)
        now = validate.optional_epoch("now", now)
        return Call(lambda: pauses.cancel(user, actor, reason, now), True)

    def pause_fleet(self, *, actor: str, reason: str | None = None,
                    now: int | None = None) -> Call[dict[str, Any]]:
        """Pause the fleet: no new run anywhere, every outbox held."""
        actor = validate.text("actor", actor)
        reason = pauses.check_reason(reason)
        now = validate.optional_epoch("now", now)
        return Call(lambda: pauses.pause_fleet(actor, reason, now), True)

    def cancel_held(self, *, actor: str, reason: str | None = None,
                    now: int | None = None) -> Call[list[str]]:
        """One look of the fleet's cancel: every run in flight fenced off."""
        actor = validate.text("actor", actor)
        reason = pauses.check_reason(reason)
        now = validate.optional_epoch("now", now)
        return Call(lambda: pauses.cancel_held(actor, reason, now), True)

    def resume_fleet(self, *, actor: str, now: int | None = None) -> Call[dict[str, Any]]:
        actor = validate.text("actor", actor)
        now = validate.optional_epoch("now", now)
        return Call(lambda: pauses.resume_fleet(actor, now), True)

    def pauses(self, *, limit: int = 100) -> Call[dict[str, Any]]:
        """{"fleet": the fleet's pause or None, "users": the paused users
        (longest paused first, at most `limit`), "users_total"}."""
        limit = validate.positive_int("limit", limit)

        def queries() -> db.Queries[dict[str, Any]]:
            fleet = yield from pauses.fleet()
            users, total = yield from pauses.paused(limit)
            return {"fleet": fleet, "users": users, "users_total": total}
        return Call(queries, False)


def _traceparent(given) -> str | None:
    """An event's traceparent: `given` if it is one (else none), or the current span's."""
    return tracing.valid_traceparent(given) if given is not None else tracing.current_traceparent()
