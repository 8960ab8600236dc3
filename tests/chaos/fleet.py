"""The chaos suite's machinery: test hosts in network namespaces, service processes
tracked by pid, a supervisor that restarts workers, and a timestamped fault log.

It proves nothing by itself; it makes the faults real. Each namespace is a test
host joined to this machine by a veth pair numbered from 198.18.0.0/15 (the
benchmarking range, never a private or public one): PostgreSQL listens on the
host side, workers connect from the namespace side, and taking the host side
down partitions that host. Every process is started in a session of its own, so
cleanup can find its descendants (handler children, orphans) by session id and
kill each by pid. Nothing is ever killed by name.
"""

import contextlib
import ipaddress
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

NETWORK = ipaddress.ip_network("198.18.0.0/15")
LOOPBACK = "127.0.0.1"


# --- the fault log -----------------------------------------------------------------

class Timeline:
    """Everything that happens, stamped with wall-clock time and seconds since start."""

    def __init__(self):
        self.started = time.monotonic()
        self.entries: list[dict] = []
        self._lock = threading.Lock()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def log(self, kind: str, detail: str = "") -> None:
        entry = {"t": round(self.elapsed(), 2), "at": time.strftime("%H:%M:%S"),
                 "kind": kind, "detail": detail}
        with self._lock:
            self.entries.append(entry)
        print(f"[chaos {entry['at']} +{entry['t']:7.2f}s] {kind}: {detail}", flush=True)

    def count(self, kind: str) -> int:
        with self._lock:
            return sum(1 for e in self.entries if e["kind"] == kind)


# --- test hosts --------------------------------------------------------------------

