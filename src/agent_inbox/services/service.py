"""What every long-running service shares: signals, wake-ups, reconnects.

A service is a `run_once()` called in a loop. Between passes it sleeps until a
wake-up: a PostgreSQL notification (LISTEN), or the polling interval (with
jitter) for when notifications are lost. LISTEN needs a session of its own on
the server, which a transaction pooler cannot give: behind one, a service
LISTENs only on a direct URL (--listen-url), else it polls. A database
fault never ends a service: it backs off (exponential, capped, jittered) and
tries again. No service sleeps through `run_once` in tests: they call it.
"""

import logging
import os
import random
import signal
import threading
from collections.abc import Callable, Iterator

import psycopg
from psycopg import conninfo

from agent_inbox import db, errors

log = logging.getLogger("agent_inbox")

# Seconds a URL given to LISTEN on has to answer at start (libpq's minimum is 2).
ANSWER_TIMEOUT = 3


def backoff_delays(base: float = 0.5, cap: float = 30.0) -> Iterator[float]:
    """0.5 s, 1 s, 2 s ... up to `cap`, each scaled by a random factor in [0.5, 1]."""
    delay = base
    while True:
        yield delay * random.uniform(0.5, 1.0)
        delay = min(cap, delay * 2)


def jittered(seconds: float) -> float:
    return seconds * random.uniform(0.8, 1.2)


class Stop:
    """Set by the first SIGTERM or SIGINT; the second one exits at once."""

    def __init__(self):
        self.event = threading.Event()
        # A signal came (the event may also be set without one: a worker
        # runtime recycled past --max-memory); the next one exits at once.
        self.signalled = False

    def install(self, *, only_from: int | None = None) -> "Stop":
        """Take SIGTERM and SIGINT. With `only_from` (a pid: the worker
        runtime's supervisor), signals from any other sender are logged and
        ignored: the supervisor passes each one on, so a process manager that
        signals the whole group (systemd's default) is not counted twice. Call
        it before any thread starts: the signals are blocked in every thread and
        read by one of their own."""
        if only_from is None:
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, self._on_signal)
            return self
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        threading.Thread(target=self._take_signals, args=(only_from,), name="agent-inbox-signals",
                         daemon=True).start()
        return self

    def _take_signals(self, sender: int) -> None:
        while True:
            info = signal.sigwaitinfo({signal.SIGTERM, signal.SIGINT})
            if info.si_pid != sender:
                log.warning("%s from pid %d ignored: the supervisor (pid %d) passes signals on",
                            signal.Signals(info.si_signo).name, info.si_pid, sender)
                continue
            self._on_signal(info.si_signo, None)

    def _on_signal(self, signum, frame) -> None:
        if self.signalled:
            os.write(2, f"second {signal.Signals(signum).name}: exiting at once\n".encode())
            os._exit(128 + signum)
        self.signalled = True
        self.event.set()  # before logging: a second signal may interrupt the log call
        log.info("%s: stopping", signal.Signals(signum).name)

    def is_set(self) -> bool:
        return self.event.is_set()

    def wait(self, seconds: float) -> bool:
        return self.event.wait(seconds)


class Waker:
    """Wake-ups for idle loops: one notification wakes one waiter, not all of them
    (no stampede on the same work); wake-ups that come while every waiter is busy
    are remembered, up to one per waiter."""

    def __init__(self, waiters: int = 1):
        self._condition = threading.Condition()
        self._pending = 0
        self._cap = waiters

    def wake_one(self) -> None:
        with self._condition:
            self._pending = min(self._cap, self._pending + 1)
            self._condition.notify()

    def wake_all(self) -> None:
        with self._condition:
            self._pending = self._cap
            self._condition.notify_all()

    def wait(self, timeout: float) -> None:
        with self._condition:
            if not self._pending:
                self._condition.wait(timeout)
            if self._pending:
                self._pending -= 1


