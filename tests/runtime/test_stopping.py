"""Stopping an agent with real worker and dispatcher processes (issue 35):
`pause --cancel` stops a run sleeping 30 s within seconds and it never
finishes; the user's next events are stored and not run while another user's
run; `resume` runs them. `pause --all` stops new runs on two workers and holds
every message, `resume --all` restarts them and each held message is sent
once. A handler that ignores its cancellation is reported and its result
refused. Bad input on the command line: exit 2, no traceback, nothing changed.
(tests/contract/test_pauses.py holds the rules on every backend.)"""

import threading

import pytest

from tests.runtime.stopping import (HANDLERS, a_cancelled_sleeper_stops_and_resume_runs_the_rest,
                                    cli, services_fixture, statuses, worker)
from tests.runtime.support import scalar, wait_until

@pytest.fixture
def services():
    yield from services_fixture()


def test_pause_cancel_stops_a_sleeping_run_and_resume_runs_the_rest(
        database_url, make_inbox, services, tmp_path):
    a_cancelled_sleeper_stops_and_resume_runs_the_rest(database_url, make_inbox(pool_size=2),
                                                      services, tmp_path)


def test_the_fleets_pause_stops_two_workers_and_holds_every_message(
        database_url, make_inbox, services, tmp_path):
    inbox = make_inbox(pool_size=2)
    workers = [services(*worker(database_url, "sleeps_unless", "--log-level", "debug"))
               for _ in range(2)]
    dispatcher = services("dispatcher", "--database-url", database_url, "--channel",
                          f"{HANDLERS}:record", "--outbox-gap", "0", "--poll-interval", "0.2",
                          "--log-level", "info", env={"AGENT_INBOX_TEST_SENDS": str(tmp_path)})
    inbox.ingest("u0", "chat", "first", {})
    wait_until(lambda: statuses(inbox, "u0") == ["done"], "a run before the pause", 60)
    wait_until(lambda: (tmp_path / "sent").exists(), "its message to be sent")

    code, out = cli(database_url, "pause", "--all", "--reason", "bad deploy")
    assert code == 0 and "the fleet is paused" in out, out
    for each in workers:
        wait_until(lambda: each.said("the fleet is paused"), "each worker to see the pause", 5)
    users = [f"u{i}" for i in range(1, 9)]
    for user in users:
        inbox.ingest(user, "chat", "during", {})
    # each worker takes again and again (notified, and polling every 0.2 s): nothing
    seen = [each.count("took 0 runs") for each in workers]
    for each, before in zip(workers, seen):
        wait_until(lambda: each.count("took 0 runs") >= before + 10, "takes that take nothing")
    assert all(statuses(inbox, user) == ["pending"] for user in users)
    code, out = cli(database_url, "status")
    assert code == 0 and "THE FLEET IS PAUSED" in out and "bad deploy" in out
    # a message queued before the pause by a run that was in flight is held too
    assert scalar(database_url, "SELECT count(*) FROM outbox WHERE sent_at IS NULL") == 0

    code, out = cli(database_url, "resume", "--all")
    assert code == 0 and "the fleet is resumed" in out
    wait_until(lambda: all(statuses(inbox, user) == ["done"] for user in users),
               "every run after resume", 30)
    wait_until(lambda: scalar(database_url, "SELECT count(*) FROM outbox WHERE sent_at IS NULL")
               == 0, "every message sent")
    sent = (tmp_path / "sent").read_text().splitlines()
    keys = [line.split("\t")[0] for line in sent]
    assert len(sent) == 1 + len(users) and len(set(keys)) == len(keys)  # each sent once
    assert dispatcher.process.poll() is None


