"""The per-bucket take and finish as Citus distributed functions, run on the
worker node that holds the bucket.

On a Citus coordinator every statement is planned twice (by the coordinator,
to route it, and by the worker node that runs it) and is a round trip between
them; a run's take and finish were ten such statements (store/bucketed.py's
sequences). Here each is one call: `agent_inbox_take(bucket, ...)` and
`agent_inbox_finish(bucket, ...)` are PL/pgSQL functions distributed by their
first argument, co-located with `leases` and forced to delegate
(`create_distributed_function(..., force_delegation => true)`): the
coordinator sends the call to the node holding `bucket`, the function's
statements run there against its local shards (every one of them filters on
that bucket, so each is a local router query), and PL/pgSQL caches their plans.

The functions' bodies are bucketed.py's statements themselves (and, routed
for one bucket, the shared ones of store/inbox.py, steps.py and memory.py),
with their parameters bound to the function's arguments (`%(x)s` becomes
`p_x`), so there is one spelling of each step; the order of the steps, and so
every invariant bucketed.py states for it, is the same. They are
(re)installed by `migrate --citus` (`install`), after the tables are laid out.

What stays with the caller, on the coordinator, in the finish's transaction:
the run's messages (bucketed.QUEUE: their ids, which order a user's messages
and name their batches, come from the coordinator's sequence, as every
outbox row's do; a row inserted on a worker node would take that node's
range, and a user whose shard moved to a node of a lower range would see its
new messages sort before its held ones), the NOTIFY to dispatchers (one sent
on a worker node reaches no listener), and the timers and approvals the run
asked for (store/timers.py).
"""

import contextlib
import re

import psycopg

from agent_inbox import citus
from agent_inbox.records import ClaimPolicy, Event
from agent_inbox.store import bucketed, lease, memory, notify, steps
from agent_inbox.store.clock import DB_CLOCK, NOW
from agent_inbox.store.inbox import Finish

_PARAM = re.compile(r"%\((\w+)\)s")


def _bound(statement: str, **arguments: str) -> str:
    """`statement`, routed to one bucket if it does not name one itself, with
    each `%(x)s` bound to `arguments[x]` (default: the function's argument
    `p_x`)."""
    if "%(bucket)s" not in statement:
        statement = citus.route(statement)
    return _PARAM.sub(lambda m: arguments.get(m[1], f"p_{m[1]}"), statement).strip()


_WAKE_NOW = _bound(bucketed.WAKE, at=_bound(NOW))

FINISH_SIGNATURE = ("agent_inbox_finish(int, text, text, bigint, bigint[], text, boolean, "
                    "boolean, jsonb, boolean, boolean, bigint)")

FINISH = f"""
CREATE OR REPLACE FUNCTION agent_inbox_finish(
    p_bucket int, p_user text, p_holder text, p_gen bigint, p_ids bigint[], p_error text,
    p_forget boolean, p_set_memory boolean, p_memory jsonb, p_queued boolean,
    p_release boolean, p_now bigint)
RETURNS boolean LANGUAGE plpgsql AS $fn$
#variable_conflict use_column
DECLARE
    v_ok boolean;
    v_left boolean;
BEGIN
    {_bound(lease.LOCK).replace("SELECT", "PERFORM", 1)};
    IF p_release THEN
        {_bound(bucketed.FENCE_RELEASE)} INTO v_ok;
    ELSE
        {_bound(bucketed.FENCE)} INTO v_ok;
    END IF;
    IF NOT v_ok THEN
        RETURN false;
    END IF;
    IF p_error IS NULL AND p_forget THEN
        {_bound(steps.FORGET)};
    END IF;
    IF p_error IS NULL AND p_set_memory THEN
        IF p_memory IS NULL THEN
            {_bound(memory.DELETE.split(" RETURNING")[0])};
        ELSE
            {_bound(memory.UPSERT, doc="p_memory", by="p_holder")};
        END IF;
    END IF;
    IF p_error IS NULL AND p_queued THEN  -- the caller queues the messages
        {_bound(bucketed.PACED)};
    END IF;
    IF p_release THEN
        {_bound(bucketed.WORK_LEFT)} INTO v_left;
        IF p_error IS NOT NULL OR v_left THEN
            {_WAKE_NOW};
        END IF;
    END IF;
    RETURN true;
END
$fn$
"""

