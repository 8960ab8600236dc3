"""The worker's completer gathers endings for COMMIT_WINDOW into one commit of
at most COMMIT_MOST, but a run's question (a durable step) ends the
gathering: the run waits for its answer, so it is answered with what is
queued at once. A finish that outlasts the statement timeout is committed in
halves. The completer runs here on a thread of this process over real runs
taken from the database; each wait is on the completer's queue or on
database state, bounded."""

import contextlib
import threading
import time
import types
from collections import Counter

import psycopg
import pytest

from agent_inbox.agent.result import Result
from agent_inbox.api.run_stats import RunStats
from agent_inbox.services.worker import completer as completer_module
from agent_inbox.services.worker.completer import Completer
from agent_inbox.services.worker.flight import Flights
from agent_inbox.services.worker.producer import Producer
from tests.runtime.support import scalar, wait_until

HOLDER = "gathering-test"


@contextlib.contextmanager
def completer_serving(inbox):
    """A completer serving on a thread; `take(user)` makes a taken, begun run's
    flight of `user` (its step journal through the completer, as the producer
    makes it). Stopped at the block's end."""
    flights = Flights(run_timeout=60)
    completer = Completer(inbox, flights, RunStats(inbox, HOLDER))
    done = threading.Event()
    thread = threading.Thread(target=completer.serve, args=(done,), daemon=True)
    thread.start()
    maker = types.SimpleNamespace(inbox=inbox, flights=flights)

    def take(user):
        inbox.ingest(user, "chat", "m1", {})
        run = inbox.take_work(HOLDER)
        assert run is not None and run.user == user
        flight = Producer._flight(maker, run, time.monotonic())  # taken now
        flights.add([flight])
        assert flights.begin(flight)
        return flight

    def taken_by_completer():
        wait_until(flights.endings.empty, "the completer to take what was queued")

    yield types.SimpleNamespace(flights=flights, take=take, taken=taken_by_completer)
    done.set()
    thread.join(timeout=30)
    assert not thread.is_alive()


@pytest.fixture
def serving(inbox):
    with completer_serving(inbox) as serving:
        yield serving


def _event_xmin(url, user):
    """The transaction that wrote `user`'s event done; None while it is not."""
    return scalar(url, "SELECT max(xmin::text) FROM events WHERE user_id = %s AND status = 'done'",
                  user)


def test_endings_that_come_within_the_window_share_one_commit(database_url, serving, monkeypatch):
    monkeypatch.setattr(completer_module, "COMMIT_WINDOW", 3.0)
    first, second = serving.take("u1"), serving.take("u2")
    serving.flights.ended(first, Result(), 0.0)
    serving.taken()  # the completer holds the first ending and gathers
    serving.flights.ended(second, Result(), 0.0)
    wait_until(lambda: _event_xmin(database_url, "u1") and _event_xmin(database_url, "u2"),
               "both runs' finishes")
    assert _event_xmin(database_url, "u1") == _event_xmin(database_url, "u2")  # one transaction


def test_a_step_asked_while_endings_gather_is_answered_without_the_window(
        database_url, serving, monkeypatch):
    monkeypatch.setattr(completer_module, "COMMIT_WINDOW", 3600.0)  # waited out: no answer in 30 s
    ending, stepping = serving.take("u1"), serving.take("u2")
    serving.flights.ended(ending, Result(), 0.0)
    serving.taken()  # the completer holds the ending and would gather for an hour
    answers = []
    step = threading.Thread(target=lambda: answers.append(
        stepping.ctx.steps.run_blocking("s", lambda: 7, (), {})), daemon=True)
    step.start()
    step.join(timeout=30)
    assert answers == [7], "the step was not answered: the completer waited out its window"
    assert scalar(database_url, "SELECT count(*) FROM steps WHERE user_id = 'u2'") == 1
    wait_until(lambda: _event_xmin(database_url, "u1"), "the ending queued before the step")


def test_a_commit_takes_at_most_commit_most_endings(database_url, serving, monkeypatch):
    """Endings piled up beyond COMMIT_MOST (thousands of runs ending while a
    commit is slow) are committed COMMIT_MOST at a time, never as one
    statement that could outlast the statement timeout and be retried whole."""
    monkeypatch.setattr(completer_module, "COMMIT_WINDOW", 3.0)
    monkeypatch.setattr(completer_module, "COMMIT_MOST", 3)
    flights = [serving.take(f"u{n}") for n in range(7)]
    for flight in flights:
        serving.flights.ended(flight, Result(), 0.0)
    wait_until(lambda: all(_event_xmin(database_url, f"u{n}") for n in range(7)),
               "every run's finish")
    commits = Counter(_event_xmin(database_url, f"u{n}") for n in range(7))
    assert max(commits.values()) <= 3 and len(commits) >= 3, commits


def test_a_finish_that_outlasts_the_statement_timeout_is_committed_in_halves(
        database_url, make_inbox, monkeypatch):
    """One run's lease row locked elsewhere holds the batch's finish past the
    statement timeout: the other runs commit (the batch halved until the
    locked run is alone) while it waits, and it commits once the lock goes."""
    monkeypatch.setattr(completer_module, "COMMIT_WINDOW", 3.0)
    with completer_serving(make_inbox(statement_timeout=1, pool_size=2)) as serving:
        flights = [serving.take(f"u{n}") for n in range(4)]
        with psycopg.connect(database_url) as blocker:
            blocker.execute("SELECT 1 FROM leases WHERE user_id = 'u3' FOR UPDATE")
            for flight in flights:
                serving.flights.ended(flight, Result(), 0.0)
            wait_until(lambda: all(_event_xmin(database_url, f"u{n}") for n in range(3)),
                       "the runs the lock does not hold up to finish", timeout=60)
            assert _event_xmin(database_url, "u3") is None
        wait_until(lambda: _event_xmin(database_url, "u3"), "the locked run's finish", timeout=60)


def test_a_finish_that_outlasts_the_statement_timeout_alone_holds_up_no_later_run(
        database_url, make_inbox):
    """A run alone whose finish outlasts the statement timeout (its lease
    row locked elsewhere) is tried again after FINISH_RETRY, not retried on
    the completer's thread in front of what ends after it: a run that ends
    while the lock is held commits, and the locked run commits once it goes."""
    with completer_serving(make_inbox(statement_timeout=1, pool_size=2)) as serving:
        locked, later = serving.take("u0"), serving.take("u1")
        with psycopg.connect(database_url) as blocker:
            blocker.execute("SELECT 1 FROM leases WHERE user_id = 'u0' FOR UPDATE")
            serving.flights.ended(locked, Result(), 0.0)
            wait_until(lambda: scalar(database_url, "SELECT count(*) FROM pg_locks"
                                      " WHERE NOT granted AND pid <> %s",
                                      blocker.info.backend_pid),
                       "the locked run's finish to wait for the lease row")
            serving.flights.ended(later, Result(), 0.0)
            wait_until(lambda: _event_xmin(database_url, "u1"),
                       "the run that ended after it to finish", timeout=20)
            assert _event_xmin(database_url, "u0") is None
        wait_until(lambda: _event_xmin(database_url, "u0"), "the locked run's finish", timeout=60)
