"""Timers and approvals: create and list timers, run the scheduler, request and
answer approvals (the answer and the expiry race under one inbox key)."""

import logging
from collections.abc import Mapping
from typing import Any

from agent_inbox import cron as cron_schedule
from agent_inbox import db, errors, metrics, validate
from agent_inbox.records import Timer
from agent_inbox.store import approvals, timers

log = logging.getLogger("agent_inbox.scheduler")

# The most missed occurrences one firing of a catch_up timer turns into events.
MAX_CATCH_UP = 10_000

# Timers fired per scheduler transaction; a pass loops until none are due.
SCHEDULER_BATCH = 500


class Scheduling:
    """Mixed into `agent_inbox.Inbox` (which owns `_pool`, `max_payload_bytes`, `_path`)."""

    def add_timer(self, user: str, timer_id: str, due: int, payload: Mapping[str, Any], *,
                  every: int | None = None, key: tuple[str, str] | None = None,
                  cron: str | None = None, timezone: str = "UTC", missed: str = "coalesce",
                  catch_up_limit: int = 100) -> None:
        """Create or replace a timer. Recurring with `every` seconds or a `cron`
        expression (evaluated in `timezone`; the first occurrence is the first at
        or after `due`), else one-off; a one-off may fix its event key (source,
        source_id), a recurring one may not (each occurrence needs its own key).
        Missed occurrences of a recurring timer: missed="coalesce" (one event for
        the latest, with `skipped`) or "catch_up" (one event each, at most
        catch_up_limit per firing, `overflow` counting the ones left out)."""
        user = validate.text("user", user)
        row = self._checked_timer(timer_id, due, payload, every, key, cron=cron,
                                  timezone=timezone, missed=missed, catch_up_limit=catch_up_limit)
        with db.connection(self._pool) as conn:
            timers.upsert(conn, user, **row)

    def _checked_timer(self, timer_id, due, payload, every, key, *, cron=None, timezone="UTC",
                       missed="coalesce", catch_up_limit=100) -> dict:
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
        encoded = validate.mapping_payload("payload", payload, self.max_payload_bytes)
        return {"timer_id": timer_id, "base": due, "delay": 0, "every": every,
                "payload_json": encoded, "key": key, "cron": cron,
                "timezone": timezone if cron is not None else None, "missed": missed,
                "catch_up_limit": catch_up_limit}

    def _checked_approval(self, request_id, expires_in, action) -> tuple[str, dict]:
        """request_approval's arguments, checked: the request id and the expiry
        timer's upsert arguments (all but its base time)."""
        request_id = validate.text("request_id", request_id)
        expires_in = validate.epoch("expires_in", expires_in)
        encoded = validate.mapping_payload(
            "action", {"approval": request_id, "answer": "expired", "action": action},
            self.max_payload_bytes)
        return request_id, {"delay": expires_in, "every": None, "payload_json": encoded,
                            "key": ("approval", request_id)}

    def timers(self, user: str) -> list[Timer]:
        user = validate.text("user", user)
        with db.connection(self._pool) as conn:
            return timers.list_timers(conn, user)

    def next_timer(self, *, now: int | None = None) -> tuple[bool, int | None]:
        """(a due timer is left, seconds until the next later one: None if
        none): what a scheduler waits for after a pass."""
        with db.connection(self._pool) as conn:
            return timers.next_due(conn, now)

    def run_scheduler(self, *, now: int | None = None) -> int:
        """Turn every due timer, across all users, into an inbox event; the number
        fired. A timer whose firing raises is parked with its error (logged,
        counted, shown by `timers(user)`) and the others fire. Safe to run as
        many copies at once as you like."""
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

    def request_approval(self, user: str, request_id: str, *, expires_in: int, action: Any,
                         now: int | None = None) -> int:
        """Arm the approval's expiry timer; returns the deadline (epoch seconds).
        The answer or the expiry comes back as the event ('approval', request_id)."""
        user = validate.text("user", user)
        request_id, row = self._checked_approval(request_id, expires_in, action)
        now = validate.optional_epoch("now", now)
        with db.connection(self._pool) as conn:
            return timers.upsert(conn, user, approvals.expiry_timer_id(request_id), base=now, **row)

    def answer_approval(self, user: str, request_id: str, answer: str, *,
                        now: int | None = None) -> str:
        """Store an answer unless the deadline has passed; returns the answer that
        stands: 'yes', 'no', 'expired', or 'unknown' for a request never made."""
        user = validate.text("user", user)
        request_id = validate.text("request_id", request_id)
        answer = validate.answer("answer", answer)
        now = validate.optional_epoch("now", now)
        with db.transaction(self._pool) as conn:
            return self._path.answer_approval(conn, user, request_id, answer, now)
