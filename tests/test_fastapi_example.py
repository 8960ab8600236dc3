"""The FastAPI example (examples/fastapi_app) against a real PostgreSQL: the
message row and its event commit together, a rolled-back request leaves
neither, a retried message is stored once and run once, a running worker
answers, an approval answered through the endpoint reaches the agent, and bad
requests are refused with nothing stored. Also the example's own command, as a
newcomer runs it (a real worker process)."""

import asyncio
import threading

import httpx
import psycopg

from agent_inbox.services.worker import Worker
from examples.fastapi_app.__main__ import main
from examples.fastapi_app.app import create_app

from tests.runtime.support import wait_until


def committed(url: str) -> tuple[list, list]:
    """(message rows, events) as committed."""
    with psycopg.connect(url, autocommit=True) as conn:
        return (conn.execute("SELECT user_id, message_id FROM chat_messages ORDER BY 2").fetchall(),
                conn.execute("SELECT user_id, source, source_id FROM events ORDER BY id"
                             ).fetchall())


async def call(url: str, requests):
    """Run `requests(client)` against the application (its lifespan run)."""
    app = create_app(url)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://chat") as client:
        return await requests(client)


def test_a_message_and_its_event_commit_together_and_a_refused_one_leaves_neither(
        database_url, make_inbox):
    async def requests(client):
        post = lambda body: client.post("/users/ann/messages", json=body)  # noqa: E731
        return [(r.status_code, r.json()) for r in [
            await post({"id": "m1", "text": "hello"}),
            await post({"id": "m1", "text": "hello"}),                   # the client's retry
            await post({"id": "m2", "text": "this is forbidden"}),       # rolled back
            await post({"id": "", "text": "no id"}),                      # refused by FastAPI
            await post({"id": "m3", "text": "x" * 5000}),
        ]]
    answers = asyncio.run(call(database_url, requests))
    assert [status for status, _ in answers] == [201, 200, 422, 422, 422]
    assert answers[:2] == [(201, {"stored": True}), (200, {"stored": False})]
    assert answers[2][1] == {"detail": "the message was refused by moderation"}
    assert committed(database_url) == ([("ann", "m1")], [("ann", "chat", "m1")])

    inbox = make_inbox(pool_size=4)
    worker = Worker(inbox, "examples.fastapi_app.agent:app", concurrency=4)
    serving = threading.Thread(target=worker.serve, args=(database_url,), daemon=True)
    serving.start()
    try:
        wait_until(lambda: [e.status for e in inbox.events("ann")] == ["done"],
                   "the message to be run", timeout=30)

        async def read(client):
            return (await client.get("/users/ann/conversation")).json()
        assert asyncio.run(call(database_url, read)) == {"conversation": [
            {"from": "user", "text": "hello"}, {"from": "agent", "text": "You said: hello"}]}
        assert [m.body for m in inbox.outbox("ann")] == ["You said: hello"]  # run once
    finally:
        worker.stop.event.set()
        serving.join(timeout=30)
        worker.close()
    assert not serving.is_alive()


def test_an_approval_is_listed_answered_once_and_reaches_the_agent(database_url, make_inbox):
    inbox = make_inbox(pool_size=4)
    worker = Worker(inbox, "examples.fastapi_app.agent:app", concurrency=4)
    serving = threading.Thread(target=worker.serve, args=(database_url,), daemon=True)
    serving.start()
    try:
        async def ask(client):
            assert (await client.post("/users/ben/messages",
                                      json={"id": "b1", "text": "refund 17"})).status_code == 201
        asyncio.run(call(database_url, ask))
        wait_until(lambda: inbox.approvals("ben"), "the agent to ask", timeout=30)
        [request] = inbox.approvals("ben")

        async def answer(client):
            path = f"/users/ben/approvals/{request.request_id}"
            listed = (await client.get("/users/ben/approvals")).json()["approvals"]
            bad = await client.post(path, json={"answer": "maybe"})
            unknown = await client.post("/users/ben/approvals/never", json={"answer": "yes"})
            yes = await client.post(path, json={"answer": "yes"})
            no = await client.post(path, json={"answer": "no"})
            return listed, bad.status_code, unknown.status_code, yes.json(), no.json()
        listed, bad, unknown, yes, no = asyncio.run(call(database_url, answer))
        assert [(a["request_id"], a["action"]["args"], a["answer"]) for a in listed] == [
            (request.request_id, {"order": "17"}, None)]
        assert (bad, unknown, yes, no) == (422, 404, {"answer": "yes"}, {"answer": "yes"})
        wait_until(lambda: len(inbox.outbox("ben")) == 2, "the refund", timeout=30)
        assert [m.body for m in inbox.outbox("ben")] == ["You said: refund 17",
                                                          "Order 17 is refunded."]
    finally:
        worker.stop.event.set()
        serving.join(timeout=30)
        worker.close()


def test_the_example_runs_end_to_end(server_url, capsys):
    assert main(["--database-url", server_url]) == 0
    out = capsys.readouterr().out
    assert "hello          -> 201 {'stored': True}" in out
    assert "hello, retried -> 200 {'stored': False}" in out
    assert "moderated      -> 422" in out
    assert "  agent: Order 881 is refunded." in out
    assert "message rows: ['m1', 'm3']" in out
    assert "events      : ['chat:m1 done', 'chat:m3 done', 'approval:permit:refund:" in out
