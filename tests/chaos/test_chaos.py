"""Chaos: the runtime's guarantees hold with real processes under real faults.

Six worker processes (two per test host, each host a network namespace), a
scheduler and a dispatcher run against a throwaway PostgreSQL: 10,000 events
for 240 users, two thirds of them ingested up front (a backlog worked off in big
batches), the rest streamed in while faults are injected, among them 10 poison
events (they kill whatever process runs them); recurring timers fire
throughout. Workers are SIGKILLed and restarted, one is SIGSTOPped for longer
than the lease TTL, one host is cut off from the database for longer than the
TTL, PostgreSQL is restarted, an operator pauses a user with its run in flight
cancelled and resumes it, and pauses the whole fleet (cancelling every run in
flight) and resumes it (store/pauses.py). Before each fault the suite waits, polling
the database, for progress (more events done) and for the previous fault's
retries to have run, so each fault costs a healthy event at most one attempt:
a healthy event parked dead then means a defect, not bad luck. When the stream
ends, everything drains and stops, and the database alone must show: each
healthy event done by exactly one accepted run, poison dead after max_attempts,
accepted runs per user in strictly increasing generation and never overlapping
in lease time, each timer occurrence fired once on its grid, each message
delivered (see checks.py).

The summary is printed and written to tests/chaos/last_run.json.
"""

import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest

from agent_inbox import Inbox, errors
from agent_inbox.schema import migrate
from agent_inbox.dev import pgserver
from tests.chaos import checks
from tests.chaos.fleet import Network, Service, Supervisor, Timeline, signal_sessions
from tests.chaos.workload import (Feeder, Item, Probe, TimerSpec, add_timers, build_events,
                                  ingest_now)

REPO = Path(__file__).resolve().parents[2]
SUMMARY_PATH = Path(__file__).with_name("last_run.json")

SEED = 20240501
USERS, HEALTHY, POISON, PRELOAD = 240, 10_000, 10, 6_600
FEED_SECONDS = 80          # the other 3,400 (~42/s) stream in over this long, through the
                           # faults: runs stay small, so a fault costs a few retries, not hundreds
LANES, WORKERS_PER_LANE, CONCURRENCY = 3, 2, 4
LEASE_TTL, MAX_ATTEMPTS, RETRY_BACKOFF = 3, 3, 1
STALL_SECONDS = PARTITION_SECONDS = 5   # each longer than the TTL
PROGRESS = 100             # done events between two faults (~3 s of the stream)
BUDGET = 200               # seconds from the first ingest to the last wait (set-up aside)
MAX_RESTARTS = 60
# Poison events are faults too: each "poison" step ingests POISON_PER_STEP of them at once,
# so the workers they kill on their first attempt die within the same second.
FAULTS = ["kill", "poison", "cancel", "stall", "poison", "kill", "partition", "fleet_pause",
          "poison", "kill", "pg_restart", "cancel", "poison", "kill", "poison", "kill"]
PAUSE_SECONDS = 2          # how long an operator's pause lasts
POISON_PER_STEP = 2
TIMERS = [TimerSpec(user, f"tick-{every}s", every)
          for user, every in [("user-0001", 1), ("user-0002", 1), ("user-0003", 2),
                              ("user-0004", 2), ("user-0100", 1), ("user-0200", 2)]]


@dataclass
class Rig:
    cluster: pgserver.TemporaryCluster
    network: Network
    dbname: str
    workdir: Path
    timeline: Timeline
    services: list[Service] = field(default_factory=list)
    supervisor: Supervisor | None = None

    def url(self, host: str = "127.0.0.1") -> str:
        return f"postgresql://postgres@{host}:{self.cluster.port}/{self.dbname}"

    @property
    def send_log(self) -> Path:
        return self.workdir / "sends.jsonl"

    @property
    def run_log(self) -> Path:
        return self.workdir / "handler-calls.txt"

    def workers(self) -> list[Service]:
        return [s for s in self.services if s.name.startswith("worker")]

    def service(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)


