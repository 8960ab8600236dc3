"""Timers feed the inbox; approvals race their expiry under one key; the outbox
is paced per user."""

import pytest

T = 1_000_000
DAY = 86400
HOUR = 3600


def timer_events(inbox, user, prefix):
    return [e for e in inbox.events(user) if e.source_id.startswith(prefix)]


def test_a_due_timer_fires_once_and_advances_on_its_grid(inbox):
    inbox.add_timer("u", "tick", T, {"task": "t"}, every=60)
    assert inbox.run_scheduler(now=T) == 1
    assert inbox.run_scheduler(now=T) == 0
    [event] = timer_events(inbox, "u", "tick@")
    assert (event.source, event.source_id) == ("timer", f"tick@{T}")
    assert event.payload == {"task": "t", "scheduled_for": T, "late_by": 0, "skipped": 0}
    assert inbox.timers("u")[0].due == T + 60


def test_missed_occurrences_coalesce_into_the_latest(inbox):
    inbox.add_timer("u", "digest", T, {}, every=DAY)
    later = T + 3 * DAY + 600
    assert inbox.run_scheduler(now=later) == 1
    [event] = timer_events(inbox, "u", "digest@")
    assert event.source_id == f"digest@{T + 3 * DAY}"
    assert event.payload == {"scheduled_for": T + 3 * DAY, "late_by": 600, "skipped": 3}
    assert inbox.timers("u")[0].due == T + 4 * DAY


def test_replaying_a_schedule_with_its_old_due_time_is_a_duplicate(inbox):
    inbox.add_timer("u", "digest", T, {}, every=DAY)
    assert inbox.run_scheduler(now=T) == 1
    inbox.add_timer("u", "digest", T, {}, every=DAY)  # a deploy re-registers it
    assert inbox.run_scheduler(now=T) == 1             # fires, but the event is a duplicate
    assert len(timer_events(inbox, "u", "digest@")) == 1


def test_a_one_off_with_a_fixed_key_fires_once_and_is_done(inbox):
    inbox.add_timer("u", "follow-up", T + 10, {"n": 1}, key=("crm", "lead-7"))
    assert inbox.run_scheduler(now=T + 9) == 0
    assert inbox.run_scheduler(now=T + 10) == 1
    assert inbox.run_scheduler(now=T + 10_000) == 0
    [event] = inbox.events("u")
    assert (event.source, event.source_id) == ("crm", "lead-7")
    assert inbox.timers("u")[0].done is True


def test_the_scheduler_serves_every_user(inbox):
    for n in range(5):
        inbox.add_timer(f"user-{n}", "tick", T, {}, every=60)
    assert inbox.run_scheduler(now=T) == 5
    assert all(len(inbox.events(f"user-{n}")) == 1 for n in range(5))


def test_the_scheduler_drains_more_timers_than_one_batch(inbox, monkeypatch):
    from agent_inbox.api import scheduling

    monkeypatch.setattr(scheduling, "SCHEDULER_BATCH", 3)
    for n in range(10):
        inbox.add_timer("u", f"t{n}", T - n, {})
    assert inbox.run_scheduler(now=T) == 10
    assert len(inbox.events("u")) == 10


def test_answer_before_the_deadline_stands_and_a_second_tap_is_ignored(inbox):
    inbox.request_approval("u", "r1", expires_in=4 * HOUR, action="refund", now=T)
    assert inbox.answer_approval("u", "r1", "yes", now=T + HOUR) == "yes"
    assert inbox.answer_approval("u", "r1", "no", now=T + 2 * HOUR) == "yes"
    assert inbox.run_scheduler(now=T + 5 * HOUR) == 1  # the expiry fires as a duplicate
    [event] = inbox.events("u")
    assert (event.source, event.source_id, event.payload) == (
        "approval", "r1", {"approval": "r1", "answer": "yes"})


def test_an_answer_at_or_after_the_deadline_stores_the_expiry(inbox):
    inbox.request_approval("u", "r1", expires_in=HOUR, action="refund", now=T)
    assert inbox.answer_approval("u", "r1", "yes", now=T + HOUR) == "expired"
    [event] = inbox.events("u")
    assert event.payload == {"approval": "r1", "answer": "expired", "action": "refund"}


def test_an_unknown_request_is_unknown_and_stores_nothing(inbox):
    assert inbox.answer_approval("u", "never", "yes", now=T) == "unknown"
    assert inbox.events("u") == []


def queue(inbox, user, now, *bodies):
    assert inbox.ingest(user, "chat", f"at-{now}-{bodies[0]}", {})
    gen = inbox.acquire(user, "A", now=now)
    ids = [e.id for e in inbox.claim_batch(user, "A", gen, now=now)]
    assert inbox.finish(user, "A", gen, ids, messages=list(bodies), now=now)


def test_dispatch_sends_held_messages_as_one_and_paces_per_user(inbox):
    sent = []
    queue(inbox, "u", T, "a", "b")
    assert inbox.dispatch("u", sent.append, now=T) == 2
    queue(inbox, "u", T + 600, "c")
    assert inbox.dispatch("u", sent.append, now=T + 600) == 0           # inside the gap
    queue(inbox, "other", T + 600, "z")
    assert inbox.dispatch("other", sent.append, now=T + 600) == 1       # its own gap
    assert inbox.dispatch("u", sent.append, now=T + HOUR) == 1
    assert sent == ["a\n\nb", "z", "c"]
    assert [m.sent_at for m in inbox.outbox("u")] == [T, T, T + HOUR]


