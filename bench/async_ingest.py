"""Async ingest at 1,000 concurrent requests: `AsyncInbox.ingest` beside
procrastinate's `defer_async`, and `ingest(..., connection=)` in the caller's
transaction.

    .venv/bin/python -m bench.async_ingest [--requests 20000] [--concurrency 1000] [--reps 3]
        [--pool-size 10] [--ours-src REV]   # REV: agent-inbox from a git revision's src/

One process, one event loop. A "request" is one asyncio task that awaits one
call with a distinct key (`source_id` / `queueing_lock`), users u0..u999 in
turn; a semaphore keeps at most --concurrency tasks in flight (a task is
created only when a place is free). Each side runs on a fresh database (ours
migrated, the peer's schema applied by its CLI), CHECKPOINTed before it, on an
async pool of --pool-size connections opened (and filled) before the clock
starts:

* `ours`: `await inbox.ingest(user, "chat", key, payload)` on
  `AsyncInbox.connect(url, pool_size=N)` (each call its own transaction).
* `peer`: `await app.tasks["bench_handle"].configure(lock=user,
  queueing_lock=key).defer_async(user=..., eid=n)`, procrastinate's
  PsycopgConnector with an AsyncConnectionPool of N (min = max = N); the
  queueing lock is the peer's counterpart of our per-key deduplication (W3's
  peer does the same).
* `callers_transaction`: each request takes a connection from a
  psycopg_pool.AsyncConnectionPool of N of its own, opens a transaction,
  INSERTs a row into an application table `chat_messages`, awaits
  `inbox.ingest(..., connection=conn)` and commits (AsyncInbox itself on a pool
  of 1, unused).

Per side: events/s = requests / (first task created -> last returned), and the
latency of each request from its task's start of the call (after its place in
the semaphore; pool wait included) to the call's return (for
callers_transaction: connection checkout, INSERT, ingest and COMMIT), p50 and
p99. Checks: no call failed, every ours call returned True, the rows in the
database equal the requests (and the application rows too). The sides' order
is reversed rep by rep (even: ours, callers_transaction, peer; odd: the
reverse). Medians over reps; ratios ours/peer and callers/ours. Prints a table
and, last, one JSON line; writes bench/results/async_ingest.json.
"""

import argparse
import asyncio
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from psycopg_pool import AsyncConnectionPool

from bench.common import (ROOT, RESULTS, ours_database, peer_database, percentile, resources, scalar,
                          sql, src_fingerprint, summary)
from bench.peer_app import TASK_NAME, build_app

SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"
USERS = 1000
SIDES = ("ours", "callers_transaction", "peer")


def imported_code() -> dict:
    """Where this process imported agent_inbox from, and a hash of that package's
    *.py (src_fingerprint hashes the working tree's src/, which is what ran only
    if PYTHONPATH did not put another copy first)."""
    from pathlib import Path

    import agent_inbox
    package = Path(agent_inbox.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.read_bytes())
    return {"path": str(package), "sha256": digest.hexdigest()[:16]}


def key_of(n: int) -> tuple[str, str]:
    return f"u{n % USERS}", f"m{n}"


async def drive(call, requests: int, concurrency: int) -> dict:
    """Run `call(n)` for n in 0..requests-1, each in a task of its own, at most
    `concurrency` at once; elapsed time, per-request latencies, failures."""
    places = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    failures: list[str] = []
    in_flight = peak = 0
    tasks: set[asyncio.Task] = set()

    async def one(n: int) -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            start = time.perf_counter()
            await call(n)
            latencies.append(time.perf_counter() - start)
        except Exception as exc:  # noqa: BLE001 -- counted, a failed check
            failures.append(repr(exc))
        finally:
            in_flight -= 1
            places.release()

    start = time.perf_counter()
    for n in range(requests):
        await places.acquire()
        task = asyncio.create_task(one(n))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    while tasks:
        await asyncio.gather(*list(tasks))
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "latencies": latencies, "failures": failures,
            "peak_in_flight": peak}