@pytest.fixture
def rig():
    try:
        pgserver.find_bindir()
    except errors.DatabaseUnavailable as exc:
        pytest.skip(str(exc))
    timeline = Timeline()
    network = Network(LANES).create()
    cluster = None
    rig = None
    try:
        cluster = pgserver.TemporaryCluster(
            settings={"listen_addresses": ",".join(network.server_addresses())},
            trusted_networks=("198.18.0.0/15",)).start()
        url = pgserver.create_database(cluster.url, prefix="agent_inbox_chaos")
        migrate.upgrade(url)
        workdir = Path(tempfile.mkdtemp(prefix="agent-inbox-chaos-"))  # kept if the test fails
        rig = Rig(cluster, network, pgserver.conninfo.conninfo_to_dict(url)["dbname"],
                  workdir, timeline)
        timeline.log("setup", f"PostgreSQL on port {cluster.port} at "
                              f"{', '.join(network.server_addresses())}; logs in {rig.workdir}")
        yield rig
    finally:
        if rig is not None:
            tear_down(rig)
        if cluster is not None:
            cluster.stop()
        network.destroy()


def tear_down(rig: Rig) -> None:
    """Stop restarting, stop every service by pid, then kill anything left in
    the sessions we started (handler children, orphans)."""
    if rig.supervisor is not None:
        rig.supervisor.stop()
    for service in rig.services:
        service.stop(grace=1.0)
    sessions = set().union(*(s.sessions for s in rig.services)) if rig.services else set()
    if signal_sessions(sessions):
        rig.timeline.log("cleanup", "killed leftover processes in our sessions")


# --- services ----------------------------------------------------------------------

def service_env(rig: Rig) -> dict[str, str]:
    """Our environment, with the repository importable (tests.chaos.handlers)."""
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(REPO)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1",
            "CHAOS_SEND_LOG": str(rig.send_log), "CHAOS_RUN_LOG": str(rig.run_log)}


def cli(command: str, url: str, *options: str) -> list[str]:
    return [sys.executable, "-m", "agent_inbox.cli", command, "--database-url", url, *options]


def start_services(rig: Rig) -> None:
    env = service_env(rig)
    for lane in rig.network.lanes:
        for k in range(WORKERS_PER_LANE):
            argv = cli("worker", rig.url(lane.server_addr),
                       "--handler", "tests.chaos.handlers:handle",
                       "--concurrency", str(CONCURRENCY), "--lease-ttl", str(LEASE_TTL),
                       "--retry-backoff", str(RETRY_BACKOFF), "--max-attempts", str(MAX_ATTEMPTS),
                       "--poll-interval", "0.5", "--grace", "3")
            name = f"worker-{lane.index}{'abcdef'[k]}"
            rig.services.append(Service(name, lane.wrap(argv), env, str(REPO),
                                        rig.workdir / f"{name}.log", lane))
    rig.services.append(Service("scheduler", cli("scheduler", rig.url(), "--poll-interval", "0.5"),
                                env, str(REPO), rig.workdir / "scheduler.log"))
    rig.services.append(Service("dispatcher", cli("dispatcher", rig.url(),
                                                  "--channel", "tests.chaos.handlers:record_send",
                                                  "--outbox-gap", "0", "--poll-interval", "0.5"),
                                env, str(REPO), rig.workdir / "dispatcher.log"))
    for service in rig.services:
        service.start()
    rig.supervisor = Supervisor(rig.services, rig.timeline, max_restarts=MAX_RESTARTS)
    rig.supervisor.start()
    rig.timeline.log("start", ", ".join(f"{s.name}={s.pid}" for s in rig.services))


def stop_service(rig: Rig, name: str, grace: float = 10.0) -> int | None:
    """Stop one service for good (the supervisor no longer restarts it)."""
    service = rig.service(name)
    with rig.supervisor.lock:
        rig.supervisor.services.remove(service)
    code = service.stop(grace)
    rig.timeline.log("stop", f"{name} pid {service.pid} exited {code}")
    return code


def stop_everything(rig: Rig, grace: float = 8.0) -> dict[str, int | None]:
    """SIGTERM every service still running, at once, once each has started (a
    worker the last fault restarted may still be importing: a SIGTERM then is
    Python's default, not the service's shutdown); SIGKILL whatever outlives `grace`."""
    rig.supervisor.stop()
    running = [s for s in rig.services if s.exit_code() is None]
    starting = time.monotonic() + 30
    while any(s.exit_code() is None and not s.ready() for s in running):
        if time.monotonic() > starting:
            rig.timeline.log("stop", "not started after 30 s: " + " ".join(
                s.name for s in running if not s.ready()))
            break
        time.sleep(0.05)  # polling the services' logs
    for service in running:
        service.terminate()
    deadline = time.monotonic() + grace
    codes = {}
    for service in running:
        codes[service.name] = service.wait_or_kill(max(0.1, deadline - time.monotonic()))
    rig.timeline.log("stop", " ".join(f"{n}={c}" for n, c in codes.items()))
    return codes


