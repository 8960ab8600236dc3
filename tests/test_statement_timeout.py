"""The pool's statement bound (db.BoundedConnection): the server cancels a
statement past it on a direct connection; without the server's timeout (behind
a transaction pooler none is set) the client closes the connection past it;
an operator's long work (db.unbounded) and a bound of None are not cut."""

import time

import pytest

from agent_inbox import Inbox, db, errors


def slept(inbox, seconds, *, unbounded=False):
    began = time.monotonic()
    with db.transaction(inbox.pool) as conn:
        if unbounded:
            with db.unbounded(conn):
                conn.execute("SELECT pg_sleep(%s)", (seconds,))
        else:
            conn.execute("SELECT pg_sleep(%s)", (seconds,))
    return time.monotonic() - began


def test_the_server_cancels_a_statement_past_the_bound(database_url):
    with Inbox.connect(database_url, pool_size=1, statement_timeout=1) as inbox:
        began = time.monotonic()
        with pytest.raises(errors.DatabaseUnavailable, match="statement timeout"):
            slept(inbox, 10)
        assert time.monotonic() - began < 3
        assert slept(inbox, 1.5, unbounded=True) >= 1.5   # the same connection, kept


def test_the_client_cuts_a_wait_past_the_bound(database_url):
    # pooler="transaction": no server setting, so only the client's bound ends it
    with Inbox.connect(database_url, pool_size=1, pooler="transaction",
                       statement_timeout=1) as inbox:
        began = time.monotonic()
        with pytest.raises(errors.DatabaseUnavailable, match="no answer from the database"):
            slept(inbox, 10)
        assert time.monotonic() - began < 3
        assert slept(inbox, 0) < 3                          # a fresh connection


def test_no_bound(database_url):
    with Inbox.connect(database_url, pool_size=1, statement_timeout=None) as inbox:
        assert slept(inbox, 1.2) >= 1.2


def test_a_bound_must_be_positive(database_url):
    with pytest.raises(errors.InvalidInput):
        Inbox.connect(database_url, statement_timeout=-1)