def test_messages_queued_while_the_fleet_is_paused_wait_for_resume(
        database_url, make_inbox, services, tmp_path):
    inbox = make_inbox(pool_size=2)
    woken = tmp_path / "woken"
    services(*worker(database_url, "sleeps_unless", "--log-level", "info"))
    inbox.ingest("alice", "chat", "a-1", {"sleep_unless": str(woken)})
    wait_until(lambda: statuses(inbox, "alice") == ["running"], "alice's run to start", 60)
    assert cli(database_url, "pause", "--all")[0] == 0      # the run in flight goes on
    dispatcher = services("dispatcher", "--database-url", database_url, "--channel",
                          f"{HANDLERS}:record", "--outbox-gap", "0", "--poll-interval", "0.2",
                          "--log-level", "info", env={"AGENT_INBOX_TEST_SENDS": str(tmp_path)})
    wait_until(lambda: dispatcher.said("dispatcher started"), "the dispatcher to start", 30)
    woken.touch()
    assert cli(database_url, "cancel", "--user", "alice")[0] == 0  # its next run does not sleep
    code, out = cli(database_url, "resume", "--all")
    assert code == 0
    wait_until(lambda: statuses(inbox, "alice") == ["done"], "alice's run after resume", 30)
    wait_until(lambda: (tmp_path / "sent").exists(), "its message, sent after resume")
    assert len((tmp_path / "sent").read_text().splitlines()) == 1


def test_a_handler_that_ignores_its_cancel_is_reported_and_its_result_refused(
        database_url, make_inbox, services):
    inbox = make_inbox(pool_size=2)
    running = services(*worker(database_url, "blocks_in_thread", "--log-level", "info"))
    inbox.ingest("alice", "chat", "a-1", {"block": 12})
    wait_until(lambda: statuses(inbox, "alice") == ["running"], "alice's run to start", 60)
    assert cli(database_url, "pause", "--user", "alice", "--cancel")[0] == 0
    wait_until(lambda: running.said("run cancelled by an operator user=alice"), "the cancel", 5)
    wait_until(lambda: running.said("the handler of a cancelled run still runs"),
               "the report of a handler that ignores its cancel", 15)
    wait_until(lambda: running.said("returned") and running.said("after it was cancelled"),
               "the handler to return", 30)
    assert inbox.outbox("alice") == []
    assert [(e.status, e.attempts) for e in inbox.events("alice")] == [("pending", 0)]


@pytest.mark.parametrize("args, says", [
    (["pause", "--all", "--user", "alice"], "not allowed with argument"),
    (["pause"], "one of the arguments --user --all is required"),
    (["pause", "--user", ""], "must not be empty"),
    (["pause", "--user", "nobody"], "is not a known user"),
    (["pause", "--user", "alice", "--reason", "x" * 1001], "at most 1000 bytes"),
    (["resume", "--user", "nobody"], "is not a known user"),
    (["cancel", "--user", "nobody"], "is not a known user"),
    (["cancel", "--all"], "the following arguments are required: --user"),
])
def test_bad_input_exits_2_with_a_clear_error_and_changes_nothing(
        database_url, make_inbox, args, says):
    make_inbox().ingest("alice", "chat", "a-1", {})
    code, out = cli(database_url, *args)
    assert code == 2 and says in out and "Traceback" not in out, out
    assert scalar(database_url, "SELECT count(*) FROM operator_actions") == 0
    assert scalar(database_url, "SELECT count(*) FROM leases WHERE paused_at IS NOT NULL") == 0
    assert scalar(database_url, "SELECT count(*) FROM fleet_pause") == 0


def test_without_listen_a_worker_finds_the_cancel_at_its_next_look(database_url, make_inbox,
                                                                   caplog, tmp_path):
    """Behind a transaction pooler a worker has no LISTEN: the keeper's look at
    its runs' lease rows (every CANCEL_LOOK seconds) finds the cancel."""
    import logging

    from agent_inbox.services.worker import Worker
    from agent_inbox.services.worker.keeper import CANCEL_LOOK

    inbox = make_inbox(pool_size=4)
    caplog.set_level(logging.WARNING, logger="agent_inbox")
    serving = Worker(inbox, f"{HANDLERS}:sleeps_unless", concurrency=4, poll_interval=0.2)
    thread = threading.Thread(target=serving.serve, args=(None,), daemon=True)  # no LISTEN
    thread.start()
    try:
        inbox.ingest("alice", "chat", "a-1", {"sleep_unless": str(tmp_path / "never")})
        wait_until(lambda: statuses(inbox, "alice") == ["running"], "alice's run to start", 60)
        inbox.pause("alice", actor="test", cancel=True)
        wait_until(lambda: "run cancelled by an operator user=alice" in caplog.text,
                   "the keeper's look to stop the run", timeout=CANCEL_LOOK + 3)
        wait_until(lambda: not serving.in_flight(), "the run to leave the worker")
    finally:
        serving.stop.event.set()
        thread.join(timeout=60)
