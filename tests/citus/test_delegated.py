"""The take and the finish on Citus are one call each, delegated to the
worker node that holds the bucket (backend/citus/functions.py): the coordinator
sends that node the call and nothing else, no BEGIN or COMMIT of its own and
no statement of the function's body, for a take of several users and for a
finish with messages, memory and a release. What the coordinator sends is
read from Citus's own log of remote commands (`citus.log_remote_commands`);
what the node plans on each call, from Citus's planner messages (DEBUG2)."""

import logging
from dataclasses import replace

import psycopg
from psycopg import conninfo
import pytest

from agent_inbox import Inbox, Result, TimerRequest, errors
from agent_inbox.backend.citus import layout as citus
from agent_inbox.backend.citus import nodes as citus_nodes
from agent_inbox.schema import revision
from agent_inbox.backend.citus import functions as delegated
from agent_inbox.store import keys


def remote_commands(url: str, call) -> list[str]:
    """The commands the coordinator sends to worker nodes while `call(conn)`
    runs on a connection of its own (with remote commands logged)."""
    sent: list[str] = []
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET citus.log_remote_commands = on")
        conn.execute("SET client_min_messages = log")
        conn.add_notice_handler(lambda notice: sent.append(notice.message_primary or ""))
        call(conn)
    return [text.split("issuing ", 1)[1] for text in sent if "issuing " in text]


def users_in_bucket(bucket: int, count: int) -> list[str]:
    """The first `count` of u0, u1, ... whose bucket is `bucket`."""
    return [u for u in (f"u{n}" for n in range(3000)) if keys.bucket(u) == bucket][:count]


def node_url(database_url: str, bucket: int) -> str:
    """The test database on the worker node that holds `bucket`."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        nodes = citus_nodes.NodeMap()
        nodes.groups(conn)
        host, port = nodes.address(bucket)
    return conninfo.make_conninfo(database_url, host=host, port=port)


def test_a_take_and_a_finish_are_one_call_each_on_the_buckets_node(database_url, inbox):
    users = users_in_bucket(keys.bucket("u0"), 3)
    inbox.ingest_many([(user, "chat", "1", {}) for user in users])
    taken = []
    take = remote_commands(database_url, lambda conn: taken.extend(delegated.take(
        conn, keys.bucket("u0"), "w", 60, inbox.settings.claim, None, 10)))
    assert sorted(user for user, *_ in taken) == sorted(users)
    assert len(take) == 1 and "agent_inbox_take(" in take[0], take
    first, second, _ = sorted(inbox.runs._as_runs("w", taken), key=lambda run: run.user)
    finished = []
    quiet = inbox.runs.outcome(first, Result(memory={"seen": 1}))
    finish = remote_commands(database_url, lambda conn: finished.append(delegated.finish(
        conn, quiet.finish, None, release=True)))
    assert len(finish) == 1 and "agent_inbox_finish(" in finish[0], finish
    # Messages are inserted from the coordinator (their ids order them), in
    # the call's transaction, after it.
    chatty = inbox.runs.outcome(second, Result(messages=["hello", "again"]))
    finish = remote_commands(database_url, lambda conn: finished.append(delegated.finish(
        conn, chatty.finish, None, release=True)))
    assert finished == [True, True]
    work = [c for c in finish if not c.startswith(("BEGIN", "SELECT assign_distributed",
                                                   "COMMIT", "PREPARE", "RELEASE"))]
    assert "agent_inbox_finish(" in work[0] and len(work) == 3, work
    assert all(c.startswith("INSERT INTO") and "outbox" in c for c in work[1:]), work
    assert not any(c.startswith("PREPARE") for c in finish), finish  # one node: no 2PC
    assert inbox.memory(first.user) == {"seen": 1}
    assert [m.body for m in inbox.outbox(second.user)] == ["hello", "again"]


def test_migrate_citus_installs_the_functions_and_a_worker_refuses_a_layout_without_them(
        fresh_citus_database, caplog):
    """On a database of its own: it drops a function the session's shares."""
    database_url = fresh_citus_database
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert delegated.installed(conn)
        assert not delegated.install(conn)  # the same bodies: left as they are
        conn.execute(f"DROP FUNCTION {delegated.FINISH_SIGNATURE}")
    with pytest.raises(errors.SchemaNotAtHead, match="migrate --citus"):
        revision.require_head(database_url)
    assert citus.distribute(database_url)  # installed again
    with caplog.at_level(logging.WARNING, logger="agent_inbox.revision"):
        revision.require_head(database_url)
    assert not caplog.records
    # a take function as an older release installed it (no plan_cache_mode):
    # the service refuses to start and says to replace it; migrate --citus does
    # (tests/citus/test_stopping.py: one that does not read the pause)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"ALTER FUNCTION {delegated.TAKE_SIGNATURE} RESET plan_cache_mode")
        assert delegated.installed(conn) and not delegated.current(conn)
    with pytest.raises(errors.RunPathDamaged, match="migrate --citus"):
        revision.require_head(database_url)
    assert citus.distribute(database_url)
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert delegated.current(conn)
    with Inbox.connect(database_url) as inbox:
        inbox.ingest("u", "chat", "1", {})
        [run] = inbox.runs.take_runs("w", users=1)
        assert inbox.finish_run(run, Result())


