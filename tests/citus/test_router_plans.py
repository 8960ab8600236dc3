"""Every statement of the run path, sent as the Citus code path sends it (those
the take and finish functions run on a node, backend/citus/functions.py; the
statements about one user, or one bucket's users, as written: each names its
bucket, store/keys.py), is planned by Citus as a router query: one task, on
one node, no distributed subplan pulled through the coordinator (a value the
coordinator computes, the clock, is allowed). A new statement on that path
that fans out, or that forgets its bucket, fails here."""

import psycopg
import pytest

from agent_inbox.backend.citus import statements as citus_statements
from agent_inbox.records import ClaimPolicy
from agent_inbox.store import (admin, approvals, inbox, lease, memory, outbox, policies, steps,
                               timers)
from agent_inbox.backend.citus import statements as bucketed
from agent_inbox.store.keys import user_key, users_key

POLICY = ClaimPolicy(max_attempts=3, backoff_base=5, backoff_cap=300, max_batch=100).params()
ALICE = user_key("alice", now=None)
RUN = {**ALICE, "holder": "A", "gen": 1, "ids": [1], "error": None}

STATEMENTS = {
    "ingest": (inbox.INSERT, user_key("alice", source="s", source_id="k",
                              payload="{}", kind=None,
                              traceparent=None)),
    "ingest: lease row": (citus_statements.EVENTS_INSERTED[0], user_key("alice")),
    "ingest: wake": (citus_statements.EVENTS_INSERTED[1], user_key("alice")),
    "lock": (lease.LOCK, user_key("alice")),
    "first acquire": (lease.CREATE_EXPIRED, user_key("alice")),
    "acquire": (lease.ACQUIRE, user_key("alice", holder="A", ttl=60, now=None)),
    "claim": (inbox.CLAIM, user_key("alice", holder="A", gen=1, now=None, **POLICY)),
    "renew": (lease.RENEW, users_key(["alice"], holder="A", gens=[1], ttl=60, now=None)),
    "lock several": (lease.LOCK_MANY, users_key(["alice"])),
    "take: pick": (bucketed.PICK, {**ALICE, "users": 4}),
    "take: stale": (bucketed.STALE, {**ALICE, "at": 0, "id": 0}),
    "take: wake": (bucketed.WAKE, {**ALICE, "at": 0}),
    "finish: message": (bucketed.QUEUE, {**ALICE, "body": "hi", "urgent": False,
                                         "traceparent": None}),
    "finish: delivery due": (bucketed.PACED, ALICE),
    "release, give back: the fence": (bucketed.EXPIRE, {**RUN}),
    "release: the events": (bucketed.MARK_RELEASED, {**RUN, "at": 0, "at_once": True, "spare": False}),
    "give back: the claims": (bucketed.UNDO_CLAIM, {**RUN, "unfinished": False}),
    "timers: due in a bucket": (bucketed.RIPE_IN_BUCKET, {**ALICE, "limit": 10}),
    "timers: advance": (timers.ADVANCE, user_key("alice", timer_id="t", due=0,
                                         done=False)),
    "timers: park": (timers.PARK, user_key("alice", timer_id="t", error="x",
                                   now=None)),
    "timers: upsert": (timers.UPSERT, user_key("alice", timer_id="t", base=None,
                                       delay=5, every=None, cron=None,
                                       timezone=None, missed="coalesce",
                                       catch_up_limit=100, payload="{}",
                                       event_source=None, event_source_id=None)),
    "approval: the request": (bucketed.REQUEST, {**ALICE, "timer_id": "expire:r"}),
    "delivery: due in a bucket": (bucketed.LOCK_DUE_IN_BUCKET, {**ALICE, "users": 10}),
    "delivery: claim": (outbox.CLAIM, users_key(["alice"], gap=60, send_timeout=60,
                                       now=None)),
    "delivery: lock in order": (outbox.LOCK_USERS, users_key(["alice"])),
    "delivery: sent": (outbox.MARK_SENT, users_key(["alice"], batches=[1], tokens=[1],
                                          gap=60, now=None)),
    "delivery: failed": (outbox.RECORD_FAILED, users_key(
        ["alice"], batches=[1], tokens=[1], errors=["x"], permanent=[False], jitters=[0.7],
        max_attempts=3, backoff_base=5, backoff_cap=300, now=None)),
    "delivery: one user": (outbox.LOCK_USER, user_key("alice")),
    "delivery: messages view": (outbox.LIST, user_key("alice")),
    "approval: the answer that stands": (approvals.STANDING, user_key("alice", request_id="r")),
    "timers: advance a cron": (timers.ADVANCE_CRON, user_key("alice", timer_id="t", due=0)),
    "events view": (inbox.LIST, user_key("alice", status=None)),
    "steps: the fence": (bucketed.STEP_FENCE, {**RUN}),
    "steps: a record": (bucketed.STEP_INSERT, {**RUN, "event_ids": [1], "position": 1,
                                               "name": "n", "occurrence": 1, "result": "1"}),
    "steps: read": (steps.RECORDED, users_key(["alice"], events=["1"])),
    "steps: forget": (steps.FORGET, {**RUN}),
    "steps view": (steps.LIST, user_key("alice", limit=10)),
    "memory: replace": (memory.UPSERT, user_key("alice", doc="{}", by="A", gen=1,
                                        now=None)),
    "memory: delete": (memory.DELETE, user_key("alice")),
    "memory: read": (memory.GET, user_key("alice")),
    "memory: an operator's lock": (memory.OPERATOR_LOCK, user_key("alice", now=None)),
    "memory: an operator's record": (admin.RECORD_MEMORY, user_key(
        "alice", actor="ops", action="memory_set", detail="{}", now=None)),
    "policy: a user's rules": (policies.LIST_USER, user_key("alice")),
    "policy: clear a user's rule": (policies.CLEAR_USER, user_key("alice", tool="t")),
    "permit: decisions view": (policies.DECISIONS, user_key("alice", limit=10)),
    "operator: a user's events": (admin.EVENTS, user_key("alice", status=None, limit=10)),
    "operator: a user's dead events": (admin.DEAD, user_key("alice", limit=10)),
    "operator: a user's repairs": (admin.ACTIONS, user_key("alice", limit=10)),
    "operator: a user's timers": (admin.TIMERS, user_key("alice", limit=10, now=None)),
    "operator: a user's parked batches": (outbox.FAILED, user_key("alice", limit=10)),
    "permit: the fence": (policies.HOLD, {**RUN}),
    "permit: decide": (policies.DECIDE, {**RUN, "tool": "t", "request_id": "permit:t:0"}),
    "permit: record": (policies.RECORD, {**RUN, "tool": "t", "digest": "0", "answer": "deny",
                                          "rule": "none"}),
    "policy: a user's rule": (policies.SET_USER, user_key("alice", tool="t",
                                                  answer="deny", ask_expires_in=60,
                                                  actor="ops", now=None)),
    "policy: the change's record": (policies.RECORD_CHANGE, user_key("alice", actor="ops",
                                                             action="policy_set",
                                                             detail="{}", now=None)),
}