# --- faults ------------------------------------------------------------------------

def await_calm(rig: Rig, probe: Probe, deadline: float) -> None:
    """Block until PROGRESS more events are done than now and no healthy event
    has a retry outstanding (the last fault has been recovered from)."""
    start = probe.wait("the database", lambda c: True, 30)["done"]
    probe.wait(f"{PROGRESS} more done events and no retry outstanding",
               lambda c: c["done"] >= start + PROGRESS and c["retrying"] == 0,
               max(1.0, deadline - time.monotonic()))


def fault_kill(rig: Rig, chaos: "Chaos") -> None:
    with rig.supervisor.lock:
        victim = chaos.rng.choice(rig.supervisor.alive_of(rig.workers()))
        pid = rig.supervisor.kill(victim)
    rig.timeline.log("fault", f"SIGKILL {victim.name} pid {pid}")


def fault_stall(rig: Rig, chaos: "Chaos") -> None:
    with rig.supervisor.lock:
        victim = chaos.rng.choice(rig.supervisor.alive_of(rig.workers()))
        signal_sessions({victim.pid}, signal.SIGSTOP)   # the supervisor and its runtime
    rig.timeline.log("fault", f"SIGSTOP {victim.name} pid {victim.pid} for {STALL_SECONDS}s "
                              f"(lease TTL {LEASE_TTL}s)")
    try:
        time.sleep(STALL_SECONDS)
    finally:
        signal_sessions({victim.pid}, signal.SIGCONT)
        rig.timeline.log("heal", f"SIGCONT {victim.name} pid {victim.pid}")


def fault_partition(rig: Rig, chaos: "Chaos") -> None:
    if not rig.network.namespaces_used:
        rig.timeline.log("skip", "partition skipped: no network namespaces on this machine")
        return
    lane = chaos.rng.choice(rig.network.lanes)
    rig.network.partition(lane)
    rig.timeline.log("fault", f"link {lane.host_if} down: {lane.namespace} cut off for "
                              f"{PARTITION_SECONDS}s")
    try:
        time.sleep(PARTITION_SECONDS)
    finally:
        rig.network.heal(lane)
        rig.timeline.log("heal", f"link {lane.host_if} up")


def fault_pg_restart(rig: Rig, chaos: "Chaos") -> None:
    rig.timeline.log("fault", "PostgreSQL restart (fast shutdown: every connection dropped)")
    started = time.monotonic()
    rig.cluster.restart()
    rig.timeline.log("heal", f"PostgreSQL up again after {time.monotonic() - started:.2f}s")


def fault_poison(rig: Rig, chaos: "Chaos") -> None:
    batch, chaos.poison = chaos.poison[:POISON_PER_STEP], chaos.poison[POISON_PER_STEP:]
    ingest_now(rig.url(), batch)
    rig.timeline.log("fault", "poison ingested for " + ", ".join(i.user for i in batch))


def fault_cancel(rig: Rig, chaos: "Chaos") -> None:
    """An operator pauses a user whose run is in flight, cancelling it, and
    resumes it PAUSE_SECONDS later: the run commits nothing, its events are
    pending again with the attempt undone, and run after the resume."""
    with Inbox.connect(rig.url(), pool_size=1) as inbox:
        running = _running_users(rig)
        if not running:
            rig.timeline.log("skip", "cancel skipped: no run in flight")
            return
        user = chaos.rng.choice(running)
        done = inbox.pause(user, actor="chaos", reason="chaos", cancel=True)
        events = (done["cancelled"] or {}).get("events", [])
        rig.timeline.log("fault", f"pause --cancel {user}: {len(events)} events pending again")
        time.sleep(PAUSE_SECONDS)
        inbox.resume(user, actor="chaos")
        rig.timeline.log("heal", f"resume {user}")


