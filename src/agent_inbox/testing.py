"""Testing an agent: a pytest plugin (loaded by pytest wherever agent-inbox is
installed) and a helper that runs an app's handler over given events through
the real take and fenced finish.

    from agent_inbox.testing import run_agent

    def test_the_agent_replies(inbox):
        [ran] = run_agent(inbox, myapp.agent.app, [("alice", "chat", "m1", {"text": "hi"})])
        assert ran.committed and ran.messages == ["hello alice"]

Fixtures:

- `agent_inbox_server` (session): a PostgreSQL server's URL to a maintenance
  database: AGENT_INBOX_TEST_DATABASE_URL if set; else a testcontainers
  PostgreSQL when a Docker engine answers a two-second probe (and the
  testcontainers package is installed); else a throwaway cluster started from
  the local PostgreSQL binaries (initdb, pg_ctl), removed after the session.
- `agent_inbox_database`: a fresh database, migrated, for this test alone
  (copied from a template migrated once per session), dropped after it.
- `inbox`: an `Inbox` on that database.
- `make_inbox`: a factory for more Inbox objects on it (`make_inbox(max_attempts=1)`).

A project's own fixtures of the same names win over these (pytest's rule).
"""

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pytest

from agent_inbox.agent import handler as handlers
from agent_inbox.schema import migrate
from agent_inbox.dev import pgserver
from agent_inbox.agent.app import App, as_app
from agent_inbox.api.inbox import Inbox
from agent_inbox.records import Event
from agent_inbox.agent.result import Result

SERVER_URL_ENV = "AGENT_INBOX_TEST_DATABASE_URL"


def _docker_engine_answers() -> bool:
    try:
        import docker

        client = docker.from_env(timeout=2)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # no package, no engine, no permission: no Docker here
        return False


@pytest.fixture(scope="session")
def agent_inbox_server():
    url = os.environ.get(SERVER_URL_ENV)
    if url:
        yield url
    elif _docker_engine_answers():
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:15", driver=None) as container:
            yield container.get_connection_url()
    else:
        with pgserver.TemporaryCluster() as cluster:
            yield cluster.url


@pytest.fixture(scope="session")
def agent_inbox_template(agent_inbox_server):
    url = pgserver.create_database(agent_inbox_server, prefix="agent_inbox_template")
    migrate.upgrade(url)
    yield pgserver.conninfo.conninfo_to_dict(url)["dbname"]
    pgserver.drop_database(url)


@pytest.fixture
def agent_inbox_database(agent_inbox_server, agent_inbox_template):
    """A fresh, migrated database for this test alone."""
    url = pgserver.create_database(agent_inbox_server, prefix="agent_inbox_test",
                                   template=agent_inbox_template)
    yield url
    pgserver.drop_database(url)


@pytest.fixture
def inbox(agent_inbox_database):
    with Inbox.connect(agent_inbox_database, pool_size=4) as opened:
        yield opened


@pytest.fixture
def make_inbox(agent_inbox_database):
    """Open more Inbox objects on the test's database (one per simulated process)."""
    with contextlib.ExitStack() as stack:
        def make(**options) -> Inbox:
            options.setdefault("pool_size", 1)
            return stack.enter_context(Inbox.connect(agent_inbox_database, **options))

        yield make


@dataclass(frozen=True)
class Ran:
    """One run `run_agent` made, and what of it committed."""

    user: str
    events: list[Event]
    result: Result           # what the handler returned (an exception as its error)
    committed: bool          # the fenced finish accepted it
    messages: list[str]      # the user's outbox after the run, oldest first
    memory: Any              # the user's memory after the run


def run_agent(inbox: Inbox, app: App | Callable, events: Iterable[tuple], *,
              holder: str = "agent-inbox-test", max_runs: int = 100) -> list[Ran]:
    """Ingest `events` ((user, source, source_id, payload[, kind]) each), then
    take and run every user's work as a worker would (the app's startup hooks
    first, its shutdown hooks last; async handlers and hooks on one event
    loop), each run committed by the fenced finish, until no work is left or
    `max_runs` runs were made. The runs made, in order."""
    app = as_app(app, getattr(app, "__qualname__", repr(app)))
    inbox.ingest_many(list(events))
    loop = asyncio.new_event_loop()

    def await_on(awaitable):
        return loop.run_until_complete(handlers.awaited(awaitable))

    ran: list[Ran] = []
    try:
        app.start(await_on)
        try:
            while len(ran) < max_runs:
                run = inbox.take_work(holder)
                if run is None:
                    break
                result = handlers.call(app.handler, run.events, inbox.context(run), await_on)
                committed = inbox.finish_run(run, result)
                ran.append(Ran(run.user, run.events, result, committed,
                               [m.body for m in inbox.outbox(run.user)],
                               inbox.memory(run.user)))
        finally:
            app.stop(await_on)
    finally:
        loop.close()
    return ran
