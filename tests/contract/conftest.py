"""The contract suite: every test of this folder runs once per backend, with no
list to edit.

`backend` (autouse, so every test here is parametrized by it) is one of

- "plain": the test server (tests/conftest.py), a fresh migrated database;
- "pgbouncer": the same, with every Inbox reaching it through a PgBouncer in
  `pool_mode = transaction` (tests/pgbouncer.py) and pooler="transaction";
- "citus": the session's one database on the session's one Citus cluster
  (tests/conftest.py's `citus_database` on `citus_cluster`: a coordinator and
  two worker nodes), migrated and laid out as `migrate --citus` does, once, and
  emptied for each test.

Each param carries a marker, so `-m backend_plain`, `-m "not backend_citus"`
pick. A backend whose component is missing (no pgbouncer binary, no Citus
extension) is skipped with the reason, as in tests/behind_pgbouncer and
tests/citus. A test that cannot hold on a backend says so, never silently:
`@pytest.mark.skip_backend("citus", reason="...")` (one or more backends; the
reason is required) skips that param with the reason.

Fixtures, derived from the backend:

- `database_url` and `direct_url`: the test's database, reached directly, never
  through PgBouncer: for the tests' own probes (lock holders, pg_stat_activity,
  result queries) and the operator CLI, which then take none of the pool's few
  server connections. On Citus, the coordinator.
- `inbox_url`: the URL the code under test uses (through PgBouncer on
  "pgbouncer", else `direct_url`); `inbox_options`: what an Inbox needs on it
  ({"pooler": "transaction"} on "pgbouncer"; on "citus", `citus_nodes="direct"`:
  tests/citus covers the calls through the coordinator).
- `inbox` (pool_size 4, checked to be on Citus exactly on "citus":
  `inbox_on_citus`) and `make_inbox` (pool_size 1 unless given) on it:
  tests/conftest.py's, which use these two fixtures.

PgBouncers are started once per session, one per pool size (server
connections per database): 4 unless a test or module says
`@pytest.mark.pgbouncer_pool_size(16)`.
"""

import contextlib

import pytest

from tests import pgbouncer

BACKENDS = ("plain", "pgbouncer", "citus")
DEFAULT_POOL_SIZE = 4


@pytest.fixture(scope="session")
def pgbouncers(server_url):
    """A PgBouncer in front of the test server per pool size, started when first asked."""
    with contextlib.ExitStack() as stack:
        running: dict[int, pgbouncer.PgBouncer] = {}

        def get(pool_size: int) -> pgbouncer.PgBouncer:
            if pool_size not in running:
                running[pool_size] = stack.enter_context(
                    pgbouncer.PgBouncer(server_url, pool_size=pool_size))
            return running[pool_size]

        yield get


def _skip_reason(node, backend: str) -> str | None:
    for marker in node.iter_markers("skip_backend"):
        unknown = set(marker.args) - set(BACKENDS)
        if unknown or not marker.args:
            pytest.fail(f"skip_backend names {sorted(unknown) or 'no backend'}; "
                        f"the backends are {', '.join(BACKENDS)}", pytrace=False)
        if not marker.kwargs.get("reason"):
            pytest.fail("skip_backend needs reason=...: why the test cannot hold there",
                        pytrace=False)
        if backend in marker.args:
            return marker.kwargs["reason"]
    return None


@pytest.fixture(autouse=True, params=[
    pytest.param(name, marks=getattr(pytest.mark, f"backend_{name}")) for name in BACKENDS])
def backend(request):
    name = request.param
    reason = _skip_reason(request.node, name)
    if reason:
        pytest.skip(f"not on {name}: {reason}")
    if name == "pgbouncer" and not pgbouncer.available():
        pytest.skip("no pgbouncer binary (Debian package pgbouncer; tests/setup-deps.sh, "
                    "which ./dev test runs, installs it when run as root)")
    if name == "citus":
        request.getfixturevalue("citus_cluster")  # skips, saying why, without the extension
    return name


@pytest.fixture
def direct_url(backend, request):
    if backend == "citus":
        return request.getfixturevalue("citus_database")
    return request.getfixturevalue("agent_inbox_database")


@pytest.fixture
def database_url(direct_url):
    """The test's database, direct (the name the suite's tests use for it)."""
    return direct_url


@pytest.fixture
def inbox_options(backend):
    """Behind PgBouncer, its mode; on Citus, the take and finish calls sent
    straight to the worker nodes (`citus_nodes="direct"`: tests/citus runs
    them through the coordinator, the default)."""
    return {"pgbouncer": {"pooler": "transaction"},
            "citus": {"citus_nodes": "direct"}}.get(backend, {})


@pytest.fixture
def inbox_url(backend, direct_url, request):
    if backend != "pgbouncer":
        return direct_url
    marker = request.node.get_closest_marker("pgbouncer_pool_size")
    pool_size = marker.args[0] if marker else DEFAULT_POOL_SIZE
    return request.getfixturevalue("pgbouncers")(pool_size).url(direct_url)


@pytest.fixture
def inbox_on_citus(backend):
    return backend == "citus"
