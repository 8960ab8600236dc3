"""Durable steps: `await ctx.step(name, fn, *args)` calls `fn` once per run's
events, however many attempts the run takes.

A run's steps are numbered in the order it asks for them (its *positions*),
and named `name`, `name#2`, ... by occurrence. The first attempt calls `fn`,
records its JSON-encodable result under the run's lease fence (store/steps.py)
and only then returns it. A later attempt at exactly the same events (after a
crash, a timeout, a lost lease or an error) reads the records once and, for
every position recorded, returns the recorded result without calling `fn`; past
the last record it calls `fn` again. An attempt that asks, at a recorded
position, for a step of another name or occurrence gets `StepMismatch`.

What a step returns is its result as JSON gives it back (a tuple comes back a
list), on the first attempt as on a replay, so the handler sees one shape.

A retry that claims a different set of events (a batch's retries are claimed
one event at a time, fresh events join a new batch) starts with no steps: a
record is never replayed into a run that did not claim exactly its events.
`ctx.step_key(name)` names the next call of `name` the same way on every
attempt: pass it to a provider as its idempotency key, so that a step that ran
but whose record was lost (the process died between the call and the commit)
is not done twice by the provider either.

Where records go is the run's `Journal`: the worker's (worker/completer.py: records from
every run in flight committed together by the completer), an `Inbox`'s own
(`DirectJournal`: one transaction per record, for code that runs a handler
itself), or a quarantine process's pipe to its worker (handler.py).
"""

import asyncio
import hashlib
import inspect
import json
from typing import Any, Callable, Protocol

from agent_inbox import errors, tracing, validate
from agent_inbox.store.steps import RecordedStep, StepRecord, events_key

MAX_NAME_BYTES = 200


class Journal(Protocol):
    """Where a run's step records are read and written. `recorded` returns the
    steps an earlier attempt recorded for the run's events; `record` returns once
    the record is committed, or raises StepRefused (the fence said no)."""

    def recorded(self) -> list[RecordedStep]: ...

    def record(self, record: StepRecord) -> None: ...

    async def recorded_async(self) -> list[RecordedStep]: ...

    async def record_async(self, record: StepRecord) -> None: ...


NO_RUN = ("ctx.step needs a run's journal: call it from a handler the worker runs, or make "
          "the context with Inbox.context(run)")


class RunSteps:
    """The steps of one attempt at one run: positions handed out in call order,
    the earlier attempts' records read at most once, each result recorded
    before it is returned."""

    def __init__(self, user: str, holder: str, gen: int, event_ids, *, may_resume: bool,
                 journal: Journal, max_result_bytes: int):
        self.user, self.holder, self.gen = user, holder, gen
        self.event_ids = tuple(sorted(event_ids))
        # Only an event claimed before may have records: a first attempt skips the read.
        # The earlier attempts' records by position (steps started together may
        # have been recorded out of order, leaving a gap); None until read.
        self._recorded: dict[int, RecordedStep] | None = None if may_resume else {}
        self._loading = None  # an asyncio future while an async read is under way
        self.journal = journal
        self.max_result_bytes = max_result_bytes
        self._calls = 0
        self._occurrences: dict[str, int] = {}
        self.written = 0  # records this attempt committed
        self.trace = None  # the run's span, parent of its steps' (tracing.py)

    def key(self, name: str) -> str:
        """The idempotency key of the next call of `name` (see the module's docstring)."""
        name = _checked_name(name)
        return self._key(name, self._occurrences.get(name, 0) + 1)

    def _key(self, name: str, occurrence: int) -> str:
        digest = hashlib.sha256("\x00".join(
            (self.user, events_key(self.event_ids), name, str(occurrence))).encode()).hexdigest()
        return f"agent-inbox-{digest[:40]}"

    def _next(self, name: str) -> tuple[int, int]:
        """This call's position and occurrence, handed out before any wait, so
        that steps started together keep their call order."""
        name = _checked_name(name)
        self._calls += 1
        occurrence = self._occurrences[name] = self._occurrences.get(name, 0) + 1
        return self._calls, occurrence

    def _replay(self, position: int, name: str, occurrence: int) -> tuple[bool, Any]:
        step = self._recorded.get(position)
        if step is None:
            return False, None
        if (step.name, step.occurrence) != (name, occurrence):
            asked = name if occurrence == 1 else f"{name}#{occurrence}"
            raise errors.StepMismatch(
                f"step {position} of this run was recorded as {step.label!r} by an earlier "
                f"attempt at the same events, but this attempt asked for {asked!r}: call the "
                f"steps in the same order on every attempt")
        return True, step.result

    def _encoded(self, name: str, occurrence: int, value: Any) -> str:
        label = name if occurrence == 1 else f"{name}#{occurrence}"
        return validate.payload(f"the result of step {label!r}", value, self.max_result_bytes)

    def _record(self, position: int, name: str, occurrence: int, encoded: str) -> StepRecord:
        return StepRecord(self.user, self.holder, self.gen, self.event_ids, position, name,
                          occurrence, encoded)

    async def run_async(self, name: str, fn: Callable, args, kwargs) -> Any:
        position, occurrence = self._next(name)
        with tracing.step(self.trace, name, position, occurrence) as span:
            return await self._run_async(span, position, name, occurrence, fn, args, kwargs)

    async def _run_async(self, span, position: int, name: str, occurrence: int, fn: Callable,
                         args, kwargs) -> Any:
        if self._recorded is None:
            if self._loading is None:
                self._loading = asyncio.ensure_future(self.journal.recorded_async())
            loading = self._loading
            try:
                self._recorded = _by_position(await asyncio.shield(loading))
            except BaseException:
                if self._loading is loading and loading.done():
                    self._loading = None  # a failed read is asked again by the next step
                raise
        replayed, result = self._replay(position, name, occurrence)
        span.set_attribute("agent_inbox.step.replayed", replayed)
        if replayed:
            return result
        value = fn(*args, **kwargs)
        if inspect.isawaitable(value):
            value = await value
        encoded = self._encoded(name, occurrence, value)
        await self.journal.record_async(self._record(position, name, occurrence, encoded))
        self.written += 1
        return _decoded(encoded)

    def run_blocking(self, name: str, fn: Callable, args, kwargs) -> Any:
        position, occurrence = self._next(name)
        with tracing.step(self.trace, name, position, occurrence) as span:
            return self._run_blocking(span, position, name, occurrence, fn, args, kwargs)

    def _run_blocking(self, span, position: int, name: str, occurrence: int, fn: Callable,
                      args, kwargs) -> Any:
        if self._recorded is None:
            self._recorded = _by_position(self.journal.recorded())
        replayed, result = self._replay(position, name, occurrence)
        span.set_attribute("agent_inbox.step.replayed", replayed)
        if replayed:
            return result
        value = fn(*args, **kwargs)
        if inspect.isawaitable(value):
            raise errors.InvalidInput(f"step {name!r}", value,
                                      "returned an awaitable: use `await ctx.step(...)` in an "
                                      "async handler")
        encoded = self._encoded(name, occurrence, value)
        self.journal.record(self._record(position, name, occurrence, encoded))
        self.written += 1
        return _decoded(encoded)


def _by_position(recorded: list[RecordedStep]) -> dict[int, RecordedStep]:
    return {step.position: step for step in recorded}


def _checked_name(name: object) -> str:
    name = validate.text("step name", name, MAX_NAME_BYTES)
    if "#" in name:
        raise errors.InvalidInput("step name", name,
                                  "must not contain '#' (repeats are numbered name#2, name#3, ...)")
    return name


def _decoded(encoded: str) -> Any:
    return json.loads(encoded)
