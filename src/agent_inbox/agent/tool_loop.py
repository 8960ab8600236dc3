"""A durable LLM tool-use loop inside a run, for any provider: the model is
called, the tools it asks for are checked by `ctx.permit` and called, their
results go back to it, until it answers with text alone, which is the run's
message. The provider is an `Adapter` (anthropic_loop.py: the Anthropic
Messages API).

    loop = ToolLoop(AnthropicAdapter(client, model="claude-sonnet-4-5"),
                    [Tool("lookup_order", lookup_order, "Look an order up", SCHEMA)])

    async def handle(batch, ctx):
        return await loop.run(batch, ctx)

In one run, every event with a text (`text_of(event)`, by default
`payload["text"]`) is a user message added to the conversation, then:

- each model call is the durable step `model-turn` (its Nth call in the run is
  occurrence N), recording the provider's response as JSON;
- each tool call the model asks for is checked by `ctx.permit(name, input)`,
  its answer recorded as the step `permit:<tool-use id>`: 'deny' is answered
  to the model as an error result, the tool not called; an 'ask' nobody has
  answered ends the run with that approval request (`Result(approvals=[...])`,
  as permits.py does it) and the conversation, mid-turn, in the memory; the
  answer's event ('approval', request id) resumes it in a later run;
- each allowed call is the durable step `tool:<tool-use id>`; a tool raising
  `ToolError` is answered to the model as an error result, any other
  exception is the run's error (it is retried, its steps replayed);
- a turn asking for no tool ends the run: `Result(messages=[its text])`.

The conversation lives in the user's memory document under `memory_key` (the
document's other keys are kept), written by the run's fenced finish with its
messages, so it moves on only when the run commits. Text arriving while an
approval is awaited waits in it and is sent after the pending turn's results.

Invariant: the steps a run asks for, in order, are a function of its events,
its memory as claimed and the results of the steps before them (the model's
responses and the permits' answers are recorded, so a tool-use id is the same
on every attempt), so an attempt after a kill replays every model call, permit
and tool call that completed and calls the provider or a tool again only past
the last record. The call in flight at a kill is the one thing done again: a
model call sent but not recorded, or a tool that ran but whose record was lost.
"""

import hashlib
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from agent_inbox import errors
from agent_inbox.agent.handler import Context
from agent_inbox.agent.permits import ApprovalNeeded, Permit
from agent_inbox.agent.result import Result
from agent_inbox.records import Event

MAX_ID_CHARS = 150  # a tool-use id longer than this (or with a '#') is named by its digest


class ToolError(Exception):
    """Raised by a tool: the model is told, as the call's error result; the run goes on."""


class ToolLoopExhausted(errors.AgentInboxError):
    """The model asked for tools `max_turns` times in one run without a final answer."""


@dataclass(frozen=True)
class Tool:
    """A tool the model may call: `fn(**input)` (awaited if it returns an
    awaitable), its JSON-encodable result sent back to the model (a `str` as
    it is, anything else as JSON)."""

    name: str
    fn: Callable
    description: str = ""
    input_schema: Mapping[str, Any] = field(
        default_factory=lambda: {"type": "object", "properties": {}})


@dataclass(frozen=True)
class ToolCall:
    """One tool use the model asked for."""

    id: str
    name: str
    input: Any


@dataclass(frozen=True)
class Turn:
    """A model response as the loop reads it: its text, and the tools it asks for."""

    text: str
    calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class ToolResult:
    """What one tool call answered (`content`), or why it did not run (`is_error`)."""

    id: str
    content: str
    is_error: bool = False


class Adapter(Protocol):
    """A provider's API, in the loop's terms. `messages` are the provider's own
    (JSON documents); `create` returns the response as a JSON document (it is
    a step's record), which `parse` reads and `append_response` adds."""

    async def create(self, messages: list, tools: Sequence[Tool]) -> Any: ...

    def parse(self, response: Any) -> Turn: ...

    def user_message(self, text: str) -> Any: ...

    def append_response(self, messages: list, response: Any) -> list: ...

    def append_results(self, messages: list, results: Sequence[ToolResult]) -> list: ...


def text_in_payload(event: Event) -> str | None:
    """`text_of`'s default: the event payload's "text", if it has one."""
    payload = event.payload
    text = payload.get("text") if isinstance(payload, Mapping) else None
    return text if isinstance(text, str) else None


@dataclass
class _Conversation:
    """The loop's part of the memory: the messages; `starts`, where each of
    their exchanges (a user's text and what answered it) begins; the turn
    whose tool calls are being answered (`pending`: its calls, the results
    so far, the approval awaited); the texts that wait for it (`queued`)."""

    messages: list
    starts: list
    pending: dict | None
    queued: list

    @classmethod
    def of(cls, doc: Any) -> "_Conversation":
        doc = doc or {}
        return cls(list(doc.get("messages", [])), list(doc.get("starts", [])),
                   doc.get("pending"), list(doc.get("queued", [])))

    def doc(self) -> dict:
        return {"messages": self.messages, "starts": self.starts, "pending": self.pending,
                "queued": self.queued}


