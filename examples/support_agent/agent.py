"""A support agent: it remembers each customer's conversation, asks an LLM (over
a real async HTTP client, opened once per worker process), keeps the fleet
under the LLM's rate limit, and refunds only with permission.

    agent-inbox worker --app examples.support_agent.agent:app

Each call to the LLM is a durable step: a run that dies after it does not pay
for it again. The refund is a tool call that needs permission: the default
rule here asks (an approval request); once a person answers yes, the answer
comes back as an event and the agent, resuming from its memory, refunds.
"""

import os

import httpx

from agent_inbox import ApprovalNeeded, App, Limit, Result

LLM_URL = os.environ.get("SUPPORT_AGENT_LLM_URL", "http://127.0.0.1:8089")
clients: dict[str, httpx.AsyncClient] = {}


async def open_client() -> None:
    clients["llm"] = httpx.AsyncClient(base_url=LLM_URL, timeout=30)


async def close_client() -> None:
    await clients.pop("llm").aclose()


async def complete(prompt: str) -> dict:
    answer = await clients["llm"].post("/v1/complete", json={"prompt": prompt})
    answer.raise_for_status()
    return answer.json()


async def refund(order: str) -> dict:
    return {"refunded": order}  # a real agent calls the payment provider here


async def handle(batch, ctx):
    memory = ctx.memory or {"transcript": [], "pending": None}
    replies = []
    for event in batch:
        if event.source == "approval":  # the answer to a refund we asked about
            pending = memory["pending"]
            if pending and await ctx.permit("refund", pending) == "allow":
                done = await ctx.step("refund", refund, pending["order"])
                replies.append(f"Order {done['refunded']} is refunded.")
            else:
                replies.append("Sorry, that refund was not approved.")
            memory["pending"] = None
            continue
        text = event.payload["text"]
        memory["transcript"].append({"from": "customer", "text": text})
        await ctx.limit("llm")  # the fleet's budget with the provider
        answer = await ctx.step("llm", complete, "\n".join(
            turn["text"] for turn in memory["transcript"][-10:]))
        memory["transcript"].append({"from": "agent", "text": answer["text"]})
        replies.append(answer["text"])
        tool = answer.get("tool")
        if tool and tool["name"] == "refund":
            memory["pending"] = tool["args"]
            try:
                allowed = await ctx.permit("refund", tool["args"]) == "allow"
            except ApprovalNeeded as asked:  # a person decides; the answer comes back as an event
                return Result(messages=replies, memory=memory, approvals=[asked.request])
            if allowed:
                done = await ctx.step("refund", refund, tool["args"]["order"])
                replies.append(f"Order {done['refunded']} is refunded.")
            memory["pending"] = None
    return Result(messages=replies, memory=memory)


app = App(handle, on_startup=[open_client], on_shutdown=[close_client],
          policies={"refund": "ask"}, limits={"llm": Limit(rate=5, per=1, burst=5)})
