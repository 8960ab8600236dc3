"""The handler and channel the failover scenario's service processes load.

`handle` appends one line per call to the file named by FAILOVER_CALL_LOG (the
run's user, holder, generation and the event keys it was given, when) and
returns one message naming them, so each accepted run leaves one outbox row,
and for each feed event whose n is a multiple of TIMER_EVERY a one-off timer
due TIMER_DELAY seconds later, under the stable event key ('timer', 't<n>'):
the scheduler fires it into the same user's inbox, and the handler handles it
like any event. It sleeps a little, so that runs are in flight when the
primary dies.
`record_send` appends one line per send to the file named by FAILOVER_SEND_LOG
(user, key, text). Both append with O_APPEND in one write, so lines from
several processes never interleave and a SIGKILL loses no line written.
"""

import json
import os
import random
import time

from agent_inbox import Result, TimerRequest

TIMER_EVERY = 10
TIMER_DELAY = 2


def _append(variable: str, record: dict) -> None:
    path = os.environ.get(variable)
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record, sort_keys=True) + "\n").encode())
    finally:
        os.close(fd)


def handle(batch, ctx):
    keys = [event.source_id for event in batch]
    _append("FAILOVER_CALL_LOG", {"user": ctx.user, "holder": ctx.holder, "gen": ctx.gen,
                                  "keys": keys, "t": time.time()})
    time.sleep(random.uniform(0.05, 0.25))
    body = {"user": ctx.user, "holder": ctx.holder, "gen": ctx.gen, "keys": keys}
    timers = [TimerRequest(timer_id=f"t{event.payload['n']}", due=int(time.time()) + TIMER_DELAY,
                           key=("timer", f"t{event.payload['n']}"))
              for event in batch
              if event.source == "feed" and event.payload["n"] % TIMER_EVERY == 0]
    return Result(messages=[json.dumps(body, sort_keys=True)], timers=timers)


def record_send(user, text, key):
    _append("FAILOVER_SEND_LOG", {"user": user, "key": key, "text": text, "t": time.time()})
