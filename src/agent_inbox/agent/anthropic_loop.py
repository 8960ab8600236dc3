"""The Anthropic Messages API as a tool loop's `Adapter` (tool_loop.py), for
the `anthropic` SDK's `AsyncAnthropic` client (`pip install agent-inbox[anthropic]`).

    client = anthropic.AsyncAnthropic()          # opened once per process: App(on_startup=...)
    loop = ToolLoop(AnthropicAdapter(client, model="claude-sonnet-4-5", max_tokens=1024,
                                     system="You answer a shop's customers."), TOOLS)

`create` is one `client.messages.create(...)` call, with the SDK's own retries
(429, 5xx, 529 overloaded: `AsyncAnthropic(max_retries=...)`) inside it, so a
step records the one response that answered; the response is recorded as
`Message.model_dump(mode="json", exclude_none=True)`, and its content blocks go
back to the API as the assistant's turn.

Invariant: this module does not import `anthropic` (the client is the
caller's), so neither importing `agent_inbox` nor this module needs the SDK,
and what it records and sends is JSON only.
"""

from collections.abc import Sequence
from typing import Any

from agent_inbox.agent.tool_loop import Tool, ToolCall, ToolResult, Turn


class AnthropicAdapter:
    """`client`: an `anthropic.AsyncAnthropic` (or anything whose
    `messages.create(**params)` is awaitable and returns a pydantic model of
    a Message); `options`: more parameters of `messages.create` (temperature,
    tool_choice, metadata, ...)."""

    def __init__(self, client: Any, *, model: str, max_tokens: int = 1024,
                 system: str | None = None, **options: Any):
        self.client = client
        self.params = {"model": model, "max_tokens": max_tokens, **options}
        if system is not None:
            self.params["system"] = system

    async def create(self, messages: list, tools: Sequence[Tool]) -> dict:
        params = dict(self.params, messages=messages)
        if tools:
            params["tools"] = [{"name": t.name, "description": t.description,
                                "input_schema": dict(t.input_schema)} for t in tools]
        response = await self.client.messages.create(**params)
        return response.model_dump(mode="json", exclude_none=True)

    def parse(self, response: dict) -> Turn:
        blocks = response.get("content", [])
        return Turn(
            "".join(block["text"] for block in blocks if block.get("type") == "text"),
            tuple(ToolCall(block["id"], block["name"], block.get("input", {}))
                  for block in blocks if block.get("type") == "tool_use"))

    def user_message(self, text: str) -> dict:
        return {"role": "user", "content": text}

    def append_response(self, messages: list, response: dict) -> list:
        return [*messages, {"role": "assistant", "content": response.get("content", [])}]

    def append_results(self, messages: list, results: Sequence[ToolResult]) -> list:
        return [*messages, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": r.id, "content": r.content,
             **({"is_error": True} if r.is_error else {})} for r in results]}]
