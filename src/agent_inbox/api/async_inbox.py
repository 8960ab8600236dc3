"""`AsyncInbox`: the calls an asyncio application makes, on psycopg's async pool.

    async with await AsyncInbox.connect(url) as inbox:
        await inbox.ingest("alice", "chat", message_id, {"text": text})

It offers what an application (a FastAPI or Starlette service) needs beside
its own requests: ingest and ingest_many (in its own transaction, or in the
caller's: `connection=` a psycopg AsyncConnection, a SQLAlchemy AsyncConnection
or AsyncSession), and the reads and answers of events, memory and approvals.
Running agents stays the worker's (a process of its own: `agent-inbox worker`).

Every call is `Inbox`'s own, written once in api/calls.py and driven here with
`db.run_async`: the same checks (InvalidInput before any SQL, nothing stored),
the same statements, the same answers. Its connections are opened and bounded
as the sync pool's are (db.open_async_pool: the same session settings, at most
`statement_timeout` seconds for any answer).
"""

from typing import Any, TypeVar

from agent_inbox import db, errors, validate
from agent_inbox.api.calls import Call, Calls
from agent_inbox.api.settings import DEFAULT_MAX_PAYLOAD_BYTES, Settings
from agent_inbox.backend import path as run_path
from agent_inbox.backend.citus import layout as citus
from agent_inbox.records import Approval, Event
from agent_inbox.store import pauses

__all__ = ["AsyncInbox"]

T = TypeVar("T")


class AsyncInbox:
    """An application's inbox calls for asyncio: `await inbox.ingest(...)`."""

    def __init__(self, pool, statements: run_path.Statements, *,
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES):
        """An AsyncInbox on an open psycopg_pool.AsyncConnectionPool whose
        statements are cut as `statements` says (backend/path.statements_for);
        `connect` makes both."""
        self.settings = Settings.checked(max_payload_bytes=max_payload_bytes)
        self._pool = pool
        self._calls = Calls(statements, self.settings)
        self.citus = statements.distributed

    @classmethod
    async def connect(cls, url: str, *, pool_size: int = 10,
                      application_name: str = "agent-inbox", pooler: str = "none",
                      statement_timeout: float | None = db.DEFAULT_STATEMENT_TIMEOUT,
                      connect_timeout: float | None = db.DEFAULT_CONNECT_TIMEOUT,
                      max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> "AsyncInbox":
        """Open an async pool of up to `pool_size` connections to `url`, as
        `Inbox.connect` opens its own (`pooler`, `statement_timeout` and
        `connect_timeout` mean the same); DatabaseUnavailable if no
        connection opens within 30 s. Whether the database is a Citus
        coordinator is asked on the first connection."""
        validate.text("url", url)
        validate.positive_int("pool_size", pool_size)
        Settings.checked(max_payload_bytes=max_payload_bytes)  # bad options before connecting
        detector = citus.Detector(node_connection_timeout=connect_timeout
                                  if pooler == "none" else None)
        pool = await db.open_async_pool(url, size=pool_size, name=application_name,
                                        pooler=pooler, configure=detector.configure_async,
                                        statement_timeout=statement_timeout,
                                        connect_timeout=connect_timeout)
        try:
            if detector.distributed is None:
                raise errors.DatabaseUnavailable("the pool's first connection was not set up")
            return cls(pool, run_path.statements_for(detector.distributed),
                       max_payload_bytes=max_payload_bytes)
        except BaseException:
            await pool.close()
            raise

    @property
    def pool(self):
        """The psycopg_pool.AsyncConnectionPool its calls run on."""
        return self._pool

    async def close(self) -> None:
        await self._pool.close()

    async def __aenter__(self) -> "AsyncInbox":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def _run(self, call: Call[T], connection: Any = None) -> T:
        """Drive `call` as Inbox._run does, awaiting each statement."""
        if connection is not None:
            async with db.callers_async_transaction(connection) as conn:
                result = await db.run_async(conn, call.queries())
        elif call.transaction:
            async def work(conn):
                return await db.run_async(conn, call.queries())
            result = await db.async_in_transaction(self._pool, work)
        else:
            async with db.async_connection(self._pool) as conn:
                result = await db.run_async(conn, call.queries())
        return call.done(result)

    async def ingest(self, user: str, source: str, source_id: str, payload: Any, *,
                     kind: str | None = None, traceparent: str | None = None,
                     connection: Any = None) -> bool:
        """Inbox.ingest: store an event once; False for a duplicate. With
        `connection` (a psycopg AsyncConnection, a SQLAlchemy AsyncConnection
        or AsyncSession on postgresql+psycopg://) in the caller's open
        transaction: the event exists only if it commits."""
        return await self._run(self._calls.ingest(user, source, source_id, payload, kind=kind,
                                                  traceparent=traceparent), connection)

    async def ingest_many(self, events, *, connection: Any = None) -> list[bool]:
        """Inbox.ingest_many: many events in one transaction (or the caller's)."""
        return await self._run(self._calls.ingest_many(events), connection)

    async def events(self, user: str, *, status: str | None = None) -> list[Event]:
        """A user's events, ordered by id."""
        return await self._run(self._calls.events(user, status=status))

    async def memory(self, user: str) -> Any:
        """The user's memory document (None if it has none)."""
        return await self._run(self._calls.memory(user))

    async def approvals(self, user: str, *, limit: int = 100) -> list[Approval]:
        """The user's approval requests, latest deadline first, at most `limit`."""
        return await self._run(self._calls.approvals(user, limit=limit))

    async def answer_approval(self, user: str, request_id: str, answer: str, *,
                              now: int | None = None) -> str:
        """Inbox.answer_approval: the answer that stands ('yes', 'no',
        'expired', or 'unknown' for a request never made)."""
        return await self._run(self._calls.answer_approval(user, request_id, answer, now=now))

    # --- stopping an agent (Inbox.pause and the others say what each does) ----

    async def pause(self, user: str, *, actor: str, reason: str | None = None,
                    cancel: bool = False, now: int | None = None) -> dict:
        return await self._run(self._calls.pause(user, actor=actor, reason=reason,
                                                 cancel=cancel, now=now))

    async def resume(self, user: str, *, actor: str, now: int | None = None) -> dict:
        return await self._run(self._calls.resume(user, actor=actor, now=now))

    async def cancel(self, user: str, *, actor: str, reason: str | None = None,
                     now: int | None = None) -> dict:
        return await self._run(self._calls.cancel(user, actor=actor, reason=reason, now=now))

    async def pause_fleet(self, *, actor: str, reason: str | None = None, cancel: bool = False,
                          now: int | None = None) -> dict:
        cancel = validate.boolean("cancel", cancel)
        state = await self._run(self._calls.pause_fleet(actor=actor, reason=reason, now=now))
        cancelled: list[str] = []
        for _ in range(pauses.CANCEL_PASSES if cancel else 0):
            cancelled += await self._run(self._calls.cancel_held(actor=actor, reason=reason,
                                                                 now=now))
        return {**state, "cancelled": cancelled}

    async def resume_fleet(self, *, actor: str, now: int | None = None) -> dict:
        return await self._run(self._calls.resume_fleet(actor=actor, now=now))

    async def pauses(self, *, limit: int = 100) -> dict:
        return await self._run(self._calls.pauses(limit=limit))