def planned_statements(conn, call) -> int:
    """How many statements Citus planned with its full router planner while
    `call()` ran on `conn`: the DEBUG2 message its pruning gives each ("query
    has a single distribution column value"), which a fast-path query (its
    shard chosen at execution) and a single-row INSERT do not give."""
    messages: list[str] = []

    def heard(notice):
        messages.append(notice.message_primary or "")

    conn.add_notice_handler(heard)
    conn.execute("SET client_min_messages = debug2")
    try:
        call()
    finally:
        conn.execute("RESET client_min_messages")
        conn.remove_notice_handler(heard)
    return sum(message.startswith("query has a single distribution column value")
               for message in messages)


def test_on_the_buckets_node_a_warm_take_plans_nothing_per_user_and_a_finish_nothing(
        database_url, inbox):
    """Inside the functions only PICK goes through Citus's full router planner
    (STALE too when PICK read past a wake it could not take: not here); the
    claim, the lease taken, the fence and the rest are fast-path statements
    (backend/citus/functions.py's docstring). A statement with a CTE over two tables
    would be router-planned on every call, in the take's claim once per user
    taken."""
    bucket = keys.bucket("u0")
    users = users_in_bucket(bucket, 4)
    with psycopg.connect(node_url(database_url, bucket), autocommit=True) as conn:
        def take_and_finish(take_users: list[str], round_: int) -> tuple[int, int]:
            inbox.ingest_many([(user, "chat", f"{round_}-{n}", {}) for user in take_users
                               for n in range(2)])
            taken = []
            take = planned_statements(conn, lambda: taken.extend(delegated.take(
                conn, bucket, "w", 60, inbox.settings.claim, None, 10)))
            runs = inbox.runs._as_runs("w", taken)
            assert sorted(run.user for run in runs) == sorted(take_users)
            assert all(len(run.events) == 2 for run in runs)
            assert all([e.id for e in run.events] == sorted(e.id for e in run.events)
                       for run in runs)
            # the memory each user's last finish left, read once for the take
            assert [run.memory for run in runs] == [last.get(run.user) for run in runs]
            finished = []
            finish = planned_statements(conn, lambda: finished.extend(
                delegated.finish(conn, inbox.runs.outcome(run, Result(memory={"n": round_})).finish,
                                 None, release=True) for run in runs))
            assert finished == [True] * len(runs)
            last.update((run.user, {"n": round_}) for run in runs)
            return take, finish

        last: dict[str, dict] = {}

        for round_ in range(8):  # PostgreSQL's plan cache keeps a generic plan after 5 uses
            take_and_finish(users, round_)
        one_take, one_finish = take_and_finish(users[:1], 8)
        four_takes, four_finishes = take_and_finish(users, 9)
    assert (one_take, four_takes) == (1, 1)        # PICK
    assert (one_finish, four_finishes) == (0, 0)
    assert all(inbox.memory(user) == {"n": 9} for user in users)