# Statements Citus runs in steps (an INSERT ... SELECT from parameters),
# every step on the user's node, in one transaction: their results do not
# depend on one snapshot, so they are kept as they are.
ONE_NODE = {
    "ingest many": (inbox.INSERT_MANY, users_key(["alice"], sources=["s"],
                                        source_ids=["k"], payloads=["{}"],
                                        kinds=[None], traceparents=[None])),
}


def plan(conn, statement: str, params: dict) -> list[str]:
    return [row[0] for row in conn.execute("EXPLAIN (COSTS OFF) " + statement, params)]


@pytest.mark.parametrize("case", STATEMENTS.values(), ids=STATEMENTS.keys())
def test_router_plan(database_url, case):
    statement, params = case
    with psycopg.connect(database_url) as conn:
        lines = plan(conn, statement, params)
    text = "\n".join(lines)
    assert lines[0].startswith("Custom Scan (Citus Adaptive)"), text
    assert [line.strip() for line in lines if "Task Count" in line] == ["Task Count: 1"], text
    assert "INSERT/SELECT" not in text, text
    # a subplan is allowed only as a value the coordinator computes itself (the
    # clock: Citus evaluates clock_timestamp() there, as it refuses volatile
    # functions in a distributed UPDATE), never one sent to a node
    top = next(n for n, line in enumerate(lines) if line.strip().startswith("Task Count"))
    assert "Task" not in "\n".join(lines[1:top]), text


@pytest.mark.parametrize("case", ONE_NODE.values(), ids=ONE_NODE.keys())
def test_one_node_plan(database_url, case):
    statement, params = case
    with psycopg.connect(database_url) as conn:
        text = "\n".join(plan(conn, statement, params))
        [coordinator] = conn.execute("SELECT nodeport FROM pg_dist_node WHERE groupid = 0"
                                     ).fetchone()
    assert {line.strip() for line in text.splitlines() if "Task Count" in line} <= {"Task Count: 1"}
    workers = {line.strip() for line in text.splitlines() if line.strip().startswith("Node:")
               and f"port={coordinator} " not in line}   # the coordinator reads the steps' results
    assert len(workers) <= 1, text
