"""A FastAPI chat application that hands each message to its agent in the
same transaction as the message's own row.

    uvicorn --factory examples.fastapi_app.app:create_app   (AGENT_INBOX_DATABASE_URL set)

- `POST /users/{user}/messages` `{"id": ..., "text": ...}`: the message row
  (the application's table `chat_messages`, through SQLAlchemy's AsyncSession)
  and its event (`AsyncInbox.ingest(..., connection=session)`) commit together
  or not at all. A message the moderation check refuses after both were
  written is answered 422 and rolled back: neither exists. A client's retry of
  the same message id is answered 200 with `"stored": false`: one row, one
  event, one run.
- `GET /users/{user}/conversation`: the conversation the agent keeps in the
  user's memory (examples/fastapi_app/agent.py).
- `GET /users/{user}/approvals` and `POST /users/{user}/approvals/{request_id}`
  `{"answer": "yes" | "no"}`: what the agent asked a person, and the answer;
  the answer that stands is returned (the expiry may have come first).

The agent runs in a worker process of its own
(`agent-inbox worker --app examples.fastapi_app.agent:app`), which LISTENs and
runs a committed message within moments.
"""

import contextlib
import os

import psycopg
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from agent_inbox import AsyncInbox, InvalidInput

metadata = sa.MetaData()
chat_messages = sa.Table(
    "chat_messages", metadata,
    sa.Column("user_id", sa.Text, primary_key=True),
    sa.Column("message_id", sa.Text, primary_key=True),
    sa.Column("text", sa.Text, nullable=False),
)

BANNED = ("forbidden",)


class NewMessage(BaseModel):
    id: str = Field(min_length=1, max_length=200)
    text: str = Field(min_length=1, max_length=4000)


class Answer(BaseModel):
    answer: str


def async_engine(url: str):
    """SQLAlchemy's asyncio engine on psycopg 3, for any libpq URL or
    connection string `url`."""
    return create_async_engine("postgresql+psycopg://",
                               async_creator=lambda: psycopg.AsyncConnection.connect(url))


def create_app(database_url: str | None = None) -> FastAPI:
    """The application on `database_url` (else AGENT_INBOX_DATABASE_URL),
    whose schema agent-inbox's migrations made (`agent-inbox migrate`)."""
    url = database_url or os.environ["AGENT_INBOX_DATABASE_URL"]

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine = async_engine(url)
        async with engine.begin() as conn:
            await conn.run_sync(metadata.create_all)
        async with await AsyncInbox.connect(url, pool_size=4) as inbox:
            app.state.inbox = inbox
            app.state.sessions = async_sessionmaker(engine, expire_on_commit=False)
            yield
        await engine.dispose()

    app = FastAPI(title="chat with an agent", lifespan=lifespan)

    @app.post("/users/{user}/messages", status_code=201)
    async def post_message(user: str, message: NewMessage):
        inbox: AsyncInbox = app.state.inbox
        session: AsyncSession
        async with app.state.sessions() as session, session.begin():
            inserted = await session.execute(
                insert(chat_messages)
                .values(user_id=user, message_id=message.id, text=message.text)
                .on_conflict_do_nothing().returning(chat_messages.c.message_id))
            if inserted.first() is None:  # a client's retry: its row and event stand
                return JSONResponse({"stored": False}, status_code=200)
            try:
                stored = await inbox.ingest(user, "chat", message.id, {"text": message.text},
                                            connection=session)
            except InvalidInput as bad:
                raise HTTPException(422, str(bad)) from None
            if any(word in message.text.lower() for word in BANNED):
                # Refused after both were written: leaving the block with an
                # error rolls back the row and the event together.
                raise HTTPException(422, "the message was refused by moderation")
        return {"stored": stored}

    @app.get("/users/{user}/conversation")
    async def conversation(user: str):
        memory = await app.state.inbox.memory(user)
        return {"conversation": (memory or {}).get("conversation", [])}

    @app.get("/users/{user}/approvals")
    async def approvals(user: str):
        return {"approvals": [
            {"request_id": a.request_id, "deadline": a.deadline, "action": a.action,
             "answer": a.answer} for a in await app.state.inbox.approvals(user)]}

    @app.post("/users/{user}/approvals/{request_id}")
    async def answer(user: str, request_id: str, answer: Answer):
        try:
            standing = await app.state.inbox.answer_approval(user, request_id, answer.answer)
        except InvalidInput as bad:
            raise HTTPException(422, str(bad)) from None
        if standing == "unknown":
            raise HTTPException(404, f"no approval request {request_id!r} for {user!r}")
        return {"answer": standing}

    return app
