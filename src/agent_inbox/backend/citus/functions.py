"""The per-bucket take and finish as Citus distributed functions, run on the
worker node that holds the bucket.

On a Citus coordinator every statement is planned twice (by the coordinator,
to route it, and by the worker node that runs it) and is a round trip between
them. Here each of the take and the finish is one call: `agent_inbox_take(bucket,
...)` and `agent_inbox_finish(bucket, ...)` are PL/pgSQL functions distributed
by their first argument, co-located with `leases` and forced to delegate
(`create_distributed_function(..., force_delegation => true)`): the
coordinator, or a worker node called directly (backend/path.py's direct mode),
sends the call to the node holding `bucket`, and the function's statements
run there against its local shards.

**Why most statements are single-table ones.** Citus plans a *fast-path*
query (one distributed table, filtered by `bucket = <a parameter>`, no CTE,
no subquery) in a fraction of the time of any other: a statement with CTEs
over several tables (the plain path's shape) is planned three times per
execution (PostgreSQL's planner inside Citus's, Citus's router planner, then
the deparsed shard query): the take's claim as one such statement took 1.4
ms of planning and 3.4 ms of execution per run in W7, where a single-table
statement took 0.1 ms. A fast-path statement still costs Citus's executor a
deparse, parse and plan of its shard query each time (about 0.1-0.15 ms of
CPU), so fewer statements are cheaper ones.

**Why every call plans anew** (SETTINGS: `plan_cache_mode =
force_custom_plan` on both functions). Under a generic plan, which
PostgreSQL picks for a function's statement after five calls, Citus 13.2.2
builds the local shard plan of a fast-path statement on every execution and
appends it to the statement's cached plan: its lookup (`GetCachedLocalPlan`)
reads the generic plan's own task list, which is empty when the shard is
chosen at execution (deferred pruning), so it never finds what it kept. A
worker node's session then grew by about 0.7 MB a run, for as long as the
session lived (1.2 GB after 1,600 runs; `tests/citus/test_delegated.py`
watches `pg_backend_memory_contexts`). A custom plan is planned and freed
per call: the same CPU (the cached plan was never used), no growth.

So the clock is read once into `v_now` (the finish reads it after locking
the lease, never before a wait for it), the claim's jitter is drawn in a
statement on no table, and the steps bucketed.py describes are written as
single-table statements, ordered so that each invariant it states still
holds under READ COMMITTED: the user's lease row is locked first (the
finish) or by PICK (the take), so no other transaction changes that user's
lease or open events until this one ends. Only PICK, and STALE when PICK
read past a wake it did not take (a count of the wakes PICK read says so),
read wakes beside leases and go through Citus's full router planner. The
take reads, plans and claims the open events of all the users it took in
one statement each (not one per user), reads their memory in one, and
returns the claimed events from the claim's own UPDATE (RETURNING), not
from a read after it; the finish closes the run's events and counts them in
one statement (NOT_ALL_HELD).

The rules are not spelled twice: the fence is lease.fenced and
lease.claimed_by; the claim is store/inbox.py's open_to_claim, CLAIM_RANKS,
CLAIM_PLAN and claim_set; the other single-user statements are the shared
ones of bucketed.py, steps.py and memory.py, routed to the bucket and with
their parameters bound to the function's arguments (`%(x)s` becomes `p_x`).
The functions are (re)installed by `migrate --citus` (`install`), after the
tables are laid out.

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
from typing import Any

import psycopg

from agent_inbox import errors
from agent_inbox.backend.citus import statements as bucketed
from agent_inbox.records import ClaimPolicy, Event
from agent_inbox import notify
from agent_inbox.store import lease, memory, one, steps
from agent_inbox.store.clock import DB_CLOCK, NOW
from agent_inbox.store.inbox import (CLAIM_PLAN, CLAIM_RANKS, EVENT_COLUMNS, OPEN, Finish, claim_set,
                                    open_to_claim)
from agent_inbox.store.keys import bucket as bucket_of, user_key

_PARAM = re.compile(r"%\((\w+)\)s")


def _bound(statement: str, **arguments: str) -> str:
    """`statement` (a statement about a user names its bucket: store/keys.py)
    with each `%(x)s` bound to `arguments[x]` (default: the function's
    argument `p_x`); given `now`, the clock NOW (the caller's time, else the
    server's) is that value itself, so that no call of `clock_timestamp()` is
    left in the statement (a volatile function: Citus would not cache its plan)."""
    if "now" in arguments:
        statement = statement.replace(NOW, arguments["now"])
    return _PARAM.sub(lambda m: arguments.get(m[1], f"p_{m[1]}"), statement).strip()


# The generation the take gave the event `e`'s user (see TAKE).
_GEN_OF = "(v_gen_of ->> e.user_id)::bigint"


# What the claim's plan says of the event `e` in its UPDATE (see TAKE): its new
# status, the jitter of its retry's backoff, and the status and attempts it was
# read with. Each names the plan's smallest value that says it (an array of
# ids, a jsonb object by id: never an array subscript, on which Citus 13.2's
# deparser fails), since Citus writes every value the statement names into the
# shard query's text once per mention and parses it back, on every call.
_NEW_STATUS = "CASE WHEN e.id = ANY(v_running) THEN 'running' ELSE 'dead' END"
_JITTER = "(v_jitter_of ->> e.id::text)::float8"
_OLD_STATUS = "(v_old_of -> e.id::text ->> 0)"
_OLD_ATTEMPTS = "(v_old_of -> e.id::text ->> 1)::int"


_WAKE_NOW = _bound(bucketed.WAKE, at="v_now")

NOT_ALL_HELD = "AI001"
"""The SQLSTATE of agent_inbox_finish refusing a run that holds some of the
events it names but not all: it closes them in the statement that finds out
how many it held (no read of them before it), so a refusal after closing some
is an error, which undoes the call's transaction; `finish` answers False. A
run that holds none of them (a finish sent again after it committed) is
refused with nothing written and no error."""

# The take's output columns of one claimed event set from the UPDATE's row
# `r` (EVENT_COLUMNS' names), or all NULL (a run's closing row).
_EVENT_NAMES = [column.split()[-1].strip('"') for column in EVENT_COLUMNS.split(",")]
_EVENT_OUT = ";\n                ".join(
    f'"{name}" := r."{name}"' if name == "user" else f"{name} := r.{name}"
    for name in _EVENT_NAMES)
_NO_EVENT_OUT = ";\n        ".join(
    f'"{name}" := NULL' if name == "user" else f"{name} := NULL" for name in _EVENT_NAMES)

SETTINGS = ["plan_cache_mode=force_custom_plan"]
"""The functions' own settings (pg_proc.proconfig), set around each call:
see "Why every call plans anew" above."""

FINISH_SIGNATURE = ("agent_inbox_finish(int, text, text, bigint, bigint[], text, boolean, "
                    "boolean, jsonb, boolean, boolean, bigint)")

# bucketed.py's finish, one single-table statement at a time (see the module's
# docstring). With the lease row locked first, nothing else changes the run's
# lease or its events until this transaction ends, so the fence checked by the
# first statements still holds for the writes after them; the look for work
# left comes after the release deleted the user's wakes, in a later snapshot,
# as bucketed.py requires.
FINISH = f"""
CREATE OR REPLACE FUNCTION agent_inbox_finish(
    p_bucket int, p_user text, p_holder text, p_gen bigint, p_ids bigint[], p_error text,
    p_forget boolean, p_set_memory boolean, p_memory jsonb, p_queued boolean,
    p_release boolean, p_now bigint)
RETURNS boolean LANGUAGE plpgsql
SET plan_cache_mode = force_custom_plan AS $fn$
#variable_conflict use_column
DECLARE
    v_lease record;
    v_now bigint;
    v_ok boolean;
    v_closed bigint;
BEGIN
    {_bound(lease.LOCK).replace(" FROM", " INTO v_lease FROM", 1)};
    v_now := {_bound(NOW)};  -- read with the lease locked, never before a wait for it
    v_ok := coalesce({lease.fenced("p_holder", "p_gen", "v_now", lease="v_lease")}, false);
    IF NOT v_ok THEN
        RETURN false;
    END IF;
    UPDATE events e
       SET status = CASE WHEN p_error IS NULL THEN 'done' ELSE 'pending' END, error = p_error
     WHERE e.bucket = p_bucket AND e.user_id = p_user AND e.id = ANY(p_ids)
       AND {lease.claimed_by("p_gen")};
    GET DIAGNOSTICS v_closed = ROW_COUNT;
    IF v_closed <> cardinality(p_ids) THEN  -- not every event is the run's: refused
        IF v_closed > 0 THEN  -- undone with this call's statement (see NOT_ALL_HELD)
            RAISE EXCEPTION USING ERRCODE = '{NOT_ALL_HELD}',
                MESSAGE = 'agent_inbox: a finish named events its run does not hold';
        END IF;
        RETURN false;
    END IF;
    IF p_release THEN
        UPDATE leases l SET until = v_now - 1 WHERE l.bucket = p_bucket AND l.user_id = p_user;
        DELETE FROM wakes w WHERE w.bucket = p_bucket AND w.user_id = p_user;
    END IF;
    IF p_error IS NULL AND p_forget THEN
        {_bound(steps.FORGET)};
    END IF;
    IF p_error IS NULL AND p_set_memory THEN
        IF p_memory IS NULL THEN
            {_bound(memory.DELETE.split(" RETURNING")[0])};
        ELSE
            {_bound(memory.UPSERT, doc="p_memory", by="p_holder", now="v_now")};
        END IF;
    END IF;
    IF p_error IS NULL AND p_queued THEN  -- the caller queues the messages
        {_bound(bucketed.PACED, now="v_now")};
    END IF;
    IF p_release THEN  -- a wake now if the run failed or other events are open
        PERFORM 1 FROM events e
          WHERE e.bucket = p_bucket AND e.user_id = p_user AND {OPEN} LIMIT 1;
        IF p_error IS NOT NULL OR FOUND THEN
            {_WAKE_NOW};
        END IF;
    END IF;
    RETURN true;
END
$fn$
"""

# What agent_inbox_take returns: a row per event it claimed, of every run
# taken, in no set order (the run's columns but `died`, `unfinished` and `doc`
# NULL), then a closing row per run in the order taken (longest waiting first),
# with the event's columns NULL and the run's counts and memory.
TAKE_COLUMNS = ("taken_user text, taken_gen bigint, taken_at bigint, died bigint, "
                "unfinished bigint, doc jsonb, id bigint, \"user\" text, source text, "
                "source_id text, payload jsonb, status text, attempts int, error text, "
                "claim_gen bigint, created_at bigint, available_at bigint, claimed_at bigint, "
                "kind text, traceparent text")

TAKE_SIGNATURE = "agent_inbox_take(int, text, int, int, bigint, int, int, int, int)"

# bucketed.py's take. PICK and STALE are as bucketed.py spells them (STALE
# only if a count of the wakes up to where PICK stopped shows more than PICK
# took: a skipped wake; a wake committed since only makes it look); the
# leases taken, the wakes read deleted and the claims are single-table
# statements (see the module's docstring). The claim is store/inbox.py's, for
# all the users taken at once, in three steps: their open rows read
# (open_to_claim, each user's in the generation this take gave it), their new
# states planned over those values (CLAIM_RANKS, CLAIM_PLAN, per user as on
# the plain path: a statement on no table), and the changed rows written by
# id (claim_set), each re-checked on its newest version against the (status,
# attempts) read, as the plain claim re-checks; the rows it claimed are the
# UPDATE's own (RETURNING). This transaction took the users' leases (locked
# since PICK) just before, so the claim is behind their fences.
TAKE = f"""
CREATE OR REPLACE FUNCTION agent_inbox_take(
    p_bucket int, p_holder text, p_ttl int, p_users int, p_now bigint,
    p_max_attempts int, p_backoff_base int, p_backoff_cap int, p_max_batch int)
RETURNS TABLE ({TAKE_COLUMNS}) LANGUAGE plpgsql
SET plan_cache_mode = force_custom_plan AS $fn$
#variable_conflict use_column
DECLARE
    r record;
    v_now bigint := {_bound(NOW)};
    v_picked int := 0;
    v_passed bigint;
    v_order text[] := '{{}}';
    v_read_users text[] := '{{}}';
    v_read_ids bigint[] := '{{}}';
    v_stale_users text[] := '{{}}';
    v_stale_ats bigint[] := '{{}}';
    v_taken_users text[] := '{{}}';
    v_gens bigint[] := '{{}}';
    v_at bigint;
    v_id bigint;
    v_gen_of jsonb := '{{}}';
    v_users text[];
    v_ids bigint[];
    v_statuses text[];
    v_attempts int[];
    v_availables bigint[];
    v_p_ids bigint[];
    v_running bigint[];
    v_jitter_of jsonb;
    v_old_of jsonb;
    v_died bigint[];
    v_unfinished bigint[];
    v_pos int;
    v_doc_users text[];
    v_docs jsonb[];
BEGIN
    FOR r IN {_bound(bucketed.PICK, now="v_now")} LOOP
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
        v_at := greatest(v_now, {DB_CLOCK});
        v_id := 9223372036854775807;
    END IF;
    -- STALE only if PICK read past a wake it did not take (a fast-path count:
    -- PICK read these wakes just before; one committed since only makes STALE look)
    SELECT count(*) INTO v_passed FROM wakes w
     WHERE w.bucket = p_bucket AND (w.at, w.id) <= (v_at, v_id);
    IF v_passed > v_picked THEN
        FOR r IN {_bound(bucketed.STALE, at="v_at", id="v_id", now="v_now")} LOOP
            v_read_users := v_read_users || r.user_id;
            v_read_ids := v_read_ids || r.id;
            IF r.next_at IS NOT NULL THEN
                v_stale_users := v_stale_users || r.user_id;
                v_stale_ats := v_stale_ats || r.next_at;
            END IF;
        END LOOP;
    END IF;
    IF cardinality(v_order) > 0 THEN  -- (each statement skipped has nothing to do)
        FOR r IN UPDATE leases l SET holder = p_holder, gen = l.gen + 1, until = v_now + p_ttl
                  WHERE l.bucket = p_bucket AND l.user_id = ANY(v_order)
              RETURNING l.user_id, l.gen, l.until LOOP
            v_taken_users := v_taken_users || r.user_id;
            v_gens := v_gens || r.gen;
            v_gen_of := v_gen_of || jsonb_build_object(r.user_id, r.gen);
            {_bound(bucketed.WAKE, user="r.user_id", at="r.until + 1")};
        END LOOP;
    END IF;
    IF cardinality(v_read_ids) > 0 THEN
        DELETE FROM wakes w
         WHERE w.bucket = p_bucket AND w.user_id = ANY(v_read_users) AND w.id = ANY(v_read_ids);
    END IF;
    FOR r IN SELECT DISTINCT s.u, s.a FROM unnest(v_stale_users, v_stale_ats) AS s(u, a)
              ORDER BY s.u, s.a LOOP
        {_bound(bucketed.WAKE, user="r.u", at="r.a")};
    END LOOP;
    IF cardinality(v_order) = 0 THEN
        RETURN;
    END IF;
    SELECT coalesce(array_agg(m.user_id), '{{}}'), coalesce(array_agg(m.doc), '{{}}')
      INTO v_doc_users, v_docs
      FROM memory m WHERE m.bucket = p_bucket AND m.user_id = ANY(v_order);
    -- the taken users' claims, all in one read, one plan and one write
    SELECT coalesce(array_agg(e.user_id), '{{}}'), array_agg(e.id), array_agg(e.status),
           array_agg(e.attempts), array_agg(e.available_at)
      INTO v_users, v_ids, v_statuses, v_attempts, v_availables
      FROM events e
     WHERE e.bucket = p_bucket AND e.user_id = ANY(v_taken_users)
       AND {open_to_claim(_GEN_OF)};
    SELECT coalesce(array_agg(p.id), '{{}}'),
           coalesce(array_agg(p.id) FILTER (WHERE p.status = 'running'), '{{}}'),
           jsonb_object_agg(p.id, round(p.jitter::numeric, 6)) FILTER (WHERE p.status = 'running'),
           jsonb_object_agg(p.id, jsonb_build_array(p.old_status, p.old_attempts))
      INTO v_p_ids, v_running, v_jitter_of, v_old_of
      FROM (WITH run AS (SELECT v_now AS now), open AS (
                SELECT NULL::tid AS version, e.user_id, e.id, e.status, e.attempts,
                       {_GEN_OF} AS gen, run.now, {CLAIM_RANKS}
                  FROM run, unnest(v_users, v_ids, v_statuses, v_attempts, v_availables)
                            AS e(user_id, id, status, attempts, available_at)
            ), {CLAIM_PLAN}
            SELECT * FROM plan WHERE plan.status <> 'pending') p;
    v_died := array_fill(0, ARRAY[cardinality(v_order)]);
    v_unfinished := v_died;
    taken_at := v_now;
    died := NULL;
    unfinished := NULL;
    doc := NULL;
    FOR r IN UPDATE events e
                SET {claim_set(_NEW_STATUS, _GEN_OF, "v_now", _JITTER)}
              WHERE e.bucket = p_bucket AND e.user_id = ANY(v_taken_users)
                AND e.id = ANY(v_p_ids)
                AND e.status = {_OLD_STATUS}
                AND e.attempts = {_OLD_ATTEMPTS}
          RETURNING {EVENT_COLUMNS}, {_OLD_STATUS} AS old_status LOOP
        v_pos := array_position(v_order, r."user");
        IF r.status = 'dead' THEN
            v_died[v_pos] := v_died[v_pos] + 1;
        ELSIF r.status = 'running' THEN
            IF r.old_status = 'running' THEN
                v_unfinished[v_pos] := v_unfinished[v_pos] + 1;
            END IF;
            taken_user := r."user";
            taken_gen := r.claim_gen;
            {_EVENT_OUT};
            RETURN NEXT;
        END IF;
    END LOOP;
    {_NO_EVENT_OUT};
    FOR i IN 1 .. cardinality(v_order) LOOP  -- each run's closing row, in the order taken
        taken_user := v_order[i];
        taken_gen := v_gens[array_position(v_taken_users, v_order[i])];
        died := v_died[i];
        unfinished := v_unfinished[i];
        doc := v_docs[array_position(v_doc_users, v_order[i])];
        RETURN NEXT;
    END LOOP;
END
$fn$
"""

# The claim's shared parts (CLAIM_RANKS, CLAIM_PLAN, claim_set) name the
# policy's parameters as `%(x)s`: the function's arguments `p_x`.
FINISH, TAKE = _PARAM.sub(lambda m: f"p_{m[1]}", FINISH), _PARAM.sub(lambda m: f"p_{m[1]}", TAKE)

FUNCTIONS = ((FINISH, FINISH_SIGNATURE), (TAKE, TAKE_SIGNATURE))


def _differs(conn: psycopg.Connection[Any], definition: str, signature: str) -> bool:
    """Whether the function `signature` is missing, or its body or settings
    are not those of `definition` and SETTINGS."""
    found = conn.execute("SELECT prosrc, proconfig FROM pg_proc"
                         " WHERE oid = to_regprocedure(%s)", (signature,)).fetchone()
    return found is None or found[0] != definition.split("$fn$")[1] or found[1] != SETTINGS


def current(conn: psycopg.Connection[Any]) -> bool:
    """Whether every function is this code's own, body and settings (one from
    an older `migrate --citus` runs, but perhaps as the older code did: those
    before plan_cache_mode kept every node session's memory growing)."""
    return not any(_differs(conn, definition, signature) for definition, signature in FUNCTIONS)


def install(conn: psycopg.Connection[Any]) -> bool:
    """Create (or replace) the functions whose body differs from this code's on
    a laid-out coordinator database, and distribute them by their bucket,
    co-located with leases, delegated even inside a transaction block; whether
    any was (re)installed. In autocommit: Citus distributes a function in a
    transaction of its own."""
    changed = False
    for definition, signature in FUNCTIONS:
        if not _differs(conn, definition, signature):
            continue
        conn.execute(definition)
        conn.execute("SELECT create_distributed_function(%s, 'p_bucket', "
                     "colocate_with => 'leases', force_delegation => true)", (signature,))
        changed = True
    return changed


def installed(conn: psycopg.Connection[Any]) -> bool:
    """Whether the functions this code calls are there (a database laid out by
    an older `migrate --citus` lacks them)."""
    return all(one(conn.execute("SELECT to_regprocedure(%s) IS NOT NULL", (signature,)))[0]
               for _, signature in FUNCTIONS)


TAKE_CALL = "SELECT * FROM agent_inbox_take(%s, %s, %s, %s, %s, %s, %s, %s, %s)"


def take(conn: psycopg.Connection[Any], bucket: int, holder: str, ttl: int, policy: ClaimPolicy, now: int | None,
         users: int) -> list[tuple[Any, ...]]:
    """TAKE_WORK in one bucket, in one call on its node: read_taken's rows (user,
    gen, claimed_at, died, unfinished, memory, events), longest waiting first."""
    p = policy.params()
    rows = conn.execute(TAKE_CALL, (bucket, holder, ttl, users, now, p["max_attempts"],
                                    p["backoff_base"], p["backoff_cap"],
                                    p["max_batch"])).fetchall()
    runs: dict[str, list[Any]] = {}
    order: list[str] = []
    for user, gen, claimed_at, died, unfinished, doc, *event in rows:
        run = runs.setdefault(user, [user, gen, claimed_at, 0, 0, None, []])
        if event[0] is None:  # the run's closing row
            run[3:6] = died, unfinished, doc
            order.append(user)
        else:
            run[6].append(Event(*event))
    return [(*runs[user][:6], sorted(runs[user][6], key=lambda event: event.id))
            for user in order]


FINISH_CALL = ("SELECT agent_inbox_finish(%s, %s, %s, %s, %s::bigint[], %s, %s, %s, %s::jsonb,"
               " %s, %s, %s)")


class RefusedInTransaction(Exception):
    """agent_inbox_finish refused a run with an error (NOT_ALL_HELD) inside the
    caller's transaction, which the error aborted: the caller rolls it back
    and takes the finish as refused (nothing of it was written)."""


def finish(conn: psycopg.Connection[Any], f: Finish, now: int | None, *, release: bool) -> bool:
    """A run's fenced finish: one call on the run's node, and, if it queues
    messages, them and the NOTIFY from the coordinator in the same
    transaction (the caller's, or one of its own). False (nothing written) if
    the fence refuses; inside the caller's transaction a refusal that undid
    the call raises RefusedInTransaction instead."""
    queued = f.error is None and bool(f.messages)
    in_caller = conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE
    ok: bool
    try:
        with contextlib.nullcontext() if in_caller or not queued else conn.transaction():
            [ok] = one(conn.execute(FINISH_CALL, (
                bucket_of(f.user), f.user, f.holder, f.gen, list(f.ids), f.error,
                f.forget_steps, f.memory is not None,
                f.memory[0] if f.memory is not None else None, queued, release,
                now)))
            if ok and queued:
                params = user_key(f.user, now=now, traceparent=f.traceparent)
                for body, urgent in f.messages:
                    conn.execute(bucketed.QUEUE, {**params, "body": body, "urgent": urgent})
                conn.execute(f"SELECT pg_notify('{notify.OUTBOX}', '')")
    except psycopg.Error as exc:
        if exc.sqlstate != NOT_ALL_HELD:
            raise
        if in_caller:
            raise RefusedInTransaction(errors.first_line(exc)) from None
        return False
    return ok