def test_dispatch_with_nothing_held_does_not_call_send(inbox):
    assert inbox.dispatch("u", lambda text: pytest.fail("send called"), now=T) == 0


def test_a_failed_send_marks_nothing(inbox):
    queue(inbox, "u", T, "a")

    def broken(text):
        raise ConnectionError("channel down")

    with pytest.raises(ConnectionError):
        inbox.dispatch("u", broken, now=T)
    assert [m.sent_at for m in inbox.outbox("u")] == [None]
    sent = []
    assert inbox.dispatch("u", sent.append, now=T) == 1
    assert sent == ["a"]


def test_catch_up_emits_one_event_per_missed_occurrence_each_under_its_own_key(inbox):
    inbox.add_timer("u", "billing", T, {"job": "reconcile"}, every=DAY, missed="catch_up")
    assert inbox.run_scheduler(now=T + 3 * DAY + 60) == 1
    events = timer_events(inbox, "u", "billing@")
    assert [e.source_id for e in events] == [f"billing@{T + n * DAY}" for n in range(4)]
    assert [e.payload["late_by"] for e in events] == [3 * DAY + 60, 2 * DAY + 60, DAY + 60, 60]
    assert {e.payload["overflow"] for e in events} == {0}
    assert inbox.timers("u")[0].due == T + 4 * DAY
    assert inbox.run_scheduler(now=T + 3 * DAY + 60) == 0


def test_catch_up_keeps_the_latest_occurrences_up_to_its_limit_and_reports_the_overflow(inbox):
    inbox.add_timer("u", "billing", T, {}, every=DAY, missed="catch_up", catch_up_limit=2)
    inbox.run_scheduler(now=T + 4 * DAY)
    events = timer_events(inbox, "u", "billing@")
    assert [e.source_id for e in events] == [f"billing@{T + 3 * DAY}", f"billing@{T + 4 * DAY}"]
    assert {e.payload["overflow"] for e in events} == {3}


def test_a_cron_timer_fires_on_its_schedule_in_its_time_zone(inbox):
    from datetime import datetime
    from zoneinfo import ZoneInfo

    berlin = ZoneInfo("Europe/Berlin")
    start = int(datetime(2026, 12, 1, 12, 0, tzinfo=berlin).timestamp())
    inbox.add_timer("u", "standup", start, {}, cron="30 9 * * 1-5", timezone="Europe/Berlin")
    [timer] = inbox.timers("u")
    assert datetime.fromtimestamp(timer.due, berlin) == datetime(2026, 12, 2, 9, 30, tzinfo=berlin)
    # Friday 9:30 to the next Wednesday 9:00: Friday, Monday and Tuesday were due
    friday = int(datetime(2026, 12, 4, 9, 30, tzinfo=berlin).timestamp())
    wednesday = int(datetime(2026, 12, 9, 9, 0, tzinfo=berlin).timestamp())
    assert inbox.run_scheduler(now=timer.due) == 1
    inbox.add_timer("u", "standup", friday, {}, cron="30 9 * * 1-5", timezone="Europe/Berlin")
    assert inbox.run_scheduler(now=wednesday) == 1
    latest = timer_events(inbox, "u", "standup@")[-1]
    tuesday = int(datetime(2026, 12, 8, 9, 30, tzinfo=berlin).timestamp())
    assert latest.payload == {"scheduled_for": tuesday, "late_by": wednesday - tuesday, "skipped": 2}
    assert inbox.timers("u")[0].due == int(datetime(2026, 12, 9, 9, 30, tzinfo=berlin).timestamp())
    assert inbox.run_scheduler(now=wednesday) == 0


def test_a_cron_timer_can_catch_up(inbox):
    inbox.add_timer("u", "hourly", 3600, {}, cron="0 * * * *", missed="catch_up")
    assert inbox.run_scheduler(now=4 * 3600 + 5) == 1
    assert [e.payload["scheduled_for"] for e in timer_events(inbox, "u", "hourly@")] == [
        3600, 7200, 10800, 14400]


@pytest.mark.parametrize("options, message", [
    ({"cron": "61 * * * *"}, "minute field '61' is outside 0-59"),
    ({"cron": "* * *"}, "must have 5 fields"),
    ({"cron": "* * * * *", "timezone": "Mars/Olympus"}, "is not a known time zone"),
    ({"cron": "* * * * *", "every": 60}, "cannot be combined with every"),
    ({"cron": "* * * * *", "key": ("a", "b")}, "cannot be fixed on a recurring timer"),
    ({"every": 60, "missed": "skip"}, "must be 'coalesce' or 'catch_up'"),
    ({"every": 60, "missed": "catch_up", "catch_up_limit": 0}, "must be a positive integer"),
])
def test_bad_timer_policies_are_refused(inbox, options, message):
    from agent_inbox import InvalidInput

    with pytest.raises(InvalidInput, match=message.replace("(", r"\(").replace(")", r"\)")):
        inbox.add_timer("u", "t", T, {}, **options)
    assert inbox.timers("u") == []
