"""The tests of this folder run against a real Citus cluster: a
coordinator and two worker nodes, each a throwaway cluster from the local
binaries (pgserver.CitusCluster): tests/conftest.py's `citus_cluster`, started
once per session and shared with the contract suite's citus backend.

Skipped, saying why, only where the Citus extension is not installed
(tests/setup-deps.sh installs it from ../shared/citus/). Each test gets the
session's one distributed database (tests/conftest.py's `citus_database`:
migrated with `migrate --citus`'s steps, the ordinary migrations then
citus.distribute, once), emptied for it. A test that needs a database of its
own says so with `fresh_citus_database` (on whichever `citus_cluster` it
sees), and one that lays a database out itself makes its own. `inbox` and
`make_inbox` are tests/conftest.py's, on `database_url` (overridden here, and
by a module that takes a fresh database); `inbox_on_citus` has `inbox` checked
to be on the coordinator.
Tests that hold on every backend belong in tests/contract, not here.
"""

import pytest

from tests.citus.support import distributed_database


@pytest.fixture
def database_url(citus_database):
    return citus_database


@pytest.fixture
def fresh_citus_database(citus_cluster):
    """A database of this test's own on `citus_cluster`, migrated and laid out
    (10-20 s), dropped after the test: for tests whose aftermath emptying does
    not undo, as a node stopped or hung in the middle of their runs."""
    url = distributed_database(citus_cluster)
    yield url
    citus_cluster.drop_database(url)


@pytest.fixture
def inbox_on_citus():
    return True
