"""The workloads: ceiling, W1/W1b drain, W2 latency, W3 ingest, W4 take-work at scale,
W5/W5s agents (many slow handlers at once in one worker process).

Every function runs ONE repetition and returns a dict of figures plus the
correctness checks of that repetition; bench.run repeats, interleaves the two
systems and summarises.
"""

import random
import re
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psycopg
from procrastinate import exceptions as peer_exceptions

from agent_inbox import DatabaseUnavailable, Inbox, Result, TransactionConflict
try:
    from agent_inbox.schema import migrate
except ImportError:  # a revision before the layers (bench.ab's side on e.g. 5e7d469)
    from agent_inbox import migrate
from agent_inbox.store import inbox as inbox_store, wake_rings

from bench import records
from bench.common import (TreeSampler, Workers, check_runs, ours_worker_help, percentile,
                          poll_connection, reset_ours, reset_peer, resources, scalar, sql, stop_processes,
                          vacuum_analyze, wait_drained)
from bench.peer_app import AGENT_SYNC_TASK, AGENT_TASK, TASK_NAME, build_app

SOURCE = "bench"
PRELOAD_CHUNK = 1000
# Extra environment for agent-inbox worker processes (an A/B against another source tree:
# {"PYTHONPATH": "/path/to/other/src:/work/main"}); empty for the normal run.
OURS_ENV: dict = {}


# --- ceiling ----------------------------------------------------------------------------

def pgbench_init(server_url: str, scale: int) -> str:
    url = resources().database(server_url, "pgbench")
    _pgbench(url, ["-i", "-s", str(scale), "-q"])
    return url


def _pgbench(url: str, args: list[str]) -> str:
    info = psycopg.conninfo.conninfo_to_dict(url)
    cmd = ["pgbench", *args, "-h", info.get("host", "127.0.0.1"), "-p", str(info.get("port", 5432)),
           "-U", info.get("user", "postgres"), info["dbname"]]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pgbench failed: {done.stderr[-2000:]}")
    return done.stdout + done.stderr


def pgbench_run(url: str, clients: int, threads: int, seconds: int) -> dict:
    out = _pgbench(url, ["-N", "-c", str(clients), "-j", str(threads), "-T", str(seconds)])
    m = re.search(r"tps = ([\d.]+) \(without initial connection time\)", out)
    if not m:
        raise RuntimeError(f"no tps in pgbench output: {out[-1000:]}")
    return {"tps": float(m.group(1))}


