"""Stopping an agent on Citus: a worker with no Citus option (its takes through
the coordinator, its LISTEN on it) and the scenario of tests/runtime/stopping.py;
the fleet's brake with a real worker."""

import pytest

from tests.runtime.stopping import (a_cancelled_sleeper_stops_and_resume_runs_the_rest, cli,
                                    services_fixture, statuses, worker)
from tests.runtime.support import wait_until


@pytest.fixture
def services():
    yield from services_fixture()


def test_pause_cancel_on_citus(database_url, inbox, services, tmp_path):
    a_cancelled_sleeper_stops_and_resume_runs_the_rest(database_url, inbox, services, tmp_path)


def test_the_fleets_brake_on_citus(database_url, inbox, services):
    running = services(*worker(database_url, "sleeps_unless", "--log-level", "debug"))
    code, out = cli(database_url, "pause", "--all")
    assert code == 0, out
    wait_until(lambda: running.said("the fleet is paused"), "the worker to see the pause", 5)
    users = [f"u{i}" for i in range(6)]  # spread over buckets
    for user in users:
        inbox.ingest(user, "chat", "1", {})
    before = running.count("took 0 runs")
    wait_until(lambda: running.count("took 0 runs") >= before + 10, "takes that take nothing")
    assert all(statuses(inbox, user) == ["pending"] for user in users)
    assert cli(database_url, "resume", "--all")[0] == 0
    wait_until(lambda: all(statuses(inbox, user) == ["done"] for user in users),
               "every run after resume", 30)
