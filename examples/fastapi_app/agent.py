"""The agent behind the FastAPI chat application (examples/fastapi_app/app.py).

    agent-inbox worker --app examples.fastapi_app.agent:app

It answers each chat message the application committed, keeps the
conversation in the user's memory (the application shows it), and asks a
person before it issues a refund: `ctx.permit("refund", ...)` under the rule
"ask" ends the run with an approval request; the answer (from the
application's approvals endpoint) comes back as an event and the agent acts
on it, once.
"""

from agent_inbox import App, ApprovalNeeded, Result


def reply_to(text: str) -> str:
    """A stand-in for the model: a real agent calls an LLM here, as a durable
    step (docs/an-llm-agent-with-tools.md)."""
    return f"You said: {text}"


async def handle(batch, ctx):
    memory = ctx.memory or {"conversation": [], "pending_refund": None}
    replies = []

    def say(text: str) -> None:
        replies.append(text)
        memory["conversation"].append({"from": "agent", "text": text})

    for event in batch:
        if event.source == "approval":  # a person answered the refund we asked about
            order, memory["pending_refund"] = memory["pending_refund"], None
            allowed = order is not None and await ctx.permit("refund", {"order": order}) == "allow"
            say(f"Order {order} is refunded." if allowed else "The refund was not approved.")
            continue
        text = event.payload["text"]
        memory["conversation"].append({"from": "user", "text": text})
        say(await ctx.step("reply", reply_to, text))
        if text.startswith("refund "):
            order = text.removeprefix("refund ").strip()
            memory["pending_refund"] = order
            try:
                await ctx.permit("refund", {"order": order})
            except ApprovalNeeded as asked:  # the answer comes back as an event
                return Result(messages=replies, memory=memory, approvals=[asked.request])
    return Result(messages=replies, memory=memory)


app = App(handle, policies={"refund": "ask"})
