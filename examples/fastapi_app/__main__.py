"""Run the FastAPI chat application end to end, in one command:

    .venv/bin/python -m examples.fastapi_app [--database-url URL]

On a throwaway PostgreSQL (started from the local binaries) unless a URL is
given (then in a scratch database created and dropped on that server): the
application (examples/fastapi_app/app.py, called through httpx's ASGI
transport, its lifespan run as a server runs it), a real `agent-inbox worker
--app examples.fastapi_app.agent:app` process, a user's messages (one refused
by moderation and rolled back, one sent twice), a refund a person approves
through the approvals endpoint; then the conversation and what was stored.

To serve it instead: `agent-inbox migrate`, then
`AGENT_INBOX_DATABASE_URL=... uvicorn --factory examples.fastapi_app.app:create_app`
beside the worker.
"""

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import psycopg

from examples.fastapi_app.app import create_app
from examples.support_agent.__main__ import ROOT, scratch_database

USER = "ann"


async def until(condition, what: str, timeout: float = 60.0):
    """`await condition()` until it is true (a value), polling the application."""
    deadline = time.monotonic() + timeout
    while not (value := await condition()):
        if time.monotonic() > deadline:
            raise SystemExit(f"fastapi example: timed out waiting for {what}")
        await asyncio.sleep(0.1)
    return value


async def converse(url: str) -> None:
    app = create_app(url)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://chat") as client:
        async def post(message_id: str, text: str) -> str:
            answer = await client.post(f"/users/{USER}/messages",
                                       json={"id": message_id, "text": text})
            return f"{answer.status_code} {answer.json()}"

        print("hello          ->", await post("m1", "hello"))
        print("hello, retried ->", await post("m1", "hello"))
        print("moderated      ->", await post("m2", "something forbidden"))
        print("refund         ->", await post("m3", "refund 881"))

        async def asked():
            approvals = (await client.get(f"/users/{USER}/approvals")).json()["approvals"]
            return [a for a in approvals if a["answer"] is None]
        [request] = await until(asked, "the agent to ask about the refund")
        answer = await client.post(f"/users/{USER}/approvals/{request['request_id']}",
                                   json={"answer": "yes"})
        print(f"a person approves {request['request_id']}: {answer.json()['answer']}")

        async def refunded():
            turns = (await client.get(f"/users/{USER}/conversation")).json()["conversation"]
            return turns if any("refunded" in t["text"] for t in turns) else None
        print("\nconversation:")
        for turn in await until(refunded, "the refund"):
            print(f"  {turn['from']:>5}: {turn['text']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.fastapi_app")
    parser.add_argument("--database-url", default=os.environ.get("AGENT_INBOX_DATABASE_URL"))
    args = parser.parse_args(argv)
    with scratch_database(args.database_url) as url:
        env = {**os.environ,
               "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
        worker = subprocess.Popen(
            [sys.executable, "-m", "agent_inbox.cli", "worker", "--database-url", url,
             "--app", "examples.fastapi_app.agent:app", "--concurrency", "8",
             "--poll-interval", "0.2", "--log-level", "warning"], cwd=ROOT, env=env)
        try:
            asyncio.run(converse(url))
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=60)
        with psycopg.connect(url) as conn:
            rows = conn.execute("SELECT message_id FROM chat_messages ORDER BY message_id")
            print("\nmessage rows:", [r[0] for r in rows])
            events = conn.execute("SELECT source, source_id, status FROM events ORDER BY id")
            print("events      :", [f"{s}:{i} {st}" for s, i, st in events])
    return 0


if __name__ == "__main__":
    sys.exit(main())
