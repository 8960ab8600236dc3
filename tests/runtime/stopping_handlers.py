"""Handlers and a channel for tests/runtime/test_stopping.py (worker and
dispatcher processes import them as module:function)."""

import asyncio
import os
import time

from agent_inbox import Result


async def sleeps_unless(batch, ctx):
    """Sleeps 30 s for each event whose payload names a file `sleep_unless`
    that does not exist yet; then one message."""
    for event in batch:
        path = event.payload.get("sleep_unless")
        if path and not os.path.exists(path):
            await asyncio.sleep(30)
    return Result(messages=[f"{ctx.user}: ran " + ",".join(e.source_id for e in batch)])


def blocks_in_thread(batch, ctx):
    """A plain handler that ignores its cancellation (a blocking call in a
    thread cannot be stopped) for the seconds its events' payloads say."""
    time.sleep(max(e.payload.get("block", 0) for e in batch))
    return Result(messages=["returned after its cancel"])


def record(user, text, key):
    """A channel: each send appended to $AGENT_INBOX_TEST_SENDS/sent as key<TAB>text."""
    with open(os.path.join(os.environ["AGENT_INBOX_TEST_SENDS"], "sent"), "a") as sent:
        sent.write(f"{key}\t{text!r}\n")
