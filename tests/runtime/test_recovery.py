"""Recovery from a crash at agent scale: the run that was executing when the
runtime died is named by the slot the supervisor shares with it (blame.py); it
alone is retried in quarantine, the runs that died beside it are retried in the
next runtime at full concurrency."""

import asyncio
import signal
import threading

from agent_inbox.services.worker import blame, executors
from agent_inbox.agent.handler import Context
from agent_inbox.api.runs import Run
from agent_inbox.services.worker import InFlight
from tests.runtime.support import scalar, wait_until

HEALTHY = 30
HANDLER = "tests.runtime.recovery_handlers:poison_or_hold"


def test_the_slot_names_the_run_whose_task_is_stepping_and_only_then():
    slot = blame.Slot.create()
    loop = executors.EventLoop(slot)
    seen, done = {}, threading.Event()

    async def handle(batch, ctx):
        async def helper():  # a task the run starts is the run's too
            await asyncio.sleep(0)
            return slot.read()

        seen["step"], seen["helper"] = slot.read(), await asyncio.create_task(helper())
        await ctx.lease_lost
        seen["cancelled"] = slot.read()

    run = Run("u:1", "h", 7, 0, [])
    flight = InFlight(run, Context(run.user, run.holder, run.gen), 0.0)
    try:
        loop.run(handle, flight, lambda f: True, lambda f, outcome, s: done.set())
        wait_until(lambda: "helper" in seen, "the run's first steps")
        idle = slot.read()  # the run awaits: no task steps
        flight.ctx.lease_lost.set()
        assert done.wait(10)
        async def no_run():
            return slot.read()

        outside = asyncio.run_coroutine_threadsafe(no_run(), loop.loop)
        assert outside.result(10) is None  # a task that is no run's
    finally:
        loop.close()
        slot.close()
    assert seen == {"step": "7:u:1", "helper": "7:u:1", "cancelled": "7:u:1"}
    assert idle is None and blame.parse("7:u:1") == ("u:1", 7)


def test_the_runs_beside_a_poison_event_are_retried_at_full_concurrency(
        database_url, inbox, spawn, tmp_path):
    """30 async runs in flight when a poison event kills the runtime in its
    task's step: the supervisor names it to the next runtime, which retries it in
    quarantine (dead after max_attempts) and the 30 others as ordinary runs, all
    at once on its event loop (2 quarantine processes could hold 2 of them), each
    executed twice in all, none through quarantine."""
    def payload(user, **more):
        return {"runs": str(tmp_path / user), "release": str(tmp_path / "go"), **more}

    def executions(user):
        path = tmp_path / user
        return path.read_text().split() if path.exists() else []

    inbox.ingest_many([(f"healthy{n:02}", "chat", "1", payload(f"healthy{n:02}"))
                       for n in range(HEALTHY)])
    worker = spawn("worker", "--database-url", database_url, "--handler", HANDLER,
                   "--log-level", "info", "--concurrency", "40", "--quarantine", "2",
                   "--lease-ttl", "600", "--retry-backoff", "1")
    wait_until(lambda: all(executions(f"healthy{n:02}") for n in range(HEALTHY)),
               f"{HEALTHY} first attempts in flight")
    inbox.ingest("poison", "chat", "1", payload("poison", poison=True))
    wait_until(lambda: all(len(executions(f"healthy{n:02}")) == 2 for n in range(HEALTHY)),
               f"the {HEALTHY} runs that died to be running again, all at once", timeout=60)
    (tmp_path / "go").touch()
    wait_until(lambda: scalar(database_url, "SELECT count(*) FROM events "
                                            "WHERE status IN ('pending', 'running')") == 0,
               "every event to be done or dead", timeout=60)
    worker.send_signal(signal.SIGTERM)
    output, _ = worker.communicate(timeout=60)

    assert [(e.status, e.attempts) for e in inbox.events("poison")] == [("dead", 3)]
    healthy = [e for n in range(HEALTHY) for e in inbox.events(f"healthy{n:02}")]
    assert {(e.status, e.attempts) for e in healthy} == {("done", 2)}
    runs = [executions(f"healthy{n:02}") for n in range(HEALTHY)]
    assert {len(r) for r in runs} == {2}               # executed twice each, no more
    assert len({r[1] for r in runs}) == 1              # the second time all in one process,
    assert {r[0] for r in runs}.isdisjoint({r[1] for r in runs})  # the next runtime
    assert output.count("agent-inbox worker: the runtime") == 1
    assert "was killed by SIGKILL after" in output and " executing user=poison gen=" in output
    assert f"released its {HEALTHY + 1} leases" in output
    assert output.count("run in quarantine user=poison") == 2
    assert output.count("quarantine run crashed user=poison") == 2
    assert "run in quarantine user=healthy" not in output
