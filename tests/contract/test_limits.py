"""Limits shared by the fleet (limits.py, store/limits.py) against a real
PostgreSQL: several limiters, each on an Inbox of its own (as separate
processes would be), never let more through than the bucket in the database
allows, measured by the database's clock; callers are served in arrival order;
a change by `agent-inbox limits set` reaches a running limiter; bad input gets
a clear error and changes nothing.

A contract test module: each test runs on every backend (tests/contract/conftest.py).
Waits are on the limiter's observable state (its statements, its callers),
bounded.
"""

import asyncio
import threading
import time

import pytest

from agent_inbox import cli, errors
from agent_inbox.api import limits
from agent_inbox.agent.handler import Context
from agent_inbox.api.limits import Limiter


def wait_until(condition, description, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {description}")
        time.sleep(0.01)


def call_all(limiter, name, costs, done):
    """Every cost asked of `limiter` at once, in list order, on an event loop
    of this thread; `done` gets (index, time.monotonic()) as each is let through."""
    async def one(index, cost):
        await limiter.acquire(name, cost)
        done.append((index, time.monotonic()))

    async def main():
        tasks = [asyncio.ensure_future(one(index, cost)) for index, cost in enumerate(costs)]
        await asyncio.gather(*tasks)

    asyncio.run(main())


def stored(inbox):
    return {x["name"]: x for x in limits.list_limits(inbox)}


def test_limiters_of_several_processes_never_take_more_than_the_bucket(inbox, make_inbox):
    rate, burst, callers, per_limiter = 40, 10, 3, 40
    limits.set_limit(inbox, "llm", rate, 1, burst)
    limiters = [Limiter(make_inbox(pool_size=1).pool) for _ in range(callers)]
    done = [[] for _ in limiters]
    for limiter in limiters:
        limiter.grant_log = []
    threads = [threading.Thread(target=call_all, args=(limiter, "llm", [1] * per_limiter, out))
               for limiter, out in zip(limiters, done)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)

    total = callers * per_limiter
    assert sum(len(out) for out in done) == total
    # every caller let through had a token of its own from the database
    assert [limiter.calls for limiter in limiters] == [per_limiter] * callers
    assert sum(limiter.tokens for limiter in limiters) == total
    # the grants, by the database's clock: no span holds more than the bucket allows
    grants = sorted((at, taken) for limiter in limiters for _, taken, at in limiter.grant_log)
    for i, (start, _) in enumerate(grants):
        taken = 0
        for at, amount in grants[i:]:
            taken += amount
            assert taken <= burst + rate * (at - start) + 1e-6, (start, at, taken)
    # and the limit was used: about (total - burst) / rate seconds, not much more
    span = grants[-1][0] - grants[0][0]
    assert (total - burst) / rate - 1e-6 <= span < (total - burst) / rate + 2.0
    # a busy limiter asks in chunks, not once per caller
    assert sum(limiter.statements for limiter in limiters) < total / 2


def test_callers_are_served_in_arrival_order(inbox):
    limits.set_limit(inbox, "tool", 50, 1, 3)
    limiter = Limiter(inbox.pool)
    costs = [1, 3, 1, 2, 1, 1, 3, 1, 2, 1]
    done = []
    call_all(limiter, "tool", costs, done)
    assert [index for index, _ in done] == list(range(len(costs)))
    assert limiter.calls == len(costs) and limiter.tokens == sum(costs)


def test_a_caller_that_gives_up_leaves_the_line(inbox):
    limits.set_limit(inbox, "slow", 1, 3600, 1)
    limiter = Limiter(inbox.pool)
    limiter.acquire_blocking("slow")  # the bucket's one token
    stop = threading.Event()
    with pytest.raises(limits.LimitAbandoned):
        threading.Timer(0.2, stop.set).start()
        limiter.acquire_blocking("slow", abandoned=stop.is_set, poll=0.02)
    assert limiter.stats()["waiting"] == 0

    async def cancelled():
        task = asyncio.ensure_future(limiter.acquire("slow"))
        await asyncio.sleep(0)  # queued
        assert limiter.stats()["waiting"] == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert limiter.stats()["waiting"] == 0

    asyncio.run(cancelled())


def test_a_change_by_limits_set_reaches_a_running_limiter(inbox, database_url, capsys):
    limits.set_limit(inbox, "llm", 1, 3600, 1)
    limiter = Limiter(inbox.pool)
    limiter.acquire_blocking("llm")  # the bucket's one token; the next waits an hour
    waiting = threading.Thread(target=limiter.acquire_blocking, args=("llm",))
    waiting.start()
    wait_until(lambda: limiter.statements >= 2, "the waiting caller's grant to come back empty")
    assert waiting.is_alive() and limiter.stats()["waiting"] == 1

    code = cli.main(["limits", "set", "llm", "--rate", "100", "--per", "1", "--burst", "5",
                     "--database-url", database_url])
    changed = time.monotonic()
    assert code == 0
    err = capsys.readouterr().err
    assert "agent-inbox audit: limits set by" in err and "'llm' 100 per 1 s, burst 5" in err
    waiting.join(timeout=10)
    assert not waiting.is_alive()
    assert time.monotonic() - changed < limits.MAX_SLEEP + 2.0
    assert stored(inbox)["llm"]["rate"] == 100


def test_a_context_calls_its_limiter_in_async_and_plain_handlers(inbox):
    limits.set_limit(inbox, "llm", 100, 1, 10)
    inbox.ingest("alice", "chat", "m1", {})
    ctx = inbox.context(inbox.take_work("A"))
    ctx.limit_sync("llm", 2)
    asyncio.run(ctx.limit("llm", cost=3))
    assert inbox.limiter.calls == 2
    assert inbox.limiter.tokens == 5

    bare = Context("alice", "A", 1)
    with pytest.raises(errors.AgentInboxError, match="needs a limiter"):
        bare.limit_sync("llm")


def test_declare_makes_a_default_that_an_operator_change_wins_over(inbox):
    assert limits.declare(inbox, "llm", 100, 1) is True
    assert limits.declare(inbox, "llm", 5, 60, 5) is False  # stands as it was
    assert {k: stored(inbox)["llm"][k] for k in ("rate", "per_seconds", "burst", "updated_by")} == {
        "rate": 100, "per_seconds": 1, "burst": 100, "updated_by": "app"}
    change = limits.set_limit(inbox, "llm", 10, 1, 20, actor="ops@host")
    assert change["before"] == {"rate": 100, "per_seconds": 1, "burst": 100}
    assert change["after"]["burst"] == 20 and change["after"]["tokens"] <= 20
    assert limits.declare(inbox, "llm", 100, 1) is False
    assert stored(inbox)["llm"]["updated_by"] == "ops@host"


def test_bad_input_gets_a_clear_error_and_changes_nothing(inbox):
    limits.set_limit(inbox, "llm", 5, 1, 5)
    limiter = Limiter(inbox.pool)
    for cost in (-1, 0, 1.5, True, "1", None):
        with pytest.raises(errors.InvalidInput, match="cost must be a positive whole number"):
            limiter.acquire_blocking("llm", cost)
    for name in ("", None, "x\x00y", "n" * 201):
        with pytest.raises(errors.InvalidInput, match="limit name"):
            asyncio.run(limiter.acquire(name))
    assert limiter.statements == 0

    with pytest.raises(errors.UnknownLimit, match="limit 'nope' does not exist.*limits set"):
        limiter.acquire_blocking("nope")
    with pytest.raises(errors.CostAboveBurst, match=r"cost is above the burst of limit 'llm' \(5\)"):
        asyncio.run(limiter.acquire("llm", 6))
    assert limiter.calls == limiter.tokens == 0
    assert stored(inbox)["llm"]["tokens"] == 5  # still full: nothing was taken
    assert set(stored(inbox)) == {"llm"}

    for rate, per, burst in ((0, 1, None), (1, 0, None), (-3, 1, None), (1, 1, 0), (1.5, 1, 1),
                             (1, 1, True)):
        with pytest.raises(errors.InvalidInput):
            limits.set_limit(inbox, "other", rate, per, burst)
    with pytest.raises(errors.InvalidInput):
        limits.declare(inbox, "", 1, 1)
    assert set(stored(inbox)) == {"llm"}
    assert stored(inbox)["llm"]["rate"] == 5


def test_the_cli_refuses_bad_limits_and_lists_what_stands(inbox, database_url, capsys):
    url = ["--database-url", database_url]
    for bad in (["--rate", "0", "--per", "1"], ["--rate", "1", "--per", "-5"],
                ["--rate", "1", "--per", "1", "--burst", "0"], ["--rate", "x", "--per", "1"]):
        with pytest.raises(SystemExit) as exited:
            cli.main(["limits", "set", "llm", *bad, *url])
        assert exited.value.code == 2
    with pytest.raises(SystemExit):
        cli.main(["limits", "set", "", "--rate", "1", "--per", "1", *url])
    capsys.readouterr()
    assert cli.main(["limits", "list", *url]) == 0
    assert "no limits" in capsys.readouterr().out
    assert cli.main(["limits", "set", "llm", "--rate", "100", "--per", "1", *url]) == 0
    assert cli.main(["limits", "list", "--json", *url]) == 0
    out = capsys.readouterr().out
    document = __import__("json").loads(out[out.index('{\n  "limits"'):])
    [llm] = document["limits"]
    assert (llm["name"], llm["rate"], llm["per_seconds"], llm["burst"]) == ("llm", 100, 1, 100)