async def fill(pool, size: int) -> int:
    """Grow `pool` (min_size 1) to `size` open connections before the clock starts."""
    for _ in range(20):
        if pool.get_stats().get("pool_size", 0) >= size:
            break

        async def hold():
            async with pool.connection():
                await asyncio.sleep(0.05)
        await asyncio.gather(*(hold() for _ in range(size)))
    return pool.get_stats().get("pool_size", 0)


async def run_ours(url: str, requests: int, concurrency: int, pool_size: int) -> dict:
    from agent_inbox import AsyncInbox
    async with await AsyncInbox.connect(url, pool_size=pool_size,
                                        application_name="bench-async-ours") as inbox:
        opened = await fill(inbox.pool, pool_size)
        answers: list[bool] = []

        async def call(n: int) -> None:
            user, key = key_of(n)
            answers.append(await inbox.ingest(user, "chat", key, {"text": "hello", "n": n}))

        out = await drive(call, requests, concurrency)
    stored = scalar(url, "SELECT count(*) FROM events")
    out["check"] = {"stored_in_db": stored, "returned_true": sum(answers),
                    "ok": not out["failures"] and stored == requests and sum(answers) == requests}
    out["connections"] = opened
    return out


async def run_callers(url: str, requests: int, concurrency: int, pool_size: int) -> dict:
    from agent_inbox import AsyncInbox
    sql(url, "CREATE TABLE chat_messages (id bigserial PRIMARY KEY, user_id text NOT NULL,"
             " message_id text NOT NULL, body text NOT NULL)")
    app_pool = AsyncConnectionPool(url, min_size=pool_size, max_size=pool_size, open=False,
                                   kwargs={"application_name": "bench-async-app"})
    await app_pool.open(wait=True, timeout=30)
    try:
        async with await AsyncInbox.connect(url, pool_size=1,
                                            application_name="bench-async-callers") as inbox:
            answers: list[bool] = []

            async def call(n: int) -> None:
                user, key = key_of(n)
                async with app_pool.connection() as conn:
                    async with conn.transaction():
                        await conn.execute("INSERT INTO chat_messages (user_id, message_id, body)"
                                           " VALUES (%s, %s, %s)", (user, key, "hello"))
                        answers.append(await inbox.ingest(user, "chat", key,
                                                          {"text": "hello", "n": n},
                                                          connection=conn))

            out = await drive(call, requests, concurrency)
            opened = app_pool.get_stats().get("pool_size", 0) + inbox.pool.get_stats().get(
                "pool_size", 0)
    finally:
        await app_pool.close()
    stored = scalar(url, "SELECT count(*) FROM events")
    app_rows = scalar(url, "SELECT count(*) FROM chat_messages")
    out["check"] = {"stored_in_db": stored, "app_rows": app_rows, "returned_true": sum(answers),
                    "ok": (not out["failures"] and stored == requests and app_rows == requests
                           and sum(answers) == requests)}
    out["connections"] = opened
    return out


async def run_peer(url: str, requests: int, concurrency: int, pool_size: int) -> dict:
    app = build_app(url, min_size=pool_size, max_size=pool_size,
                    kwargs={"application_name": "bench-async-peer"})
    async with app.open_async():
        pool = app.connector.pool  # procrastinate's psycopg AsyncConnectionPool
        await pool.wait(timeout=30)
        task = app.tasks[TASK_NAME]
        ids: list[int] = []

        async def call(n: int) -> None:
            user, key = key_of(n)
            ids.append(await task.configure(lock=user, queueing_lock=key).defer_async(
                user=user, eid=n))

        out = await drive(call, requests, concurrency)
        opened = pool.get_stats().get("pool_size", 0)
    stored = scalar(url, "SELECT count(*) FROM procrastinate_jobs")
    out["check"] = {"stored_in_db": stored, "ids_returned": len(set(ids)),
                    "ok": not out["failures"] and stored == requests and len(set(ids)) == requests}
    out["connections"] = opened
    return out