def fault_fleet_pause(rig: Rig, chaos: "Chaos") -> None:
    """The emergency brake: every run in flight cancelled, no run and no send
    for PAUSE_SECONDS, then the fleet resumed."""
    with Inbox.connect(rig.url(), pool_size=1) as inbox:
        done = inbox.pause_fleet(actor="chaos", reason="chaos", cancel=True)
        rig.timeline.log("fault", f"pause --all --cancel: {len(done['cancelled'])} runs cancelled")
        time.sleep(PAUSE_SECONDS)
        inbox.resume_fleet(actor="chaos")
        rig.timeline.log("heal", "resume --all")


def _running_users(rig: Rig) -> list[str]:
    with psycopg.connect(rig.url(), autocommit=True) as conn:
        return [user for user, in conn.execute(
            "SELECT DISTINCT user_id FROM events WHERE status = 'running' ORDER BY 1")]


FAULT_ACTIONS = {"kill": fault_kill, "stall": fault_stall, "partition": fault_partition,
                 "pg_restart": fault_pg_restart, "poison": fault_poison, "cancel": fault_cancel,
                 "fleet_pause": fault_fleet_pause}


@dataclass
class Chaos:
    rng: random.Random
    poison: list[Item]


def run_faults(rig: Rig, probe: Probe, chaos: Chaos, deadline: float) -> None:
    for name in FAULTS:
        await_calm(rig, probe, deadline)
        in_flight = (probe.counts() or {}).get("running")
        rig.timeline.log("before", f"{name}: {in_flight} events running")
        FAULT_ACTIONS[name](rig, chaos)


# --- the test ----------------------------------------------------------------------

def handler_calls(rig: Rig) -> dict[str, int]:
    calls = [line.split() for line in rig.run_log.read_text().splitlines()] \
        if rig.run_log.exists() else []
    return {"handler_calls": len(calls),
            "quarantine_runs": sum(1 for where, *_ in calls if where == "quarantine")}


RUN_LINE = re.compile(r"(lease lost|finished|finish refused by the fence) "
                      r"user=(\S+) holder=(\S+) gen=(\d+)")


def runtime_restarts(rig: Rig) -> int:
    """Worker runtimes that died under their supervisor (a poison event's first
    attempt) and were started again."""
    return sum(path.read_text(errors="replace").count("agent-inbox worker: the runtime")
               for path in rig.workdir.glob("worker-*.log"))


def worker_log_stats(rig: Rig) -> dict[str, int]:
    """What the workers said about their runs: leases lost by runs that then
    committed nothing, finishes the fence refused, and 'lease lost' warnings
    about runs whose finish had in fact been accepted (a renewal racing it)."""
    said: dict[str, set] = {"lease lost": set(), "finished": set(),
                            "finish refused by the fence": set()}
    for path in rig.workdir.glob("worker-*.log"):
        for match in RUN_LINE.finditer(path.read_text(errors="replace")):
            said[match.group(1)].add(match.groups()[1:])
    lost, finished = said["lease lost"], said["finished"]
    return {"lost_leases": len(lost - finished),
            "lease_lost_warnings_after_accepted_finish": len(lost & finished),
            "fenced_finishes": len(said["finish refused by the fence"])}


def run_checks(rig: Rig, items, timers) -> tuple[list[str], list[dict], dict]:
    snap = checks.Snapshot.load(rig.url())
    snap.dump(rig.workdir / "snapshot.json")
    problems = checks.check_ingest(snap, items)
    outcome_problems, healthy_dead = checks.check_outcomes(snap, MAX_ATTEMPTS)
    problems += outcome_problems
    problems += checks.check_runs(snap)
    problems += checks.check_leases(snap)
    problems += checks.check_timers(snap, timers)
    problems += checks.check_deliveries(snap, rig.send_log)
    return problems, healthy_dead, snap.stats


