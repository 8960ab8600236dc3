"""A run's objects (its flight, context, step journal, permits, task) hold no
reference cycle once the run leaves the worker's table (InFlight.leave): they
are freed by reference counting alone, at once. With thousands of runs in
flight, leaving them to the cyclic garbage collector made it most of the
worker's CPU (docs/benchmarks, W5 at 5,000 in flight). Each test runs with the
collector switched off, so a cycle left anywhere keeps its run's flight alive."""

import gc
import weakref

import pytest

from agent_inbox.services.worker import Worker

from tests.runtime.support import wait_until

T = 1_000_000
RUNS = 5


@pytest.mark.parametrize("reference, payload, timeout", [
    ("tests.runtime.handlers:async_echo", {}, 60.0),               # a task on the loop
    ("tests.runtime.handlers:echo", {}, 60.0),                     # a thread each
    ("tests.runtime.step_handlers:five_steps", "steps", 60.0),     # durable steps
    ("tests.runtime.app_handlers:app", {}, 60.0),                  # a limit, a step, a permit
    ("tests.runtime.handlers:async_hang", {}, 1.0),                # stopped: timed out, cancelled
], ids=["async", "plain", "steps", "permit", "stopped"])
def test_a_runs_objects_are_freed_without_the_garbage_collector(inbox, tmp_path, monkeypatch,
                                                                  reference, payload, timeout):
    monkeypatch.setenv("APP_HOOKS_LOG", str(tmp_path / "hooks.log"))  # app_handlers' hooks
    if payload == "steps":
        payload = {"log": str(tmp_path / "steps.log"), "after_3": "nothing"}
    for i in range(RUNS):
        inbox.ingest(f"u{i}", "chat", "1", payload)
    worker = Worker(inbox, reference, concurrency=RUNS, run_timeout=timeout)
    taken: list[weakref.ref] = []
    add = worker.flights.add

    def remember(flights):
        taken.extend(weakref.ref(flight) for flight in flights)
        add(flights)

    worker.flights.add = remember
    gc.collect()
    gc.disable()
    try:
        counts = worker.run_once(now=T, timeout=timeout)
        assert counts["runs"] == RUNS and len(taken) == RUNS
        assert counts["accepted"] == (0 if reference.endswith("hang") else RUNS)
        # a plain handler's thread, a cancelled task: each lets go of its run as it ends
        wait_until(lambda: all(ref() is None for ref in taken),
                   "every run's flight freed by reference counting")
    finally:
        gc.enable()
        worker.close()
