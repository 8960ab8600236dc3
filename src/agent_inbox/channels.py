"""Channels that ship with agent-inbox: where the dispatcher's batches go.

A channel is `send(user, text, key)`. Raising leaves the batch unsent: the
dispatcher sends it again after a backoff, with the same rows and the same key,
unless the channel raised `PermanentSendError` (the batch can never be sent as
it is), which parks it `failed` at once.

`http_post` POSTs `{"user", "text", "key"}` as JSON to AGENT_INBOX_HTTP_CHANNEL_URL
with the key as the `Idempotency-Key` header, so the receiver can drop a repeat
(and, with the `otel` extra, the send span's W3C `traceparent` header).
Connection errors, timeouts, 408, 429 and 5xx answers are retried with
exponential backoff (then ChannelError: the dispatcher retries later); any other
4xx raises PermanentSendError (the request itself is wrong). A redirect is never
followed (the body and the token would go to a host nobody configured, and a
301-303 would turn the POST into a GET): a 3xx is a failed send at once.

    agent-inbox dispatcher --channel agent_inbox.channels:http_post
"""

import json
import os
import random
import time
import urllib.error
import urllib.request
from functools import cache

from agent_inbox import errors, tracing


class ChannelError(errors.AgentInboxError):
    """The channel did not accept the batch; it stays unsent."""


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """A 3xx comes back as the HTTPError it is, never as a request elsewhere."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_OPENER = urllib.request.build_opener(_RefuseRedirects)


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
        traceparent = tracing.current_traceparent()  # the send's span (tracing.py), if any
        if traceparent:
            headers["traceparent"] = traceparent
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        for attempt in range(1, self.attempts + 1):
            request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
            try:
                with _OPENER.open(request, timeout=self.timeout) as response:
                    response.read()
                    return
            except urllib.error.HTTPError as exc:
                if 300 <= exc.code < 400:
                    raise ChannelError(
                        f"{self.url} answered batch {key} with HTTP {exc.code}, a redirect to "
                        f"{exc.headers.get('Location')!r}: not followed, the batch is not "
                        f"sent") from None
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
