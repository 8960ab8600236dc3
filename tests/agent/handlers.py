"""The agent of the tool loop's tests: a ToolLoop on an AsyncAnthropic client
pointed at the fake Messages API ($FAKE_ANTHROPIC_URL), opened once per
process, with two tools that append a line to $TOOL_LOG (outside every
process, so a test counts their calls across processes).

    agent-inbox worker --app tests.agent.handlers:app
"""

import os

import anthropic

from agent_inbox import App
from agent_inbox.agent.anthropic_loop import AnthropicAdapter
from agent_inbox.agent.tool_loop import Tool, ToolLoop

ORDER = {"type": "object", "properties": {"order": {"type": "string"}}, "required": ["order"]}
loops: dict[str, ToolLoop] = {}  # the process's loop, made at startup


def _called(line: str) -> None:
    with open(os.environ["TOOL_LOG"], "a") as log:
        log.write(line + "\n")


async def lookup_order(order: str) -> dict:
    _called(f"lookup_order {order}")
    return {"order": order, "status": "shipped"}


def refund(order: str) -> str:
    _called(f"refund {order}")
    return f"refunded {order}"


TOOLS = [Tool("lookup_order", lookup_order, "Look an order up", ORDER),
         Tool("refund", refund, "Refund an order", ORDER)]


def make_loop(client, **options) -> ToolLoop:
    return ToolLoop(AnthropicAdapter(client, model="claude-fake", system="You help."), TOOLS,
                    **options)


async def open_client() -> None:
    loops["agent"] = make_loop(anthropic.AsyncAnthropic(
        base_url=os.environ["FAKE_ANTHROPIC_URL"], api_key="test-key", max_retries=2))


async def close_client() -> None:
    await loops.pop("agent").adapter.client.close()


async def handle(batch, ctx):
    return await loops["agent"].run(batch, ctx)


app = App(handle, on_startup=[open_client], on_shutdown=[close_client])
