"""A dense storm of poison events among healthy ones, through real worker
processes: every poison event is dead after max_attempts, and no healthy event
is parked dead. A poison event's first attempt kills its worker's runtime and
the runs in flight beside it (one attempt each: the price of no process per
run); the supervisor starts another runtime, and every retry of a run that
ended without a finish runs alone in quarantine, where only the poison event
dies again. With an async handler the poison is named (blame.py): only its
run goes to quarantine, the runs beside it are retried in the next runtime."""

import pytest

from tests.runtime.support import scalar, wait_until, worker_args

USERS = 40
POISON_EVERY = 3  # users 0, 3, 6, ...: 14 poison users among 40


@pytest.mark.parametrize("handler", ["crash_process", "async_crash_process"])
def test_a_poison_storm_kills_only_the_poison_events(database_url, inbox, spawn, handler):
    inbox.ingest_many([(f"u{n:02}", "chat", str(k), {"poison": n % POISON_EVERY == 0 and k == 0})
                       for k in range(2) for n in range(USERS)])
    for _ in range(2):
        spawn(*worker_args(database_url, handler, "--concurrency", "2",
                           "--retry-backoff", "1", "--poll-interval", "0.2",
                           "--log-level", "warning"))
    wait_until(lambda: scalar(database_url, "SELECT count(*) FROM events "
                                            "WHERE status IN ('pending', 'running')") == 0,
               "every event to be done or dead", timeout=120)

    poison = [e for n in range(0, USERS, POISON_EVERY) for e in inbox.events(f"u{n:02}")
              if e.payload["poison"]]
    healthy = [e for n in range(USERS) for e in inbox.events(f"u{n:02}") if not e.payload["poison"]]
    assert len(poison) == 14 and len(healthy) == 2 * USERS - 14
    assert {(e.status, e.attempts) for e in poison} == {("dead", 3)}
    assert all(e.status == "done" for e in healthy), [e for e in healthy if e.status != "done"]
