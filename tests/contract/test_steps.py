"""Durable steps through the Inbox API (Inbox.context): recorded under the
run's fence, replayed to a later attempt at exactly the same events, refused
for a stale generation, gone with the run's successful finish.

A contract test module: each test runs on every backend (tests/contract/conftest.py).
"""

import asyncio

import psycopg
import pytest

from agent_inbox import Result, errors
from agent_inbox.store import keys
from tests.contract.test_concurrency import race_behind


class Calls:
    """Counts the calls of step functions, by name."""

    def __init__(self):
        self.names: list[str] = []

    def fn(self, name, value=None):
        def call(*args):
            self.names.append(name)
            return value if value is not None else {"step": name, "args": list(args)}
        return call


def crash(inbox, run):
    """What a worker that died with the run does: the lease released, the
    events left running (the retry sees them unfinished)."""
    assert inbox.runs.release_runs([run], error="the worker process running it died") == [run.user]


def test_a_retry_of_the_same_events_replays_its_recorded_steps(inbox):
    inbox.ingest("alice", "chat", "m1", {"text": "refund order 881"})
    run = inbox.take_work("A")
    ctx, calls = inbox.context(run), Calls()
    assert ctx.step_sync("plan", calls.fn("plan"), "m1") == {"step": "plan", "args": ["m1"]}
    assert ctx.step_sync("refund", calls.fn("refund", ["refunded", 881])) == ["refunded", 881]
    assert ctx.step_sync("refund", calls.fn("refund#2", {"twice": True})) == {"twice": True}
    crash(inbox, run)

    retry = inbox.take_work("B")
    assert (retry.gen, [e.attempts for e in retry.events], retry.unfinished) == (2, [2], 1)
    again, replays = inbox.context(retry), Calls()
    assert again.step_sync("plan", replays.fn("plan"), "m1") == {"step": "plan", "args": ["m1"]}
    assert again.step_sync("refund", replays.fn("refund")) == ["refunded", 881]
    assert again.step_sync("refund", replays.fn("refund#2")) == {"twice": True}
    assert again.step_sync("email", replays.fn("email", "sent")) == "sent"
    assert calls.names == ["plan", "refund", "refund#2"]
    assert replays.names == ["email"]  # the recorded three were not called again
    recorded = inbox.steps("alice")
    assert [(s.label, s.gen, s.holder) for s in recorded] == [
        ("plan", 1, "A"), ("refund", 1, "A"), ("refund#2", 1, "A"), ("email", 2, "B")]
    assert inbox.finish_run(retry, Result(messages=["done"]))
    assert inbox.steps("alice") == []  # gone with the successful finish


def test_steps_asked_in_another_order_get_a_clear_error(inbox):
    inbox.ingest("bob", "chat", "m1", {})
    run = inbox.take_work("A")
    ctx, calls = inbox.context(run), Calls()
    ctx.step_sync("search", calls.fn("search"))
    ctx.step_sync("answer", calls.fn("answer"))
    crash(inbox, run)

    retry = inbox.context(inbox.take_work("A"))
    retry.step_sync("search", calls.fn("search"))
    with pytest.raises(errors.StepMismatch, match=r"step 2 of this run was recorded as "
                                                  r"'answer'.*asked for 'search#2'"):
        retry.step_sync("search", calls.fn("search"))
    assert calls.names == ["search", "answer"]


def test_a_stale_generations_step_is_refused_and_stores_nothing(inbox):
    inbox.ingest("carol", "chat", "m1", {})
    run = inbox.take_work("A")
    stale, calls = inbox.context(run), Calls()
    stale.step_sync("one", calls.fn("one"))
    crash(inbox, run)
    newer = inbox.take_work("B")  # generation 2
    with pytest.raises(errors.StepRefused, match="lease is lost"):
        stale.step_sync("two", calls.fn("two"))
    assert calls.names == ["one", "two"]  # it ran; its record was refused
    assert [(s.label, s.gen) for s in inbox.steps("carol")] == [("one", 1)]
    current = inbox.context(newer)
    assert current.step_sync("one", calls.fn("one")) == {"step": "one", "args": []}
    assert current.step_sync("two", calls.fn("two", "again")) == "again"
    assert [(s.label, s.gen) for s in inbox.steps("carol")] == [("one", 1), ("two", 2)]