class ToolLoop:
    """The loop (see the module's docstring). `history`: how many earlier
    exchanges are sent with a new one (older messages are dropped from the
    memory); `max_turns`: model calls in one run before `ToolLoopExhausted`."""

    def __init__(self, adapter: Adapter, tools: Sequence[Tool], *, memory_key: str = "tool_loop",
                 history: int = 10, max_turns: int = 20,
                 text_of: Callable[[Event], str | None] = text_in_payload):
        self.adapter = adapter
        self.tools = {tool.name: tool for tool in tools}
        if len(self.tools) != len(tools):
            raise errors.InvalidInput("tools", [t.name for t in tools], "name a tool twice")
        if history < 0 or max_turns < 1:
            raise errors.InvalidInput("history, max_turns", (history, max_turns),
                                      "must be at least 0 and 1")
        self.memory_key, self.history, self.max_turns = memory_key, history, max_turns
        self.text_of = text_of

    async def run(self, batch: Sequence[Event], ctx: Context) -> Result:
        """One run's part of the conversation: the `Result` to return from the handler."""
        if ctx.memory is not None and not isinstance(ctx.memory, Mapping):
            raise errors.InvalidInput("ctx.memory", ctx.memory,
                                      "must be a JSON object (or none) for ToolLoop")
        memory = dict(ctx.memory or {})
        conversation = _Conversation.of(memory.get(self.memory_key))
        conversation.queued += [text for text in map(self.text_of, batch) if text is not None]
        pending = conversation.pending
        if pending is not None and not any(
                e.source == "approval" and e.source_id == pending["request"] for e in batch):
            return self._result(memory, conversation)  # the approval's answer is still to come
        if pending is None and not conversation.queued:
            return Result()  # nothing new to say (an approval this loop no longer awaits)
        try:
            if pending is not None:
                calls = [ToolCall(**call) for call in pending["calls"]]
                await self._answer(ctx, conversation, calls, pending["results"])
            for _ in range(self.max_turns):
                if conversation.queued:
                    self._start_exchange(conversation)
                response = await ctx.step("model-turn", self.adapter.create,
                                          conversation.messages, list(self.tools.values()))
                turn = self.adapter.parse(response)
                conversation.messages = self.adapter.append_response(conversation.messages,
                                                                     response)
                if not turn.calls:
                    return self._result(memory, conversation, [turn.text] if turn.text else [])
                await self._answer(ctx, conversation, turn.calls, [])
        except ApprovalNeeded as asked:  # the turn waits in the memory for the answer
            conversation.pending["request"] = asked.request.request_id
            return self._result(memory, conversation, approvals=[asked.request])
        raise ToolLoopExhausted(f"the model asked for tools {self.max_turns} times in one run "
                                "without answering (ToolLoop max_turns)")

    def _start_exchange(self, conversation: _Conversation) -> None:
        conversation.starts.append(len(conversation.messages))
        conversation.messages = conversation.messages + [
            self.adapter.user_message(text) for text in conversation.queued]
        conversation.queued = []
        if len(conversation.starts) > self.history + 1:
            cut = conversation.starts[-(self.history + 1)]
            conversation.messages = conversation.messages[cut:]
            conversation.starts = [s - cut for s in conversation.starts[-(self.history + 1):]]

    async def _answer(self, ctx: Context, conversation: _Conversation,
                      calls: Sequence[ToolCall], results: list) -> None:
        """Every call's result, in order, then the results appended; meanwhile
        the turn is `pending`, so that an approval asked for keeps it."""
        conversation.pending = {"calls": [asdict(call) for call in calls], "results": results,
                                "request": None}
        answered = {result["id"] for result in results}
        for call in calls:
            if call.id not in answered:
                results.append(asdict(await self._result_of(ctx, call)))
        conversation.messages = self.adapter.append_results(
            conversation.messages, [ToolResult(**result) for result in results])
        conversation.pending = None

    async def _result_of(self, ctx: Context, call: ToolCall) -> ToolResult:
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(call.id, f"there is no tool named {call.name!r}", True)
        answer = await ctx.step(_step_name("permit", call.id), _permit, ctx, call.name, call.input)
        if answer == Permit.DENY:
            return ToolResult(call.id, f"{call.name} was not permitted (denied by policy)", True)
        outcome = await ctx.step(_step_name("tool", call.id), _called, tool.fn, call.input)
        return ToolResult(call.id, outcome["content"], outcome["is_error"])

    def _result(self, memory: dict, conversation: _Conversation, messages=(),
                approvals=()) -> Result:
        return Result(messages=tuple(messages), approvals=tuple(approvals),
                      memory={**memory, self.memory_key: conversation.doc()})


async def _permit(ctx: Context, tool: str, args: Any) -> str:
    return (await ctx.permit(tool, args)).value


async def _called(fn: Callable, args: Any) -> dict:
    """The tool's result as the model is told it; arguments the tool does not
    take, and a ToolError, are the model's to see, as an error result."""
    if not isinstance(args, Mapping):
        return {"content": f"the arguments must be a JSON object, not {args!r}", "is_error": True}
    try:
        bound = inspect.signature(fn).bind(**args)
    except TypeError as exc:
        return {"content": f"bad arguments: {exc}", "is_error": True}
    try:
        value = fn(*bound.args, **bound.kwargs)
        if inspect.isawaitable(value):
            value = await value
    except ToolError as exc:
        return {"content": str(exc), "is_error": True}
    return {"content": value if isinstance(value, str) else json.dumps(value), "is_error": False}


def _step_name(kind: str, tool_use_id: str) -> str:
    if "#" in tool_use_id or len(tool_use_id) > MAX_ID_CHARS:
        tool_use_id = hashlib.sha256(tool_use_id.encode()).hexdigest()[:40]
    return f"{kind}:{tool_use_id}"