def insert_commit_loop(url: str, seconds: float) -> dict:
    """Single-row INSERT, each its own commit (autocommit), on one connection."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS bench_commit_probe")
        conn.execute("CREATE TABLE bench_commit_probe (id bigint GENERATED ALWAYS AS IDENTITY"
                     " PRIMARY KEY, body text NOT NULL)")
        n = 0
        start = time.perf_counter()
        end = start + seconds
        while time.perf_counter() < end:
            conn.execute("INSERT INTO bench_commit_probe (body) VALUES (%s)", ("x",))
            n += 1
        elapsed = time.perf_counter() - start
        conn.execute("DROP TABLE bench_commit_probe")
    return {"commits_per_s": n / elapsed, "commits": n}


# --- W1 / W1b: drain a preloaded backlog -------------------------------------------------------

def _preload_ours(url: str, users: int, per_user: int) -> set:
    with Inbox.connect(url, pool_size=1) as inbox:
        batch = []
        for k in range(per_user):            # arrival order interleaves the users
            for u in range(users):
                batch.append((f"u{u}", SOURCE, f"{u}-{k}", {"k": k}))
                if len(batch) == PRELOAD_CHUNK:
                    inbox.ingest_many(batch)
                    batch = []
        if batch:
            inbox.ingest_many(batch)
    return {r[0] for r in sql(url, "SELECT id FROM events", fetch=True)}


def _preload_peer(url: str, users: int, per_user: int, task_name: str = TASK_NAME) -> set:
    app = build_app(url, min_size=1, max_size=1)
    app.open()
    try:
        task = app.tasks[task_name]
        jobs, eid = [], 0
        for k in range(per_user):
            for u in range(users):
                jobs.append(task.configure(lock=f"u{u}",
                                           task_kwargs={"user": f"u{u}", "eid": eid}).job)
                eid += 1
                if len(jobs) == PRELOAD_CHUNK:
                    app.job_manager.batch_defer_jobs(jobs=jobs)
                    jobs = []
        if jobs:
            app.job_manager.batch_defer_jobs(jobs=jobs)
    finally:
        app.close()
    return set(range(eid))


def drain(system: str, url: str, *, users: int, per_user: int, workers: int, concurrency: int,
          poll: float, timeout: float, worker_url: str | None = None, worker_args: list = (),
          on_loaded=None) -> dict:
    """Preload users x per_user events, start the workers, time until all are done.
    The workers connect to `worker_url` (default `url`: e.g. a pooler's, or another
    role's) with `worker_args` added to their command; the preload, the poll and the
    checks use `url`. `on_loaded()`, if given, runs once the backlog is loaded and
    analyzed, just before the workers start (e.g. to reset the server's statistics)."""
    res = resources()
    if system == "ours":
        reset_ours(url)
        expected = _preload_ours(url, users, per_user)
        vacuum_analyze(url, "events", "leases", "wakes")
    else:
        reset_peer(url)
        expected = _preload_peer(url, users, per_user)
        vacuum_analyze(url, "procrastinate_jobs")
    n = len(expected)
    assert n == users * per_user, (n, users * per_user)
    w = Workers(system, worker_url or url, workers, concurrency, poll, res.tempdir("rec"),
                res.tempdir("log"), env=dict(OURS_ENV) if system == "ours" else {},
                extra_args=list(worker_args))
    if on_loaded is not None:
        on_loaded()
    w.start()
    try:
        t_done = wait_drained(url, system, w, timeout)
    finally:
        w.stop()
    recs = records.read(w.record_dir, system)
    check = check_runs(recs, expected)
    if system == "ours":
        not_done = scalar(url, "SELECT count(*) FROM events WHERE status <> 'done'")
        takes = scalar(url, "SELECT coalesce(sum(gen), 0) FROM leases")
        reclaimed = scalar(url, "SELECT count(*) FROM events WHERE attempts > 1")
        check.update(not_done=not_done, takes=int(takes), events_claimed_more_than_once=reclaimed)
        check["ok"] = check["ok"] and not_done == 0
    else:
        not_done = scalar(url, "SELECT count(*) FROM procrastinate_jobs WHERE status <> 'succeeded'")
        check.update(not_done=not_done)
        check["ok"] = check["ok"] and not_done == 0
    runs = len(recs)
    first = min(r["s"] for r in recs)
    wall = t_done - w.spawned_at
    busy = t_done - first
    return {"wall_s": wall, "drain_s": busy, "startup_s": first - w.spawned_at,
            "events": n, "runs": runs,
            "events_per_s": n / wall, "events_per_s_drain": n / busy,
            "runs_per_s": runs / wall, "runs_per_s_drain": runs / busy,
            "check": check}


# --- W2: latency from ingest to handler start ----------------------------------------------------

def latency(system: str, url: str, *, users: int, interval: float, duration: float, workers: int,
            concurrency: int, poll: float, timeout: float, senders: int = 4,
            warm: float = 2.0) -> dict:
    """A paced producer: one event every `interval` s for `duration` s, round-robin over
    `users`, each sent by one of `senders` threads (so a slow commit does not lower the
    offered rate: both systems get the same schedule). t0 = time.time() just before the
    ingest/defer call, carried in the payload; latency = handler start - t0."""
    res = resources()
    (reset_ours if system == "ours" else reset_peer)(url)
    w = Workers(system, url, workers, concurrency, poll, res.tempdir("rec"), res.tempdir("log"),
                env=dict(OURS_ENV) if system == "ours" else {})
    w.start()
    try:
        w.wait_listening()
        time.sleep(1.0)  # let every slot make its first empty pass and go idle
        n = int(round(duration / interval))
        if system == "ours":
            inbox = Inbox.connect(url, pool_size=senders)
            send = lambda k, user, t0: inbox.ingest(user, SOURCE, str(k), {"t0": t0})  # noqa: E731
            close = inbox.close
        else:
            app = build_app(url, min_size=senders, max_size=senders)
            app.open()
            task = app.tasks[TASK_NAME]
            send = lambda k, user, t0: task.configure(lock=user).defer(user=user, eid=k, t0=t0)  # noqa: E731
            close = app.close
        lateness = []

        def one(k, target):
            lateness.append(time.perf_counter() - target)
            send(k, f"u{k % users}", time.time())

        try:
            with ThreadPoolExecutor(senders) as pool:
                start = time.perf_counter() + 0.05
                futures = []
                for k in range(n):
                    target = start + k * interval
                    pause = target - time.perf_counter()
                    if pause > 0:
                        time.sleep(pause)
                    futures.append(pool.submit(one, k, target))
                for f in futures:
                    f.result()
            produced_in = time.perf_counter() - start
        finally:
            close()
        wait_drained(url, system, w, timeout)
    finally:
        w.stop()
    recs = records.read(w.record_dir, system)
    if system == "ours":
        expected = {r[0] for r in sql(url, "SELECT id FROM events", fetch=True)}
    else:
        expected = set(range(n))
    check = check_runs(recs, expected)
    check["ok"] = check["ok"] and len(expected) == n
    # Each event's latency is to its FIRST handling: a second handling is a correctness
    # failure, counted by the check, not a latency sample.
    first: dict = {}
    for r in recs:
        for i, t0 in zip(r["ids"], r["t0"]):
            if t0 is not None and (i not in first or r["s"] < first[i][0]):
                first[i] = (r["s"], t0)
    lat = [(s_ - t0) * 1000.0 for s_, t0 in first.values()]
    # Steady state: the events sent after the first `warm` seconds (a worker's first runs
    # can pay one-off costs: new connections, cold caches, a handler process starting).
    t_first = min(t0 for _, t0 in first.values())
    steady = [(s_ - t0) * 1000.0 for s_, t0 in first.values() if t0 >= t_first + warm]
    return {"events": n, "produced_per_s": n / produced_in,
            "steady_p50_ms": percentile(steady, 50), "steady_p99_ms": percentile(steady, 99),
            "steady_max_ms": max(steady), "warm_s": warm,
            "late_sends": sum(1 for x in lateness if x > interval),
            "send_lateness_p99_ms": percentile(lateness, 99) * 1000.0,
            "runs": len(recs), "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99),
            "max_ms": max(lat), "mean_ms": sum(lat) / len(lat), "check": check}


# --- W3: ingest with duplicates ------------------------------------------------------------------

def w3_events(n: int, dup_fraction: float, users: int, seed: int = 7) -> tuple[list, int]:
    """n deliveries, dup_fraction of them redeliveries of an earlier key (same payload),
    each placed at a random point after its original."""
    rng = random.Random(seed)
    distinct = n - int(n * dup_fraction)
    placed = [(float(i), (f"u{i % users}", SOURCE, f"id{i}", {"n": i})) for i in range(distinct)]
    for _ in range(n - distinct):
        j = rng.randrange(distinct)
        placed.append((rng.uniform(j + 0.5, distinct), placed[j][1]))
    placed.sort(key=lambda p: p[0])
    return [e for _, e in placed], distinct


def _chunks(events: list, size: int) -> list[list]:
    return [events[i:i + size] for i in range(0, len(events), size)]


def _run_threads(conns: int, setup, work) -> float:
    """`setup(i)` per thread before the clock starts, then `work(i, state)`; seconds elapsed."""
    states = [setup(i) for i in range(conns)]
    barrier = threading.Barrier(conns + 1)
    errors: list[BaseException] = []

    def body(i):
        barrier.wait()
        try:
            work(i, states[i])
        except BaseException as exc:  # noqa: BLE001 -- re-raised in the driver
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(conns)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return elapsed, states


def _retrying_deadlocks(call, counter: list, i: int):
    """Call again when PostgreSQL broke a deadlock between concurrent batches (the
    rolled-back batch stored nothing, so a retry is exact). agent-inbox means to retry
    these itself (db.in_transaction) and raise TransactionConflict; it currently
    surfaces them as DatabaseUnavailable (see bench/README.md), so both are accepted."""
    for attempt in range(20):
        try:
            return call()
        except (TransactionConflict, DatabaseUnavailable) as exc:
            if "deadlock" not in str(exc) or attempt == 19:
                raise
            counter[i] += 1
            time.sleep(random.uniform(0, 0.01))


def w3_ours(url: str, events: list, distinct: int, *, mode: str, conns: int, batch: int) -> dict:
    reset_ours(url)
    vacuum_analyze(url, "events", "leases", "wakes")
    stored = [0] * conns
    deadlocks = [0] * conns
    if mode == "single":
        chunks = [events]
    else:
        chunks = _chunks(events, batch)

    def setup(i):
        return Inbox.connect(url, pool_size=1)

    def work(i, inbox):
        for c in chunks[i::conns]:
            if mode == "single":
                stored[i] += sum(inbox.ingest(*e) for e in c)
            else:
                stored[i] += sum(_retrying_deadlocks(lambda: inbox.ingest_many(c), deadlocks, i))

    elapsed, states = _run_threads(conns, setup, work)
    for inbox in states:
        inbox.close()
    in_db = scalar(url, "SELECT count(*) FROM events")
    check = {"stored_reported": sum(stored), "stored_in_db": in_db, "distinct_keys": distinct,
             "deadlocks_retried_by_bench": sum(deadlocks),
             "ok": sum(stored) == distinct and in_db == distinct}
    assert check["ok"], check
    return {"events": len(events), "seconds": elapsed, "events_per_s": len(events) / elapsed,
            "stored": in_db, "deadlocks": sum(deadlocks), "check": check}


def w3_peer(url: str, events: list, distinct: int, *, mode: str, conns: int, batch: int,
            dedupe: bool) -> dict:
    """mode single: Task.configure(lock, queueing_lock).defer per delivery, AlreadyEnqueued
    caught. mode batch: JobManager.batch_defer_jobs per chunk (what Task.batch_defer runs,
    with a per-job lock); with dedupe the queueing_lock is set and a chunk refused for a
    duplicate is deferred again one job at a time."""
    reset_peer(url)
    vacuum_analyze(url, "procrastinate_jobs")
    stored = [0] * conns
    deadlocks = [0] * conns
    refused_batches = [0] * conns
    chunks = [events] if mode == "single" else _chunks(events, batch)
    indexed = {id(e): n for n, e in enumerate(events)}

    def setup(i):
        app = build_app(url, min_size=1, max_size=1)
        app.open()
        return app

    def job_of(task, e):
        user, source, source_id, payload = e
        options = {"lock": user, "task_kwargs": {"user": user, "eid": indexed[id(e)], "n": payload["n"]}}
        if dedupe:
            options["queueing_lock"] = f"{user}:{source}:{source_id}"
        return task.configure(**options)

    def work(i, app):
        task = app.tasks[TASK_NAME]
        for c in chunks[i::conns]:
            if mode == "single":
                for e in c:
                    try:
                        job_of(task, e).defer()
                        stored[i] += 1
                    except peer_exceptions.AlreadyEnqueued:
                        pass
                continue
            jobs = [job_of(task, e).job for e in c]
            try:
                _peer_retrying_deadlocks(lambda: app.job_manager.batch_defer_jobs(jobs=jobs),
                                         deadlocks, i)
                stored[i] += len(jobs)
            except peer_exceptions.AlreadyEnqueued:
                refused_batches[i] += 1
                for job in jobs:
                    try:
                        app.job_manager.defer_job(job=job)
                        stored[i] += 1
                    except peer_exceptions.AlreadyEnqueued:
                        pass

    elapsed, states = _run_threads(conns, setup, work)
    for app in states:
        app.close()
    in_db = scalar(url, "SELECT count(*) FROM procrastinate_jobs")
    want = distinct if dedupe else len(events)
    check = {"stored_reported": sum(stored), "stored_in_db": in_db, "distinct_keys": distinct,
             "deduplicated": dedupe, "batches_refused": sum(refused_batches),
             "deadlocks_retried_by_bench": sum(deadlocks),
             "ok": sum(stored) == want and in_db == want}
    assert check["ok"], check
    return {"events": len(events), "seconds": elapsed, "events_per_s": len(events) / elapsed,
            "stored": in_db, "deadlocks": sum(deadlocks), "check": check}


def _peer_retrying_deadlocks(call, counter: list, i: int):
    for attempt in range(20):
        try:
            return call()
        except peer_exceptions.AlreadyEnqueued:
            raise
        except peer_exceptions.ConnectorException as exc:
            if "deadlock" not in str(exc.__cause__ or exc) or attempt == 19:
                raise
            counter[i] += 1
            time.sleep(random.uniform(0, 0.01))


# --- W4: take_work with many idle users ---------------------------------------------------------

IDLE_SQL = """
INSERT INTO leases (user_id, holder, gen, until)
SELECT 'idle-' || g, 'bench-old-holder', 3, %(past)s FROM generate_series(1, %(idle)s) g
"""

IDLE_EVENTS_SQL = """
INSERT INTO events (user_id, source, source_id, payload, status, attempts, claim_gen,
                    created_at, available_at, claimed_at)
SELECT 'idle-' || g, 'bench', 'old-' || k, '{"old": true}'::jsonb, 'done', 1, 3,
       %(past)s, %(past)s + 5, %(past)s
  FROM generate_series(1, %(idle)s) g, generate_series(1, %(per_user)s) k
"""


def w4_setup(server_url: str, users: int, busy: int, done_per_idle: int, pending: int) -> str:
    url = resources().database(server_url, f"w4_{users}")
    w4_fill(url, users, busy, done_per_idle, pending)
    return url


def w4_fill(url: str, users: int, busy: int, done_per_idle: int, pending: int,
            lay_out=None) -> None:
    """W4's data in the empty database `url`: migrated, the idle users' leases and done
    events in bulk SQL, then `lay_out(url)` if given (e.g. citus.distribute: the bulk
    rows are laid out with the rest), then the busy users' events through the API."""
    migrate.upgrade(url)
    past = int(time.time()) - 86400
    idle = users - busy
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(IDLE_SQL, {"idle": idle, "past": past})
        conn.execute(IDLE_EVENTS_SQL, {"idle": idle, "per_user": done_per_idle, "past": past})
    if lay_out is not None:
        lay_out(url)
    with Inbox.connect(url, pool_size=1) as inbox:
        inbox.ingest_many([(f"busy-{b}", SOURCE, f"p-{b}-{k}", {"k": k})
                           for k in range(pending) for b in range(busy)])
    vacuum_analyze(url, "events", "leases", "wakes")


# W4b: users that think while their messages arrive. Each holds a valid lease (taken by
# take_runs with a lease of W4B_TTL, its first event claimed) and then receives `pending`
# more events through ingest_many, as a user's messages arrive during its run.
W4B_TTL = 7200

DUE_WAKES_OF_HELD_LEASES = """
SELECT count(*) FROM wakes w JOIN leases l ON l.user_id = w.user_id
 WHERE w.at <= floor(extract(epoch FROM clock_timestamp()))::bigint
   AND l.until >= floor(extract(epoch FROM clock_timestamp()))::bigint
"""


PENDING_OF_HELD_LEASES = """
SELECT count(*) FROM events e JOIN leases l ON l.user_id = e.user_id
 WHERE e.status = 'pending' AND l.until >= floor(extract(epoch FROM clock_timestamp()))::bigint
"""


def w4b_setup(server_url: str, thinking: int, busy: int, pending: int,
              thinking_pending: int, serial: list) -> tuple[str, dict]:
    """`thinking` users holding a valid lease with `thinking_pending` pending events each,
    plus `busy` free users with `pending` events each. The arrivals woke the thinking users
    (one due wake each); take+finish cycles as W4 measures them (untimed) run until a
    take has looked at every one of them (their next wake is at their lease's end). The
    setup figures (settle calls and seconds) are returned beside the url."""
    url = resources().database(server_url, f"w4b_{thinking}")
    migrate.upgrade(url)
    with Inbox.connect(url, pool_size=1, lease_ttl=W4B_TTL) as inbox:
        inbox.ingest_many([(f"thinking-{u}", SOURCE, "first", {"k": 0}) for u in range(thinking)])
        taken = 0
        while taken < thinking:
            runs = inbox.runs.take_runs("bench-w4b-thinker", users=200)
            assert runs, f"only {taken} of {thinking} thinking users taken"
            taken += len(runs)
        for k in range(thinking_pending):
            inbox.ingest_many([(f"thinking-{u}", SOURCE, f"m-{k}", {"k": k})
                               for u in range(thinking)])
        inbox.ingest_many([(f"busy-{b}", SOURCE, f"p-{b}-{k}", {"k": k})
                           for k in range(pending) for b in range(busy)])
    vacuum_analyze(url, "events", "leases", "wakes")
    t = time.perf_counter()
    calls = 0
    with Inbox.connect(url, pool_size=1) as inbox:
        while scalar(url, DUE_WAKES_OF_HELD_LEASES):
            _take_cycle(inbox, "bench-w4-holder", pending, serial)
            calls += 1
            assert calls <= 10 * thinking, "the thinking users' wakes were not looked at"
    settle = {"settle_calls": calls, "settle_s": time.perf_counter() - t}
    vacuum_analyze(url, "events", "leases", "wakes")
    return url, settle


def _take_cycle(inbox: Inbox, holder: str, pending: int, serial: list) -> float:
    """One take_work timed (ms), then (untimed) its run finished and its user given
    `pending` fresh events, so the number of users with work stays the same."""
    t = time.perf_counter()
    run = inbox.take_work(holder)
    dt = time.perf_counter() - t
    assert run is not None and len(run.events) == pending, run
    finish_and_refill(inbox, run, pending, serial)
    return dt * 1000.0


def finish_and_refill(inbox: Inbox, run, pending: int, serial: list) -> None:
    """A taken run finished and its user given `pending` fresh events (keys from
    the counter `serial[0]`), so the number of users with work stays the same."""
    assert inbox.finish_run(run, Result())
    base = serial[0]
    serial[0] += pending
    inbox.ingest_many([(run.user, SOURCE, f"r-{base + k}", {"k": k}) for k in range(pending)])


def take_work_params(inbox: Inbox, holder: str) -> dict:
    return {"holder": holder, "ttl": inbox.settings.lease_ttl, "now": None, "users": 1, **inbox.settings.claim.params()}


def explain_take_work(url: str, inbox: Inbox, holder: str) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) of TAKE_WORK, custom plan and forced generic plan, each
    inside a transaction that is rolled back (the statement leases and claims)."""
    params = take_work_params(inbox, holder)
    parts = []
    with psycopg.connect(url) as conn:
        for mode in ("auto", "force_generic_plan"):
            with conn.transaction(force_rollback=True):
                conn.execute(f"SET LOCAL plan_cache_mode = {mode}")
                rows = conn.execute("EXPLAIN (ANALYZE, BUFFERS, VERBOSE OFF) " + inbox_store.TAKE_WORK,
                                    {**params, **wake_rings.Given().params(conn)}).fetchall()
            parts.append(f"-- plan_cache_mode = {mode}\n" + "\n".join(r[0] for r in rows))
    return "\n\n".join(parts) + "\n"


def w4_measure(url: str, *, calls: int, warmup: int, pending: int, serial: list) -> dict:
    """Median take_work round trip over `calls` calls. Between calls (not timed) the run is
    finished and the user gets `pending` fresh events, so 100 users always have work."""
    with Inbox.connect(url, pool_size=1) as inbox:
        times = [_take_cycle(inbox, "bench-w4-holder", pending, serial)
                 for _ in range(warmup + calls)][warmup:]
    times.sort()
    return {"median_ms": times[len(times) // 2], "p90_ms": percentile(times, 90),
            "min_ms": times[0], "max_ms": times[-1], "calls": len(times)}


def server_execution_ms(explain_text: str) -> float | None:
    m = re.search(r"Execution Time: ([\d.]+) ms", explain_text)
    return float(m.group(1)) if m else None


# --- W5 / W5s: many slow (1 s) handlers at once in ONE worker process ------------------------------

OURS_HANDLERS = {"async": "bench.handlers:agent_async", "sync": "bench.handlers:agent_sync",
                 "steps": "bench.handlers:agent_steps"}
PEER_TASKS = {"async": AGENT_TASK, "sync": AGENT_SYNC_TASK}


def ours_agent_args(env: dict | None, requested: list | None) -> tuple[list, bool]:
    """The extra worker flags for W5/W5s, and whether this agent-inbox is the runtime
    with a connection (and, by default, a handler process) per slot. `requested` None
    means automatic: `--isolation thread` when `agent-inbox worker --help` lists
    `--isolation` (a process per slot, ~35 MB each, would not fit at 1,000), else none."""
    per_slot = "--isolation" in ours_worker_help(env)
    if requested is not None:
        return list(requested), per_slot
    return (["--isolation", "thread"] if per_slot else []), per_slot


def peer_variant_name(variant: dict) -> str:
    name = f"c{variant['concurrency']}"
    return name + (f"_t{variant['threads']}" if variant.get("threads") else "")


def _open_done_query(system: str) -> str:
    if system == "ours":
        return ("SELECT count(*) FILTER (WHERE status IN ('pending', 'running')),"
                " count(*) FILTER (WHERE status = 'done') FROM events")
    return ("SELECT count(*) FILTER (WHERE status IN ('todo', 'doing')),"
            " count(*) FILTER (WHERE status = 'succeeded') FROM procrastinate_jobs")


def agents(system: str, url: str, *, users: int, concurrency: int, handler: str, sleep: float,
           lease_ttl: float, timeout: float, stall_s: float, rss_cap_mib: float,
           conn_cap: int | None, poll: float = 1.0, extra_args: list | None = None,
           threads: int | None = None, interval: float = 0.1, steps: int = 0,
           step_sleep: float = 0.0) -> dict:
    """users x 1 event preloaded (ours: ingest_many; peer: batch_defer_jobs, lock=<user>),
    then ONE worker process at `concurrency` whose handler waits `sleep` s (handler
    "async": await asyncio.sleep; "sync": time.sleep). A TreeSampler samples the worker's
    process tree (RSS, processes, threads) and its connections every `interval` s.
    The wait is bounded: `timeout` s in all, `stall_s` s without a run finishing, the
    tree's RSS (`rss_cap_mib`) and connections (`conn_cap`): the first bound hit ends the
    run and is its `outcome` ("drained" when all work was done).
    Handler "steps" (W5x3, agent-inbox only): each run is `steps` durable steps that each
    await `step_sleep` s; `sleep` is then only the run time the ideal is computed from."""
    res = resources()
    if system == "ours":
        reset_ours(url)
        if handler == "steps":
            sql(url, "TRUNCATE steps")
        expected = _preload_ours(url, users, 1)
        vacuum_analyze(url, "events", "leases", "wakes")
        w = Workers("ours", url, 1, concurrency, poll, res.tempdir("rec"), res.tempdir("log"),
                    env={**OURS_ENV, "BENCH_AGENT_SLEEP": str(sleep), "BENCH_STEPS": str(steps),
                         "BENCH_STEP_SLEEP": str(step_sleep)},
                    handler=OURS_HANDLERS[handler],
                    extra_args=["--lease-ttl", str(lease_ttl), *(extra_args or [])])
    else:
        reset_peer(url)
        expected = _preload_peer(url, users, 1, PEER_TASKS[handler])
        vacuum_analyze(url, "procrastinate_jobs")
        env = {"BENCH_AGENT_SLEEP": str(sleep)}
        if threads:
            env["BENCH_PEER_THREADS"] = str(threads)
        w = Workers("peer", url, 1, concurrency, poll, res.tempdir("rec"), res.tempdir("log"),
                    env=env, extra_args=list(extra_args or []))
    n = len(expected)
    assert n == users, (n, users)
    query = _open_done_query(system)
    outcome, t_end, done = "drained", None, 0
    w.start()
    sampler = TreeSampler(w.procs[0].pid, url, interval=interval,
                          rss_cap=int(rss_cap_mib * 2**20) if rss_cap_mib else None,
                          conn_cap=conn_cap)
    sampler.start()
    try:
        deadline = time.monotonic() + timeout
        last_done, last_progress = -1, time.monotonic()
        with poll_connection(url) as conn:
            while True:
                open_, done = conn.execute(query).fetchone()
                now = time.monotonic()
                t_end = time.time()
                if open_ == 0:
                    break
                if sampler.tripped:
                    outcome = "stopped: " + sampler.tripped
                    break
                if not w.alive():
                    outcome = "worker died"
                    break
                if done != last_done:
                    last_done, last_progress = done, now
                elif now - last_progress > stall_s:
                    outcome = f"stalled: no run finished for {stall_s:.0f} s"
                    break
                if now > deadline:
                    outcome = f"timeout after {timeout:.0f} s"
                    break
                time.sleep(0.05)
    finally:
        tree = sampler.stop()
        # a run that did not drain has work in flight that would keep a graceful stop
        # waiting (procrastinate finishes every job it holds): 5 s, then SIGKILL
        stop_processes(w.procs, timeout=20 if outcome == "drained" else 5)
    recs = records.read(w.record_dir, system)
    check = check_runs(recs, expected)
    drained = outcome == "drained"
    if system == "ours":
        not_done = scalar(url, "SELECT count(*) FROM events WHERE status <> 'done'")
        takes = scalar(url, "SELECT coalesce(sum(gen), 0) FROM leases")
        reclaimed = scalar(url, "SELECT count(*) FROM events WHERE attempts > 1")
        check.update(not_done=not_done, takes=int(takes), events_claimed_more_than_once=reclaimed)
        # ours must drain: a bound hit is a failure
        check["ok"] = check["ok"] and not_done == 0 and drained
        if handler == "steps":
            # each step called once: every event handled by one run (above), claimed once
            # (an attempt that died before its record would have raised `attempts`), and
            # that run called all its step functions; a successful finish deletes its
            # records, so none may be left
            dead = scalar(url, "SELECT count(*) FROM events WHERE status = 'dead'")
            left = scalar(url, "SELECT count(*) FROM steps")
            short = sum(1 for r in recs if r.get("calls") != steps)
            check.update(dead=dead, steps_left=left, runs_not_calling_every_step=short,
                         step_calls=sum(r.get("calls", 0) for r in recs))
            check["ok"] = (check["ok"] and dead == 0 and left == 0 and short == 0
                           and reclaimed == 0)
    else:
        not_done = scalar(url, "SELECT count(*) FROM procrastinate_jobs WHERE status <> 'succeeded'")
        check.update(not_done=not_done)
        if not drained:
            # the peer not finishing (a stall, a bound) is its figure, not a bench failure:
            # only what it did run must be exactly-once and non-overlapping
            check["ok"] = (check["handled_twice"] == 0 and check["unexpected"] == 0
                           and check["overlapping_runs"] == 0)
        else:
            check["ok"] = check["ok"] and not_done == 0
    check["outcome"] = outcome
    runs = len(recs)
    ideal = concurrency / sleep
    out = {"outcome": outcome, "drained": drained, "users": users, "concurrency": concurrency,
           "sleep_s": sleep, "handler": handler, "extra_args": w.extra_args, "threads": threads,
           "events": n, "runs": runs, "done": done, "ideal_runs_per_s": ideal,
           "ideal_drain_s": -(-users // concurrency) * sleep, **tree, "check": check}
    if recs:
        first = min(r["s"] for r in recs)
        last_end = max(r["e"] for r in recs)
        busy = t_end - first
        out.update(startup_s=first - w.spawned_at, wall_s=t_end - w.spawned_at,
                   handler_span_s=last_end - first,
                   # over what ran until the bound when not drained (then drain_s is None)
                   runs_per_s_upto_stop=runs / busy if busy > 0 else None)
        if drained:
            out.update(drain_s=busy, runs_per_s_drain=runs / busy,
                       ratio_to_ideal=runs / busy / ideal)
        # how many ran at once: the most handler spans open at one instant
        edges = sorted([(r["s"], 1) for r in recs] + [(r["e"], -1) for r in recs])
        live = peak = 0
        for _, d in edges:
            live += d
            peak = max(peak, live)
        out["peak_runs_at_once"] = peak
        costs = sorted(c for r in recs for c in r.get("sc", ()))
        if costs:
            out.update(steps_per_run=steps, step_sleep_s=step_sleep, step_samples=len(costs),
                       step_cost_p50_ms=1000 * percentile(costs, 50),
                       step_cost_p90_ms=1000 * percentile(costs, 90),
                       step_cost_p99_ms=1000 * percentile(costs, 99),
                       step_cost_max_ms=1000 * costs[-1],
                       step_cost_mean_ms=1000 * sum(costs) / len(costs),
                       runs_per_s_from_spawn=runs / (t_end - w.spawned_at),
                       # against the runs' sleeps alone (no cost at all per step)
                       ratio_to_sleep_ideal=(runs / busy / (concurrency / (steps * step_sleep))
                                             if drained else None))
            for n in range(steps):
                at = sorted(r["sc"][n] for r in recs if len(r.get("sc", ())) > n)
                out[f"step{n + 1}_cost_p50_ms"] = 1000 * percentile(at, 50)
                out[f"step{n + 1}_cost_p99_ms"] = 1000 * percentile(at, 99)
    return out
