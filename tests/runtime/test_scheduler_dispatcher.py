"""The scheduler and dispatcher services' passes (`run_once`), and batch keys."""

import pytest

from agent_inbox import Message, Result
from agent_inbox.services.dispatcher import Dispatcher
from agent_inbox.services.scheduler import Scheduler

T = 1_000_000


def test_a_scheduler_pass_fires_due_timers_and_says_when_the_next_is_due(inbox):
    scheduler = Scheduler(inbox)
    assert scheduler.run_once(now=T) is None                 # no timers at all
    inbox.add_timer("a", "tick", T, {}, every=60)
    inbox.add_timer("b", "later", T + 500, {})
    assert scheduler.run_once(now=T) == 60                   # tick fired, next at T + 60
    assert [e.source_id for e in inbox.events("a")] == [f"tick@{T}"]
    assert scheduler.run_once(now=T + 70) == 50              # tick again; its next is T+120
    scheduler.run_once(now=T + 500)
    assert [e.source_id for e in inbox.events("b")] == [f"later@{T + 500}"]


def queue(inbox, user, now, *messages):
    inbox.ingest(user, "chat", f"{now}", {})
    run = inbox.take_work(f"w-{user}", now=now)
    assert inbox.finish_run(run, Result(messages=list(messages)), now=now)


def test_a_dispatcher_pass_sends_each_due_user_once_with_a_batch_key(inbox):
    sends = []
    dispatcher = Dispatcher(inbox, lambda user, text, key: sends.append((user, text, key)))
    queue(inbox, "a", T, "a1", "a2")
    queue(inbox, "b", T, "b1")
    dispatcher.run_once(now=T)
    [a_ids, b_ids] = [[m.id for m in inbox.outbox(u)] for u in ("a", "b")]
    assert sends == [("a", "a1\n\na2", f"a:{a_ids[0]}"), ("b", "b1", f"b:{b_ids[0]}")]
    dispatcher.run_once(now=T)
    assert len(sends) == 2                                   # nothing held, nothing sent


def test_an_urgent_message_goes_at_once_inside_the_gap(inbox):
    sends = []
    dispatcher = Dispatcher(inbox, lambda user, text, key: sends.append(text))
    queue(inbox, "u", T, "first")
    dispatcher.run_once(now=T)
    queue(inbox, "u", T + 60, "routine")
    dispatcher.run_once(now=T + 60)
    assert sends == ["first"]                                # inside the gap: held
    queue(inbox, "u", T + 120, Message("the server is down", urgent=True))
    dispatcher.run_once(now=T + 120)
    assert sends == ["first", "routine\n\nthe server is down"]
    assert all(m.sent_at is not None for m in inbox.outbox("u"))


def test_a_batch_resent_after_a_crash_keeps_its_rows_and_key(inbox):
    queue(inbox, "u", T, "first")
    attempts = []

    def crash_after_sending(text, key):
        attempts.append((text, key))
        raise ConnectionResetError("crashed before marking the batch sent")

    with pytest.raises(ConnectionResetError):
        inbox.delivery.dispatch_batch("u", crash_after_sending, now=T)
    queue(inbox, "u", T + 1, "second")              # arrives before the retry
    inbox.delivery.dispatch_batch("u", lambda text, key: attempts.append((text, key)), now=T + 2)
    assert attempts[0] == attempts[1]               # same rows, same key: droppable
    assert attempts[1][0] == "first"
    assert [m.sent_at for m in inbox.outbox("u")] == [T + 2, None]   # "second" waits its turn


def test_at_most_once_marks_before_sending(inbox):
    queue(inbox, "u", T, "only once")

    def crash(text, key):
        raise ConnectionResetError("lost")

    with pytest.raises(ConnectionResetError):
        inbox.delivery.dispatch_batch("u", crash, at_most_once=True, now=T)
    assert [m.sent_at for m in inbox.outbox("u")] == [T]            # marked: never resent
    assert inbox.delivery.dispatch_batch("u", crash, at_most_once=True, now=T + 7200) == 0


def test_a_service_loop_survives_a_failing_pass():
    from agent_inbox.services.service import Stop, serve

    stop, calls = Stop(), []

    def run_once():
        calls.append(len(calls))
        if len(calls) == 1:
            raise ValueError("a row the pass cannot handle")
        stop.event.set()

    serve("test", run_once, lambda seconds: None, stop, poll_interval=0.01)
    assert calls == [0, 1]                  # logged, backed off, ran again