@dataclass
class Lane:
    """Where one group of workers runs: a namespace and its veth pair, or (fallback)
    plain loopback. `server_addr` is the address its workers connect to."""

    index: int
    namespace: str | None = None
    host_if: str | None = None
    server_addr: str = LOOPBACK
    client_addr: str | None = None

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` run inside this lane's namespace (ip netns exec execs, so the
        pid we get is the service's own)."""
        return ["ip", "netns", "exec", self.namespace, *argv] if self.namespace else argv


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class Network:
    """`count` test hosts in namespaces `ai-chaos-<pid>-<n>`; lane n uses the /30
    block base+4n in 198.18.0.0/15 (host side .1, namespace side .2), the base
    derived from our pid so concurrent runs do not collide."""

    def __init__(self, count: int, tag: int | None = None):
        self.tag = os.getpid() if tag is None else tag
        self.count = count
        block = (self.tag % 8000) * 16
        self.base = NETWORK.network_address + block
        self.lanes: list[Lane] = []
        self.namespaces_used = False
        self.fallback_reason = ""

    def _lane(self, n: int) -> Lane:
        host = self.base + 4 * n + 1
        return Lane(index=n, namespace=f"ai-chaos-{self.tag}-{n}",
                    host_if=f"aic{self.tag % 100000}h{n}", server_addr=str(host),
                    client_addr=str(host + 1))

    def create(self) -> "Network":
        """Make the namespaces; on any refusal undo them and fall back to loopback.
        CHAOS_NETNS=0 in the environment forces the fallback (to exercise it)."""
        try:
            if os.environ.get("CHAOS_NETNS", "1") == "0":
                raise OSError("network namespaces turned off by CHAOS_NETNS=0")
            for n in range(self.count):
                lane = self._lane(n)
                self.lanes.append(lane)
                self._make(lane)
            self.namespaces_used = True
        except OSError as exc:
            self.destroy()
            self.fallback_reason = str(exc)
            self.lanes = [Lane(index=n) for n in range(self.count)]
            print(f"[chaos] NETWORK NAMESPACES UNAVAILABLE ({exc}): falling back to plain "
                  "loopback processes; the partition fault is skipped", flush=True)
        return self

    def _make(self, lane: Lane) -> None:
        peer = lane.host_if[:-2] + "n" + lane.host_if[-1]
        _ip("netns", "add", lane.namespace)
        _ip("link", "add", lane.host_if, "type", "veth", "peer", "name", peer,
            "netns", lane.namespace)
        _ip("addr", "add", f"{lane.server_addr}/30", "dev", lane.host_if)
        _ip("link", "set", lane.host_if, "up")
        _ip("-n", lane.namespace, "addr", "add", f"{lane.client_addr}/30", "dev", peer)
        _ip("-n", lane.namespace, "link", "set", peer, "up")
        _ip("-n", lane.namespace, "link", "set", "lo", "up")

    def server_addresses(self) -> list[str]:
        return sorted({LOOPBACK, *(lane.server_addr for lane in self.lanes)})

    def partition(self, lane: Lane) -> None:
        _ip("link", "set", lane.host_if, "down")

    def heal(self, lane: Lane) -> None:
        _ip("link", "set", lane.host_if, "up")

    def destroy(self) -> None:
        for lane in self.lanes:
            if lane.namespace:
                with contextlib.suppress(OSError):
                    _ip("link", "del", lane.host_if)  # takes the peer with it
                with contextlib.suppress(OSError):
                    _ip("netns", "del", lane.namespace)


# --- processes ---------------------------------------------------------------------

def _session_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[3])  # state ppid pgrp session ...


def signal_sessions(session_ids: set[int], signum: int = signal.SIGKILL) -> int:
    """Send `signum`, one pid at a time, to every live process in the sessions we
    created (a service: the worker's supervisor, its runtime and quarantine
    processes, and whatever they left behind); how many were signalled."""
    signalled = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _session_of(int(entry.name)) in session_ids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signum)
                signalled += 1
    return signalled


@dataclass
class Service:
    """One long-running process (a worker, the scheduler, the dispatcher), restartable.
    Each start is a new session whose id is the new pid."""

    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    log_path: Path
    lane: Lane | None = None
    popen: subprocess.Popen | None = None
    started_at: float = 0.0
    log_from: int = 0  # where this start's lines begin in log_path
    sessions: set[int] = field(default_factory=set)

    def start(self) -> None:
        self.log_from = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(self.argv, cwd=self.cwd, env=self.env, stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True)
        self.started_at = time.monotonic()
        self.sessions.add(self.popen.pid)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def ready(self) -> bool:
        """Whether this start has logged its `... started:` line: it takes
        SIGTERM from then on (services/service.py installs its handler first)."""
        with open(self.log_path, "rb") as log:
            log.seek(self.log_from)
            return b" started: " in log.read()

    def exit_code(self) -> int | None:
        return self.popen.poll() if self.popen else None

    def send(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.popen.pid, signum)

    def terminate(self) -> None:
        """SIGCONT (in case it is stalled), then one SIGTERM: a second one would
        make the service exit at once, skipping its graceful shutdown."""
        if self.popen is not None and self.popen.poll() is None:
            signal_sessions({self.popen.pid}, signal.SIGCONT)
            self.send(signal.SIGTERM)

    def wait_or_kill(self, grace: float) -> int | None:
        """The exit code, waiting up to `grace` seconds, then SIGKILL."""
        if self.popen is None:
            return None
        try:
            return self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            self.send(signal.SIGKILL)
            return self.popen.wait(10)

    def stop(self, grace: float) -> int | None:
        self.terminate()
        return self.wait_or_kill(grace)


class Supervisor(threading.Thread):
    """Restarts any watched service that exits, at most `max_restarts` times in all;
    a service that died young waits a second first (no tight crash loop while the
    database is down). Records every exit; `lock` keeps faults and restarts apart."""

    def __init__(self, services: list[Service], timeline: Timeline, *, max_restarts: int):
        super().__init__(name="chaos-supervisor", daemon=True)
        self.services = services
        self.timeline = timeline
        self.max_restarts = max_restarts
        self.restarts = 0
        self.exits: list[dict] = []
        self.chaos_killed: set[int] = set()
        self._exit_of: dict[int, dict] = {}
        self.lock = threading.RLock()
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.wait(0.1):
            for service in list(self.services):
                with self.lock:
                    if not self._stopping.is_set() and service in self.services:
                        self._check(service)

    def _check(self, service: Service) -> None:
        code = service.exit_code()
        if code is None:
            return
        record = self._exit_of.get(service.pid)
        if record is None:
            cause = "chaos kill" if service.pid in self.chaos_killed else (
                "died (SIGKILL)" if code == -signal.SIGKILL else f"exited {code}")
            record = {"service": service.name, "pid": service.pid, "code": code, "cause": cause,
                      "lived": round(time.monotonic() - service.started_at, 2),
                      "seen": time.monotonic()}
            self._exit_of[service.pid] = record
            self.exits.append(record)
            self.timeline.log("exit", f"{service.name} pid {service.pid} {cause}")
        if self.restarts >= self.max_restarts:
            return
        if record["lived"] < 3.0 and time.monotonic() - record["seen"] < 1.0:
            return
        service.start()
        self.restarts += 1
        self.timeline.log("restart", f"{service.name} as pid {service.pid} "
                                     f"(restart {self.restarts})")

    def alive_of(self, services: list[Service]) -> list[Service]:
        """Those of `services` running now, by name (hold `lock` to act on them)."""
        return sorted((s for s in services if s.exit_code() is None), key=lambda s: s.name)

    def kill(self, service: Service) -> int:
        """SIGKILL a service as a fault; its pid."""
        with self.lock:
            self.chaos_killed.add(service.pid)
            service.send(signal.SIGKILL)
            return service.pid

    def stop(self) -> None:
        self._stopping.set()
        with self.lock:
            pass  # wait out a restart in progress
        self.join(5)
