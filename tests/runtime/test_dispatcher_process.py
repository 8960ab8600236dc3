"""The dispatcher as a process: SIGTERM lets the sends in flight end and be
marked; a dispatcher killed mid-send is followed, after its send deadline, by
another that sends the same batches under the same keys."""

import signal

import pytest

from agent_inbox import Result
from tests.runtime.support import wait_until

USERS = [f"u{i}" for i in range(5)]


@pytest.fixture
def sends(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_INBOX_TEST_SENDS", str(tmp_path))
    return tmp_path


def lines(path):
    return path.read_text().split() if path.exists() else []


def queue_messages(inbox):
    for user in USERS:
        inbox.ingest(user, "chat", "1", {})
        run = inbox.take_work(f"w-{user}")
        assert inbox.finish_run(run, Result(messages=[f"to {user}"]))


def dispatcher_args(url, *extra):
    return ["dispatcher", "--database-url", url, "--channel", "tests.runtime.channels:held",
            "--concurrency", "5", "--poll-interval", "0.2", "--log-level", "info", *extra]


def test_sigterm_waits_for_the_sends_in_flight_and_marks_them(database_url, inbox, spawn, sends):
    queue_messages(inbox)
    dispatcher = spawn(*dispatcher_args(database_url))
    wait_until(lambda: len(lines(sends / "started")) == len(USERS), "every send to start")
    dispatcher.send_signal(signal.SIGTERM)
    (sends / "release").touch()
    output, _ = dispatcher.communicate(timeout=60)
    assert dispatcher.returncode == 0, output
    assert sorted(lines(sends / "sent")) == sorted(lines(sends / "started"))
    assert all(m.sent_at is not None for u in USERS for m in inbox.outbox(u))


def test_a_killed_dispatchers_batches_go_again_after_the_deadline_same_keys(
        database_url, inbox, spawn, sends):
    queue_messages(inbox)
    first = spawn(*dispatcher_args(database_url, "--send-timeout", "3"))
    wait_until(lambda: len(lines(sends / "started")) == len(USERS), "every send to start")
    first.kill()
    first.wait(timeout=10)
    claimed = sorted(lines(sends / "started"))
    assert all(m.sent_at is None for u in USERS for m in inbox.outbox(u))
    (sends / "release").touch()
    second = spawn(*dispatcher_args(database_url, "--send-timeout", "3"))
    wait_until(lambda: all(m.sent_at is not None for u in USERS for m in inbox.outbox(u)),
               "the second dispatcher to send every batch", timeout=30)
    assert sorted(lines(sends / "sent")) == claimed       # the same keys, each once more
    second.send_signal(signal.SIGTERM)
    second.communicate(timeout=30)
