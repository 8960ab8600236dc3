"""An async handler that blocks the worker's event loop (time.sleep) is named:
logged once for its run with its user and the loop's stack, counted in
agent_inbox_loop_blocked_total; one that blocks it past its run timeout ends
the runtime as a crash, and the supervisor's next runtime recovers the runs.
Real worker processes, a real PostgreSQL."""

import socket
import urllib.request

from tests.runtime.support import stop_all, wait_until, worker_args

OTHERS = ["a", "b", "c"]


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def scrape(port, name):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


def all_done(inbox, users):
    return all(e.status == "done" for user in users for e in inbox.events(user)) and all(
        inbox.events(user) for user in users)


def test_a_handler_blocking_the_loop_is_logged_once_with_its_stack_and_counted(
        database_url, inbox, spawn):
    inbox.ingest("blocker", "chat", "1", {"block": 2})
    for user in OTHERS:
        inbox.ingest(user, "chat", "1", {"wait": 0.5})
    port = free_port()
    worker = spawn(*worker_args(database_url, "block_the_loop", "--concurrency", "4",
                                "--metrics-port", str(port)))
    wait_until(lambda: all_done(inbox, ["blocker", *OTHERS]), "every run to finish", timeout=60)
    assert scrape(port, "agent_inbox_loop_blocked_total") == 1.0
    stop_all([worker])
    output = worker.stdout.read()
    assert worker.returncode == 0, output
    warnings = [line for line in output.splitlines() if "event loop blocked for" in line]
    assert len(warnings) == 1, output                   # once for the run, not at every look
    assert "by user=blocker holder=" in warnings[0] and " gen=1:" in warnings[0], warnings
    stack = output.split(warnings[0], 1)[1]
    assert "in sleep_holding_the_loop" in stack and "time.sleep(seconds)" in stack, output
    assert "in block_the_loop" in stack
    assert "past --run-timeout" not in output and "run timed out" not in output
    assert {(e.status, e.attempts) for u in ["blocker", *OTHERS] for e in inbox.events(u)} == {
        ("done", 1)}


def test_a_handler_blocking_the_loop_past_its_timeout_crashes_the_runtime_not_the_others(
        database_url, inbox, spawn):
    inbox.ingest("blocker", "chat", "1", {"block": 30})
    for user in OTHERS:
        inbox.ingest(user, "chat", "1", {"wait": 1})
    worker = spawn(*worker_args(database_url, "block_the_loop", "--concurrency", "4",
                                "--run-timeout", "2", "--retry-backoff", "1"))
    wait_until(lambda: all_done(inbox, ["blocker", *OTHERS]), "every run to finish", timeout=90)
    stop_all([worker])
    output = worker.stdout.read()
    exits = [line for line in output.splitlines() if "past --run-timeout 2 s: the runtime exits"
             in line]
    assert len(exits) == 1 and "by user=blocker holder=" in exits[0], output
    assert "exited: an async run blocked its event loop past --run-timeout" in output
    assert "run timed out" not in output                # the others were not charged a timeout
    # the blocker's retry ran alone in quarantine, where it does not block (attempt 2)
    assert "run in quarantine user=blocker" in output
    assert [m.body for m in inbox.outbox("blocker")] == ["blocker:2"]
    for user in OTHERS:                                 # recovered, nothing lost
        assert [e.status for e in inbox.events(user)] == ["done"]


def test_a_task_a_handler_starts_is_named_for_its_run():
    """The watchdog names the run a blocking task works for, even a task the
    handler started itself (it inherits the run's context), and reports a block
    outside any task with no run."""
    import asyncio
    import contextvars
    import threading
    import time

    from agent_inbox.services.worker import executors

    loop = executors.EventLoop()
    reports, done = [], threading.Event()
    loop.watch(lambda flight, seconds, stack, first: reports.append((flight, first, stack)))
    run = object()

    async def handler():
        await asyncio.create_task(child())
        asyncio.get_running_loop().call_soon(outside_any_task)

    async def child():
        time.sleep(1.5)

    def outside_any_task():
        time.sleep(1.5)
        done.set()

    context = contextvars.copy_context()
    context.run(executors.RUN.set, run)
    loop.loop.call_soon_threadsafe(lambda: loop.loop.create_task(handler(), context=context))
    assert done.wait(30)
    time.sleep(executors.LOOP_WATCH_EVERY * 2)
    loop.close()
    firsts = [(flight, stack) for flight, first, stack in reports if first]
    assert [flight for flight, _ in firsts] == [run, None]
    assert "in child" in firsts[0][1] and "time.sleep(1.5)" in firsts[0][1]
