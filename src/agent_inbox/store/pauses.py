"""Pausing a user or the fleet, and cancelling a run in flight (migration 0013).

A paused user (`leases.paused_at` set) is never taken: every take already
reads the user's lease row (store/inbox.py TAKEABLE; the Citus PICK), so the
pause costs the hot path no statement. Its events are still stored, its timers
still fire into its inbox, its approvals can still be answered; its outbox
messages are held (store/outbox.py CLAIM: the verdict `paused`). A take that
finds a paused user's wake parks it (`parked_or`): the user's wakes are
replaced by one at PARKED, never due, which keeps the low-water mark they
carried (store/inbox.py, low_water) and costs later takes nothing. `resume`
clears the pause and adds a wake due now (and makes its deliveries due), so
everything held goes on in order.

The fleet is paused while `fleet_pause` has its row (`pause --all`): every
take (FLEET_RUNS, in the take's own statement) and every dispatcher's scan
reads it, so the brake needs nothing but the database: a take that began
after the pause committed takes nothing, on every worker. An empty table is
a running fleet, so a TRUNCATE of every table can resume a fleet but never
silently stop it.

Cancelling a run (`cancel`, and `pause --cancel`) fences its lease off: the
generation moves and the lease expires, so the run's renewal, step records
and finish are all refused (nothing it would commit commits); its events go
back to pending with the attempt undone (lease.undone_claims: a cancel is not
a poison attempt), its completed durable steps stay, and a NOTIFY on
notify.CANCEL tells its worker at once (the worker also looks every few
seconds, where LISTEN is not available: services/worker/keeper.py).

Every change takes the user's lease row FOR UPDATE first, as every run-path
transaction does (store/lease.py), and is recorded in `operator_actions`
with its actor and reason (the fleet's under the user '', which no user can
be). Each statement names one bucket, so Citus runs the same text.
"""

import json
from typing import Any

from agent_inbox import errors, notify
from agent_inbox.db import Queries, Query
from agent_inbox.store import lease
from agent_inbox.store.clock import NOW
from agent_inbox.store.keys import user_key, users_key

# Where a take puts a paused user's wake: never due, so no take reads it, and
# every statement that reads the user's wakes for their marks still does.
PARKED = 9223372036854775807

# The fleet runs (SQL, an initplan of the take and of the dispatchers' scan).
FLEET_RUNS = "NOT EXISTS (SELECT 1 FROM fleet_pause)"

# The lease row `l` is not paused (SQL).
NOT_PAUSED = "l.paused_at IS NULL"

# The longest reason kept, in bytes (UTF-8).
MAX_REASON_BYTES = 1000

# The user the fleet's actions are recorded under (validate.text refuses '').
FLEET = ""


def parked_or(next_at: str, paused_at: str) -> str:
    """When a take looking at a user whose lease it cannot take wakes it next
    (SQL): `next_at` (its next retry, NULL if it has no open event), or PARKED
    if the user is paused (`paused_at` not NULL) and has one."""
    return f"CASE WHEN {paused_at} IS NOT NULL AND {next_at} IS NOT NULL THEN {PARKED}" \
           f" ELSE {next_at} END"


LOCK = f"""
SELECT l.holder, l.gen, l.until, l.paused_at, l.paused_reason, {NOW} AS now
  FROM leases l WHERE l.bucket = %(bucket)s AND l.user_id = %(user)s
   FOR UPDATE
"""

SET_PAUSED = """
UPDATE leases SET paused_at = %(at)s, paused_reason = %(reason)s
 WHERE bucket = %(bucket)s AND user_id = %(user)s
"""

# The run in flight fenced off: a new generation, expired, held by no one.
FENCE_OFF = """
UPDATE leases l SET gen = l.gen + 1, holder = '', until = %(now)s - 1
 WHERE l.bucket = %(bucket)s AND l.user_id = %(user)s AND l.until >= %(now)s
RETURNING l.gen - 1
"""

# The error a cancelled run's events keep: the next run reads its durable
# steps by it (records.Event.ran_before), since the attempt count is undone.
CANCELLED = "cancelled by an operator"

# Its events back to pending, the claim's attempt undone, marked CANCELLED.
UNCLAIM = f"""
UPDATE events e SET {lease.undone_claims("false")}, error = '{CANCELLED}'
 WHERE e.bucket = %(bucket)s AND e.user_id = %(user)s AND {lease.claimed_by("%(gen)s")}
RETURNING e.id
"""

WAKE = "INSERT INTO wakes (bucket, user_id, at) VALUES (%(bucket)s, %(user)s, %(now)s)"

# The user's held messages due now (a dispatcher's claim decides what to send);
# a batch backing off after a failure keeps its time. No condition on due_at:
# a dispatcher's claim that locked the row and read the user as paused before
# this commit writes a NULL when it commits; this waits for it and overwrites it.
DELIVERIES_DUE = """
UPDATE deliveries SET due_at = coalesce(due_at, %(now)s)
 WHERE bucket = %(bucket)s AND user_id = %(user)s
"""

