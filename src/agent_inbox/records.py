"""The rows agent-inbox hands back: plain, immutable records."""

import operator
import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

EVENT_STATUSES = ("pending", "running", "done", "dead")


@dataclass(frozen=True, slots=True)
class Event:
    """One inbox event, as a handler gets it in its batch (times are epoch
    seconds, by the database server's clock):

    - `id`: its row id, unique and increasing: a batch is ordered by it.
    - `user`: whose inbox it is in (the run's `ctx.user`).
    - `source`: where it came from: what `ingest` was given (`github`,
      `stripe`, a webhook route's `{source}`, ...), `timer` for a timer's
      firing, `approval` for an approval's answer or expiry.
    - `source_id`: its id at that source (a webhook's delivery id, a
      timer's `<timer_id>@<scheduled_at>` or a one-off's key, an
      approval's request id):
      `(user, source, source_id)` is stored once, a redelivery is dropped.
    - `payload`: the decoded JSON it carried (a webhook's body; a timer's
      payload with `scheduled_for`, `late_by` and `skipped`; an approval's
      `{"approval": request_id, "answer": ...}`).
    - `status`: `pending`, `running` (claimed by a run), `done` or `dead`.
    - `attempts`: the claims of it so far, this run's included (1 on its
      first run); past `max_attempts` it is `dead`.
    - `error`: the error of its last failed run (None if none failed).
    - `claim_gen`: the lease generation of the run that claimed it last.
    - `created_at`: when it was stored.
    - `available_at`: when it may run (after a failed run, its retry backoff).
    - `claimed_at`: when a run claimed it last (None: never claimed).
    - `kind`: what the provider calls it (GitHub's `X-GitHub-Event`, Stripe's
      `type`, ...; `ingest(kind=...)`), or None.
    - `traceparent`: the W3C trace context it arrived with (tracing.py), or None.
    """

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
    available_at: int
    claimed_at: int | None
    kind: str | None = None
    traceparent: str | None = None

    @property
    def ran_before(self) -> bool:
        """Whether an earlier run claimed it, so that run's durable steps may
        be recorded: a claim before this one counted (attempts > 1), or one
        whose attempt an operator's cancel undid (store/pauses.py), which
        leaves CANCELLED as its error."""
        return self.attempts > 1 or self.error is not None

    def __reduce__(self):
        # Pickled as its fields in order (half the cost of the default): every
        # batch goes to a quarantine process this way.
        return Event, _event_fields(self)


_event_fields = operator.attrgetter(*(f.name for f in fields(Event)))


@dataclass(frozen=True, slots=True)
class OutboxMessage:
    id: int
    body: str
    created: int
    sent_at: int | None
    failed_at: int | None = None  # its batch was parked: it will not be sent unless retried
    error: str | None = None      # why its batch's last send failed
    batch: int | None = None      # the batch it went (or goes) in: the key is <user>:<batch>


@dataclass(frozen=True, slots=True)
class Timer:
    timer_id: str
    due: int
    every: int | None
    payload: Any
    key: tuple[str, str] | None
    done: bool
    cron: str | None = None
    timezone: str | None = None
    missed: str = "coalesce"
    catch_up_limit: int = 100
    parked_at: int | None = None  # set when firing it raised: done until replaced
    error: str | None = None      # what raised


@dataclass(frozen=True, slots=True)
class Approval:
    """One approval request of a user (`Inbox.approvals`): its id, its
    deadline (epoch seconds, the database's clock), the action it asks
    about, and the answer that stands: 'yes', 'no', 'expired' (the deadline
    passed first), or None while it waits (`answered_at` then None too)."""

    request_id: str
    deadline: int
    action: Any
    answer: str | None
    answered_at: int | None


@dataclass(frozen=True, slots=True)
class Lease:
    holder: str
    gen: int
    until: int


@dataclass(frozen=True, slots=True)
class ClaimPolicy:
    """How claims count attempts and space out retries.

    A claimed event's retry becomes claimable `min(cap, base * 2**(attempts-1))`
    seconds after its claim, scaled by a random factor in [0.5, 1] (jitter), so
    retries of many events do not arrive in lockstep. A run claims at most
    `max_batch` fresh events, the oldest; the rest are the next run's.
    """

    max_attempts: int = 3
    backoff_base: int = 5
    backoff_cap: int = 300
    max_batch: int = 100

    def params(self) -> dict[str, int]:
        return {"max_attempts": self.max_attempts, "backoff_base": self.backoff_base,
                "backoff_cap": self.backoff_cap, "max_batch": self.max_batch}


@dataclass(frozen=True, slots=True)
class SendPolicy:
    """How the outbox sends: a claim holds a batch for `timeout` seconds (after
    which another dispatcher sends it again, same rows and key), a failed send
    is retried after min(cap, base * 2^(failures - 1)) seconds scaled by a
    random factor in [0.5, 1], and parked `failed` after `max_attempts` sends."""

    timeout: int = 120
    max_attempts: int = 10
    backoff_base: int = 5
    backoff_cap: int = 300


# --- a run's durable steps (store/steps.py) ------------------------------------


@dataclass(frozen=True)
class StepRecord:
    """One step's result as a run records it: `result` is its JSON text."""

    user: str
    holder: str
    gen: int
    event_ids: tuple[int, ...]
    position: int
    name: str
    occurrence: int
    result: str


@dataclass(frozen=True, slots=True)
class RecordedStep:
    """A recorded step as a later attempt (or an operator) reads it."""

    position: int
    name: str
    occurrence: int
    result: object  # the decoded JSON
    event_ids: tuple[int, ...] = ()
    holder: str = ""
    gen: int = 0
    recorded_at: int = 0

    @property
    def label(self) -> str:
        """`name` for its first occurrence in the run, `name#2` for the second..."""
        return self.name if self.occurrence == 1 else f"{self.name}#{self.occurrence}"


# --- the outbox's sends (store/outbox.py) --------------------------------------


@dataclass(frozen=True)
class Batch:
    """A claimed batch: send `text` under `key`, then report with `token`."""

    user: str
    batch: int
    token: int
    ids: list[int]
    bodies: list[str]
    traceparents: list[str | None] = field(default_factory=list)  # each message's (tracing.py)

    @property
    def key(self) -> str:
        return f"{self.user}:{self.batch}"

    @property
    def text(self) -> str:
        return "\n\n".join(self.bodies)


@dataclass(frozen=True)
class Failure:
    batch: Batch
    error: str
    permanent: bool


# --- compaction (store/compaction.py) ------------------------------------------

# What a look at the table came to (Compaction.outcome).
COMPACTED = "compacted"

FEW_DEAD = "few dead tuples"

NOT_HELD = "nothing holds the horizon back: VACUUM removes the dead tuples"

BUSY = "another compactor is at work"

NOT_GRANTED = "the table lock was not granted in time"


@dataclasses.dataclass(frozen=True)
class Compaction:
    """What one look at a table found and did."""

    table: str
    outcome: str     # COMPACTED, FEW_DEAD, NOT_HELD, BUSY or NOT_GRANTED
    dead: int        # dead tuples before (statistics: about a second behind)
    live: int        # live tuples before (statistics)
    kept: int | None = None  # the rows kept (counted), when compacted


# A taken run as the store answers it:
# (user, gen, claimed_at, died, unfinished, memory, events).
Taken = tuple[Any, ...]
