"""`agent-inbox worker` as users run it: a small process that runs the worker
runtime in a child and starts a new one whenever that child dies.

The runtime runs a run's first attempt in its own process (no process per run),
so an event that kills its process (a poison event) takes the runtime and the
other runs in flight down with it. The supervisor starts a new runtime at once
(after a pause that doubles while children keep dying young, unless the dead
one named the run it was executing: see below) and gives it the
dead one's holder id: the new runtime releases that holder's leases first, so
the runs that died are retried after their backoff rather than after the lease
TTL. It also tells it which run was executing when the child died, read from a
slot of shared memory the child's event loop writes at every step of a run
(blame.py): that run is retried alone in a quarantine process, the others on
their first attempt as ordinary runs at full concurrency; when no run was named
(a plain handler's thread, a crash between steps), each is retried alone in
quarantine (runs.release_holder). The poison event itself is parked dead after
max_attempts; the other runs lose one attempt each.

Invariants: the supervisor holds no database connection and loads no handler;
a runtime never outlives its supervisor (it is killed if the supervisor dies);
each SIGTERM/SIGINT the supervisor gets is passed to the runtime once (the
runtime runs in a process group of its own, so a terminal's Ctrl-C reaches it
through the supervisor only): the first stops it gracefully, a second at once.
"""

import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

from agent_inbox.services.worker import blame

# Environment the supervisor gives each runtime child.
HOLDER_ENV = "_AGENT_INBOX_WORKER_HOLDER"
PREDECESSOR_ENV = "_AGENT_INBOX_WORKER_PREDECESSOR"
FATE_ENV = "_AGENT_INBOX_WORKER_PREDECESSOR_FATE"
SLOT_ENV = "_AGENT_INBOX_WORKER_SLOT"  # the descriptor of the slot (blame.py)
SUSPECT_ENV = "_AGENT_INBOX_WORKER_PREDECESSOR_SUSPECT"  # the run it named: gen:user
# A child that lived less than this died young: the next start waits, doubling.
YOUNG = 10.0
MAX_PAUSE = 5.0
# A runtime that refuses its configuration (bad options, a schema not at head)
# says so with this code (sysexits' EX_CONFIG): starting again would not help,
# and the supervisor exits 2, as every command does for bad input. Any other
# code, 2 included (a handler may call os._exit(2)), starts another runtime.
EXIT_REFUSED = 78
# A runtime past --max-memory that stopped taking work and let its runs end
# exits with this code (sysexits' EX_TEMPFAIL): another starts at once, with no
# pause, and releases whatever lease it left as usual (normally none).
EXIT_RECYCLE = 75
# A runtime whose event loop an async run blocked past --run-timeout exits with
# this code (sysexits' EX_SOFTWARE): a crash, as any other (the run cannot be
# cancelled while it holds the loop).
EXIT_LOOP_BLOCKED = 70
# Recycles so far, for the next runtime's agent_inbox_worker_recycles_total.
RECYCLES_ENV = "_AGENT_INBOX_WORKER_RECYCLES"


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the supervisor dies (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _fate(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    if code == EXIT_LOOP_BLOCKED:
        return "exited: an async run blocked its event loop past --run-timeout"
    return f"exited with code {code}"


def supervise(argv: list[str]) -> int:
    """Run `agent-inbox <argv>` as the runtime child until a signal stopped it
    (its exit code) or it refused its configuration (2). Any other end, a clean exit included (a handler may
    call os._exit(0)), starts another."""
    child: subprocess.Popen | None = None
    signals: list[int] = []

    def forward(signum, frame):
        signals.append(signum)
        if child is not None and child.poll() is None:
            os.kill(child.pid, signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    tag = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
    predecessor, fate, pause, incarnation = None, "", 0.5, 0
    recycles = 0
    slot, suspect = blame.Slot.create(), None
    while True:
        incarnation += 1
        holder = f"{tag}:{incarnation}"
        env = {**os.environ, HOLDER_ENV: holder, RECYCLES_ENV: str(recycles),
               SLOT_ENV: str(slot.fd)}
        env.pop(SUSPECT_ENV, None)
        if predecessor:
            env.update({PREDECESSOR_ENV: predecessor, FATE_ENV: fate})
            if suspect:
                env[SUSPECT_ENV] = suspect
        slot.clear()
        born = time.monotonic()
        child = subprocess.Popen([sys.executable, "-m", "agent_inbox.cli", *argv], env=env,
                                 process_group=0, preexec_fn=_die_with_parent,
                                 pass_fds=(slot.fd,))
        if signals:  # a signal came while it was being started
            os.kill(child.pid, signals[-1])
        code = child.wait()
        named = slot.read()
        suspect = named if blame.parse(named) else None
        if code == EXIT_REFUSED:
            return 2
        if code == EXIT_RECYCLE:  # past --max-memory, its runs ended: a fresh one at once
            if signals:
                return 0
            recycles += 1
            print(f"agent-inbox worker: the runtime (pid {child.pid}) was recycled past "
                  f"--max-memory after {time.monotonic() - born:.1f} s; starting another",
                  file=sys.stderr, flush=True)
            predecessor, fate, suspect = holder, "was recycled past --max-memory", None
            continue
        if signals:  # a runtime exits 0 only when told to stop
            if code == -signals[-1]:
                return 0  # stopped before it took its signals over: it had started no run
            return code if code >= 0 else 128 - code
        fate = _fate(code)
        lived = time.monotonic() - born
        pause = 0.5 if lived > YOUNG else min(MAX_PAUSE, pause * 2)
        # A runtime that named the run it was executing got through its start
        # and ran handlers; that run goes to quarantine: no pause is needed.
        wait = 0.0 if lived > YOUNG or suspect else pause
        print(f"agent-inbox worker: the runtime (pid {child.pid}) {fate} after {lived:.1f} s"
              f"{' executing user=%s gen=%d' % blame.parse(suspect) if suspect else ''}; "
              f"starting another{f' in {wait:.0f} s' if wait else ''}", file=sys.stderr, flush=True)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not signals:
            time.sleep(min(0.2, deadline - time.monotonic()))
        if signals:
            return 0
        predecessor = holder
