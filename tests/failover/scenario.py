"""The failover scenario, shared by tests/failover and `python -m bench.failover`.

A durable primary streams to one standby (asynchronously, or synchronously with
synchronous_commit = on or remote_apply: pgserver.standby_of). Two workers, a
dispatcher and a scheduler run as real processes on the libpq multi-host URL
`postgresql://postgres@127.0.0.1:P1,127.0.0.1:P2/db?target_session_attrs=read-write`,
and a feeder thread ingests events steadily through the same URL, recording
each acknowledgement (`ingest` returned True or False; a call that raised is
retried until one of them). While runs are in flight the primary's postmaster
and every process it started are SIGKILLed; `promote_after` seconds later (the
time a failover manager takes to decide) the standby is promoted. Nothing
restarts the services: they must find the new primary by themselves. Then the
feed ends, everything drains, the services stop, and the new primary and the
record files say:

- lost: events acknowledged to the feeder (True or False) and absent;
- handled: acknowledged events that are done;
- calls_repeated: events the handler was called for more than once (a run in
  flight at the kill runs again: at-least-once, expected in every mode);
- runs_repeated: events the handler was called for again after a call whose
  finish had been acknowledged to its worker (its `finished user=.. holder=..
  gen=..` log line): an accepted outcome lost with the old primary;
- sent_twice: outbox keys the channel was handed more than once (a send whose
  mark-sent was not acknowledged goes again under the same key: at-least-once);
- sent_twice_after_ack: keys whose mark-sent the dispatcher saw acknowledged
  twice (its `sent user=.. key=..` log line): a send acknowledged, then lost;
- keys_reused: keys sent with two different texts (a batch lost with the old
  primary whose id the new primary handed out again);
- timers: timers fired and handled (the handler sets one for every tenth feed
  event, handlers.py); timers_lost: those whose feed event is done and whose
  timer never fired; timers_repeated: timer events handled again after a run
  whose finish was acknowledged (part of runs_repeated);
- reconnect_attempts_per_s: the most connection attempts one service process
  made per second while no primary answered (its pool's "error connecting"
  lines, from the kill to the promotion): a backoff, not a storm;
- recovery_s: seconds from the kill until the first run completes on the new
  primary (recovery_after_promotion_s: from the end of the promotion).

Every wait polls the database or a file against a deadline. Every process and
cluster started here is stopped (by pid) and removed in a `finally`.
"""

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psycopg

from agent_inbox import DatabaseUnavailable, Inbox
from agent_inbox.dev import pgserver
from agent_inbox.schema import migrate
from tests.failover import handlers

REPO = Path(__file__).resolve().parents[2]
SOURCE = "feed"
MODES = ("async", "on", "remote_apply")
HANDLER = "tests.failover.handlers:handle"
CHANNEL = "tests.failover.handlers:record_send"


@dataclass
class Config:
    replication: str = "on"         # "async", "on" or "remote_apply"
    events: int = 300
    users: int = 30
    rate: float = 30.0              # events/s the feeder ingests
    kill_after: int = 100           # events acknowledged (and 20 done) before the kill
    promote_after: float = 1.0      # seconds from the kill to pg_ctl promote
    lag: float = 1.0                # seconds the replication link is held before the kill
    send_timeout: int = 10          # the dispatcher's --send-timeout: when a batch claimed
                                    # but not marked sent before the kill goes again
    workers: int = 2
    concurrency: int = 4
    lease_ttl: int = 5
    deadline: float = 90.0          # seconds for the whole run, set-up aside
    keep: bool = False              # keep the work directory (logs, record files)


class Failed(AssertionError):
    """The scenario could not reach a state it waits for; the logs say why."""


# --- processes -------------------------------------------------------------------

@dataclass
class Process:
    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen | None = None

    def start(self, env: dict[str, str]) -> None:
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(self.argv, cwd=REPO, env=env, stdout=out,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def _session_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[3])