def test_a_step_racing_a_takeover_waits_for_it_and_is_refused(database_url, inbox, make_inbox):
    """The record takes the lease row FOR SHARE: behind a takeover not yet
    committed it waits, then sees the new generation and stores nothing."""
    racer = make_inbox(application_name="racer-steps")
    inbox.ingest("dave", "chat", "m1", {})
    run = racer.take_work("A")
    ctx = racer.context(run)
    takeover = ("UPDATE leases SET holder = 'B', gen = gen + 1 WHERE user_id = %(user)s")
    [refusal] = race_behind(database_url, takeover, {"user": "dave"},
                            [lambda: _refusal(ctx)], commit=True)
    assert isinstance(refusal, errors.StepRefused)
    assert inbox.steps("dave") == []


def _refusal(ctx):
    try:
        ctx.step_sync("late", lambda: "x")
    except errors.StepRefused as exc:
        return exc
    return None


def test_a_retry_that_claims_other_events_starts_without_steps(make_inbox):
    """A batch's retries are claimed one event at a time: the batch's records
    are never replayed into them, and the first retry that succeeds deletes
    them (the batch can never be claimed whole again)."""
    inbox = make_inbox(retry_backoff=0, pool_size=2)
    inbox.ingest_many([("erin", "chat", "m1", {}), ("erin", "chat", "m2", {})])
    run = inbox.take_work("A")
    assert len(run.events) == 2
    calls = Calls()
    inbox.context(run).step_sync("summarise", calls.fn("summarise", "both"))
    assert inbox.finish_run(run, Result(error="the model timed out"))

    first = inbox.take_work("A")
    assert [e.source_id for e in first.events] == ["m1"]
    assert inbox.context(first).step_sync("summarise", calls.fn("summarise", "m1")) == "m1"
    assert calls.names == ["summarise", "summarise"]
    assert sorted(len(s.event_ids) for s in inbox.steps("erin")) == [1, 2]
    assert inbox.finish_run(first, Result())
    assert inbox.steps("erin") == []


def test_an_error_keeps_the_steps_and_the_retry_resumes(make_inbox):
    inbox = make_inbox(retry_backoff=0, pool_size=2)
    inbox.ingest("fay", "chat", "m1", {})
    run = inbox.take_work("A")
    calls = Calls()
    inbox.context(run).step_sync("charge", calls.fn("charge", {"charge": "ch_1"}))
    assert inbox.finish_run(run, Result(error="the tool raised"))
    assert [s.label for s in inbox.steps("fay")] == ["charge"]

    retry = inbox.take_work("A")
    assert retry.unfinished == 0  # an error: not a quarantine suspect
    assert inbox.context(retry).step_sync("charge", calls.fn("charge")) == {"charge": "ch_1"}
    assert calls.names == ["charge"]


def test_step_results_and_names_are_checked_and_nothing_is_stored(make_inbox):
    inbox = make_inbox(max_payload_bytes=64)
    inbox.ingest("gus", "chat", "m1", {})
    ctx = inbox.context(inbox.take_work("A"))
    with pytest.raises(errors.InvalidPayload, match="result of step 'now' is not JSON"):
        ctx.step_sync("now", lambda: object())
    with pytest.raises(errors.PayloadTooLarge, match="result of step 'big' is 90 bytes as JSON, "
                                                     "over the limit of 64"):
        ctx.step_sync("big", lambda: "x" * 88)
    with pytest.raises(errors.InvalidInput, match="step name must not contain '#'"):
        ctx.step_sync("a#2", lambda: 1)
    with pytest.raises(errors.InvalidInput, match="step name must not be empty"):
        ctx.step_sync("", lambda: 1)
    assert inbox.steps("gus") == []
    with pytest.raises(errors.AgentInboxError, match="needs a run's journal"):
        asyncio.run(type(ctx)("gus", "A", 1).step("x", lambda: 1))


