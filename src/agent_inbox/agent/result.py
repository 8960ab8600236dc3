"""What a handler returns: everything one run produces, committed together.

`Result(messages=[...], timers=[...], approvals=[...], memory=...)` is written in
the run's one fenced finish transaction, or not at all; `Result(error="...")`
(or a raised exception) puts the run's events back for a retry and writes
nothing else. `memory` replaces the user's memory document (`ctx.memory` is
what the run read with its claim); None deletes it; left out, it stays.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Message:
    """An outgoing message; an urgent one is sent at once, regardless of the gap."""

    body: str
    urgent: bool = False


@dataclass(frozen=True)
class TimerRequest:
    """A timer to create or replace, as `Inbox.add_timer` takes it."""

    timer_id: str
    due: int
    payload: Mapping[str, Any] = field(default_factory=dict)
    every: int | None = None
    key: tuple[str, str] | None = None
    cron: str | None = None
    timezone: str = "UTC"
    missed: str = "coalesce"
    catch_up_limit: int = 100


@dataclass(frozen=True)
class ApprovalRequest:
    """A deferred tool call: the answer or its expiry comes back as an event."""

    request_id: str
    expires_in: int
    action: Any = None


class _Keep:
    """`Result.memory`'s default: the user's memory stays as it is."""

    def __repr__(self) -> str:
        return "KEEP"

    def __reduce__(self):  # one object in every process (a quarantine's result is pickled)
        return "KEEP"


KEEP = _Keep()


@dataclass(frozen=True)
class Result:
    messages: tuple = ()   # str or Message
    timers: tuple = ()     # TimerRequest
    approvals: tuple = ()  # ApprovalRequest
    error: str | None = None
    memory: Any = KEEP     # a JSON document replaces the user's memory; None deletes it