def kill_sessions(processes: list[Process]) -> None:
    """SIGKILL, one pid at a time, every live process in the sessions of
    `processes` (a worker's supervisor, its runtime, its quarantine processes)."""
    sessions = {p.popen.pid for p in processes if p.popen is not None}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _session_of(int(entry.name)) in sessions:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)
    for p in processes:
        if p.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(5)


def stop_processes(processes: list[Process], grace: float = 15.0) -> dict[str, int | None]:
    """SIGTERM each (once: a second would skip the graceful shutdown), wait up
    to `grace` seconds, then SIGKILL what is left; the exit codes."""
    for p in processes:
        if p.alive():
            p.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    codes = {}
    for p in processes:
        if p.popen is None:
            continue
        try:
            codes[p.name] = p.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            codes[p.name] = p.popen.wait(10)
    return codes


def cli(command: str, url: str, *options: str) -> list[str]:
    return [sys.executable, "-m", "agent_inbox.cli", command, "--database-url", url, *options]


def service_env(workdir: Path) -> dict[str, str]:
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(REPO)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1",
            "FAILOVER_CALL_LOG": str(workdir / "calls.jsonl"),
            "FAILOVER_SEND_LOG": str(workdir / "sends.jsonl")}


# --- waiting -----------------------------------------------------------------------

def wait_for(check, what: str, timeout: float, every: float = 0.05):
    """Poll `check()` until it returns something true; that value. Failed past `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(psycopg.OperationalError):
            value = check()
            if value:
                return value
        if time.monotonic() > deadline:
            raise Failed(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


def query(url: str, sql: str, *params):
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        return conn.execute(sql, params).fetchone()


def done_count(url: str) -> int:
    return query(url, "SELECT count(*) FROM events WHERE source = %s AND status = 'done'",
                 SOURCE)[0]


# --- the feeder --------------------------------------------------------------------

@dataclass
class Feeder:
    """Ingests `events` events over `users` users at `rate` per second through
    `url`; each event's acknowledgement (True/False and when) is recorded. A
    call that raises is retried (the same key) until it is acknowledged."""

    url: str
    events: int
    users: int
    rate: float
    retry_for: float = 60.0
    acks: dict[str, tuple[bool, float]] = field(default_factory=dict)
    errors: list[tuple[float, str]] = field(default_factory=list)
    failure: BaseException | None = None

    def __post_init__(self):
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="failover-feeder", daemon=True)

    def start(self) -> "Feeder":
        self.thread.start()
        return self

    def acknowledged(self) -> int:
        with self._lock:
            return len(self.acks)

    def _run(self) -> None:
        try:
            with Inbox.connect(self.url, pool_size=2, application_name="failover-feeder") as inbox:
                started = time.monotonic()
                for n in range(self.events):
                    pause = started + n / self.rate - time.monotonic()
                    if pause > 0:
                        time.sleep(pause)  # the feed's pace, not a wait for a state
                    key = f"e{n:05d}"
                    stored = self._ingest(inbox, f"user-{n % self.users:03d}", key, {"n": n})
                    with self._lock:
                        self.acks[key] = (stored, time.time())
        except BaseException as exc:  # noqa: BLE001 - reported by the scenario
            self.failure = exc

    def _ingest(self, inbox: Inbox, user: str, key: str, payload: dict) -> bool:
        deadline = time.monotonic() + self.retry_for
        while True:
            try:
                return inbox.ingest(user, SOURCE, key, payload)
            except DatabaseUnavailable as exc:
                self.errors.append((time.time(), str(exc).splitlines()[0][:200]))
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)  # a client's retry pace


# --- the replication link -----------------------------------------------------------

class Relay:
    """A TCP relay on a loopback port in front of the primary's: the standby
    streams through it. `hold()` stops forwarding (what is read stays in the
    relay, what is not stays in the kernel: a congested link, a standby that
    lags); `cut()` closes every connection and the listener, dropping what was
    held: WAL the primary wrote that never reaches the standby."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.flowing = threading.Event()
        self.flowing.set()
        self.closed = threading.Event()
        self.sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                up.settimeout(None)
            except OSError:
                down.close()
                continue
            with self._lock:
                if self.closed.is_set():
                    down.close()
                    up.close()
                    return
                self.sockets += [down, up]
            for src, dst in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while True:
                data = src.recv(65536)
                if not data:
                    break
                while not self.flowing.wait(0.05):  # held: keep it, read no more
                    if self.closed.is_set():
                        return
                if self.closed.is_set():
                    return
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def hold(self) -> None:
        self.flowing.clear()

    def cut(self) -> None:
        self.closed.set()
        with contextlib.suppress(OSError):
            self.listener.close()
        with self._lock:
            for sock in self.sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


