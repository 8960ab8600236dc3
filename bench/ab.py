"""A/B two agent-inbox source trees on W1b (per-run cost) and W2 (latency), interleaved.

    .venv/bin/python -m bench.ab REV [--reps 3] [--users 5000] [--seconds 10]
    .venv/bin/python -m bench.ab REV --users 1000 --per-user 20 --out FILE   # W1's drain in place of W1b

REV is a git revision: its src/ and migrations/ are extracted with `git archive` into a
temp dir (the repository is not touched) and its workers run with PYTHONPATH pointing
there; B is the working tree. Each side runs on a database of its own, migrated by its
own migrations (a schema change is part of what is compared). Writes
bench/results/ab_<REV>.json and prints medians.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from alembic import command
from alembic.config import Config

try:
    from agent_inbox.schema import migrate
except ImportError:  # a revision before the layers (bench.ab's side on e.g. 5e7d469)
    from agent_inbox import migrate
from bench import workloads as wl
from bench.common import RESULTS, ROOT, ours_database, resources


def migrated_by(migrations: str, server_url: str, env: dict | None = None) -> str:
    """A new database migrated to head by the migration scripts at `migrations`, in a
    process of its own on that tree's code (`env`: its env.py imports that agent_inbox)."""
    url = resources().database(server_url, "ours")
    if env is not None:
        subprocess.run([sys.executable, "-m", "bench.ab", "-", "--migrate", migrations, url],
                       env={**os.environ, **env}, check=True)
        return url
    config = Config()
    config.set_main_option("script_location", migrations)
    with migrate._connection(url) as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
    return url


def one_side(url: str, users: int, seconds: float, per_user: int = 1) -> dict:
    """One repetition of W1b (W1 with `per_user` 20) and W2 on `url`, by the
    agent_inbox this process imports (its workers too: they get this process's
    PYTHONPATH)."""
    wl.OURS_ENV = {"PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT))}
    try:
        a = wl.drain("ours", url, users=users, per_user=per_user, workers=4, concurrency=1,
                     poll=1.0, timeout=600)
        b = wl.latency("ours", url, users=200, interval=0.01, duration=seconds,
                       workers=4, concurrency=1, poll=1.0, timeout=120)
    finally:
        resources().release()
    return {"w1b_runs_per_s": a["runs_per_s_drain"], "events_per_s": a["events_per_s_drain"],
            "startup_s": a["startup_s"],
            "w2_p50_ms": b["p50_ms"], "w2_p99_ms": b["p99_ms"], "w2_max_ms": b["max_ms"],
            "w2_steady_p99_ms": b["steady_p99_ms"],
            "ok": a["check"]["ok"] and b["check"]["ok"], "loadavg_1m": os.getloadavg()[0]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ab")
    parser.add_argument("rev")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--users", type=int, default=5000, help="W1b size (users x 1 event)")
    parser.add_argument("--per-user", type=int, default=1,
                        help="events per user of the drain (W1b: 1; W1: 20 with --users 1000)")
    parser.add_argument("--seconds", type=float, default=10.0, help="W2 duration")
    parser.add_argument("--out", help="result file (default bench/results/ab_<REV>.json)")
    parser.add_argument("--server-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--side", help="run one repetition on this database, print its row")
    parser.add_argument("--migrate", nargs=2, metavar=("MIGRATIONS", "URL"),
                        help="migrate URL to head by the scripts at MIGRATIONS (this process's code)")
    args = parser.parse_args(argv)
    if args.migrate:
        config = Config()
        config.set_main_option("script_location", args.migrate[0])
        with migrate._connection(args.migrate[1]) as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, "head")
        return 0
    if args.side:
        print(json.dumps(one_side(args.side, args.users, args.seconds, args.per_user)))
        return 0
    res = resources()
    tree = res.tempdir("ab-src")
    archive = subprocess.run(["git", "archive", args.rev, "src", "migrations"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    trees = {args.rev: {"PYTHONPATH": f"{tree}/src:{ROOT}"}, "working-tree": {}}
    out: dict = {name: [] for name in trees}
    try:
        urls = {args.rev: migrated_by(f"{tree}/migrations", args.server_url, trees[args.rev]),
                "working-tree": ours_database(args.server_url)}
        for rep in range(args.reps):
            items = list(trees.items())
            for name, env in (items if rep % 2 == 0 else items[::-1]):
                # one side's repetition in a process of its own, on that side's code
                # (its in-process loads and sends too: its schema may differ from ours)
                side = subprocess.run(
                    [sys.executable, "-m", "bench.ab", "--side", urls[name], "--users",
                     str(args.users), "--per-user", str(args.per_user),
                     "--seconds", str(args.seconds), "-"],
                    env={**os.environ, **env}, capture_output=True, text=True)
                if side.returncode != 0:
                    raise SystemExit(f"{name}: {side.stderr[-3000:]}")
                row = json.loads(side.stdout.splitlines()[-1])
                out[name].append(row)
                print(name, {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()},
                      flush=True)
    finally:
        res.release()
    medians = {name: {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "ok"}
               for name, rows in out.items() if rows}
    path = Path(args.out) if args.out else RESULTS / f"ab_{args.rev}.json"
    path.write_text(json.dumps({"rev": args.rev, "users": args.users, "per_user": args.per_user,
                                "reps": out, "medians": medians,
                                "date": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1))
    for name, m in medians.items():
        print(f"{name:>14}: " + ", ".join(f"{k} {v:.2f}" for k, v in m.items()))
    print(path)
    return 0 if all(r["ok"] for rows in out.values() for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
