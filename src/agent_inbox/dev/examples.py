"""Small handlers and channels for trying the services out.

    agent-inbox worker --handler agent_inbox.dev.examples:echo
    agent-inbox dispatcher --channel agent_inbox.dev.examples:print_channel
"""

import json
import sys

from agent_inbox.agent.result import Result


def echo(batch, ctx) -> Result:
    """Answer each run with one message listing the events it handled."""
    names = ", ".join(f"{e.source}/{e.source_id}" for e in batch)
    return Result(messages=[f"{ctx.user}: handled {names}"])


def print_channel(user: str, text: str, key: str) -> None:
    """Write each send to standard output as one JSON line."""
    print(json.dumps({"user": user, "key": key, "text": text}), file=sys.stdout, flush=True)