RUNNERS = {"ours": run_ours, "callers_transaction": run_callers, "peer": run_peer}


def one_side(side: str, args) -> dict:
    res = resources()
    url = peer_database(args.server_url) if side == "peer" else ours_database(args.server_url)
    try:
        sql(url, "CHECKPOINT")
        load = os.getloadavg()[0]
        out = asyncio.run(RUNNERS[side](url, args.requests, args.concurrency, args.pool_size))
    finally:
        res.drop(url)
    lat = out.pop("latencies")
    failures = out.pop("failures")
    return {"events_per_s": args.requests / out["seconds"], "seconds": out["seconds"],
            "p50_ms": percentile(lat, 50) * 1000 if lat else None,
            "p99_ms": percentile(lat, 99) * 1000 if lat else None,
            "max_ms": max(lat) * 1000 if lat else None,
            "failed": len(failures), "failures_first": failures[:5],
            "peak_in_flight": out["peak_in_flight"], "pool_connections": out["connections"],
            "loadavg_1m": load, "check": out["check"]}


def rerun_on(rev: str) -> int:
    """This benchmark again in a child process whose agent_inbox is `rev`'s src/
    (extracted with `git archive` into a temp dir, first on PYTHONPATH, as bench.ab
    does); its exit status."""
    commit = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
    tree = tempfile.mkdtemp(prefix=f"bench-async-ingest-{commit}-")
    try:
        archive = subprocess.Popen(["git", "archive", commit, "src"], cwd=ROOT,
                                   stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", tree], stdin=archive.stdout, check=True)
        archive.stdout.close()
        if archive.wait() != 0:
            raise SystemExit(f"git archive {commit} failed")
        env = dict(os.environ, PYTHONPATH=f"{tree}/src{os.pathsep}{ROOT}",
                   BENCH_OURS_SRC=commit)
        return subprocess.run([sys.executable, "-m", "bench.async_ingest", *sys.argv[1:]],
                              cwd=ROOT, env=env).returncode
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def medians_of(figures: dict) -> dict:
    """{side: {figure: median}}: what docs/gen_bench.py shows as a table."""
    return {side: {k: round(f["median"], 1) for k, f in fs.items() if f["median"] is not None}
            for side, fs in figures.items()}


def fmt(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--pool-size", type=int, default=10)
    parser.add_argument("--server-url", default=SERVER)
    parser.add_argument("--out", default=str(RESULTS / "async_ingest.json"))
    parser.add_argument("--ours-src", metavar="REV",
                        help="run agent-inbox from a git revision's src/ (default: the working tree)")
    args = parser.parse_args()
    if args.ours_src and not os.environ.get("BENCH_OURS_SRC"):
        sys.exit(rerun_on(args.ours_src))
    if args.pool_size + 1 > 39:
        parser.error("--pool-size: at most 38 (one side at a time, under 40 connections)")

    from bench.run import machine
    info = machine(args.server_url)
    info["agent_inbox_imported"] = imported_code()
    started = time.monotonic()
    reps: list[dict[str, dict]] = []
    code_per_rep = []
    try:
        for r in range(args.reps):
            order = SIDES if r % 2 == 0 else tuple(reversed(SIDES))
            code_per_rep.append(src_fingerprint()["sha256"])
            rep = {"order": list(order)}
            for side in order:
                rep[side] = one_side(side, args)
                s = rep[side]
                print(f"rep {r + 1}/{args.reps} {side:>20}: {s['events_per_s']:8,.0f} events/s, "
                      f"p50 {s['p50_ms']:7.1f} ms, p99 {s['p99_ms']:7.1f} ms, "
                      f"check {'ok' if s['check']['ok'] else 'FAILED ' + json.dumps(s['check'])}",
                      file=sys.stderr, flush=True)
            reps.append(rep)
    finally:
        resources().release()
    info["loadavg_at_end"] = os.getloadavg()
    info["agent_inbox_code_at_end"] = src_fingerprint()
    info["code_per_rep"] = code_per_rep

    figures: dict[str, dict] = {}
    for side in SIDES:
        figures[side] = {k: summary([rep[side][k] for rep in reps])
                         for k in ("events_per_s", "p50_ms", "p99_ms", "max_ms")}

    def med(side, k):
        return figures[side][k]["median"]

    ratios = {
        "ours_over_peer_events_per_s": med("ours", "events_per_s") / med("peer", "events_per_s"),
        "ours_over_peer_p50": med("ours", "p50_ms") / med("peer", "p50_ms"),
        "ours_over_peer_p99": med("ours", "p99_ms") / med("peer", "p99_ms"),
        "callers_over_ours_events_per_s": (med("callers_transaction", "events_per_s")
                                           / med("ours", "events_per_s")),
        "callers_over_ours_p50": med("callers_transaction", "p50_ms") / med("ours", "p50_ms"),
    }
    checks_ok = all(rep[side]["check"]["ok"] for rep in reps for side in SIDES)

    print(f"\nasync ingest: {args.requests:,} requests, {args.concurrency:,} in flight, pools of "
          f"{args.pool_size}, {len(reps)} reps (medians [min-max]); load "
          f"{info['loadavg_at_start'][0]:.1f} -> {info['loadavg_at_end'][0]:.1f}")
    print(f"{'side':<42} {'events/s':>22} {'p50 ms':>20} {'p99 ms':>20}")
    labels = {"ours": "agent-inbox AsyncInbox.ingest",
              "callers_transaction": "agent-inbox ingest(connection=) + app row",
              "peer": "procrastinate defer_async"}
    for side in SIDES:
        f = figures[side]
        cells = [f"{fmt(f[k]['median'], d)} [{fmt(f[k]['min'], d)}-{fmt(f[k]['max'], d)}]"
                 for k, d in (("events_per_s", 0), ("p50_ms", 1), ("p99_ms", 1))]
        print(f"{labels[side]:<42} {cells[0]:>22} {cells[1]:>20} {cells[2]:>20}")
    print(f"ours / peer: events/s {ratios['ours_over_peer_events_per_s']:.2f}x, "
          f"p50 {ratios['ours_over_peer_p50']:.2f}, p99 {ratios['ours_over_peer_p99']:.2f}; "
          f"caller's transaction / ours: events/s {ratios['callers_over_ours_events_per_s']:.2f}, "
          f"p50 {ratios['callers_over_ours_p50']:.2f}")
    print(f"checks: {'all ok' if checks_ok else 'FAILED'}; "
          f"{time.monotonic() - started:.0f} s")

    result = {"config": {"requests": args.requests, "concurrency": args.concurrency,
                         "reps": args.reps, "pool_size": args.pool_size, "users": USERS,
                         "ours_src": os.environ.get("BENCH_OURS_SRC", "working tree"),
                         "peer_call": "configure(lock=user, queueing_lock=key).defer_async",
                         "command": "python -m bench.async_ingest " + " ".join(sys.argv[1:])},
              "medians": medians_of(figures), "figures": figures,
              "ratios": {k: round(v, 3) for k, v in ratios.items()},
              "checks_ok": checks_ok, "runs": reps, "machine": info,
              "seconds": time.monotonic() - started,
              "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    with open(args.out, "w") as fh:
        fh.write(json.dumps(result, indent=2) + "\n")
    brief = {"requests": args.requests, "concurrency": args.concurrency, "reps": len(reps),
             **{f"{side}_{k}": round(figures[side][k]["median"], 1)
                for side in SIDES for k in ("events_per_s", "p50_ms", "p99_ms")},
             **{k: round(v, 3) for k, v in ratios.items()}, "checks_ok": checks_ok}
    print(json.dumps(brief))
    sys.exit(0 if checks_ok else 1)


if __name__ == "__main__":
    main()