def test_a_take_that_reads_past_a_wake_it_cannot_take_moves_that_wake(database_url, inbox):
    """A due wake whose user another worker holds is looked at by the take that
    read past it (STALE): the wake moves to the lease's end and the user PICK
    could take behind it is taken. Without STALE the due wake would stay and
    every take of the bucket would read past it again."""
    bucket = keys.bucket("u0")
    held, free = users_in_bucket(bucket, 2)
    inbox.ingest(held, "chat", "1", {})
    with psycopg.connect(database_url, autocommit=True) as conn:
        [[user, gen, *_]] = delegated.take(conn, bucket, "other", 60, inbox.settings.claim, None, 1)
        assert user == held
        until = conn.execute("SELECT until FROM leases WHERE bucket = %s AND user_id = %s",
                             (bucket, held)).fetchone()[0]
        held_wakes = ("SELECT at FROM wakes WHERE bucket = %s AND user_id = %s", (bucket, held))
        inbox.ingest(held, "chat", "2", {})   # a wake now, while "other" holds the lease
        # a take that takes nobody still moves the wake it read past
        assert delegated.take(conn, bucket, "w", 60, inbox.settings.claim, None, 10) == []
        wakes = conn.execute(*held_wakes).fetchall()
        assert wakes and all(at == until + 1 for (at,) in wakes), (wakes, until)  # none due
        inbox.ingest(held, "chat", "3", {})   # a wake now again
        inbox.ingest(free, "chat", "1", {})   # a wake behind it
        taken = delegated.take(conn, bucket, "w", 60, inbox.settings.claim, None, 10)
        assert [user for user, *_ in taken] == [free]
        wakes = conn.execute(*held_wakes).fetchall()
    assert wakes and all(at == until + 1 for (at,) in wakes), (wakes, until)  # none due


def test_one_take_claims_several_users_each_run_with_its_own_counts(database_url, inbox):
    """The take claims all the users it took in one read, plan and write: each
    run still gets its own events, generation and counts (an event whose
    attempts are spent dies in its own user's run, an event a crashed run left
    running comes back as that user's unfinished one)."""
    bucket = keys.bucket("u0")
    crashed, poisoned, fresh = users_in_bucket(bucket, 3)
    inbox.ingest(crashed, "chat", "1", {})
    with psycopg.connect(database_url, autocommit=True) as conn:
        [[user, first_gen, claimed_at, *_]] = delegated.take(conn, bucket, "x", 60, inbox.settings.claim,
                                                             None, 1)
        assert user == crashed   # and "x" never finishes it
        inbox.ingest_many([(fresh, "chat", str(n), {}) for n in range(3)])  # taken first
        inbox.ingest(poisoned, "chat", "1", {})
        conn.execute("UPDATE events SET attempts = %s WHERE bucket = %s AND user_id = %s",
                     (inbox.settings.claim.max_attempts, bucket, poisoned))
        later = claimed_at + 61   # the crashed run's lease has expired
        taken = delegated.take(conn, bucket, "w", 60, inbox.settings.claim, later, 10)
    runs = {run.user: run for run in inbox.runs._as_runs("w", taken)}
    assert list(runs) == [fresh, poisoned, crashed]   # in the order of their wakes
    counts = {user: (run.died, run.unfinished, len(run.events)) for user, run in runs.items()}
    assert counts == {crashed: (0, 1, 1), poisoned: (1, 0, 0), fresh: (0, 0, 3)}, counts
    assert runs[crashed].gen == first_gen + 1
    assert all(event.user == user and event.claim_gen == runs[user].gen
               for user, run in runs.items() for event in run.events)
    assert [e.id for e in runs[fresh].events] == sorted(e.id for e in runs[fresh].events)


