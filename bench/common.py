"""Shared plumbing: scratch databases, worker processes, polling, statistics, checks."""

import atexit
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

try:
    from agent_inbox.schema import migrate
    from agent_inbox.dev import pgserver
except ImportError:  # a revision before the layers (bench.ab's side on e.g. 5e7d469)
    from agent_inbox import migrate, pgserver

ROOT = Path(__file__).resolve().parent.parent          # /work/main
VENV_BIN = Path(sys.executable).parent
RESULTS = ROOT / "bench" / "results"
# Worker processes' PYTHONPATH: this checkout's src/ first (in a git worktree the
# venv's editable install points at another checkout's src/), then the bench.
TREE_PATH = f"{ROOT / 'src'}{os.pathsep}{ROOT}"
DB_PREFIX = "bench"


# --- cleanup registry -----------------------------------------------------------

class Resources:
    """Every database, process and temp dir this run creates, released at exit
    (normal end, exception, SIGINT or SIGTERM)."""

    def __init__(self):
        self.databases: list[str] = []
        self.processes: list[subprocess.Popen] = []
        self.dirs: list[str] = []
        atexit.register(self.release)
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame):
        self.release()
        raise SystemExit(128 + signum)

    def tempdir(self, prefix: str) -> str:
        path = tempfile.mkdtemp(prefix=f"bench-{prefix}-")
        self.dirs.append(path)
        return path

    def release(self) -> None:
        stop_processes(self.processes, timeout=10)
        self.processes.clear()
        for url in reversed(self.databases):
            try:
                pgserver.drop_database(url)
            except Exception as exc:  # noqa: BLE001 -- report and go on cleaning
                print(f"warning: could not drop {url}: {exc}", file=sys.stderr)
        self.databases.clear()
        for path in self.dirs:
            shutil.rmtree(path, ignore_errors=True)
        self.dirs.clear()

    def database(self, server_url: str, kind: str) -> str:
        url = pgserver.create_database(server_url, prefix=f"{DB_PREFIX}_{kind}")
        self.databases.append(url)
        return url

    def drop(self, url: str) -> None:
        pgserver.drop_database(url)
        if url in self.databases:
            self.databases.remove(url)


RES: Resources | None = None


def resources() -> Resources:
    global RES
    if RES is None:
        RES = Resources()
    return RES


# --- databases ---------------------------------------------------------------------

def ours_database(server_url: str) -> str:
    url = resources().database(server_url, "ours")
    migrate.upgrade(url)
    return url


