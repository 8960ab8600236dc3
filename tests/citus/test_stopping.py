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


def test_services_refuse_a_take_function_of_another_version(database_url, inbox, services):
    """An older release's take (one that does not read the pause) left by its
    `migrate --citus` would take paused users: services refuse to start on it,
    saying how to repair it, and `migrate --citus` does."""
    import psycopg

    from agent_inbox.backend.citus import functions
    from agent_inbox.errors import RunPathDamaged
    from agent_inbox.schema import revision

    older = functions.TAKE.replace("l.paused_at IS NULL AND ", "")
    assert older != functions.TAKE
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(older)
    try:
        with pytest.raises(RunPathDamaged, match="migrate --citus"):
            revision.require_head(database_url)
        refused = services(*worker(database_url, "sleeps_unless"))
        assert refused.process.wait(timeout=60) == 2
        wait_until(lambda: refused.said("agent-inbox migrate --citus"), "the refusal's reason")
        assert not refused.said("Traceback")
        code, out = cli(database_url, "migrate", "--citus")
        assert code == 0, out
        revision.require_head(database_url)
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            functions.install(conn)