def test_a_finish_naming_an_event_its_run_does_not_hold_is_refused_on_every_path(
        database_url, inbox):
    """agent_inbox_finish closes the run's events in the statement that counts
    them: one naming an event the run does not hold besides its own is refused
    by an error that undoes the call (NOT_ALL_HELD), so nothing is written, on
    the node, through the coordinator with messages (a transaction of the
    finish's own) and in a caller's transaction (RefusedInTransaction); one
    naming none it holds is refused without an error."""
    bucket = keys.bucket("u0")
    user = "u0"
    inbox.ingest_many([(user, "chat", str(n), {}) for n in range(2)])
    with psycopg.connect(database_url, autocommit=True) as conn:
        [[_, gen, _, _, _, _, events]] = delegated.take(conn, bucket, "w", 60, inbox.settings.claim,
                                                         None, 1)
    inbox.ingest(user, "chat", "later", {})   # pending: not the run's
    other = next(e.id for e in inbox.events(user) if e.source_id == "later")
    own = [e.id for e in events]
    f = inbox.runs.outcome(inbox.runs._as_runs("w", [(user, gen, 0, 0, 0, None, events)])[0],
                      Result(messages=["hi"], memory={"n": 1})).finish
    mixed, foreign = replace(f, ids=[*own, other]), replace(f, ids=[other])
    with psycopg.connect(node_url(database_url, bucket), autocommit=True) as node:
        assert delegated.finish(node, replace(mixed, messages=[]), None, release=True) is False
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert delegated.finish(conn, mixed, None, release=True) is False
        assert delegated.finish(conn, foreign, None, release=True) is False
        with pytest.raises(delegated.RefusedInTransaction):
            with conn.transaction():
                delegated.finish(conn, mixed, None, release=True)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    # the run path's finish with timers: in a transaction with them (backend/path.py)
    run = inbox.runs._as_runs("w", [(user, gen, 0, 0, 0, None,
                                [*events, *(e for e in inbox.events(user) if e.id == other)])])[0]
    timed = inbox.runs.outcome(run, Result(timers=[TimerRequest("t", due=60)]))
    assert inbox.runs.finish_runs([timed]) == [False]
    assert {e.id: e.status for e in inbox.events(user)} == {
        **{i: "running" for i in own}, other: "pending"}
    assert inbox.outbox(user) == [] and inbox.memory(user) is None and inbox.timers(user) == []
    with psycopg.connect(database_url, autocommit=True) as conn:   # and the run still finishes
        assert delegated.finish(conn, f, None, release=True) is True
    assert [m.body for m in inbox.outbox(user)] == ["hi"] and inbox.memory(user) == {"n": 1}


def test_a_node_session_keeps_no_plan_per_call(database_url, inbox):
    """The functions' statements are planned for each call (plan_cache_mode
    force_custom_plan): under a generic plan Citus 13.2.2 builds the local
    shard plan of a fast-path statement on every execution and appends it to
    the statement's cached plan (its lookup reads the generic plan's task
    list, empty under deferred pruning), so a node's session grew by about
    0.7 MB a run, for as long as it lived. Here the session's cached plans
    stay the size they were after warming up."""
    bucket = keys.bucket("u0")
    users = users_in_bucket(bucket, 4)
    cached = ("SELECT coalesce(sum(total_bytes), 0) FROM pg_backend_memory_contexts"
              " WHERE name = 'CachedPlan'")
    with psycopg.connect(node_url(database_url, bucket), autocommit=True) as node:
        def rounds(first: int, count: int) -> None:
            for round_ in range(first, first + count):
                inbox.ingest_many([(user, "chat", f"{round_}", {}) for user in users])
                runs = inbox.runs._as_runs("w", delegated.take(node, bucket, "w", 60, inbox.settings.claim,
                                                          None, 10))
                assert len(runs) == len(users)
                assert all(delegated.finish(node, inbox.runs.outcome(run, Result()).finish, None,
                                            release=True) for run in runs)

        rounds(0, 10)
        warm = node.execute(cached).fetchone()[0]
        rounds(10, 60)   # 240 runs: about 170 MB with the plans kept
        after = node.execute(cached).fetchone()[0]
    assert after - warm < 2 * 1024 * 1024, (warm, after)