RECORD = """
INSERT INTO operator_actions (bucket, user_id, at, actor, action, detail)
VALUES (%(bucket)s, %(user)s, %(now)s, %(actor)s, %(action)s, %(detail)s::jsonb)
"""

NOTIFY = "SELECT pg_notify(%(channel)s, %(payload)s)"


def check_reason(reason: str | None) -> str | None:
    """`reason` as stored (None for none or ''), or InvalidInput: nothing is
    sent before it is checked."""
    if reason is None:
        return None
    if not isinstance(reason, str):
        raise errors.InvalidInput("reason", reason, "must be a string")
    if "\x00" in reason:
        raise errors.InvalidInput("reason", reason, "must not contain NUL")
    if len(reason.encode("utf-8")) > MAX_REASON_BYTES:
        raise errors.InvalidInput("reason", reason, f"must be at most {MAX_REASON_BYTES} bytes")
    return reason or None


def _locked(user: str, now: int | None) -> Queries[tuple[Any, ...]]:
    rows = yield Query(LOCK, user_key(user, now=now))
    if not rows:
        raise errors.InvalidInput("user", user, "is not a known user (it has no events)")
    return tuple(rows[0])


def _record(user: str, now: int, actor: str, action: str, detail: dict[str, Any]) -> Queries[None]:
    yield Query(RECORD, user_key(user, now=now, actor=actor, action=action,
                                 detail=json.dumps(detail)))


def _fence_off(user: str, now: int) -> Queries[dict[str, Any] | None]:
    """The run holding `user`'s lease fenced off (see the module's docstring):
    {"gen", "events"}, or None if no run held it."""
    rows = yield Query(FENCE_OFF, user_key(user, now=now))
    if not rows:
        return None
    gen = rows[0][0]
    events = [event_id for event_id, in (yield Query(UNCLAIM, user_key(user, gen=gen, now=now)))]
    yield Query(NOTIFY, {"channel": notify.CANCEL,
                         "payload": json.dumps({"user": user, "gen": gen})})
    return {"gen": gen, "events": events}


def pause(user: str, actor: str, reason: str | None, cancel: bool,
          now: int | None) -> Queries[dict[str, Any]]:
    """Pause `user` (and with `cancel` fence off its run in flight), in the
    caller's transaction: {"user", "paused_at", "reason", "already", "cancelled"}.
    A user already paused keeps its pause and reason (`already`); its run is
    still cancelled if asked."""
    reason = check_reason(reason)
    _, _, _, paused_at, paused_reason, clock = yield from _locked(user, now)
    already = paused_at is not None
    if not already:
        paused_at, paused_reason = clock, reason
        yield Query(SET_PAUSED, user_key(user, at=clock, reason=reason))
    cancelled = (yield from _fence_off(user, clock)) if cancel else None
    if cancelled:
        yield Query(WAKE, user_key(user, now=clock))  # a take parks it (see the docstring)
    if not already or cancelled:
        yield from _record(user, clock, actor, "pause",
                           {"reason": reason, "already": already, "cancelled": cancelled})
    return {"user": user, "paused_at": paused_at, "reason": paused_reason, "already": already,
            "cancelled": cancelled}


def cancel(user: str, actor: str, reason: str | None, now: int | None) -> Queries[dict[str, Any]]:
    """Fence off the run holding `user`'s lease without pausing it: its events
    are taken again at once (unless it is paused). {"user", "cancelled"}:
    None if no run held the lease."""
    return {"user": user, "cancelled": (yield from _cancel(user, actor, check_reason(reason),
                                                           now))}


def _cancel(user: str, actor: str, reason: str | None,
            now: int | None) -> Queries[dict[str, Any] | None]:
    """`cancel`'s work: its lease locked, the run fenced off, a wake, the record."""
    *_, clock = yield from _locked(user, now)
    cancelled = yield from _fence_off(user, clock)
    if cancelled:
        yield Query(WAKE, user_key(user, now=clock))
        yield from _record(user, clock, actor, "cancel", {"reason": reason, **cancelled})
    return cancelled


def resume(user: str, actor: str, now: int | None) -> Queries[dict[str, Any]]:
    """Clear `user`'s pause: a wake due now, its held messages due now.
    {"user", "resumed"}: False if it was not paused (nothing changes)."""
    _, _, _, paused_at, reason, clock = yield from _locked(user, now)
    if paused_at is None:
        return {"user": user, "resumed": False}
    yield Query(SET_PAUSED, user_key(user, at=None, reason=None))
    yield Query(WAKE, user_key(user, now=clock))
    yield Query(DELIVERIES_DUE, user_key(user, now=clock))
    yield from _record(user, clock, actor, "resume",
                       {"paused_at": paused_at, "reason": reason, "paused_for": clock - paused_at})
    for channel in (notify.WORK, notify.OUTBOX):
        yield Query(NOTIFY, {"channel": channel, "payload": ""})
    return {"user": user, "resumed": True}


PAUSE_FLEET = f"""
INSERT INTO fleet_pause (paused_at, actor, reason) VALUES ({NOW}, %(actor)s, %(reason)s)
ON CONFLICT ON CONSTRAINT pk_fleet_pause DO NOTHING
RETURNING paused_at
"""

