"""Timers and approvals, the API's side: the checks of a timer and of an
approval request (the Inbox's calls and a run's result use both), and the
scheduler's protocol (fire what is due, say when the next timer is). The rules
are store/timers.py's and store/approvals.py's (the answer and the expiry race
under one inbox key)."""

import logging

from agent_inbox import cron as cron_schedule
from agent_inbox import db, errors, metrics, validate
from agent_inbox.backend.path import RunPath
from agent_inbox.store import timers

log = logging.getLogger("agent_inbox.scheduler")

# The most missed occurrences one firing of a catch_up timer turns into events.
MAX_CATCH_UP = 10_000

# Timers fired per scheduler transaction; a pass loops until none are due.
SCHEDULER_BATCH = 500


def checked_timer(timer_id, due, payload, every, key, *, cron=None, timezone="UTC",
              missed="coalesce", catch_up_limit=100, max_payload_bytes: int) -> dict:
    """add_timer's arguments, checked, as timers.upsert's keyword arguments."""
    timer_id = validate.text("timer_id", timer_id)
    due = validate.epoch("due", due)
    if every is not None:
        every = validate.positive_seconds("every", every)
    if every is not None and cron is not None:
        raise errors.InvalidTimer("cron", cron, "cannot be combined with every")
    if (every is not None or cron is not None) and key is not None:
        raise errors.InvalidTimer(
            "key", key, "cannot be fixed on a recurring timer (every or cron is set)")
    if key is not None:
        key = validate.event_key("key", key)
    if missed not in ("coalesce", "catch_up"):
        raise errors.InvalidTimer("missed", missed, "must be 'coalesce' or 'catch_up'")
    catch_up_limit = validate.positive_int("catch_up_limit", catch_up_limit)
    if catch_up_limit > MAX_CATCH_UP:
        raise errors.InvalidTimer("catch_up_limit", catch_up_limit,
                                  f"must be at most {MAX_CATCH_UP} (events per firing)")
    if cron is not None:
        due = cron_schedule.parse(cron, timezone).next_after(due - 1)
    encoded = validate.mapping_payload("payload", payload, max_payload_bytes)
    return {"timer_id": timer_id, "base": due, "delay": 0, "every": every,
            "payload_json": encoded, "key": key, "cron": cron,
            "timezone": timezone if cron is not None else None, "missed": missed,
            "catch_up_limit": catch_up_limit}


def checked_approval(request_id, expires_in, action, max_payload_bytes: int
                 ) -> tuple[str, dict]:
    """request_approval's arguments, checked: the request id and the expiry
    timer's upsert arguments (all but its base time)."""
    request_id = validate.text("request_id", request_id)
    expires_in = validate.epoch("expires_in", expires_in)
    encoded = validate.mapping_payload(
        "action", {"approval": request_id, "answer": "expired", "action": action},
        max_payload_bytes)
    return request_id, {"delay": expires_in, "every": None, "payload_json": encoded,
                        "key": ("approval", request_id)}


class Scheduling:
    """The scheduler service's protocol (`Inbox.scheduling`): fire what is
    due, say when the next timer is. It shares only the Inbox's pool and run
    path."""

    def __init__(self, pool, path: RunPath):
        self._pool, self._path = pool, path

    def next_timer(self, *, now: int | None = None) -> tuple[bool, int | None]:
        """(a due timer is left, seconds until the next later one: None if
        none): what a scheduler waits for after a pass."""
        with db.connection(self._pool) as conn:
            return timers.next_due(conn, now)

    def fire_due(self, *, now: int | None = None) -> int:
        """`Inbox.run_scheduler`: every due timer fired, SCHEDULER_BATCH per
        transaction, until none is due; the number fired."""
        now = validate.optional_epoch("now", now)
        fired_total = 0
        with db.connection(self._pool) as conn:
            for fire in self._path.timer_firings(conn, now):
                while True:
                    with conn.transaction():
                        batch = fire(now, SCHEDULER_BATCH)
                    fired_total += batch.fired
                    self._count_fired(batch)
                    if batch.fired + len(batch.parked) < SCHEDULER_BATCH:
                        break
        return fired_total

    @staticmethod
    def _count_fired(batch) -> None:  # a store.timers.Batch
        metrics.TIMERS_FIRED.inc(batch.fired)
        metrics.OCCURRENCES_SKIPPED.inc(batch.skipped)
        metrics.TIMERS_PARKED.inc(len(batch.parked))
        for user, timer_id, error in batch.parked:
            log.warning("timer parked: user=%s timer=%s: %s (add_timer re-arms it)",
                        user, timer_id, error)

