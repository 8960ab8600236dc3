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
suite's citus backend (tests/contract), started by the first test that asks;
`citus_database` is the session's one distributed database on it, emptied for
each test (migrating and laying out a database takes 10-20 s; emptying one,
about a second).
"""

import pytest

from agent_inbox.dev import pgserver


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
def citus_session_database(citus_cluster):
    """The URL of the session's one database on `citus_cluster`, migrated and
    laid out once as `migrate --citus` does (tests/citus/support.py,
    distributed_database); removed with the cluster. Tests take it through
    `citus_database`, emptied."""
    from tests.citus.support import distributed_database, require_empty

    url = distributed_database(citus_cluster)
    require_empty(url)
    return url


@pytest.fixture
def citus_database(citus_session_database):
    """The session's distributed database as a freshly migrated and laid out
    one is: emptied (tests/citus/support.py, empty). Emptied as the test starts,
    not as the one before ends: by then every fixture of that test has stopped
    what it started (worker and service processes, pools), whereas at a test's
    end the fixtures set up before this one (spawn, ...) are still running."""
    from tests.citus.support import empty

    empty(citus_session_database)
    return citus_session_database


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