# What agent_inbox_take returns: one row per claimed event of each run taken,
# or one row with a NULL event for a run that claimed none; runs in the order
# taken (longest waiting first).
TAKE_COLUMNS = ("taken_user text, taken_gen bigint, taken_at bigint, died bigint, "
                "unfinished bigint, doc jsonb, id bigint, \"user\" text, source text, "
                "source_id text, payload jsonb, status text, attempts int, error text, "
                "claim_gen bigint, created_at bigint, available_at bigint, claimed_at bigint, "
                "kind text, traceparent text")

# CLAIM_TALLY for the i-th user taken, its rows led by the run's user,
# generation and claim time (a data-modifying WITH cannot be a subquery).
_TALLY = "SELECT tally.died,"
assert bucketed.CLAIM_TALLY.count(_TALLY) == 1
_CLAIM_TAKEN = _bound(bucketed.CLAIM_TALLY, user="v_order[i]", gen="v_gens[v_n]").replace(
    _TALLY, "SELECT v_order[i], v_gens[v_n], v_claimed[v_n], tally.died,")

TAKE_SIGNATURE = "agent_inbox_take(int, text, int, int, bigint, int, int, int, int)"

TAKE = f"""
CREATE OR REPLACE FUNCTION agent_inbox_take(
    p_bucket int, p_holder text, p_ttl int, p_users int, p_now bigint,
    p_max_attempts int, p_backoff_base int, p_backoff_cap int, p_max_batch int)
RETURNS TABLE ({TAKE_COLUMNS}) LANGUAGE plpgsql AS $fn$
#variable_conflict use_column
DECLARE
    r record;
    v_picked int := 0;
    v_order text[] := '{{}}';
    v_read_users text[] := '{{}}';
    v_read_ids bigint[] := '{{}}';
    v_stale_users text[] := '{{}}';
    v_stale_ats bigint[] := '{{}}';
    v_taken_users text[] := '{{}}';
    v_gens bigint[] := '{{}}';
    v_claimed bigint[] := '{{}}';
    v_at bigint;
    v_id bigint;
    v_n int;
BEGIN
    FOR r IN {_bound(bucketed.PICK)} LOOP
        v_picked := v_picked + 1;
        IF NOT r.user_id = ANY (v_order) THEN
            v_order := v_order || r.user_id;
        END IF;
        v_read_users := v_read_users || r.user_id;
        v_read_ids := v_read_ids || r.id;
        v_at := r.at;
        v_id := r.id;
    END LOOP;
    IF v_picked < p_users THEN  -- every due wake was read
        v_at := greatest({_bound(NOW)}, {DB_CLOCK});
        v_id := 9223372036854775807;
    END IF;
    FOR r IN {_bound(bucketed.STALE, at="v_at", id="v_id")} LOOP
        v_read_users := v_read_users || r.user_id;
        v_read_ids := v_read_ids || r.id;
        IF r.next_at IS NOT NULL THEN
            v_stale_users := v_stale_users || r.user_id;
            v_stale_ats := v_stale_ats || r.next_at;
        END IF;
    END LOOP;
    FOR r IN {_bound(bucketed.TOOK, users="v_order", read_users="v_read_users",
                     read_ids="v_read_ids")} LOOP
        v_taken_users := v_taken_users || r.user_id;
        v_gens := v_gens || r.gen;
        v_claimed := v_claimed || r.now;
        {_bound(bucketed.WAKE, user="r.user_id", at="r.until + 1")};
    END LOOP;
    FOR r IN SELECT DISTINCT s.u, s.a FROM unnest(v_stale_users, v_stale_ats) AS s(u, a)
              ORDER BY s.u, s.a LOOP
        {_bound(bucketed.WAKE, user="r.u", at="r.a")};
    END LOOP;
    FOR i IN 1 .. cardinality(v_order) LOOP
        v_n := array_position(v_taken_users, v_order[i]);
        RETURN QUERY {_CLAIM_TAKEN};
    END LOOP;
END
$fn$
"""

