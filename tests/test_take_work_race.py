"""take_work claims from its statement's snapshot, but the claim re-checks every
row it writes against the newest row version: an event whose run was finished
after that snapshot is never claimed again. Found by the chaos suite (a second
holder took over a lease just released and re-ran the event the first holder
had finished); forced here.

The interleaving, held in place by a row lock rather than by timing: A has
claimed the victim's event and stalled (its lease expires). The transaction
that commits A's outcome for that event is open, holding the row. B's
take_work starts, so its snapshot still shows the event running under gen 1;
B takes the expired lease over (gen 2), plans to reclaim the event as a retry,
and its UPDATE waits on the row. The outcome commits; B's UPDATE then sees the
newest version, which is no longer what it planned from.
"""

import psycopg

from tests.races import Racers, wait_for_lock_waiters

T = 1_000_000


def test_take_work_never_claims_an_event_finished_after_its_snapshot(database_url, make_inbox):
    a = make_inbox(application_name="holder-a", lease_ttl=30)
    b = make_inbox(application_name="holder-b", lease_ttl=30)
    a.ingest("victim", "chat", "e1", {"text": "hello"})
    gen = a.acquire("victim", "A", now=T)
    [claimed] = a.claim_batch("victim", "A", gen, now=T)

    with psycopg.connect(database_url) as outcome:
        outcome.execute("UPDATE events SET status = 'done' WHERE id = %s", (claimed.id,))
        racer = Racers(lambda: b.take_work("B", now=T + 100)).start()
        wait_for_lock_waiters(database_url, 1, application_name="holder-b")
        outcome.commit()
        [run] = racer.join()

    assert (run.user, run.gen) == ("victim", gen + 1)  # B took the expired lease over
    assert run.events == []                           # and claimed nothing stale
    [event] = a.events("victim")
    assert (event.status, event.attempts, event.claim_gen) == ("done", 1, gen)