def peer_database(server_url: str) -> str:
    url = resources().database(server_url, "peer")
    env = dict(os.environ, BENCH_PEER_URL=url, PYTHONPATH=str(ROOT))
    subprocess.run([str(VENV_BIN / "procrastinate"), "--app", "bench.peer_app.app",
                    "schema", "--apply"], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return url


def sql(url: str, statement: str, params=None, fetch: bool = False):
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(statement, params)
        return cur.fetchall() if fetch else None


def scalar(url: str, statement: str, params=None):
    return sql(url, statement, params, fetch=True)[0][0]


def reset_ours(url: str) -> None:
    sql(url, "TRUNCATE events, leases, wakes, outbox, timers RESTART IDENTITY")


def reset_peer(url: str) -> None:
    sql(url, "TRUNCATE procrastinate_jobs, procrastinate_events, procrastinate_periodic_defers,"
             " procrastinate_workers RESTART IDENTITY CASCADE")


def vacuum_analyze(url: str, *tables: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for table in tables:
            conn.execute(f"VACUUM ANALYZE {table}")


# --- worker processes ----------------------------------------------------------------

def spawn(cmd: list[str], env_extra: dict[str, str], log_path: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=TREE_PATH)
    env.update(env_extra)
    log = open(log_path, "ab")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    resources().processes.append(proc)
    return proc


def stop_processes(procs: list[subprocess.Popen], timeout: float = 20) -> None:
    """SIGTERM each (graceful), then SIGKILL what is left after `timeout` seconds."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    reg = resources().processes
    for p in procs:
        if p in reg:
            reg.remove(p)


def ours_worker_cmd(url: str, concurrency: int, poll: float, handler: str = "bench.handlers:handle",
                    extra_args: list[str] = ()) -> list[str]:
    return [str(VENV_BIN / "agent-inbox"), "worker", "--database-url", url,
            "--handler", handler, "--concurrency", str(concurrency),
            "--poll-interval", str(poll), "--log-level", "warning", *extra_args]


def ours_worker_help(env_extra: dict[str, str] | None = None) -> str:
    """`agent-inbox worker --help` as the bench's worker processes would see it (same
    PYTHONPATH): which flags this agent-inbox has (e.g. `--isolation`)."""
    env = dict(os.environ, PYTHONPATH=TREE_PATH)
    env.update(env_extra or {})
    done = subprocess.run([str(VENV_BIN / "agent-inbox"), "worker", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    return done.stdout + done.stderr


def peer_worker_cmd(concurrency: int, poll: float) -> list[str]:
    return [str(VENV_BIN / "procrastinate"), "--app", "bench.peer_app.app",
            "--log-level", "warning", "worker", "--concurrency", str(concurrency),
            "--fetch-job-polling-interval", str(poll)]


@dataclass
class Workers:
    system: str            # "ours" | "peer"
    url: str
    count: int
    concurrency: int
    poll: float
    record_dir: str
    log_dir: str
    procs: list = field(default_factory=list)
    spawned_at: float = 0.0
    env: dict = field(default_factory=dict)   # e.g. PYTHONPATH of another agent-inbox tree
    handler: str = "bench.handlers:handle"    # agent-inbox only
    extra_args: list = field(default_factory=list)  # appended to the worker command

    def start(self) -> None:
        env = {"BENCH_RECORD_DIR": self.record_dir, **self.env}
        if self.system == "ours":
            cmd = ours_worker_cmd(self.url, self.concurrency, self.poll, self.handler,
                                  self.extra_args)
        else:
            cmd = peer_worker_cmd(self.concurrency, self.poll) + list(self.extra_args)
            env["BENCH_PEER_URL"] = self.url
        self.spawned_at = time.time()
        self.procs = [spawn(cmd, env, os.path.join(self.log_dir, f"{self.system}-worker-{n}.log"))
                      for n in range(self.count)]

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def wait_listening(self, timeout: float = 60) -> None:
        """Until every worker process has its LISTEN connection up."""
        dbname = psycopg.conninfo.conninfo_to_dict(self.url)["dbname"]
        if self.system == "ours":
            q = ("SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
                 " AND application_name = 'agent-inbox-listener' AND query ILIKE 'LISTEN%%'")
        else:
            q = ("SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
                 " AND (query ILIKE 'LISTEN%%' OR query = 'SELECT 1')")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.system} worker died at start: see {self.log_dir}")
            if scalar(self.url, q, (dbname,)) >= self.count:
                if self.system == "peer" and scalar(self.url, "SELECT count(*) FROM procrastinate_workers") < self.count:
                    time.sleep(0.05)
                    continue
                return
            time.sleep(0.05)
        raise RuntimeError(f"{self.system} workers not listening after {timeout} s")

    def stop(self) -> None:
        stop_processes(self.procs)
        self.procs = []


def open_count_query(system: str) -> str:
    """1 while any work is open, else 0: each read stops at the first open row, so the 50 ms
    poll costs both systems next to nothing (a count(*) over 20,000 open rows would not).
    Ours as a LIMIT 1, not EXISTS: on Citus an EXISTS over a distributed table is run as a
    subplan that pulls every open row through the coordinator (195 kB, 33 ms a poll at W1's
    start), where LIMIT 1 is pushed to each shard (10 bytes, 4 ms)."""
    if system == "ours":
        return ("SELECT count(*)::int FROM (SELECT 1 FROM events"
                " WHERE status IN ('pending', 'running') LIMIT 1) AS open")
    return "SELECT EXISTS (SELECT 1 FROM procrastinate_jobs WHERE status IN ('todo', 'doing'))::int"


def poll_connection(url: str) -> psycopg.Connection:
    """The connection a drain's poll asks on (autocommit). On Citus its reads
    across shards use one connection a node (`citus.max_adaptive_executor_pool_size`;
    a placeholder setting elsewhere): by default a slow shard makes Citus open
    more connections per read and close them after it, so the poll's cost
    under load would be many times what calibrate_poll measured alone."""
    return psycopg.connect(url, autocommit=True, application_name="bench-poll",
                           options="-c citus.max_adaptive_executor_pool_size=1")


def wait_drained(url: str, system: str, workers: Workers | None, timeout: float,
                 interval: float = 0.05) -> float:
    """Poll every `interval` s until no work is open; the wall time (time.time()) then."""
    query = open_count_query(system)
    deadline = time.monotonic() + timeout
    with poll_connection(url) as conn:
        while True:
            if conn.execute(query).fetchone()[0] == 0:
                return time.time()
            if workers is not None and not workers.alive():
                raise RuntimeError(f"{system} worker died: see {workers.log_dir}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{system}: work still open after {timeout} s")
            time.sleep(interval)


# --- process tree and connection sampling (W5) --------------------------------------------

PAGE = os.sysconf("SC_PAGE_SIZE")


def _stat_fields() -> dict[int, list[bytes]]:
    """pid -> the fields of /proc/<pid>/stat from field 3 (state) on, of every
    process: field n is at index n - 3."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read()
        except OSError:            # gone meanwhile
            continue
        # comm (field 2) may hold spaces and parentheses: split after its last ')'
        out[int(name)] = raw[raw.rindex(b")") + 2:].split()
    return out


def _proc_table() -> dict[int, tuple[int, int, int]]:
    """pid -> (ppid, rss bytes, threads) of every process, from /proc/<pid>/stat."""
    # ppid is field 4, num_threads 20, rss (pages) 24
    return {pid: (int(f[1]), int(f[21]) * PAGE, int(f[17])) for pid, f in _stat_fields().items()}


def process_tree(root: int, table: dict | None = None) -> dict[int, tuple[int, int, int]]:
    """`root` and all its descendants (by parent pid), with their (ppid, rss, threads)."""
    table = _proc_table() if table is None else table
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (ppid, _, _) in table.items():
        children[ppid].append(pid)
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in table and pid not in tree:
            tree[pid] = table[pid]
            todo.extend(children.get(pid, ()))
    return tree


TICK = os.sysconf("SC_CLK_TCK")


def server_cpu_seconds(postmaster: int) -> float:
    """CPU seconds a PostgreSQL server has used so far: the postmaster's own, its
    reaped children's (cutime, cstime) and its live children's. A backend's time
    is counted once, live or, after it exits, reaped (the postmaster waits for
    every child), so the difference of two readings is what the server used
    between them, connections that came and went included."""
    table = _stat_fields()
    # utime is field 14, stime 15, cutime 16, cstime 17
    ticks = sum(int(table[postmaster][n - 3]) for n in (14, 15, 16, 17))
    ticks += sum(int(f[11]) + int(f[12]) for f in table.values() if int(f[1]) == postmaster)
    return ticks / TICK


CONNS_QUERY = """
SELECT coalesce(application_name, ''), count(*) FROM pg_stat_activity
 WHERE datname = %s AND backend_type = 'client backend' AND pid <> pg_backend_pid()
   AND coalesce(application_name, '') NOT LIKE 'bench%%'
 GROUP BY 1
"""


class TreeSampler(threading.Thread):
    """Every `interval` s: the RSS summed over a worker process and all its descendants
    (from /proc), their process and thread counts, and the worker's connections to its
    database (pg_stat_activity rows of that database that are client backends, minus
    the bench's own connections, which all have an application_name starting with
    'bench'). Keeps the peaks. If the tree's RSS passes `rss_cap` bytes or its
    connections pass `conn_cap`, kills the tree (SIGKILL) and says why in `tripped`."""

    def __init__(self, root: int, url: str, *, interval: float = 0.1,
                 rss_cap: int | None = None, conn_cap: int | None = None):
        super().__init__(daemon=True, name="bench-sampler")
        self.root, self.url, self.interval = root, url, interval
        self.rss_cap, self.conn_cap = rss_cap, conn_cap
        self.dbname = psycopg.conninfo.conninfo_to_dict(url)["dbname"]
        self.peak_rss = self.peak_procs = self.peak_threads = self.peak_conns = 0
        self.peak_rss_at = None
        self.peak_conns_by_app: dict[str, int] = {}
        self.samples = 0
        self.tripped: str | None = None
        self.error: str | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            with psycopg.connect(self.url, autocommit=True, application_name="bench-sampler") as conn:
                while not self._halt.is_set():
                    self._sample(conn)
                    self._halt.wait(self.interval)
        except Exception as exc:  # noqa: BLE001 -- reported in the figures
            self.error = repr(exc)

    def _sample(self, conn) -> None:
        tree = process_tree(self.root)
        if not tree:
            return
        rss = sum(r for _, r, _ in tree.values())
        if rss > self.peak_rss:
            self.peak_rss, self.peak_rss_at = rss, time.time()
        self.peak_procs = max(self.peak_procs, len(tree))
        self.peak_threads = max(self.peak_threads, sum(t for _, _, t in tree.values()))
        by_app = dict(conn.execute(CONNS_QUERY, (self.dbname,)).fetchall())
        total = sum(by_app.values())
        if total > self.peak_conns:
            self.peak_conns, self.peak_conns_by_app = total, by_app
        self.samples += 1
        if self.rss_cap and rss > self.rss_cap:
            self._trip(f"rss {rss / 2**20:.0f} MiB > cap {self.rss_cap / 2**20:.0f} MiB", tree)
        elif self.conn_cap and total > self.conn_cap:
            self._trip(f"{total} connections > cap {self.conn_cap}", tree)

    def _trip(self, why: str, tree: dict) -> None:
        self.tripped = why
        for pid in [self.root, *tree]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._halt.set()

    def stop(self) -> dict:
        self._halt.set()
        self.join(5)
        return {"peak_rss_mib": self.peak_rss / 2**20, "peak_processes": self.peak_procs,
                "peak_threads": self.peak_threads, "peak_connections": self.peak_conns,
                "peak_connections_by_app": self.peak_conns_by_app,
                "samples": self.samples, "sampler_error": self.error, "tripped": self.tripped}


def src_fingerprint() -> dict:
    """The agent-inbox code a measurement ran: HEAD, uncommitted files, a hash of src/.
    (Worker processes import src/ when they start: if src/ changes during a run, the
    per-repetition fingerprints in the JSON show it.)"""
    import hashlib
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--short", "--", "src", "migrations"], cwd=ROOT,
                           capture_output=True, text=True).stdout.split("\n")
    digest = hashlib.sha256()
    for path in sorted((ROOT / "src").rglob("*.py")) + sorted((ROOT / "migrations").rglob("*.py")):
        digest.update(path.read_bytes())
    return {"git": head, "uncommitted": [d for d in dirty if d.strip()],
            "sha256": digest.hexdigest()[:16]}


