"""The handler and channel the chaos suite's processes load.

`handle` makes every accepted run leave a record: one outbox message whose body
names the run (user, gen, holder, the event ids, the claim time). Messages commit
only with an accepted finish, so after the run the outbox *is* the list of
accepted runs. An event whose payload says `poison` kills the process running it,
every time: the worker's runtime on a first attempt (its supervisor starts
another), a quarantine process on the retries.

Each call is also noted in the file named by CHAOS_RUN_LOG (whether it ran in a
quarantine process or in the worker's runtime, and the batch size), for the summary.

`record_send` appends each dispatched text to the file named by CHAOS_SEND_LOG,
so the suite can check that every queued message went out at least once.
"""

import json
import multiprocessing
import os
import random
import signal
import time

from agent_inbox import Result


def is_poison(payload) -> bool:
    return isinstance(payload, dict) and bool(payload.get("poison"))


def _append(variable: str, line: str) -> None:
    path = os.environ.get(variable)
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def handle(batch, ctx):
    where = "quarantine" if multiprocessing.parent_process() is not None else "worker"
    _append("CHAOS_RUN_LOG", f"{where} {len(batch)} {time.time():.2f} {ctx.user} {ctx.gen} "
                             f"{','.join(f'{e.id}:{e.attempts}' for e in batch)}\n")
    if any(is_poison(event.payload) for event in batch):
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(random.uniform(0.0, 0.2))  # overlap runs, widen the windows faults hit
    body = {
        "user": ctx.user,
        "gen": ctx.gen,
        "holder": ctx.holder,
        "ids": [event.id for event in batch],
        "claimed_at": min(event.claimed_at for event in batch),
    }
    return Result(messages=[json.dumps(body, sort_keys=True)])


def record_send(user, text, key):
    _append("CHAOS_SEND_LOG", json.dumps({"user": user, "key": key, "text": text}) + "\n")
