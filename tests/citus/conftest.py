"""The tests of this folder run against a real Citus cluster of their own: a
coordinator and two worker nodes, each a throwaway cluster from the local
binaries (pgserver.CitusCluster), started once per session.

Skipped, saying why, only where the Citus extension is not installed
(tests/setup-deps.sh installs it from ../shared/citus/). Each test gets a fresh database on every
node, migrated with `migrate --citus`'s steps (the ordinary migrations, then
citus.distribute). `inbox` and `make_inbox` override tests/conftest.py's, so
tests/test_concurrency.py's functions run here unchanged.
"""

import contextlib

import pytest

from agent_inbox import Inbox
from tests.citus.support import distributed_database, started_cluster


@pytest.fixture(scope="session")
def citus_cluster():
    with started_cluster() as cluster:
        yield cluster


@pytest.fixture
def database_url(citus_cluster):
    url = distributed_database(citus_cluster)
    yield url
    citus_cluster.drop_database(url)


@pytest.fixture
def inbox(database_url):
    with Inbox.connect(database_url, pool_size=4) as opened:
        assert opened.citus
        yield opened


@pytest.fixture
def make_inbox(database_url):
    with contextlib.ExitStack() as stack:
        def make(**options) -> Inbox:
            options.setdefault("pool_size", 1)
            return stack.enter_context(Inbox.connect(database_url, **options))

        yield make
