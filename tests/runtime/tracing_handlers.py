"""Handlers for tests/runtime/test_tracing.py: a durable step, a span of the
handler's own (tracing.span: nothing without OpenTelemetry), and a message."""

from agent_inbox import Result, tracing


def _answer(events: int) -> int:
    return 40 + events


async def step_and_message(batch, ctx):
    n = await ctx.step("think", _answer, len(batch))
    with tracing.span("handler.own", attributes={"test.events": len(batch)}):  # the handler's own
        pass
    return Result(messages=[f"answer {n}"])


def plain_step_and_message(batch, ctx):
    n = ctx.step_sync("think", _answer, len(batch))
    with tracing.span("handler.own"):
        pass
    return Result(messages=[f"answer {n}"])
