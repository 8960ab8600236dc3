"""Stopping an agent through PgBouncer in transaction mode: the worker has no
LISTEN (no --listen-url), so it finds the cancel at its keeper's look at its
runs' lease rows (every 2 s); the scenario is tests/runtime/stopping.py's."""

import pytest

from tests.runtime.stopping import a_cancelled_sleeper_stops_and_resume_runs_the_rest, services_fixture


@pytest.fixture
def services():
    yield from services_fixture()


def test_pause_cancel_through_pgbouncer_without_listen(database_url, bounced_url, inbox,
                                                       services, tmp_path):
    a_cancelled_sleeper_stops_and_resume_runs_the_rest(
        database_url, inbox, services, tmp_path, bounced_url, "--pooler", "transaction")
