"""The dispatcher and the scheduler say they started, and stop within about a
second of SIGTERM when idle (issue 20: the dispatcher logged nothing and, once
it had sent, slept through SIGTERM until its next poll: its main thread waits
on the Waker, which a signal did not wake)."""

import signal
import time


from agent_inbox import Result


def read_until_each(process, texts: list[str]) -> None:
    """Read the process's log lines until each of `texts` was in one (or it exits)."""
    left = set(texts)
    for line in process.stdout:
        left = {text for text in left if text not in line}
        if not left:
            return
    raise AssertionError(f"the process exited without logging {sorted(left)}")


def stop_timed(process) -> tuple[float, str]:
    asked = time.monotonic()
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=60)
    return time.monotonic() - asked, output


def test_the_dispatcher_logs_its_start_and_stops_within_a_second_of_sigterm(
        database_url, inbox, spawn):
    for user in ("u0", "u1"):
        inbox.ingest(user, "chat", "1", {})
        assert inbox.finish_run(inbox.take_work("w"), Result(messages=["hello"]))
    process = spawn("dispatcher", "--channel", "agent_inbox.dev.examples:print_channel",
                    "--database-url", database_url, "--log-level", "info",
                    "--poll-interval", "20")
    read_until_each(process, ["sent user=u0", "sent user=u1"])  # in whichever order it sends
    time.sleep(0.5)  # idle: asleep until its next poll
    took, output = stop_timed(process)
    assert process.returncode == 0, output
    assert took < 1.5, f"stopped {took:.1f} s after SIGTERM"
    assert all(m.sent_at is not None for u in ("u0", "u1") for m in inbox.outbox(u))


def test_the_dispatcher_and_scheduler_log_a_start_line(database_url, spawn):
    for service in (["dispatcher", "--channel", "agent_inbox.dev.examples:print_channel"],
                    ["scheduler"]):
        process = spawn(*service, "--database-url", database_url, "--log-level", "info")
        read_until_each(process, [f"{service[0]} started"])
        took, output = stop_timed(process)
        assert process.returncode == 0, output
