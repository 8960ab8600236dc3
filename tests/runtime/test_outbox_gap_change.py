"""Lowering the outbox gap releases messages already held: a dispatcher
applies its own --outbox-gap to users paced by a longer one (issue 20)."""

from agent_inbox import Result
from agent_inbox.services.dispatcher import Dispatcher

T = 1_000_000


def queue(inbox, user, now, key, *messages):
    inbox.ingest(user, "chat", key, {})
    run = inbox.take_work(f"w-{user}", now=now)
    assert inbox.finish_run(run, Result(messages=list(messages)), now=now)


def test_a_lower_gap_releases_a_message_held_under_a_longer_one(make_inbox, inbox):
    sends = []
    channel = lambda user, text, key: sends.append(text)  # noqa: E731
    queue(inbox, "u", T, "1", "first")
    Dispatcher(make_inbox(outbox_gap=3600), channel).run_once(now=T)
    queue(inbox, "u", T + 10, "2", "second")
    Dispatcher(make_inbox(outbox_gap=3600), channel).run_once(now=T + 10)
    assert sends == ["first"]  # held: paced until T + 3600

    # the dispatcher restarted with --outbox-gap 60
    lower = Dispatcher(make_inbox(outbox_gap=60), channel)
    assert lower.run_once(now=T + 30) >= 30  # not yet: due at T + 60
    assert sends == ["first"]
    lower.run_once(now=T + 61)
    assert sends == ["first", "second"]


def test_a_lower_gap_still_keeps_one_send_per_gap(make_inbox, inbox):
    """Guarantee 7 holds with the lower gap: the held message waits for it."""
    sends = []
    channel = lambda user, text, key: sends.append(text)  # noqa: E731
    queue(inbox, "u", T, "1", "first")
    Dispatcher(make_inbox(outbox_gap=3600), channel).run_once(now=T)
    queue(inbox, "u", T + 10, "2", "second")
    lower = Dispatcher(make_inbox(outbox_gap=600), channel)
    lower.run_once(now=T + 10)
    lower.run_once(now=T + 599)
    assert sends == ["first"]
    lower.run_once(now=T + 600)
    assert sends == ["first", "second"]
