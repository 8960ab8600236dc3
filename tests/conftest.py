"""A real PostgreSQL for every test, and an isolated database per test: the
fixtures of agent-inbox's own pytest plugin (agent_inbox.testing, which users'
tests get too): the server from AGENT_INBOX_TEST_DATABASE_URL, else a
testcontainers PostgreSQL when a Docker engine answers a quick probe, else a
throwaway cluster from the local PostgreSQL binaries; each test a fresh
database copied from a migrated template, dropped after. Here under the
names the suite uses (`server_url`, `database_url`).

`inbox` (pool_size 4) and `make_inbox` (pool_size 1 unless given) are defined
here once, for every folder: on `inbox_url` with `inbox_options`. A folder's
conftest overrides only those, where its code under test reaches the database
another way: tests/behind_pgbouncer (through its PgBouncer, pooler=
"transaction"), tests/citus (`database_url`: the Citus database) and
tests/contract (all three, from its `backend`); `inbox_on_citus` says what
`inbox` must find when it opens (None: not checked).

`citus_cluster` (session) is the one Citus cluster of the session (a
coordinator and two worker nodes), shared by tests/citus and the contract
suite's citus backend (tests/contract), started by the first test that asks;
`citus_database` is the session's one distributed database on it, emptied for
each test (migrating and laying out a database takes 10-20 s; emptying one,
about a second).
"""

import contextlib

import pytest

from agent_inbox import Inbox
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
def inbox_url(database_url):
    """The URL the code under test reaches the test's database by."""
    return database_url


@pytest.fixture
def inbox_options():
    """What every Inbox of the test is opened with (pooler=, citus_nodes=, ...)."""
    return {}


@pytest.fixture
def inbox_on_citus():
    """Whether `inbox` must be on a Citus coordinator (asserted as it opens); None: either."""
    return None


@pytest.fixture
def inbox(inbox_url, inbox_options, inbox_on_citus):
    with Inbox.connect(inbox_url, pool_size=4, **inbox_options) as opened:
        if inbox_on_citus is not None:
            assert opened.citus == inbox_on_citus
        yield opened


@pytest.fixture
def make_inbox(inbox_url, inbox_options):
    """Open more Inbox objects on the test's database (one per simulated process)."""
    with contextlib.ExitStack() as stack:
        def make(**options) -> Inbox:
            options.setdefault("pool_size", 1)
            return stack.enter_context(Inbox.connect(inbox_url, **{**inbox_options, **options}))

        yield make


@pytest.fixture
def empty_database_url(server_url):
    """A fresh database with no schema at all."""
    url = pgserver.create_database(server_url, prefix="agent_inbox_empty")
    yield url
    pgserver.drop_database(url)