# --- the clusters --------------------------------------------------------------------

@contextlib.contextmanager
def replicated_pair(replication: str):
    """(primary, standby, relay) for `replication` ("async", "on",
    "remote_apply"), the standby streaming through the relay; both clusters
    stopped and removed when the block ends, however it ends."""
    if replication not in MODES:
        raise ValueError(f"replication must be one of {MODES}: {replication!r}")
    primary = standby = relay = None
    try:
        primary = pgserver.ReplicatedCluster(durable=True).start()
        relay = Relay(primary.port)
        synchronous = False if replication == "async" else replication
        standby = pgserver.standby_of(primary, synchronous=synchronous, name="standby1",
                                      upstream_port=relay.port)
        yield primary, standby, relay
    finally:
        if relay is not None:
            relay.cut()
        for cluster in (standby, primary):
            if cluster is not None:
                cluster.stop()


def fresh_database(primary: pgserver.ReplicatedCluster,
                   standby: pgserver.StandbyCluster) -> tuple[str, str]:
    """A migrated database on the primary, replayed on the standby; (dbname,
    the multi-host URL)."""
    url = pgserver.create_database(primary.url, prefix="agent_inbox_failover")
    migrate.upgrade(url)
    standby.wait_replayed()
    dbname = pgserver.conninfo.conninfo_to_dict(url)["dbname"]
    return dbname, pgserver.multi_host_url([primary, standby], dbname)


# --- the scenario --------------------------------------------------------------------

FINISHED = re.compile(r"finished user=(\S+) holder=(\S+) gen=(\d+) ")
POOL_ERROR = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) WARNING psycopg\.pool "
                        r"error connecting", re.M)
MARKED = re.compile(r"sent user=(\S+) messages=\d+ key=(\S+)")


def run(config: Config, log=print) -> dict:
    """Run the scenario once; its figures (see the module docstring). The
    feeder's pool warns of each failed connection while no primary answers:
    those warnings are muted here (the services' logs keep theirs)."""
    pool_log = logging.getLogger("psycopg.pool")
    level = pool_log.level
    pool_log.setLevel(logging.ERROR)
    try:
        return _run(config, log)
    finally:
        pool_log.setLevel(level)


