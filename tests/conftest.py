"""A real PostgreSQL for every test, and an isolated database per test: the
fixtures of agent-inbox's own pytest plugin (agent_inbox.testing, which users'
tests get too): the server from AGENT_INBOX_TEST_DATABASE_URL, else a
testcontainers PostgreSQL when a Docker engine answers a quick probe, else a
throwaway cluster from the local PostgreSQL binaries; each test a fresh
database copied from a migrated template, dropped after; `inbox` and
`make_inbox` on it. Here under the names the suite uses (`server_url`,
`database_url`).

`citus_cluster` (session) is the one Citus cluster of the session (a
coordinator and two worker nodes), shared by tests/citus and the contract
suite's citus backend (tests/contract), started by the first test that asks.
"""

import pytest

from agent_inbox import pgserver


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """Skip reasons always in the summary (-rs on top of pyproject's -ra, or of
    any -r given), so that a partial run never reads as a full one."""
    config.option.reportchars = (config.option.reportchars or "") + "s"


@pytest.fixture(scope="session")
def citus_cluster():
    """Skipped, saying why, where the Citus extension is not installed."""
    from tests.citus.support import started_cluster

    with started_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def server_url(agent_inbox_server):
    return agent_inbox_server


@pytest.fixture
def database_url(agent_inbox_database):
    """A fresh, migrated database for this test alone."""
    return agent_inbox_database


@pytest.fixture
def empty_database_url(server_url):
    """A fresh database with no schema at all."""
    url = pgserver.create_database(server_url, prefix="agent_inbox_empty")
    yield url
    pgserver.drop_database(url)
