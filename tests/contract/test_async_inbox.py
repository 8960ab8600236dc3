"""AsyncInbox: the same calls as Inbox, answered the same, on psycopg's async
pool, and in the caller's asyncio transaction (a psycopg AsyncConnection, a
SQLAlchemy AsyncConnection or AsyncSession): rolled back, nothing stored;
committed, stored once; a running worker runs what was committed; what cannot
hold the caller's transaction is refused with nothing stored."""

import asyncio
import threading

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from agent_inbox import AsyncInbox, errors
from agent_inbox.records import Approval
from agent_inbox.services.worker import Worker

from tests.contract.test_callers_transaction import MESSAGES, stored
from tests.runtime.support import wait_until


def run(coroutine):
    return asyncio.run(coroutine)


@pytest.fixture
def connect_async(inbox_url, inbox_options):
    """`async with await connect_async() as inbox`: an AsyncInbox on the
    backend's URL (through PgBouncer on that backend)."""
    pooler = inbox_options.get("pooler", "none")
    return lambda **options: AsyncInbox.connect(inbox_url, pooler=pooler, **options)


@pytest.fixture
def app_url(inbox_url, direct_url):
    with psycopg.connect(direct_url, autocommit=True) as conn:
        conn.execute(MESSAGES)
    return inbox_url


def async_engine(app_url):
    """The application's SQLAlchemy asyncio engine (no server-side prepare:
    the URL may be PgBouncer's)."""
    return create_async_engine("postgresql+psycopg://", async_creator=lambda: (
        psycopg.AsyncConnection.connect(app_url, prepare_threshold=None)))


INSERT_MESSAGE = sa.text("INSERT INTO chat_messages (user_id, body) VALUES (:user, :body)")


def test_the_calls_answer_as_the_sync_inbox_does(connect_async, inbox, backend):
    async def calls():
        async with await connect_async() as ainbox:
            assert ainbox.citus == (backend == "citus")
            assert await ainbox.ingest("a", "chat", "1", {"n": 1}) is True
            assert await ainbox.ingest("a", "chat", "1", {"n": 1}) is False
            assert await ainbox.ingest_many([("a", "chat", "2", {}), ("b", "chat", "1", {}),
                                             ("a", "chat", "2", {})]) == [True, True, False]
            events = await ainbox.events("a")
            assert await ainbox.memory("a") is None
            assert await ainbox.approvals("a") == []
            return events
    events = run(calls())
    assert events == inbox.events("a")
    assert [(e.source_id, e.payload) for e in events] == [("1", {"n": 1}), ("2", {})]
    assert [e.source_id for e in inbox.events("b")] == ["1"]


def test_approvals_are_read_and_answered_once(connect_async, inbox):
    inbox.request_approval("c", "refund-1", expires_in=3600, action={"amount": 5})
    inbox.request_approval("c", "refund-2", expires_in=7200, action={"amount": 9})

    async def answer():
        async with await connect_async() as ainbox:
            before = await ainbox.approvals("c")
            first = await ainbox.answer_approval("c", "refund-1", "yes")
            second = await ainbox.answer_approval("c", "refund-1", "no")
            unknown = await ainbox.answer_approval("c", "never", "yes")
            return before, first, second, unknown, await ainbox.approvals("c")
    before, first, second, unknown, after = run(answer())
    assert [(a.request_id, a.action, a.answer) for a in before] == [
        ("refund-2", {"amount": 9}, None), ("refund-1", {"amount": 5}, None)]
    assert (first, second, unknown) == ("yes", "yes", "unknown")
    assert [(a.request_id, a.answer) for a in after] == [("refund-2", None), ("refund-1", "yes")]
    assert isinstance(after[1], Approval) and after[1].answered_at is not None
    assert after == inbox.approvals("c")
    assert [e.payload for e in inbox.events("c")] == [{"approval": "refund-1", "answer": "yes"}]


def test_a_psycopg_async_transaction_that_rolls_back_stores_nothing(
        connect_async, app_url, direct_url):
    async def app():
        async with await connect_async() as ainbox:
            async with await psycopg.AsyncConnection.connect(app_url,
                                                             prepare_threshold=None) as conn:
                await conn.execute("INSERT INTO chat_messages (user_id, body) VALUES ('d', 'x')")
                assert await ainbox.ingest("d", "chat", "1", {}, connection=conn) is True
                assert stored(direct_url) == ([], [], [])        # not before the commit
                await conn.rollback()
                await conn.execute("INSERT INTO chat_messages (user_id, body) VALUES ('d', 'y')")
                assert await ainbox.ingest_many([("d", "chat", "2", {}), ("d", "chat", "2", {})],
                                                connection=conn) == [True, False]
                await conn.commit()
    run(app())
    assert stored(direct_url) == ([("d", "y")], [("d", "chat", "2")], [("d", 0)])


def test_an_async_session_commits_the_message_and_its_event_together(
        connect_async, app_url, direct_url):
    async def app():
        engine = async_engine(app_url)
        try:
            async with await connect_async() as ainbox:
                async with AsyncSession(engine) as session:       # rolled back at the end
                    await session.execute(INSERT_MESSAGE, {"user": "e", "body": "lost"})
                    assert await ainbox.ingest("e", "chat", "0", {}, connection=session)
                async with AsyncSession(engine) as session, session.begin():
                    await session.execute(INSERT_MESSAGE, {"user": "e", "body": "kept"})
                    assert await ainbox.ingest("e", "chat", "1", {}, connection=session)
                async with engine.begin() as conn:                 # an AsyncConnection
                    assert await ainbox.ingest("e", "chat", "1", {}, connection=conn) is False
                    assert await ainbox.ingest("e", "chat", "2", {}, connection=conn) is True
        finally:
            await engine.dispose()
    run(app())
    assert stored(direct_url) == ([("e", "kept")], [("e", "chat", "1"), ("e", "chat", "2")],
                                  [("e", 0)])