def summarise(rig: Rig, stats: dict, extra: dict) -> dict:
    tl, sup = rig.timeline, rig.supervisor
    summary = {
        "duration_s": round(tl.elapsed(), 1),
        "namespaces": rig.network.namespaces_used,
        "fallback_reason": rig.network.fallback_reason or None,
        "workers": len(rig.workers()),
        "kills": sum(1 for e in tl.entries if e["detail"].startswith("SIGKILL")),
        "runtime_restarts": runtime_restarts(rig),
        "restarts": sup.restarts,
        "stalls": sum(1 for e in tl.entries if e["detail"].startswith("SIGSTOP")),
        "partitions": sum(1 for e in tl.entries if e["detail"].startswith("link") and
                          e["kind"] == "fault"),
        "pg_restarts": sum(1 for e in tl.entries if e["detail"].startswith("PostgreSQL restart")),
        "cancels": sum(1 for e in tl.entries if e["detail"].startswith("pause --cancel")),
        "fleet_pauses": sum(1 for e in tl.entries if e["detail"].startswith("pause --all")),
        **stats,
        **worker_log_stats(rig),
        **handler_calls(rig),
        **extra,
        "logs": None if extra.get("passed") else str(rig.workdir),
        "faults": [e for e in tl.entries if e["kind"] in ("before", "fault", "heal", "skip")],
    }
    SUMMARY_PATH.write_text(json.dumps(summary, indent=2) + "\n")
    print("\n[chaos] summary: " + json.dumps({k: v for k, v in summary.items() if k != "faults"}),
          flush=True)
    return summary


def live_phase(rig: Rig, probe: Probe, feeder: Feeder, chaos: Chaos,
               deadline: float) -> None:
    """Work off the backlog, stream the rest in under faults, drain, deliver."""
    tl = rig.timeline

    def left() -> float:
        return max(1.0, deadline - time.monotonic())

    backlog = probe.wait("the preloaded backlog worked off", lambda c: c["open"] <= 20, left())
    tl.log("backlog", json.dumps(backlog))
    feeder.start()
    run_faults(rig, probe, chaos, deadline)
    tl.log("faults", "all faults injected")
    feeder.join(left())
    tl.log("ingest", f"feed finished: {feeder.stored} stored, {feeder.duplicates} "
                     f"duplicate deliveries, {feeder.retries} retried")
    stop_service(rig, "scheduler")
    tl.log("reached", json.dumps(probe.wait("every event done or dead",
                                            lambda c: c["open"] == 0, left())))
    tl.log("reached", json.dumps(probe.wait("every message sent",
                                            lambda c: c["unsent"] == 0, left())))


@pytest.mark.slow
def test_chaos(rig):
    deadline = time.monotonic() + BUDGET
    rng = random.Random(SEED)
    tl = rig.timeline
    preloaded, fed, poison = build_events(rng, users=USERS, healthy=HEALTHY, poison=POISON,
                                          preload=PRELOAD)
    timers = add_timers(rig.url(), TIMERS)
    Feeder(rig.url(), preloaded, seconds=0).start().join(60)
    tl.log("ingest", f"{len(preloaded)} events preloaded; {len(fed)} more to stream over "
                     f"{FEED_SECONDS}s, {len(poison)} poison with the faults; "
                     f"{len(timers)} timers armed")

    start_services(rig)
    probe = Probe(rig.url())
    stuck = []  # waits that ran out of time: reported with the checks, not instead of them
    feeder = Feeder(rig.url(), fed, seconds=FEED_SECONDS)
    try:
        live_phase(rig, probe, feeder, Chaos(rng, list(poison)), deadline)
    except AssertionError as exc:  # a wait ran out of time: report it with the checks
        tl.log("stuck", str(exc))
        stuck.append(str(exc))
    finally:
        probe.close()
        exit_codes = stop_everything(rig)

    problems, healthy_dead, stats = run_checks(rig, preloaded + fed + poison, timers)
    problems = stuck + problems
    unclean = {name: code for name, code in exit_codes.items() if code != 0}
    summary = summarise(rig, stats, {
        "ingest_duplicates": feeder.duplicates, "ingest_retries": feeder.retries,
        "unclean_shutdowns": unclean, "problems": problems, "passed": not problems and
        not healthy_dead and not unclean})

    assert not problems, "invariants broken:\n" + "\n".join(problems)
    assert not healthy_dead, (
        f"{len(healthy_dead)} healthy events parked dead (goal: none): "
        + "; ".join(f"event {e['id']} of {e['user_id']}: {e['attempts']} attempts, {e['error']}"
                    for e in healthy_dead[:10]))
    assert not unclean, f"services that did not stop cleanly on SIGTERM: {unclean}"
    assert summary["kills"] >= 4 and summary["restarts"] >= summary["kills"]
    shutil.rmtree(rig.workdir, ignore_errors=True)  # passed: the logs are not needed