def _run(config: Config, log) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"agent-inbox-failover-{config.replication}-"))
    processes: list[Process] = []
    feeder = None
    try:
        with replicated_pair(config.replication) as (primary, standby, relay):
            dbname, url = fresh_database(primary, standby)
            primary_url = pgserver.with_database(primary.url, dbname)
            standby_url = pgserver.with_database(standby.url, dbname)
            log(f"[failover {config.replication}] primary :{primary.port}, standby :{standby.port}"
                f" ({primary.replication_state()}); {url}; logs in {workdir}")
            env = service_env(workdir)
            for k in range(config.workers):
                processes.append(Process(f"worker-{k}", cli(
                    "worker", url, "--handler", HANDLER, "--concurrency", str(config.concurrency),
                    "--poll-interval", "0.2", "--lease-ttl", str(config.lease_ttl),
                    "--retry-backoff", "1", "--max-attempts", "5", "--grace", "5",
                    "--log-level", "info"), workdir / f"worker-{k}.log"))
            processes.append(Process("scheduler", cli(
                "scheduler", url, "--poll-interval", "0.2", "--log-level", "info"),
                workdir / "scheduler.log"))
            processes.append(Process("dispatcher", cli(
                "dispatcher", url, "--channel", CHANNEL, "--outbox-gap", "0",
                "--send-timeout", str(config.send_timeout), "--poll-interval", "0.2",
                "--log-level", "info"), workdir / "dispatcher.log"))
            for p in processes:
                p.start(env)
            began = time.monotonic()
            left = lambda: max(1.0, config.deadline - (time.monotonic() - began))  # noqa: E731

            feeder = Feeder(url, config.events, config.users, config.rate).start()
            wait_for(lambda: feeder.acknowledged() >= config.kill_after
                     and done_count(primary_url) >= 20,
                     f"{config.kill_after} events acknowledged and 20 done", left())
            calls_file = workdir / "calls.jsonl"
            in_flight = _calls(calls_file)

            if config.lag:
                relay.hold()
                time.sleep(config.lag)  # the lag modelled: WAL piles up behind the link
            running = query(primary_url, "SELECT count(*) FROM events WHERE status = 'running'")[0]
            t_kill = time.time()
            pid = primary.kill()
            relay.cut()  # what the link held dies with the primary's machine
            log(f"[failover {config.replication}] SIGKILLed the primary (postmaster {pid}) with "
                f"{feeder.acknowledged()} events acknowledged, {len(in_flight)} handler calls made, "
                f"{running} events in runs in flight")
            time.sleep(config.promote_after)  # the failover manager's decision time
            baseline = done_count(standby_url)  # read-only until promoted: no run can commit
            promote_s = standby.promote()
            t_promoted = time.time()
            log(f"[failover {config.replication}] promoted the standby in {promote_s:.2f} s "
                f"({baseline} events done on it)")
            wait_for(lambda: done_count(standby_url) > baseline,
                     "a run to complete on the new primary", left())
            t_first_run = time.time()

            wait_for(lambda: not feeder.thread.is_alive(), "the feed to end", left(), every=0.1)
            if feeder.failure is not None:
                raise Failed(f"the feeder failed: {feeder.failure!r}")
            try:
                wait_for(lambda: query(standby_url, """
                    SELECT (SELECT count(*) FROM events WHERE status IN ('pending', 'running')) = 0
                       AND (SELECT count(*) FROM outbox WHERE sent_at IS NULL AND failed_at IS NULL) = 0
                       AND NOT EXISTS (SELECT 1 FROM timers WHERE NOT done)
                    """)[0], "every event done, every timer fired and every message sent",
                    left(), every=0.1)
            except Failed as exc:
                raise Failed(f"{exc}; on the new primary: {drain_state(standby_url)}") from None
            codes = stop_processes(processes)
            figures = analyse(config, workdir, standby_url, feeder, processes,
                              t_kill=t_kill, t_promoted=t_promoted, t_first_run=t_first_run)
            figures["running_at_kill"] = running
            figures["exit_codes"] = codes
            figures["promote_s"] = round(promote_s, 2)
            return figures
    except BaseException:
        config.keep = True
        for p in processes:
            lines = [line for line in p.text().splitlines()
                     if not line.startswith(("\t", "- host", "Multiple connection"))]
            tail = "\n".join(lines[-25:])
            log(f"--- {p.name} (last lines) ---\n{tail}")
        raise
    finally:
        kill_sessions(processes)
        if not config.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            log(f"[failover {config.replication}] logs kept in {workdir}")


def drain_state(url: str) -> dict:
    """What is left to do on `url`: events by status, messages held, batches claimed."""
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        return {
            "events": dict(conn.execute("SELECT status, count(*) FROM events GROUP BY 1")),
            "timers": conn.execute("SELECT count(*) FROM timers WHERE NOT done").fetchone()[0],
            "held": conn.execute("SELECT count(*) FROM outbox WHERE sent_at IS NULL"
                                 " AND failed_at IS NULL").fetchone()[0],
            "claimed": conn.execute(
                "SELECT user_id, batch, sending_until - extract(epoch FROM now())::bigint"
                " FROM deliveries WHERE batch IS NOT NULL").fetchall(),
        }


