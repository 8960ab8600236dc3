"""take_work locks the lease in the same statement whose snapshot it reads the
events from: a run that another holder finished in between must not be claimed
again. Found by the chaos suite; forced here.

The interleaving: B's take_work starts (its snapshot has the victim's event
pending) and is kept busy scanning many claimable events of users whose leases
are held; meanwhile A takes the victim's lease, claims and finishes with release;
then B reaches the victim, whose lease is free again, takes it over (gen 2) and
runs its claim from the old snapshot.
"""

import psycopg

from agent_inbox import Result
from agent_inbox.runs import Run

from tests.races import Racers
from tests.runtime.support import wait_until

# Claimable events that sort before the victim's, of users whose leases are held:
# B's scan has to look at each of them and skip it.
FILLER = """
INSERT INTO events (user_id, source, source_id, payload, available_at)
SELECT 'filler-' || (g % 50), 'f', g::text, '{}', 0 FROM generate_series(1, 300000) g
"""


def test_take_work_never_claims_events_finished_after_its_snapshot(database_url, make_inbox):
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(FILLER)
        conn.execute("UPDATE leases SET holder = 'busy', gen = 1, until = 4000000000")
        conn.execute("ANALYZE events")
    a = make_inbox(application_name="holder-a", lease_ttl=30)
    b = make_inbox(application_name="holder-b", lease_ttl=30)
    a.ingest("victim", "chat", "e1", {"text": "hello"})

    racer = Racers(lambda: b.take_work("B")).start()
    wait_until(lambda: _active(database_url, "holder-b"), "B's take_work to be running")
    gen = a.acquire("victim", "A")
    events = a.claim_batch("victim", "A", gen)
    assert a.finish_run(Run("victim", "A", gen, 0, events), Result(messages=["A handled e1"]))
    [run] = racer.join()

    assert (gen, run.user, run.gen) == (1, "victim", 2), "the interleaving did not happen"
    assert run.events == []                          # nothing claimed from the stale snapshot
    [event] = a.events("victim")
    assert (event.status, event.attempts, event.claim_gen) == ("done", 1, 1)


def _active(url, application_name):
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
                            "AND state = 'active'", (application_name,)).fetchone()[0]