FLEET_STATE = "SELECT paused_at, actor, reason FROM fleet_pause"

RESUME_FLEET = "DELETE FROM fleet_pause RETURNING paused_at, actor, reason"

# How many times the fleet's cancel looks for runs in flight, each in a
# transaction of its own after the pause's commit: a take whose statement began
# before that commit does not see the pause and may commit after the first
# look's snapshot; the second look, after the first one's cancels, finds it.
CANCEL_PASSES = 2

# The users whose lease a run holds (a scan of leases: the fleet's cancel only).
HELD = f"SELECT user_id FROM leases WHERE until >= {NOW} ORDER BY user_id"


def fleet() -> Queries[dict[str, Any] | None]:
    """The fleet's pause: {"paused_at", "actor", "reason"}, None while it runs."""
    rows = yield Query(FLEET_STATE)
    return dict(zip(("paused_at", "actor", "reason"), rows[0])) if rows else None


def pause_fleet(actor: str, reason: str | None, now: int | None) -> Queries[dict[str, Any]]:
    """Pause the fleet: {"paused_at", "actor", "reason", "already"}. Its
    commit is the brake: every take that begins after it takes nothing.
    Cancelling the runs in flight is cancel_held's, after that commit."""
    reason = check_reason(reason)
    rows = yield Query(PAUSE_FLEET, {"actor": actor, "reason": reason, "now": now})
    if not rows:
        return {**((yield from fleet()) or {}), "already": True}
    yield from _record(FLEET, rows[0][0], actor, "fleet_pause", {"reason": reason})
    return {"paused_at": rows[0][0], "actor": actor, "reason": reason, "already": False}


def cancel_held(actor: str, reason: str | None, now: int | None) -> Queries[list[str]]:
    """Fence off every run in flight as `cancel` does (the lease rows locked in
    user order, as LOCK_MANY locks them): the users cancelled. Run after the
    fleet's pause has committed, so that no take it cannot see starts a run
    after its read of the leases (see CANCEL_PASSES)."""
    reason = check_reason(reason)
    cancelled = []
    for user in (yield from held(now)):
        if (yield from _cancel(user, actor, reason, now)):
            cancelled.append(user)
    return cancelled


def resume_fleet(actor: str, now: int | None) -> Queries[dict[str, Any]]:
    """Resume the fleet: {"resumed"} (False: it was not paused)."""
    rows = yield Query(RESUME_FLEET)
    if not rows:
        return {"resumed": False}
    paused_at, paused_by, reason = rows[0]
    clock = (yield Query(f"SELECT {NOW}", {"now": now}))[0][0]
    yield from _record(FLEET, clock, actor, "fleet_resume",
                       {"paused_at": paused_at, "paused_by": paused_by, "reason": reason,
                        "paused_for": clock - paused_at})
    for channel in (notify.WORK, notify.OUTBOX):
        yield Query(NOTIFY, {"channel": channel, "payload": ""})
    return {"resumed": True}


def held(now: int | None) -> Queries[list[str]]:
    """The users a run holds the lease of now (for the fleet's cancel)."""
    return [user for user, in (yield Query(HELD, {"now": now}))]


PAUSED = """
SELECT user_id, paused_at, paused_reason FROM leases
 WHERE paused_at IS NOT NULL
 ORDER BY paused_at, user_id
 LIMIT %(limit)s
"""
PAUSED_COUNT = "SELECT count(*) FROM leases WHERE paused_at IS NOT NULL"


def paused(limit: int) -> Queries[tuple[list[dict[str, Any]], int]]:
    """(the paused users, longest paused first, at most `limit`; how many in all),
    read through ix_leases_paused."""
    rows = yield Query(PAUSED, {"limit": limit})
    total = (yield Query(PAUSED_COUNT))[0][0]
    return ([{"user": u, "paused_at": at, "reason": reason} for u, at, reason in rows], total)


# The runs a worker has in flight, as their lease rows say now (the keeper's
# look for runs fenced off, store/pauses.py's cancel among them).
LEASES_OF = """
SELECT user_id, holder, gen FROM leases
 WHERE bucket = ANY(%(buckets)s::int[]) AND user_id = ANY(%(users)s::text[])
"""


def fenced_off(holder: str,
               keys: list[tuple[str, int]]) -> Queries[dict[tuple[str, int], str]]:
    """Of the runs `keys` ((user, gen)) that `holder` runs, those whose lease
    no longer names them, whose finish would be refused: "cancelled" where a
    cancel left it (FENCE_OFF: held by no one), else "lost" (taken over)."""
    if not keys:
        return {}
    rows = yield Query(LEASES_OF, users_key(sorted({user for user, _ in keys})))
    now = {user: (row_holder, gen) for user, row_holder, gen in rows}
    gone = {}
    for user, gen in keys:
        row_holder, row_gen = now.get(user, ("", None))
        if (row_holder, row_gen) != (holder, gen):
            gone[(user, gen)] = "cancelled" if row_holder == "" else "lost"
    return gone
