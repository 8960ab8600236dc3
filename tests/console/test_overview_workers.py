"""The overview's worker count says what it counts (issue 20): distinct holders
of live leases, so an idle worker is not there; "workers seen 0" read as "no
workers" while one was idle."""

from tests.console.conftest import TOKENS


def test_the_worker_count_names_workers_running_a_run(console, inbox):
    status, body = console.get("/", token=TOKENS["vic"][1])
    assert status == 200
    assert "workers seen" not in body
    assert "workers running a run" in body
    assert "with no run in flight holds none" in body
