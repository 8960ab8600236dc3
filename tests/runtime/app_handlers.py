"""Apps for tests/runtime/test_app.py. Hooks write `<pid> <hook>` lines to the
file named by APP_HOOKS_LOG, so a test counts them per process."""

import asyncio
import os

from agent_inbox import App, Limit, Result


def _note(what: str) -> None:
    with open(os.environ["APP_HOOKS_LOG"], "a") as log:
        log.write(f"{os.getpid()} {what}\n")


async def open_client() -> None:
    await asyncio.sleep(0)  # on the handlers' loop
    _note("startup")


def close_client() -> None:
    _note("shutdown")


async def handle(batch, ctx):
    if batch[0].payload.get("crash") and ctx.attempt == 1:
        os._exit(3)  # the runtime dies: the retry runs in quarantine
    await ctx.limit("llm")
    reply = await ctx.step("llm", lambda: f"hello {ctx.user}")
    allowed = await ctx.permit("send_email", {"to": ctx.user})
    ctx.log.info("replying, attempt %d", ctx.attempt)
    seen = (ctx.memory or {}).get("runs", 0) + 1
    return Result(messages=[f"{reply} ({allowed.value}, attempt {ctx.attempt}, "
                            f"deadline {ctx.deadline is not None})"],
                  memory={"runs": seen})


app = App(handle, on_startup=[open_client], on_shutdown=[close_client],
          policies={"send_email": "allow", "refund": "ask"},
          limits={"llm": Limit(rate=50, per=1, burst=50)})


def broken_startup() -> None:
    raise RuntimeError("the LLM key is missing")


broken = App(handle, on_startup=[broken_startup])