def test_step_key_is_the_same_on_every_attempt_and_names_the_occurrence(inbox):
    inbox.ingest("hal", "chat", "m1", {})
    run = inbox.take_work("A")
    ctx = inbox.context(run)
    first = ctx.step_key("email")
    ctx.step_sync("email", lambda: "sent")
    second = ctx.step_key("email")
    assert first != second and first.startswith("agent-inbox-") and len(first) <= 255
    crash(inbox, run)
    again = inbox.context(inbox.take_work("B"))
    assert again.step_key("email") == first
    again.step_sync("email", lambda: "not called")
    assert again.step_key("email") == second


def test_async_steps_replay_in_call_order(inbox):
    """`await ctx.step` with sync and async functions, two started together:
    positions follow the call order, and a retry replays both."""
    inbox.ingest("ida", "chat", "m1", {})
    run = inbox.take_work("A")
    calls = Calls()

    async def fetch(name):
        calls.names.append(name)
        await asyncio.sleep(0)
        return name.upper()

    async def handler(ctx):
        a, b = await asyncio.gather(ctx.step("a", fetch, "a"), ctx.step("b", fetch, "b"))
        c = await ctx.step("c", calls.fn("c", "C"))
        return a + b + c

    assert asyncio.run(handler(inbox.context(run))) == "ABC"
    crash(inbox, run)
    assert asyncio.run(handler(inbox.context(inbox.take_work("A")))) == "ABC"
    assert sorted(calls.names) == ["a", "b", "c"]
    assert [s.label for s in inbox.steps("ida")] == ["a", "b", "c"]


def test_a_requeued_dead_event_starts_with_no_steps(make_inbox, database_url):
    inbox = make_inbox(max_attempts=1, pool_size=2)
    inbox.ingest("jo", "chat", "m1", {})
    run = inbox.take_work("A")
    inbox.context(run).step_sync("tool", lambda: "done once")
    crash(inbox, run)
    parked = inbox.take_work("A")
    assert parked.events == [] and parked.died == 1  # out of attempts: dead
    assert inbox.finish_run(parked, Result())
    [event] = inbox.events("jo")
    assert event.status == "dead" and len(inbox.steps("jo")) == 1
    assert len(inbox.repair_dead([("jo", event.id)], requeue=True, actor="test")) == 1
    assert inbox.steps("jo") == []
    run = inbox.take_work("A")
    assert inbox.context(run).step_sync("tool", lambda: "again") == "again"


def test_the_steps_table_refuses_what_the_code_never_writes(database_url):
    with psycopg.connect(database_url, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute("INSERT INTO steps (bucket, user_id, event_ids, position, name,"
                         " occurrence, result, holder, gen)"
                         " VALUES (%(bucket)s, %(user)s, '{1}', 0, 'n', 1, '1', 'h', 1)",
                         keys.user_key("x"))


def test_steps_started_together_replay_by_position_when_one_was_not_recorded(inbox):
    """Two steps started together: the first raised (not recorded), the second
    was recorded at position 2. The retry calls the first again and replays
    the second, each by its own position."""
    inbox.ingest("kim", "chat", "m1", {})
    run = inbox.take_work("A")
    calls = Calls()

    async def handler(ctx, first_fails):
        async def first():
            calls.names.append("first")
            if first_fails:
                raise RuntimeError("the tool timed out")
            return "FIRST"
        return await asyncio.gather(ctx.step("first", first),
                                    ctx.step("second", calls.fn("second", "SECOND")),
                                    return_exceptions=True)

    first_try = asyncio.run(handler(inbox.context(run), True))
    assert isinstance(first_try[0], RuntimeError) and first_try[1] == "SECOND"
    assert [(s.position, s.label) for s in inbox.steps("kim")] == [(2, "second")]
    crash(inbox, run)
    assert asyncio.run(handler(inbox.context(inbox.take_work("A")), False)) == ["FIRST", "SECOND"]
    assert calls.names == ["first", "second", "first"]
