"""The rows agent-inbox hands back: plain, immutable records."""

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Event:
    """One inbox event. `payload` is the decoded JSON; times are epoch seconds."""

    id: int
    user: str
    source: str
    source_id: str
    payload: Any
    status: str
    attempts: int
    error: str | None
    claim_gen: int | None
    created_at: int


@dataclass(frozen=True, slots=True)
class OutboxMessage:
    id: int
    body: str
    created: int
    sent_at: int | None


@dataclass(frozen=True, slots=True)
class Timer:
    timer_id: str
    due: int
    every: int | None
    payload: Any
    key: tuple[str, str] | None
    done: bool


@dataclass(frozen=True, slots=True)
class Lease:
    holder: str
    gen: int
    until: int
