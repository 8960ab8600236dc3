"""Every failure agent-inbox raises, under one root.

Expected outcomes (a duplicate delivery, a lease held by someone else, a finish
refused by the fence) are return values, not exceptions. An exception means the
caller must stop: its input was wrong, or the database is not usable. Input errors
are raised before anything is sent to the database, so nothing is stored.
"""


class AgentInboxError(Exception):
    """Root of every error agent-inbox raises."""


class InvalidInput(AgentInboxError, ValueError):
    """An argument was rejected before anything was stored.

    `field` names the argument and `value` holds what was given (truncated in
    the message, never for secrets: no secret passes through this check).
    """

    def __init__(self, field: str, value: object, problem: str):
        self.field = field
        self.value = value
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"{field} {problem} (got {shown})")


class InvalidTime(InvalidInput):
    """A time or duration that is not a non-negative whole number of seconds."""


class InvalidPayload(InvalidInput):
    """A payload that cannot be stored as JSON."""


class PayloadTooLarge(InvalidPayload):
    """A payload whose JSON encoding is over the configured limit."""


class InvalidTimer(InvalidInput):
    """A timer definition that breaks a timer rule (every <= 0, a fixed key on a
    recurring timer)."""


class InvalidAnswer(InvalidInput):
    """An approval answer other than 'yes' or 'no'."""


class SchemaNotAtHead(AgentInboxError):
    """The database schema is older than this code needs (or was never migrated)."""


class DatabaseUnavailable(AgentInboxError):
    """The database could not be reached or stopped answering."""


class PartlyDone(DatabaseUnavailable):
    """On Citus, part of a call about users on several nodes failed (a worker
    node did not answer, or a deadlock): the call did its work on the others,
    each in transactions of its own, and not that part. `done` is what it did, as the
    method says (`take_runs`: the runs taken; `finish_runs`: a flag per outcome,
    None where nothing was committed; `renew_runs`: the keys renewed, with
    `unknown`, the keys whose node did not answer)."""

    def __init__(self, message: str, done, unknown=None):
        super().__init__(message)
        self.done = done
        self.unknown = unknown


class DatabaseRefused(AgentInboxError):
    """PostgreSQL refused the statement for what it holds (a value over one of
    its own limits, such as an index row too large): the same call fails the
    same way again. `sqlstate` is PostgreSQL's code."""

    def __init__(self, message: str, sqlstate: str | None):
        super().__init__(message)
        self.sqlstate = sqlstate


class TransactionConflict(AgentInboxError):
    """Concurrent transactions kept deadlocking on the same rows; the work was
    rolled back whole and may be retried."""


class PermanentSendError(AgentInboxError):
    """Raised by a channel for a batch that can never be sent as it is (the
    receiver refused the request itself: a 4xx other than 408 and 429). The
    dispatcher parks the batch `failed` at once instead of retrying it."""


class StepMismatch(AgentInboxError):
    """A run asked for its durable steps in another order than the earlier
    attempt at the same events recorded them (`ctx.step`): replaying would hand
    a step another step's result. The handler must call its steps in the same
    order on every attempt (branch on what steps returned, not on the clock)."""


class LeaseLost(AgentInboxError):
    """A run's write or question was refused by its fence: the lease is no
    longer this run's (it expired, or another worker took the user over). The
    run is stopped; nothing it returns will commit."""


class RunPathDamaged(AgentInboxError):
    """State the run path depends on is missing or inconsistent (the
    `wakes_ring` row emptied by a TRUNCATE of every table, and the like):
    services refuse to start on it and a running worker takes nothing until
    it is repaired; the message says what is wrong and how to repair it."""


class UserBusy(AgentInboxError):
    """An operator's change to a user (its memory) was refused because a run
    holds the user's lease: that run's finish would replace it. Try again once
    the run has ended."""


class StepRefused(LeaseLost):
    """A step's record was refused by the run's fence: the lease is no longer
    this run's (it expired, or another worker took the user over). The run is
    stopped as for a lost lease; nothing it returns will commit."""


class UnknownLimit(InvalidInput):
    """`ctx.limit(name)` named a limit the database does not hold: make it with
    `agent-inbox limits set NAME --rate N --per SECONDS` (or declare it in the
    app). Nothing was taken."""


class CostAboveBurst(InvalidInput):
    """`ctx.limit(name, cost)` asked for more at once than the limit's burst
    (its bucket never holds that many): the call could never be granted, so it
    fails at once. Nothing was taken."""


def first_line(exc: BaseException) -> str:
    """The first line of what `exc` says (its class name when it says nothing):
    a database error's one-line summary, for logs and messages."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
