"""The operator's views: every read the web console shows, and what it shares
with the command line's operator commands.

The console (a service) reaches the database only through the API: each name
here is the statement it runs for one page or action, on a connection from
`db.connection(inbox.pool)` (its reads are plain SELECTs that lock nothing).
The statements themselves live with their tables in store/.
"""

from agent_inbox import db
from agent_inbox.store import admin as _admin
from agent_inbox.store import memory as _memory
from agent_inbox.store import outbox as _outbox
from agent_inbox.store import pauses as _pauses
from agent_inbox.store import policies as _policies
from agent_inbox.store import stats as _stats
from agent_inbox.store import steps as _steps
from agent_inbox.store import views as _views

CHUNK = 1000
"""Event ids per repair transaction (the CLI reports progress past one chunk;
the console names at most this many rows in one repair)."""

PAGE = _views.PAGE

# The console's pages.
overview = _views.overview
users = _views.users
lease = _views.lease
timeline = _views.timeline
runs = _views.runs
messages = _views.messages
dead_named = _views.dead_named
unanswered = _views.unanswered
last_minutes = _stats.last_minutes
RUN_STAT_FIELDS = _stats.FIELDS

# Shared with the CLI's operator commands.
dead = _admin.dead
timers = _admin.timers
failed_batches = _outbox.failed_batches
list_steps = _steps.list_steps
actions = _admin.actions
rules = _policies.rules
decisions = _policies.decisions
ANSWERS = _policies.ANSWERS
DEFAULT_ASK_EXPIRES_IN = _policies.DEFAULT_ASK_EXPIRES_IN


def user_approvals(conn, user: str) -> list[dict]:
    """The user page's approvals (store/views.py)."""
    return db.run(conn, _views.user_approvals(user))


def memory(conn, user: str) -> dict | None:
    """The user's memory row (store/memory.py's get)."""
    return db.run(conn, _memory.get(user))


def fleet_pause(conn) -> dict | None:
    """The fleet's pause, {"paused_at", "actor", "reason"}, or None while it
    runs (store/pauses.py's fleet: one read of the one-row fleet_pause)."""
    return db.run(conn, _pauses.fleet())


def paused_users(conn, limit: int) -> tuple[list[dict], int]:
    """(the paused users, longest paused first, at most `limit`; how many in
    all): store/pauses.py's paused, through ix_leases_paused."""
    return db.run(conn, _pauses.paused(limit))


def user_pause(conn, user: str, recent: list[dict]) -> dict | None:
    """`user`'s pause, {"paused_at", "reason", "by"}, or None if it is not
    paused. "by" is the actor of the action that paused it (action 'pause',
    at its paused_at, not `already`), looked for in `recent`, the user's
    newest operator actions (`actions`, newest first): None if that action
    is older than all of them."""
    paused = _admin.held_by_pause(conn, user)["user"]
    if paused is None:
        return None
    paused_at, reason = paused
    by = next((a["actor"] for a in recent if a["action"] == "pause" and a["at"] == paused_at
               and not a["detail"].get("already")), None)
    return {"paused_at": paused_at, "reason": reason, "by": by}


def describe_answer(user: str, request: str, answer: str, standing: str) -> str:
    """What an approver is told after answering (the CLI and the console): the
    answer that stands, and whether it is the one given."""
    if standing == "unknown":
        return f"unknown: user {user!r} has no approval request {request!r}"
    if standing == answer:
        return f"{standing}: the answer {standing!r} stands"
    if standing == "expired":
        return f"expired: the request's deadline passed; {answer!r} was not stored"
    return f"{standing}: the answer {standing!r} already stood; {answer!r} was not stored"