def reconnect_rate(processes: list[Process], start: float, end: float) -> float:
    """The most connection attempts per second one process logged in [start, end]."""
    seconds = end - start + 2
    counts = []
    for p in processes:
        stamps = [time.mktime(time.strptime(at[:19], "%Y-%m-%d %H:%M:%S")) + int(at[20:]) / 1000
                  for at in POOL_ERROR.findall(p.text())]
        counts.append(sum(1 for t in stamps if start - 1 <= t <= end + 1))
    return round(max(counts, default=0) / seconds, 2)


def _calls(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def analyse(config: Config, workdir: Path, url: str, feeder: Feeder, processes: list[Process],
            *, t_kill: float, t_promoted: float, t_first_run: float) -> dict:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute("SELECT source_id, status FROM events WHERE source = %s",
                            (SOURCE,)).fetchall()
        timer_rows = conn.execute("SELECT source_id, status FROM events"
                                  " WHERE source = 'timer'").fetchall()
    status = dict(rows)
    timers = dict(timer_rows)
    timers_lost = sorted(f"t{int(k[1:])}" for k, st in status.items()
                         if st == "done" and int(k[1:]) % handlers.TIMER_EVERY == 0
                         and timers.get(f"t{int(k[1:])}") != "done")
    acked = dict(feeder.acks)
    lost = sorted(k for k in acked if k not in status)
    handled = sum(1 for k in acked if status.get(k) == "done")
    dead = sum(1 for k in acked if status.get(k) == "dead")

    calls = _calls(workdir / "calls.jsonl")
    finished = set()
    for p in processes:
        if p.name.startswith("worker"):
            finished.update(FINISHED.findall(p.text()))
    per_key: dict[str, list[dict]] = defaultdict(list)
    for call in sorted(calls, key=lambda c: c["t"]):
        for key in call["keys"]:
            per_key[key].append(call)
    calls_repeated = sorted(k for k, cs in per_key.items() if len(cs) > 1)
    runs_repeated = sorted(
        k for k, cs in per_key.items()
        if any((c["user"], c["holder"], str(c["gen"])) in finished for c in cs[:-1]))

    sends = _calls(workdir / "sends.jsonl")
    keys = Counter(s["key"] for s in sends)
    texts = defaultdict(set)
    for s in sends:
        texts[s["key"]].add(s["text"])
    marked = Counter(key for p in processes if p.name == "dispatcher"
                     for _, key in MARKED.findall(p.text()))
    sent_keys_per_event = defaultdict(set)
    for s in sends:  # a batch of several messages is one text, joined by blank lines
        for body in s["text"].split("\n\n"):
            for key in json.loads(body)["keys"]:
                sent_keys_per_event[key].add(body)
    return {
        "replication": config.replication,
        "events": len(acked),
        "handled": handled,
        "lost": len(lost),
        "runs_repeated": len(runs_repeated),
        "sent_twice": sum(1 for n in keys.values() if n > 1),
        "recovery_s": round(t_first_run - t_kill, 2),
        "recovery_after_promotion_s": round(t_first_run - t_promoted, 2),
        "calls_repeated": len(calls_repeated),
        "sent_twice_after_ack": sum(1 for n in marked.values() if n > 1),
        "keys_reused": sum(1 for t in texts.values() if len(t) > 1),
        "effects_repeated": sum(1 for t in sent_keys_per_event.values() if len(t) > 1),
        "timers": sum(1 for st in timers.values() if st == "done"),
        "timers_lost": len(timers_lost),
        "timers_repeated": sum(1 for k in runs_repeated if k.startswith("t")),
        "reconnect_attempts_per_s": reconnect_rate(processes, t_kill, t_promoted),
        "dead": dead,
        "ingest_errors": len(feeder.errors),
        "acked_after_kill": sum(1 for _, t in acked.values() if t > t_kill),
        "lost_keys": lost[:20],
        "runs_repeated_keys": runs_repeated[:20],
        "config": asdict(config),
    }
