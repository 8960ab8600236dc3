"""The tests of this folder reach PostgreSQL through a PgBouncer of their own in
`pool_mode = transaction` (tests/pgbouncer.py), in front of the test server.

`bouncer` is one PgBouncer per test module, with the module's POOL_SIZE server
connections per database (default 4); `bounced_url` is the test's database
through it. `inbox_url` and `inbox_options` override tests/conftest.py's, so
that its `inbox` and `make_inbox` are on it: the code under test goes through
PgBouncer with pooler="transaction", while the tests' own probes (lock
holders, pg_stat_activity, result queries) use `database_url`, the direct
connection, so they take none of the pool's few server connections.
Tests that hold on every backend belong in tests/contract (its "pgbouncer"
backend), not here.
"""

import pytest

from tests import pgbouncer
from tests.runtime.conftest import spawn  # noqa: F401 -- the fleet test's processes

DEFAULT_POOL_SIZE = 4


@pytest.fixture(scope="module")
def bouncer(server_url, request):
    if not pgbouncer.available():
        pytest.skip("no pgbouncer binary (Debian package pgbouncer; tests/setup-deps.sh, "
                    "which ./dev test runs, installs it when run as root)")
    with pgbouncer.PgBouncer(server_url, pool_size=getattr(request.module, "POOL_SIZE",
                                                           DEFAULT_POOL_SIZE)) as running:
        yield running


@pytest.fixture
def bounced_url(bouncer, database_url):
    return bouncer.url(database_url)


@pytest.fixture
def inbox_url(bounced_url):
    return bounced_url


@pytest.fixture
def inbox_options():
    return {"pooler": "transaction"}