def wake_on_stop(stop: Stop, waker: Waker) -> None:
    """Wake `waker`'s waiters once `stop` is set: a service asleep between
    passes (up to --poll-interval) stops at once on SIGTERM, not at its next
    poll. (A signal handler runs in the main thread between its waits, so it
    cannot end a Condition wait there itself.)"""
    def watch():
        stop.event.wait()
        waker.wake_all()

    threading.Thread(target=watch, name="agent-inbox-stop-watch", daemon=True).start()


def check_answers(url: str, option: str) -> None:
    """Raise InvalidInput naming `option` unless a connection to `url` can be
    made within ANSWER_TIMEOUT seconds (the URL is shown without its password)."""
    try:
        shown = conninfo.make_conninfo(**{key: value for key, value in
                                          conninfo.conninfo_to_dict(url).items()
                                          if key != "password"})
    except psycopg.Error as exc:
        raise errors.InvalidInput(option, "...", f"is not a PostgreSQL URL ({exc})") from None
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=ANSWER_TIMEOUT):
            pass
    except psycopg.Error as exc:
        raise errors.InvalidInput(option, shown, f"does not answer ({str(exc).strip()})") from None


class Listener(threading.Thread):
    """LISTEN on `channels` on a connection of its own; call `on_notify()` once per
    notification, or for a channel in `on_payload` that channel's callable with
    the notification's payload. Whatever ends its loop (a lost connection, or anything else)
    is logged and the loop starts again after a backoff: it never stops
    silently. While it is down, services poll. With `url` None (behind a
    transaction pooler with no direct URL) it does not start: services poll."""

    def __init__(self, url: str | None, channels: list[str], on_notify: Callable[[], None],
                 stop: Stop, on_payload: dict[str, Callable[[str], None]] | None = None):
        super().__init__(name="agent-inbox-listener", daemon=True)
        self.url, self.on_notify, self.stop = url, on_notify, stop
        self.on_payload = on_payload or {}
        self.channels = list(channels) + [c for c in self.on_payload if c not in channels]

    def start(self) -> None:
        if self.url is not None:
            super().start()

    def run(self) -> None:
        delays = backoff_delays()
        while not self.stop.is_set():
            try:
                # bounded as pooled connections are (db.py): a primary gone
                # silent ends the LISTEN, and the next connection finds the new one
                with psycopg.connect(self.url, autocommit=True,
                                     application_name="agent-inbox-listener",
                                     connect_timeout=ANSWER_TIMEOUT, **db.LIVENESS) as conn:
                    for channel in self.channels:
                        conn.execute(f"LISTEN {channel}")
                    delays = backoff_delays()
                    while not self.stop.is_set():
                        for notice in conn.notifies(timeout=1.0):
                            if notice.channel in self.on_payload:
                                self.on_payload[notice.channel](notice.payload)
                            else:
                                self.on_notify()
            except psycopg.Error as exc:
                log.warning("listener lost its connection (%s); services poll meanwhile", exc)
                self.stop.wait(next(delays))
            except Exception:
                log.exception("listener failed; starting it again, services poll meanwhile")
                self.stop.wait(next(delays))


def serve(name: str, run_once: Callable[[], float | None], wait: Callable[[float], None],
          stop: Stop, poll_interval: float) -> None:
    """Call `run_once` until stopped. It returns how long it may sleep (None: the
    polling interval); `wait(seconds)` sleeps until then or a wake-up."""
    delays = backoff_delays()
    while not stop.is_set():
        try:
            pause = run_once()
            delays = backoff_delays()
        except errors.DatabaseUnavailable as exc:
            pause = next(delays)
            log.warning("%s: database unavailable (%s); retrying in %.1f s", name, exc, pause)
            stop.wait(pause)
            continue
        except Exception:  # a bug or bad row must not end the service: log, back off, go on
            pause = next(delays)
            log.exception("%s: pass failed; retrying in %.1f s", name, pause)
            stop.wait(pause)
            continue
        wait(jittered(poll_interval) if pause is None else min(pause, jittered(poll_interval)))
