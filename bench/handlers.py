"""agent-inbox handlers for the benchmark (run by the real `agent-inbox worker`).

`handle` is a no-op that records, per run: the user, the lease generation, the
event ids of the batch, the producer timestamps carried in W2 payloads
(`{"t0": ...}`), and the handler's start and end (time.time()).
"""

import os
import time

from agent_inbox import Result

from bench import records


def handle(batch, ctx):
    start = time.time()
    ids = [e.id for e in batch]
    t0 = [e.payload.get("t0") if isinstance(e.payload, dict) else None for e in batch]
    end = time.time()
    records.write("ours", {"u": ctx.user, "g": ctx.gen, "h": ctx.holder, "p": os.getpid(),
                           "a": max((e.attempts for e in batch), default=0), "ids": ids, "t0": t0,
                           "s": start, "e": end})
    return Result()
