"""The console's pages on the Citus cluster (the single-server tests, run
here unchanged): every page is a read across shards or about one user, and
none waits on a worker's lease lock."""

from tests.console.conftest import console  # noqa: F401 -- the fixture, for the tests below
from tests.console.test_console import (  # noqa: F401
    busy,
    test_a_worker_records_its_runs_for_the_chart,
    test_hidden_payloads_for_viewers,
    test_pages_never_wait_on_a_workers_lease_locks,
    test_the_overview_json_matches_the_database,
)
