"""Ingest in the caller's transaction (`connection=`): the application's own
row and its event commit together or not at all, on every backend, through
psycopg, a SQLAlchemy Connection and an ORM Session; a worker that is running
takes the event when the application commits; a connection that cannot hold
the caller's transaction is refused, with nothing stored."""

import threading

import psycopg
import pytest
import sqlalchemy as sa
from psycopg.rows import dict_row
from sqlalchemy.orm import Session

from agent_inbox import errors
from agent_inbox.services.worker import Worker

from tests.runtime.support import wait_until

MESSAGES = "CREATE TABLE IF NOT EXISTS chat_messages (id bigserial PRIMARY KEY, user_id text, body text)"


@pytest.fixture
def app_connect(inbox_url, direct_url):
    """The application's connections: where the code under test goes (through
    PgBouncer on that backend, so nothing is prepared on the server)."""
    with psycopg.connect(direct_url, autocommit=True) as conn:
        conn.execute(MESSAGES)
    return lambda **options: psycopg.connect(inbox_url, prepare_threshold=None, **options)


@pytest.fixture
def engine(app_connect):
    engine = sa.create_engine("postgresql+psycopg://", creator=app_connect)
    yield engine
    engine.dispose()


def stored(direct_url) -> tuple[list, list, list]:
    """(chat messages, events, lease rows) as committed."""
    with psycopg.connect(direct_url, autocommit=True) as conn:
        return (conn.execute("SELECT user_id, body FROM chat_messages ORDER BY id").fetchall(),
                conn.execute("SELECT user_id, source, source_id FROM events ORDER BY id"
                             ).fetchall(),
                conn.execute("SELECT user_id, gen FROM leases ORDER BY user_id").fetchall())


def write_message(conn, user: str, body: str) -> None:
    conn.execute("INSERT INTO chat_messages (user_id, body) VALUES (%s, %s)", (user, body))


def test_a_psycopg_transaction_that_rolls_back_stores_nothing_and_one_that_commits_once(
        inbox, app_connect, direct_url):
    with app_connect() as conn:
        write_message(conn, "alice", "hello")
        assert inbox.ingest("alice", "chat", "m1", {"text": "hello"}, connection=conn) is True
        assert stored(direct_url) == ([], [], [])     # not visible before the commit
        conn.rollback()
    assert stored(direct_url) == ([], [], [])
    with app_connect() as conn:
        write_message(conn, "alice", "hello")
        assert inbox.ingest("alice", "chat", "m1", {"text": "hello"}, connection=conn) is True
        conn.commit()
    assert stored(direct_url) == ([("alice", "hello")], [("alice", "chat", "m1")],
                                  [("alice", 0)])
    with app_connect() as conn:                  # a redelivery in a later transaction
        assert inbox.ingest("alice", "chat", "m1", {"text": "hello"}, connection=conn) is False
        conn.commit()
    assert stored(direct_url)[1] == [("alice", "chat", "m1")]
    [event] = inbox.events("alice")
    assert event.payload == {"text": "hello"} and event.status == "pending"


def test_ingest_many_in_the_callers_transaction_and_a_dict_row_connection(
        inbox, app_connect, direct_url):
    rows = [("u1", "chat", "1", {}), ("u2", "chat", "1", {}), ("u1", "chat", "1", {})]
    with app_connect(row_factory=dict_row) as conn:   # the caller's row factory is its own
        with conn.transaction():
            assert inbox.ingest_many(rows, connection=conn) == [True, True, False]
            assert conn.execute("SELECT 1 AS one").fetchone() == {"one": 1}
    assert stored(direct_url)[1] == [("u1", "chat", "1"), ("u2", "chat", "1")]
    with app_connect() as conn:
        with pytest.raises(RuntimeError), conn.transaction():
            inbox.ingest_many([("u3", "chat", "1", {})], connection=conn)
            raise RuntimeError("the application's own failure")
    assert [user for user, *_ in stored(direct_url)[1]] == ["u1", "u2"]


def test_an_orm_session_commits_the_message_and_its_event_together(inbox, engine, direct_url):
    with Session(engine) as session:
        session.execute(sa.text("INSERT INTO chat_messages (user_id, body) VALUES ('bob', 'a')"))
        assert inbox.ingest("bob", "chat", "a", {}, connection=session) is True
        session.rollback()
    assert stored(direct_url) == ([], [], [])
    with Session(engine) as session:                  # the event first: the session begins
        assert inbox.ingest("bob", "chat", "b", {}, connection=session) is True
        session.execute(sa.text("INSERT INTO chat_messages (user_id, body) VALUES ('bob', 'b')"))
        session.commit()
    assert stored(direct_url) == ([("bob", "b")], [("bob", "chat", "b")], [("bob", 0)])


def test_a_sqlalchemy_connection_in_engine_begin(inbox, engine, direct_url):
    with pytest.raises(RuntimeError):
        with engine.begin() as conn:
            assert inbox.ingest_many([("c", "chat", "1", {})], connection=conn) == [True]
            raise RuntimeError("rolled back")
    assert stored(direct_url)[1] == []
    with engine.begin() as conn:
        assert inbox.ingest("c", "chat", "1", {}, connection=conn) is True
    with engine.connect() as conn:                    # commit as you go: autobegin
        assert inbox.ingest("c", "chat", "1", {}, connection=conn) is False
        assert inbox.ingest("c", "chat", "2", {}, connection=conn) is True
        conn.commit()
    assert stored(direct_url)[1] == [("c", "chat", "1"), ("c", "chat", "2")]


