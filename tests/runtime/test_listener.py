"""The LISTEN thread never stops silently: whatever ends its loop is logged,
and it listens again (services poll meanwhile)."""

import logging
import threading

import psycopg

from agent_inbox.services import service
from agent_inbox.services.service import Listener, Stop

from tests.runtime.support import wait_until


def test_a_listener_that_fails_is_logged_and_listens_again(database_url, monkeypatch, caplog):
    real_notifies, failures = psycopg.Connection.notifies, []

    def fails_once(self, *args, **kwargs):      # as psycopg 3.1 did: no timeout= there
        if not failures:
            failures.append(1)
            raise TypeError("notifies() got an unexpected keyword argument 'timeout'")
        return real_notifies(self, *args, **kwargs)

    monkeypatch.setattr(psycopg.Connection, "notifies", fails_once)
    monkeypatch.setattr(service, "backoff_delays", lambda: iter(lambda: 0.05, None))
    woken, stop = threading.Event(), Stop()
    caplog.set_level(logging.WARNING, logger="agent_inbox")
    listener = Listener(database_url, ["agent_inbox_work"], woken.set, stop)
    listener.start()
    try:
        with psycopg.connect(database_url, autocommit=True) as conn:
            def notified():
                conn.execute("NOTIFY agent_inbox_work")
                return woken.wait(0.05)

            wait_until(notified, "a notification after the listener failed once")
        assert failures and listener.is_alive()
        assert "listener failed; starting it again" in caplog.text
        assert "TypeError" in caplog.text
    finally:
        stop.event.set()
        listener.join(timeout=10)
