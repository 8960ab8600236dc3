"""The take and the finish on Citus are one call each, delegated to the
worker node that holds the bucket (store/delegated.py): the coordinator
sends that node the call and nothing else, no BEGIN or COMMIT of its own and
no statement of the function's body, for a take of several users and for a
finish with messages, memory and a release. What the coordinator sends is
read from Citus's own log of remote commands (`citus.log_remote_commands`)."""

import psycopg
import pytest

from agent_inbox import Inbox, Result, citus, errors, revision
from agent_inbox.store import delegated


def remote_commands(url: str, call) -> list[str]:
    """The commands the coordinator sends to worker nodes while `call(conn)`
    runs on a connection of its own (with remote commands logged)."""
    sent: list[str] = []
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET citus.log_remote_commands = on")
        conn.execute("SET client_min_messages = log")
        conn.add_notice_handler(lambda notice: sent.append(notice.message_primary or ""))
        call(conn)
    return [text.split("issuing ", 1)[1] for text in sent if "issuing " in text]


def test_a_take_and_a_finish_are_one_call_each_on_the_buckets_node(database_url, inbox):
    users = [u for u in (f"u{n}" for n in range(2000))
             if citus.bucket(u) == citus.bucket("u0")][:3]
    inbox.ingest_many([(user, "chat", "1", {}) for user in users])
    taken = []
    take = remote_commands(database_url, lambda conn: taken.extend(delegated.take(
        conn, citus.bucket("u0"), "w", 60, inbox.policy, None, 10)))
    assert sorted(user for user, *_ in taken) == sorted(users)
    assert len(take) == 1 and "agent_inbox_take(" in take[0], take
    first, second, _ = sorted(inbox._as_runs("w", taken), key=lambda run: run.user)
    finished = []
    quiet = inbox.outcome(first, Result(memory={"seen": 1}))
    finish = remote_commands(database_url, lambda conn: finished.append(delegated.finish(
        conn, quiet.finish, None, release=True)))
    assert len(finish) == 1 and "agent_inbox_finish(" in finish[0], finish
    # Messages are inserted from the coordinator (their ids order them), in
    # the call's transaction, after it.
    chatty = inbox.outcome(second, Result(messages=["hello", "again"]))
    finish = remote_commands(database_url, lambda conn: finished.append(delegated.finish(
        conn, chatty.finish, None, release=True)))
    assert finished == [True, True]
    work = [c for c in finish if not c.startswith(("BEGIN", "SELECT assign_distributed",
                                                   "COMMIT", "PREPARE", "RELEASE"))]
    assert "agent_inbox_finish(" in work[0] and len(work) == 3, work
    assert all(c.startswith("INSERT INTO") and "outbox" in c for c in work[1:]), work
    assert not any(c.startswith("PREPARE") for c in finish), finish  # one node: no 2PC
    assert inbox.memory(first.user) == {"seen": 1}
    assert [m.body for m in inbox.outbox(second.user)] == ["hello", "again"]


def test_migrate_citus_installs_the_functions_and_a_worker_refuses_a_layout_without_them(
        fresh_citus_database):
    """On a database of its own: it drops a function the session's shares."""
    database_url = fresh_citus_database
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert delegated.installed(conn)
        assert not delegated.install(conn)  # the same bodies: left as they are
        conn.execute(f"DROP FUNCTION {delegated.FINISH_SIGNATURE}")
    with pytest.raises(errors.SchemaNotAtHead, match="migrate --citus"):
        revision.require_head(database_url)
    assert citus.distribute(database_url)  # installed again
    revision.require_head(database_url)
    with Inbox.connect(database_url) as inbox:
        inbox.ingest("u", "chat", "1", {})
        [run] = inbox.take_runs("w", users=1)
        assert inbox.finish_run(run, Result())