def test_what_cannot_hold_the_callers_transaction_is_refused_and_nothing_is_stored(
        inbox, app_connect, engine, direct_url):
    with app_connect(autocommit=True) as conn:        # no transaction: each statement alone
        with pytest.raises(errors.InvalidInput, match="autocommit mode with no transaction"):
            inbox.ingest("d", "chat", "1", {}, connection=conn)
    with app_connect() as conn:
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1 / 0")
        with pytest.raises(errors.InvalidInput, match="failed transaction"):
            inbox.ingest("d", "chat", "1", {}, connection=conn)
    closed = app_connect()
    closed.close()
    with pytest.raises(errors.InvalidInput, match="is closed"):
        inbox.ingest("d", "chat", "1", {}, connection=closed)
    for wrong in ("postgresql://elsewhere", 42, engine, object()):
        with pytest.raises(errors.InvalidInput, match="must be a psycopg Connection"):
            inbox.ingest_many([("d", "chat", "1", {})], connection=wrong)
    with app_connect() as conn:                       # bad input is checked first
        with pytest.raises(errors.InvalidInput):
            inbox.ingest("", "chat", "1", {}, connection=conn)
        conn.commit()
    assert stored(direct_url) == ([], [], [])


def test_an_asyncio_connection_is_named_as_the_wrong_kind(inbox, inbox_url):
    import asyncio

    async def refused():
        async with await psycopg.AsyncConnection.connect(inbox_url,
                                                         prepare_threshold=None) as conn:
            with pytest.raises(errors.InvalidInput, match="AsyncInbox"):
                inbox.ingest("e", "chat", "1", {}, connection=conn)
    asyncio.run(refused())


def test_a_running_worker_runs_what_the_application_committed(
        make_inbox, app_connect, direct_url):
    worker_inbox = make_inbox(pool_size=4)
    worker = Worker(worker_inbox, "tests.runtime.handlers:echo", concurrency=4)
    serving = threading.Thread(target=worker.serve, args=(direct_url,), daemon=True)
    serving.start()
    try:
        app = make_inbox()
        with app_connect() as conn:
            write_message(conn, "f", "hi")
            app.ingest("f", "chat", "1", {"text": "hi"}, connection=conn)
            conn.rollback()
        with app_connect() as conn:
            write_message(conn, "f", "hi again")
            app.ingest("f", "chat", "2", {"text": "hi again"}, connection=conn)
            conn.commit()
        wait_until(lambda: [e.status for e in app.events("f")] == ["done"],
                   "the committed event to be run", timeout=30)
        assert [m.body for m in app.outbox("f")] == ["f:2"]    # one run, of the committed event
        assert [e.source_id for e in app.events("f")] == ["2"]   # the rolled-back one never was
    finally:
        worker.stop.event.set()
        serving.join(timeout=30)
        worker.close()
    assert not serving.is_alive()


def test_read_committed_waits_for_the_other_transaction_with_the_same_key(
        inbox, app_connect, direct_url, backend):
    with app_connect() as first, app_connect() as second:
        assert inbox.ingest("g", "chat", "1", {}, connection=first) is True   # not committed
        answer = {}
        waiting = threading.Thread(target=lambda: answer.update(
            second=inbox.ingest("g", "chat", "1", {}, connection=second)), daemon=True)
        waiting.start()
        try:
            wait_until(lambda: lock_waits(direct_url, backend) > 0, "the second ingest to wait")
            assert answer == {}
        finally:
            first.commit()
            waiting.join(timeout=30)
        second.commit()
    assert answer == {"second": False}                   # a duplicate once the first committed
    assert stored(direct_url)[1] == [("g", "chat", "1")]


def lock_waits(direct_url, backend) -> int:
    """Sessions waiting for a lock: on Citus, on any node (the wait is on the
    worker node that holds the user's bucket)."""
    query = ("SELECT count(*) FROM citus_lock_waits" if backend == "citus" else
             "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'")
    with psycopg.connect(direct_url, autocommit=True) as conn:
        return conn.execute(query).fetchone()[0]


def test_repeatable_read_that_cannot_see_the_duplicate_raises_a_conflict_to_retry(
        inbox, app_connect, direct_url, backend):
    with app_connect() as snapshot_holder:
        snapshot_holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        snapshot_holder.execute("SELECT count(*) FROM chat_messages")   # its snapshot
        with app_connect() as other:
            assert inbox.ingest("h", "chat", "1", {}, connection=other) is True
            other.commit()
        if backend == "citus":
            # The worker node's part of the transaction starts at its first
            # statement there, after the other commit: its snapshot sees the key.
            assert inbox.ingest("h", "chat", "1", {}, connection=snapshot_holder) is False
        else:
            with pytest.raises(errors.TransactionConflict):
                inbox.ingest("h", "chat", "1", {}, connection=snapshot_holder)
            snapshot_holder.rollback()
            snapshot_holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            assert inbox.ingest("h", "chat", "1", {}, connection=snapshot_holder) is False
        snapshot_holder.commit()
    assert stored(direct_url)[1] == [("h", "chat", "1")]
