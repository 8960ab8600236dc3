"""The fleet's limits in `agent-inbox worker` as users run it: two worker
processes whose runs all call `ctx.limit("llm")` are let through no faster than
the limit in the database allows, and no slower than it by much; a run retried
in quarantine waits on its worker's limiter over its pipe, and gets the
limiter's errors there too. Every wait is on database state, bounded."""

import pytest

from agent_inbox.api import limits
from tests.runtime.support import scalar, stop_all, wait_until

HANDLERS = "tests.runtime.limit_handlers"
RATE, BURST, USERS = 20, 5, 60


def grants(path) -> list[tuple[float, int, int]]:
    """(time, pid, attempt) of every call let through, in time order."""
    if not path.exists():
        return []
    return sorted((float(t), int(pid), int(attempt))
                  for _, t, pid, attempt in (line.split() for line in lines(path, "ok ")))


def lines(path, prefix: str) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.startswith(prefix)]



@pytest.mark.parametrize("handler", ["limited", "limited_plain"])
def test_two_workers_share_one_limit(database_url, inbox, spawn, tmp_path, handler):
    log = tmp_path / "grants"
    limits.set_limit(inbox, "llm", RATE, 1, BURST)
    workers = [spawn("worker", "--database-url", database_url,
                     "--handler", f"{HANDLERS}:{handler}", "--concurrency", "40",
                     "--poll-interval", "0.2", "--log-level", "warning") for _ in range(2)]
    inbox.ingest_many([(f"u{n:03}", "chat", "1", {"log": str(log)}) for n in range(USERS)])
    wait_until(lambda: scalar(database_url, "SELECT count(*) FROM events WHERE status = 'done'")
               == USERS, "every event to be done", timeout=60)
    stop_all(workers)

    times = [t for t, _, _ in grants(log)]
    assert len(times) == USERS
    assert len({pid for _, pid, _ in grants(log)}) == 2  # both workers ran some
    # Never faster than the bucket: (USERS - BURST) / RATE seconds at least
    # from the first call let through to the last (a few ms spare: the times
    # are the handlers', taken just after the grant reached them) ...
    assert times[-1] - times[0] >= (USERS - BURST) / RATE - 0.1
    # ... and in any 1-second span, no more than the burst and a second's worth
    # (and a tenth of a second's, for the same reason).
    for i, start in enumerate(times):
        inside = sum(1 for t in times[i:] if t - start <= 1.0)
        assert inside <= BURST + RATE * 1.1, (start, inside)
    # ... and not much slower than the limit either
    assert times[-1] - times[0] < (USERS - BURST) / RATE + 3.0


def test_a_quarantined_run_waits_on_its_workers_limiter(database_url, inbox, spawn, tmp_path):
    log = tmp_path / "grants"
    limits.set_limit(inbox, "llm", 100, 1, 10)
    inbox.ingest_many([("poison", "chat", "1", {"log": str(log), "crash": True}),
                       ("unknown", "chat", "1", {"log": str(log), "crash": True,
                                                  "limit": "nope"}),
                       ("greedy", "chat", "1", {"log": str(log), "crash": True, "cost": 11})])
    worker = spawn("worker", "--database-url", database_url, "--handler",
                   f"{HANDLERS}:limited", "--concurrency", "1", "--quarantine", "1",
                   "--retry-backoff", "0", "--max-attempts", "2", "--poll-interval", "0.2",
                   "--log-level", "info")
    wait_until(lambda: scalar(database_url, "SELECT count(*) FROM events "
                                            "WHERE status IN ('pending', 'running')") == 0,
               "every event to be done or dead", timeout=90)
    stop_all([worker])
    output = worker.stdout.read()

    assert [(e.status, e.attempts) for e in inbox.events("poison")] == [("done", 2)]
    assert [attempt for _, _, attempt in grants(log)] == [2]  # let through in quarantine
    assert "run in quarantine user=poison" in output
    # the limiter's errors reach the quarantined handler (its run's error)
    assert [e.status for e in inbox.events("unknown") + inbox.events("greedy")] == ["dead"] * 2
    assert sorted(lines(log, "error ")) == [
        "error 2 CostAboveBurst: cost is above the burst of limit 'llm' (10): it could never "
        "be granted (got 11)",
        "error 2 UnknownLimit: limit 'nope' does not exist: make it with `agent-inbox limits "
        "set NAME --rate N --per SECONDS` (or declare it in the app) (got 'nope')"]
    assert [attempt for _, _, attempt in grants(log)] == [2]  # nothing let them through
