"""Log lines about what the intake refused, safe to write whatever a client sends.

Invariants: text from a request (a user name from the path) is logged escaped
(no control, bidi or other unprintable character reaches the log raw) and cut
to SHOWN characters; refusals are logged at most `per_second` lines a second,
and what was left out is counted in one line ("N more ... not logged") when
logging resumes, so an unauthenticated client cannot flood the log.
"""

import logging
import threading
import time
from collections.abc import Callable

from agent_inbox import metrics

log = logging.getLogger("agent_inbox.ingest")

# Characters of a client's text shown in a log line.
SHOWN = 64


def shown(text: str, limit: int = SHOWN, *, quote: bool = True) -> str:
    """`text` with backslashes, quotes and every unprintable character
    (controls, bidi marks, separators) escaped, cut to `limit` characters of
    the original (then its length is said), in quotes unless `quote` is false."""
    escaped = "".join(_ESCAPES.get(c) or (c if c.isprintable() else ascii(c)[1:-1])
                      for c in text[:limit])
    suffix = f"... ({len(text)} characters)" if len(text) > limit else ""
    return (f"'{escaped}'" if quote else escaped) + suffix


_ESCAPES = {"\\": "\\\\", "'": "\\'"}


class Throttle:
    """At most `per_second` log lines a second; the rest are counted and
    summed up in one line before the next one logged."""

    def __init__(self, per_second: int, what: str, *,
                 clock: Callable[[], float] = time.monotonic):
        self.per_second = per_second
        self.what = what
        self.clock = clock
        self._lock = threading.Lock()
        self._window = -1.0
        self._in_window = 0
        self._dropped = 0

    def log(self, logger: logging.Logger, level: int, message: str, *args) -> bool:
        """Log the line unless over the rate; whether it was logged."""
        with self._lock:
            now = self.clock()
            if now - self._window >= 1.0:
                self._window, self._in_window = now, 0
            if self._in_window >= self.per_second:
                self._dropped += 1
                return False
            self._in_window += 1
            dropped, self._dropped = self._dropped, 0
        if dropped:
            logger.log(level, "%d more %s not logged", dropped, self.what)
        logger.log(level, message, *args)
        return True


_refusals = Throttle(per_second=10, what="refused deliveries")


def refused(source: str, user: str, reason: str) -> None:
    """A delivery refused 401 (`reason` is ours, `source` and `user` the
    client's): counted, and logged escaped, cut short and rate-limited."""
    metrics.INTAKE_REFUSED.inc()
    _refusals.log(log, logging.WARNING, "refused a %s delivery for user %s: %s",
                  shown(source, quote=False), shown(user), reason)
