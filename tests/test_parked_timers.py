"""Timers that cannot block each other: a timer whose firing raises is parked
with its error while the others fire, and a scheduler whose due timers another
scheduler holds sleeps instead of looping."""

import logging

import psycopg
import pytest
from prometheus_client import REGISTRY

from agent_inbox.store import keys
from agent_inbox.services.scheduler import HELD_BACKOFF, Scheduler
from tests.test_operator_cli import run_cli, run_json

T = 1_000_020  # a whole minute: cron occurrences fall on it
BIGINT_MAX = 2**63 - 1


def parked_count() -> float:
    return REGISTRY.get_sample_value("agent_inbox_timers_parked_total") or 0.0


def write_timer(url, user, timer_id, due, *, every=None, cron=None, timezone=None,
                payload="{}"):
    """A timer row as another host or older code could have written it: add_timer
    on this host refuses it."""
    with psycopg.connect(url) as conn:
        conn.execute("INSERT INTO timers (bucket, user_id, timer_id, due, every, cron, timezone,"
                     " payload) VALUES (%(bucket)s, %(user)s, %(timer_id)s, %(due)s, %(every)s,"
                     " %(cron)s, %(timezone)s, %(payload)s::jsonb)",
                     keys.user_key(user, timer_id=timer_id, due=due, every=every, cron=cron,
                                   timezone=timezone, payload=payload))


def fired_ids(inbox, user):
    return sorted(e.source_id.split("@")[0] for e in inbox.events(user))


def parked(inbox, user):
    """{timer_id: error} of the user's parked timers (done until replaced)."""
    found = {t.timer_id: t.error for t in inbox.timers(user) if t.parked_at is not None}
    assert all(t.done for t in inbox.timers(user) if t.timer_id in found)
    return found


def test_a_cron_timer_that_raises_is_parked_and_the_others_fire(
        capsys, caplog, database_url, inbox):
    # The bad rows are the oldest due: each batch meets them first.
    write_timer(database_url, "u", "mars", T - 120, cron="* * * * *", timezone="Mars/Olympus_Mons")
    write_timer(database_url, "u", "listy", T - 120, cron="* * * * *", timezone="UTC",
                payload="[1, 2]")
    inbox.add_timer("u", "minutely", T - 60, {}, cron="* * * * *")
    inbox.add_timer("u", "berlin", T - 60, {}, cron="* * * * *", timezone="Europe/Berlin")
    inbox.add_timer("u", "tick", T - 60, {}, every=60)
    inbox.add_timer("v", "once", T, {})
    before = parked_count()

    with caplog.at_level(logging.WARNING, logger="agent_inbox.scheduler"):
        assert inbox.run_scheduler(now=T) == 4
    assert fired_ids(inbox, "u") == ["berlin", "minutely", "tick"]
    assert fired_ids(inbox, "v") == ["once"]
    errors = parked(inbox, "u")
    assert errors == {
        "mars": "InvalidTimer: timezone is not a known time zone on this host"
                " (got 'Mars/Olympus_Mons')",
        "listy": "InvalidTimer: payload must be a JSON object (got [1, 2])"}
    assert parked_count() - before == 2
    logged = sorted(r.getMessage() for r in caplog.records if r.name == "agent_inbox.scheduler")
    assert [line.split(":")[0] for line in logged] == ["timer parked"] * 2
    assert logged[1].startswith("timer parked: user=u timer=mars: InvalidTimer: ")

    assert inbox.run_scheduler(now=T) == 0                   # parked: skipped, nothing raises
    assert Scheduler(inbox).run_once(now=T) == 60            # the good ones' next due, not 0
    assert parked_count() - before == 2

    report = run_json(capsys, database_url, "timers", "--user", "u", "--now", str(T))
    [mars] = [t for t in report["timers"] if t["timer_id"] == "mars"]
    assert (mars["state"], mars["parked_at"], mars["error"]) == ("parked", T, errors["mars"])
    code, out, _ = run_cli(capsys, database_url, "timers", "--user", "u", "--now", str(T))
    assert code == 0
    assert sum(" parked " in line for line in out.splitlines()[2:7]) == 2
    assert f"  mars since 1970-01-12T13:47:00Z: {errors['mars']}" in out.splitlines()

    inbox.add_timer("u", "mars", T, {}, cron="* * * * *", timezone="Europe/Paris")
    assert parked(inbox, "u").keys() == {"listy"}
    assert inbox.run_scheduler(now=T) == 1
    assert fired_ids(inbox, "u") == ["berlin", "mars", "minutely", "tick"]


def test_a_row_that_fails_the_set_based_firing_is_parked_and_the_others_fire(
        database_url, inbox):
    # Its next due time, due + every, is past a bigint: the batch's one statement fails.
    write_timer(database_url, "u", "overflow", T - 100, every=BIGINT_MAX)
    inbox.add_timer("u", "tick", T - 50, {}, every=60)
    inbox.add_timer("u", "catch", T - 200, {}, every=60, missed="catch_up")
    inbox.add_timer("v", "once", T, {}, key=("reminder", "r-1"))
    before = parked_count()

    assert inbox.run_scheduler(now=T) == 3
    assert fired_ids(inbox, "u") == ["catch"] * 4 + ["tick"]
    assert [(e.source, e.source_id) for e in inbox.events("v")] == [("reminder", "r-1")]
    assert parked(inbox, "u") == {"overflow": "NumericValueOutOfRange: bigint out of range"}
    assert parked_count() - before == 1
    assert inbox.run_scheduler(now=T) == 0
    assert inbox.run_scheduler(now=T + 60) == 2              # the good ones go on; it stays parked
    assert parked_count() - before == 1

    inbox.add_timer("u", "overflow", T + 60, {}, every=3600)
    assert parked(inbox, "u") == {}
    assert inbox.run_scheduler(now=T + 60) == 1


def test_re_arming_an_approval_clears_its_parked_expiry(database_url, inbox):
    inbox.request_approval("u", "deploy", expires_in=60, action={}, now=T)
    with psycopg.connect(database_url) as conn:
        conn.execute("UPDATE timers SET done = true, parked_at = %s, error = 'boom'", (T,))
    assert inbox.run_scheduler(now=T + 60) == 0
    inbox.request_approval("u", "deploy", expires_in=60, action={}, now=T + 60)
    assert parked(inbox, "u") == {}
    assert inbox.run_scheduler(now=T + 120) == 1


@pytest.mark.parametrize("later", [None, 1])
def test_a_scheduler_whose_due_timers_another_holds_sleeps(database_url, inbox, later):
    """Due timers held FOR UPDATE by another transaction: the pass takes none and
    pauses (a jittered HELD_BACKOFF, or less if a later timer falls due sooner)."""
    inbox.add_timer("u", "tick", T - 60, {}, every=60)
    inbox.add_timer("u", "cron", T - 60, {}, cron="* * * * *")
    inbox.add_timer("v", "once", T, {})
    scheduler = Scheduler(inbox)
    with psycopg.connect(database_url) as holder:
        holder.execute("SELECT 1 FROM timers FOR UPDATE").fetchall()
        if later is not None:
            inbox.add_timer("w", "later", T + later, {})
        pause = scheduler.run_once(now=T)
        assert inbox.events("u") == inbox.events("v") == []
        assert 0 < pause <= (later or HELD_BACKOFF * 1.2)
    assert scheduler.run_once(now=T) == (later or 60)       # released: all fire, no wait left
    assert fired_ids(inbox, "u") == ["cron", "tick"]