FUNCTIONS = ((FINISH, FINISH_SIGNATURE), (TAKE, TAKE_SIGNATURE))


def install(conn) -> bool:
    """Create (or replace) the functions whose body differs from this code's on
    a laid-out coordinator database, and distribute them by their bucket,
    co-located with leases, delegated even inside a transaction block; whether
    any was (re)installed. In autocommit: Citus distributes a function in a
    transaction of its own."""
    changed = False
    for definition, signature in FUNCTIONS:
        body = definition.split("$fn$")[1]
        found = conn.execute("SELECT prosrc FROM pg_proc WHERE oid = to_regprocedure(%s)",
                             (signature,)).fetchone()
        if found is not None and found[0] == body:
            continue
        conn.execute(definition)
        conn.execute("SELECT create_distributed_function(%s, 'p_bucket', "
                     "colocate_with => 'leases', force_delegation => true)", (signature,))
        changed = True
    return changed


def installed(conn) -> bool:
    """Whether the functions this code calls are there (a database laid out by
    an older `migrate --citus` lacks them)."""
    return all(conn.execute("SELECT to_regprocedure(%s) IS NOT NULL", (signature,)).fetchone()[0]
               for _, signature in FUNCTIONS)


TAKE_CALL = "SELECT * FROM agent_inbox_take(%s, %s, %s, %s, %s, %s, %s, %s, %s)"


def take(conn, bucket: int, holder: str, ttl: int, policy: ClaimPolicy, now: int | None,
         users: int) -> list[tuple]:
    """TAKE_WORK in one bucket, in one call on its node: read_taken's rows (user,
    gen, claimed_at, died, unfinished, memory, events), longest waiting first."""
    p = policy.params()
    rows = conn.execute(TAKE_CALL, (bucket, holder, ttl, users, now, p["max_attempts"],
                                    p["backoff_base"], p["backoff_cap"],
                                    p["max_batch"])).fetchall()
    runs: dict[str, tuple] = {}
    for user, gen, claimed_at, died, unfinished, doc, *event in rows:
        if user not in runs:
            runs[user] = (user, gen, claimed_at, died, unfinished, doc, [])
        if event[0] is not None:
            runs[user][6].append(Event(*event))
    return list(runs.values())


FINISH_CALL = ("SELECT agent_inbox_finish(%s, %s, %s, %s, %s::bigint[], %s, %s, %s, %s::jsonb,"
               " %s, %s, %s)")


def finish(conn, f: Finish, now: int | None, *, release: bool) -> bool:
    """A run's fenced finish: one call on the run's node, and, if it queues
    messages, them and the NOTIFY from the coordinator in the same
    transaction (the caller's, or one of its own). False (nothing written) if
    the fence refuses."""
    queued = f.error is None and bool(f.messages)
    in_caller = conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE
    with contextlib.nullcontext() if in_caller or not queued else conn.transaction():
        [ok] = conn.execute(FINISH_CALL, (
            citus.bucket(f.user), f.user, f.holder, f.gen, list(f.ids), f.error,
            f.forget_steps, f.memory is not None,
            f.memory[0] if f.memory is not None else None, queued, release, now)).fetchone()
        if ok and queued:
            params = {"bucket": citus.bucket(f.user), "user": f.user, "now": now,
                      "traceparent": f.traceparent}
            for body, urgent in f.messages:
                conn.execute(bucketed.QUEUE, {**params, "body": body, "urgent": urgent})
            conn.execute(f"SELECT pg_notify('{notify.OUTBOX}', '')")
    return ok
