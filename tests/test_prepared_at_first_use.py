"""The set-based path's take and finish are prepared on a connection's first
use of them (store/inbox.py, GENERIC_PLAN): never planned anew per call, not
even for a fresh worker's first five; behind a transaction pooler nothing is
prepared."""

from agent_inbox import Inbox, Result, db
from agent_inbox.store import inbox as store_inbox

# Each statement's prepared form, told apart by a line only it has.
TAKE_MARK = "FOR UPDATE OF l SKIP LOCKED) l"
FINISH_MARK = "WITH ORDINALITY AS r(user_id, holder, gen, named, error, forget, events,"


def prepared(inbox: Inbox) -> dict[str, tuple[int, int]]:
    """(generic plans, custom plans) of the take and the finish prepared on
    the pool's one connection."""
    with db.connection(inbox.pool) as conn:
        rows = conn.execute("SELECT statement, generic_plans, custom_plans"
                            " FROM pg_prepared_statements").fetchall()
    found = {}
    for statement, generic, custom in rows:
        for name, mark in (("take", TAKE_MARK), ("finish", FINISH_MARK)):
            if mark in statement:
                found[name] = (generic, custom)
    return found


def test_the_marks_name_one_statement_each():
    assert TAKE_MARK in store_inbox.TAKE_WORK and TAKE_MARK not in store_inbox.FINISH
    assert FINISH_MARK in store_inbox.FINISH and FINISH_MARK not in store_inbox.TAKE_WORK


def test_the_first_take_and_finish_are_prepared_with_one_generic_plan(database_url):
    with Inbox.connect(database_url, pool_size=1) as inbox:
        inbox.ingest_many([(f"u{i}", "chat", "1", {}) for i in range(3)])
        [run] = inbox.runs.take_runs("H", users=1)
        assert prepared(inbox) == {"take": (1, 0)}
        assert inbox.runs.finish_runs([inbox.runs.outcome(run, Result())]) == [True]
        assert prepared(inbox) == {"take": (1, 0), "finish": (1, 0)}
        for _ in range(2):  # later calls run the same plan
            [run] = inbox.runs.take_runs("H", users=1)
            assert inbox.runs.finish_runs([inbox.runs.outcome(run, Result())]) == [True]
        assert prepared(inbox) == {"take": (3, 0), "finish": (3, 0)}


def test_behind_a_transaction_pooler_nothing_is_prepared(database_url):
    with Inbox.connect(database_url, pool_size=1, pooler="transaction") as inbox:
        inbox.ingest("u", "chat", "1", {})
        [run] = inbox.runs.take_runs("H", users=1)
        assert inbox.runs.finish_runs([inbox.runs.outcome(run, Result())]) == [True]
        assert prepared(inbox) == {}
