"""Channels that ship with agent-inbox: where the dispatcher's batches go.

A channel is `send(user, text, key)`. Raising leaves the batch unsent: the
dispatcher sends it again after a backoff, with the same rows and the same key,
unless the channel raised `PermanentSendError` (the batch can never be sent as
it is), which parks it `failed` at once.

`http_post` POSTs `{"user", "text", "key"}` as JSON to AGENT_INBOX_HTTP_CHANNEL_URL
with the key as the `Idempotency-Key` header, so the receiver can drop a repeat.
Connection errors, timeouts, 408, 429 and 5xx answers are retried with
exponential backoff (then ChannelError: the dispatcher retries later); any other
4xx raises PermanentSendError (the request itself is wrong).

    agent-inbox dispatcher --channel agent_inbox.channels:http_post
"""

import json
import os
import random
import time
import urllib.error
import urllib.request
from functools import cache

from agent_inbox import errors


class ChannelError(errors.AgentInboxError):
    """The channel did not accept the batch; it stays unsent."""


class HttpChannel:
    def __init__(self, url: str, *, timeout: float = 10.0, attempts: int = 4,
                 backoff: float = 0.5, token: str | None = None):
        if not url.startswith(("http://", "https://")):
            raise errors.InvalidInput("url", url, "must be an http:// or https:// URL")
        self.url, self.timeout, self.attempts, self.backoff = url, timeout, attempts, backoff
        self.token = token

    def __call__(self, user: str, text: str, key: str) -> None:
        body = json.dumps({"user": user, "text": text, "key": key}).encode()
        headers = {"Content-Type": "application/json", "Idempotency-Key": key}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        for attempt in range(1, self.attempts + 1):
            request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    response.read()
                    return
            except urllib.error.HTTPError as exc:
                if exc.code < 500 and exc.code not in (408, 429):
                    raise errors.PermanentSendError(
                        f"{self.url} refused batch {key}: HTTP {exc.code}") from None
                problem = f"HTTP {exc.code}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                problem = str(getattr(exc, "reason", exc))
            if attempt < self.attempts:
                time.sleep(self.backoff * 2 ** (attempt - 1) * random.uniform(0.5, 1.0))
        raise ChannelError(f"{self.url} did not take batch {key} after {self.attempts} "
                           f"attempts ({problem})")


@cache
def _configured() -> HttpChannel:
    url = os.environ.get("AGENT_INBOX_HTTP_CHANNEL_URL")
    if not url:
        raise errors.InvalidInput("AGENT_INBOX_HTTP_CHANNEL_URL", url, "must be set for http_post")
    return HttpChannel(url, timeout=float(os.environ.get("AGENT_INBOX_HTTP_CHANNEL_TIMEOUT", 10)),
                       attempts=int(os.environ.get("AGENT_INBOX_HTTP_CHANNEL_ATTEMPTS", 4)),
                       token=os.environ.get("AGENT_INBOX_HTTP_CHANNEL_TOKEN"))


def http_post(user: str, text: str, key: str) -> None:
    """The HTTP channel, configured from the environment (see the module docstring)."""
    _configured()(user, text, key)