# --- checks ----------------------------------------------------------------------------

def check_runs(records: list[dict], expected_ids: set) -> dict:
    """Exactly-once and per-user non-overlap, from handler records."""
    seen = Counter(i for r in records for i in r["ids"])
    missing = len(expected_ids - set(seen))
    twice = sum(1 for i, n in seen.items() if n > 1)
    unexpected = len(set(seen) - expected_ids)
    by_user = defaultdict(list)
    for r in records:
        by_user[r["u"]].append((r["s"], r["e"]))
    overlaps = 0
    for spans in by_user.values():
        spans.sort()
        for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
            if s1 < e0:
                overlaps += 1
    ok = missing == 0 and twice == 0 and unexpected == 0 and overlaps == 0
    out = {"ok": ok, "runs_recorded": len(records), "events_recorded": sum(seen.values()),
           "missing": missing, "handled_twice": twice, "unexpected": unexpected,
           "overlapping_runs": overlaps}
    if twice:  # evidence: every run that handled a twice-handled event, per user
        doubled = {i for i, n in seen.items() if n > 1}
        users = sorted({r["u"] for r in records if doubled & set(r["ids"])})[:5]
        out["twice_detail"] = {u: sorted(({k: v for k, v in r.items() if k not in ("t0", "ids")}
                                          | {"n_ids": len(r["ids"]), "first_id": r["ids"][0]}
                                          for r in records
                                          if r["u"] == u and doubled & set(r["ids"])),
                                         key=lambda r: r["s"])
                               for u in users[:3]}
    return out


# --- statistics ------------------------------------------------------------------------

def summary(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "runs": []}
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": values}


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100)."""
    s = sorted(values)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, int(round(p / 100 * len(s) + 0.5)) - 1))
    return s[k]