def test_what_cannot_hold_the_callers_transaction_is_refused_and_nothing_is_stored(
        connect_async, app_url, direct_url):
    async def refused():
        engine = async_engine(app_url)
        sync_engine = sa.create_engine("postgresql+psycopg://", creator=lambda: (
            psycopg.connect(app_url, prepare_threshold=None)))
        try:
            async with await connect_async() as ainbox:
                async with await psycopg.AsyncConnection.connect(
                        app_url, prepare_threshold=None, autocommit=True) as conn:
                    with pytest.raises(errors.InvalidInput, match="autocommit mode"):
                        await ainbox.ingest("f", "chat", "1", {}, connection=conn)
                async with await psycopg.AsyncConnection.connect(
                        app_url, prepare_threshold=None) as conn:
                    with pytest.raises(psycopg.errors.DivisionByZero):
                        await conn.execute("SELECT 1 / 0")
                    with pytest.raises(errors.InvalidInput, match="failed transaction"):
                        await ainbox.ingest("f", "chat", "1", {}, connection=conn)
                with psycopg.connect(app_url, prepare_threshold=None) as conn:
                    with pytest.raises(errors.InvalidInput, match="not an asyncio connection"):
                        await ainbox.ingest("f", "chat", "1", {}, connection=conn)
                with sync_engine.connect() as conn:
                    with pytest.raises(errors.InvalidInput, match="must be a psycopg AsyncConn"):
                        await ainbox.ingest("f", "chat", "1", {}, connection=conn)
                for wrong in ("postgresql://elsewhere", 42, engine, object()):
                    with pytest.raises(errors.InvalidInput, match="must be a psycopg AsyncConn"):
                        await ainbox.ingest_many([("f", "chat", "1", {})], connection=wrong)
                for bad in ([("", "chat", "1", {})], [("f", "chat", "1", {"x": float("nan")})],
                            "not a list"):
                    with pytest.raises(errors.InvalidInput):
                        await ainbox.ingest_many(bad)
                with pytest.raises(errors.InvalidInput):
                    await ainbox.approvals("f", limit=0)
        finally:
            await engine.dispose()
            sync_engine.dispose()
    run(refused())
    assert stored(direct_url) == ([], [], [])


def test_the_sync_inbox_names_the_asyncio_sqlalchemy_session_as_the_wrong_kind(inbox, app_url):
    async def refused():
        engine = async_engine(app_url)
        try:
            async with AsyncSession(engine) as session:
                with pytest.raises(errors.InvalidInput, match="use AsyncInbox"):
                    inbox.ingest("g", "chat", "1", {}, connection=session)
        finally:
            await engine.dispose()
    run(refused())


def test_bad_options_are_refused_before_connecting():
    for options in ({"pool_size": 0}, {"max_payload_bytes": -1}, {"pooler": "session"}):
        with pytest.raises(errors.InvalidInput):
            run(AsyncInbox.connect("postgresql://127.0.0.1:1/none", **options))


def test_a_running_worker_runs_what_the_async_application_committed(
        connect_async, make_inbox, app_url, direct_url):
    worker_inbox = make_inbox(pool_size=4)
    worker = Worker(worker_inbox, "tests.runtime.handlers:echo", concurrency=4)
    serving = threading.Thread(target=worker.serve, args=(direct_url,), daemon=True)
    serving.start()
    try:
        async def app():
            engine = async_engine(app_url)
            try:
                async with await connect_async() as ainbox:
                    async with AsyncSession(engine) as session:
                        await session.execute(INSERT_MESSAGE, {"user": "h", "body": "no"})
                        await ainbox.ingest("h", "chat", "1", {}, connection=session)
                        await session.rollback()
                    async with AsyncSession(engine) as session, session.begin():
                        await session.execute(INSERT_MESSAGE, {"user": "h", "body": "yes"})
                        await ainbox.ingest("h", "chat", "2", {}, connection=session)
            finally:
                await engine.dispose()
        run(app())
        app_inbox = make_inbox()
        wait_until(lambda: [e.status for e in app_inbox.events("h")] == ["done"],
                   "the committed event to be run", timeout=30)
        assert [m.body for m in app_inbox.outbox("h")] == ["h:2"]
        assert [e.source_id for e in app_inbox.events("h")] == ["2"]
    finally:
        worker.stop.event.set()
        serving.join(timeout=30)
        worker.close()
    assert not serving.is_alive()


def test_pause_resume_and_the_fleets_brake_from_asyncio(connect_async, inbox):
    inbox.ingest("alice", "chat", "a-1", {})
    inbox.ingest("bob", "chat", "b-1", {})

    async def stop_and_go():
        async with await connect_async() as ainbox:
            paused = await ainbox.pause("alice", actor="app", reason="abuse")
            fleet = await ainbox.pause_fleet(actor="app", cancel=True)
            state = await ainbox.pauses()
            await ainbox.resume_fleet(actor="app")
            return paused, fleet, state
    paused, fleet, state = run(stop_and_go())
    assert (paused["already"], fleet["already"], fleet["cancelled"]) == (False, False, [])
    assert state["fleet"]["actor"] == "app" and [u["user"] for u in state["users"]] == ["alice"]
    assert [run.user for run in inbox.runs.take_runs("H", users=5)] == ["bob"]

    async def go():
        async with await connect_async() as ainbox:
            return await ainbox.resume("alice", actor="app")
    assert run(go()) == {"user": "alice", "resumed": True}
    assert [run.user for run in inbox.runs.take_runs("H", users=5)] == ["alice"]
