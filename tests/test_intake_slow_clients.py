"""Slow and many clients against `agent-inbox ingest-server`, a real process on
a loopback port: connections that trickle their headers or their body, or push
large badly signed bodies, are closed within the timeouts, hold little memory,
and do not delay a properly signed delivery sent meanwhile.

Bounded: every client socket is opened by the test, on 127.0.0.1, and closed
at the end whatever happens; every wait has a deadline; the server is killed
at teardown. Waiting for the server to close a socket is a read with a deadline.
"""

import hashlib
import hmac
import json
import resource
import selectors
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.test_ingest_server import ServerProcess, COMMAND, spawn_server  # noqa: F401

SECRET = "slow-clients-github-secret-0123456789"
HEADER_TIMEOUT = 3.0
BODY_TIMEOUT = 3.0
# Beyond a timeout, how late the server may close a connection: it also accepts
# and serves hundreds of sockets on a loaded 2-core machine.
MARGIN = 2.0
BIG_BODY = (1 << 20) - 1  # one byte under the default --max-body
# Every test client is on 127.0.0.1: a crowd of them stands for many senders.
MANY_CLIENTS = ("--max-connections-per-client", "1000")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/PID/status")


def room_for_sockets(count: int) -> None:
    """Raise this process's soft fd limit (up to the hard one) to fit `count` more."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = count + 256
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"needs {needed} file descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def github_request(body: bytes, *, signature: str, delivery: str, length: int | None = None) -> bytes:
    length = len(body) if length is None else length
    return (f"POST /hooks/github/alice HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nX-GitHub-Event: push\r\n"
            f"X-GitHub-Delivery: {delivery}\r\nX-Hub-Signature-256: {signature}\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def signed_delivery(base: str, delivery: str) -> tuple[int, float]:
    """POST a properly signed GitHub delivery: (status, seconds to the answer)."""
    body = json.dumps({"delivery": delivery}).encode()
    signature = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    request = urllib.request.Request(
        f"{base}/hooks/github/alice", data=body, method="POST",
        headers={"Content-Type": "application/json", "X-GitHub-Event": "push",
                 "X-GitHub-Delivery": delivery, "X-Hub-Signature-256": signature})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status = response.status
            response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            status = exc.code
    return status, time.monotonic() - started


class Client:
    """One socket: `opening` sent at once, then `trickle` one chunk per tick."""

    def __init__(self, port: int, opening: bytes, trickle: bytes, chunk: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.opened = time.monotonic()
        self.sock.setblocking(False)
        self.pending = opening
        self.trickle = trickle
        self.chunk = chunk
        self.answer = b""
        self.closed_at: float | None = None
        self.answered_at: float | None = None
        self.flush()

    def flush(self) -> None:
        """Send what is pending, as far as the socket takes it."""
        try:
            while self.pending and self.closed_at is None:
                sent = self.sock.send(self.pending)
                self.pending = self.pending[sent:]
        except BlockingIOError:
            pass
        except OSError:  # reset or broken pipe: the server closed it
            self.closed()

    def tick(self) -> None:
        if self.closed_at is None and not self.pending and self.trickle:
            self.pending, self.trickle = self.trickle[:self.chunk], self.trickle[self.chunk:]
        self.flush()

    def readable(self) -> None:
        try:
            data = self.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            self.closed()
            return
        if data:
            self.answer += data
            self.answered_at = self.answered_at or time.monotonic()
        else:
            self.closed()

    def closed(self) -> None:
        if self.closed_at is None:
            self.closed_at = time.monotonic()


class Crowd:
    """Many Clients driven from one thread: a chunk each per `tick` seconds,
    reading whatever the server answers, until all are closed or `deadline`."""

    def __init__(self, server_pid: int, tick: float = 1.0):
        self.clients: list[Client] = []
        self.server_pid = server_pid
        self.tick = tick
        self.max_rss = 0
        self.ticks = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._selector = selectors.DefaultSelector()

    def add(self, client: Client) -> None:
        self.clients.append(client)
        self._selector.register(client.sock, selectors.EVENT_READ, client)

    def start(self, deadline: float) -> None:
        self._thread = threading.Thread(target=self._run, args=(deadline,), daemon=True)
        self._thread.start()

    def _run(self, deadline: float) -> None:
        next_tick = time.monotonic()
        while not self._stop.is_set() and time.monotonic() < deadline:
            if all(c.closed_at is not None for c in self.clients):
                break
            now = time.monotonic()
            if now >= next_tick:
                for client in self.clients:
                    client.tick()
                self.ticks += 1
                next_tick = now + self.tick
            self.sample_rss()
            for key, _ in self._selector.select(timeout=max(0.0, min(0.2, next_tick - now))):
                client = key.data
                client.readable()
                if client.closed_at is not None:
                    self._selector.unregister(client.sock)

    def sample_rss(self) -> None:
        try:
            self.max_rss = max(self.max_rss, rss_bytes(self.server_pid))
        except (OSError, AssertionError):
            pass

    def wait_ticks(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.ticks < count:
            assert time.monotonic() < deadline, f"fewer than {count} ticks within {timeout} s"
            self._stop.wait(0.05)

    def join(self, timeout: float) -> None:
        assert self._thread is not None
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the client thread did not end"

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._selector.close()
        for client in self.clients:
            client.sock.close()


@pytest.fixture
def slow_server(spawn_server, database_url, tmp_path):  # noqa: F811
    def start(*options: str):
        path = tmp_path / "secrets.json"
        path.write_text(json.dumps({"alice": {"github": SECRET}}))
        server = spawn_server("--database-url", database_url, "--secrets", str(path),
                              "--port", "0", "--log-level", "info",
                              "--header-timeout", str(HEADER_TIMEOUT),
                              "--body-timeout", str(BODY_TIMEOUT), *options)
        base = server.base_url()
        assert signed_delivery(base, "warm-up")[0] == 202  # imports done, pool warm
        return server, base, int(base.rsplit(":", 1)[1])
    return start


def test_trickling_clients_are_closed_in_time_and_a_signed_delivery_goes_through(
        slow_server, inbox):
    room_for_sockets(600)
    server, base, port = slow_server(*MANY_CLIENTS)
    pid = server.process.pid
    baseline = rss_bytes(pid)
    crowd = Crowd(pid)
    try:
        bad = "sha256=" + "0" * 64
        for n in range(400):  # full headers, then a 1 MiB - 1 body one byte a second
            crowd.add(Client(port, github_request(b"", signature=bad, delivery=f"slow-body-{n}",
                                                  length=BIG_BODY),
                             b"x" * 60, chunk=1))
        for n in range(100):  # part of the headers, then the rest one byte a second
            crowd.add(Client(port, b"POST /hooks/github/alice HTTP/1.1\r\nHost: 127",
                             f".0.0.1\r\nX-GitHub-Delivery: slow-head-{n}\r\n".encode() * 5,
                             chunk=1))
        crowd.start(deadline=time.monotonic() + max(HEADER_TIMEOUT, BODY_TIMEOUT) + 30)
        crowd.wait_ticks(2, timeout=10)  # every slow client has trickled
        assert sum(c.closed_at is None for c in crowd.clients) == 500, "closed too early"

        status, took = signed_delivery(base, "while-slow")
        assert status == 202
        assert took < 1.0, f"the signed delivery took {took:.2f} s among 500 slow clients"
        assert ("github", "while-slow") in {(e.source, e.source_id) for e in inbox.events("alice")}

        crowd.join(timeout=max(HEADER_TIMEOUT, BODY_TIMEOUT) + 30)
        crowd.sample_rss()
    finally:
        crowd.close()

    open_too_long = [c for c in crowd.clients if c.closed_at is None]
    assert not open_too_long, f"{len(open_too_long)} slow connections were never closed"
    bodies, heads = crowd.clients[:400], crowd.clients[400:]
    late_bodies = max(c.closed_at - c.opened for c in bodies)
    late_heads = max(c.closed_at - c.opened for c in heads)
    assert late_bodies <= BODY_TIMEOUT + MARGIN, f"a slow body was closed after {late_bodies:.1f} s"
    assert late_heads <= HEADER_TIMEOUT + MARGIN, f"slow headers were closed after {late_heads:.1f} s"
    assert all(c.answer.startswith(b"HTTP/1.1 408 ") for c in crowd.clients), \
        {c.answer[:40] for c in crowd.clients}
    growth = crowd.max_rss - baseline
    assert growth <= 100 << 20, f"the server's RSS grew by {growth >> 20} MiB"
    print(f"\nslow clients: signed delivery {took * 1000:.0f} ms; RSS +{growth / 2**20:.1f} MiB; "
          f"closed after at most {late_bodies:.2f} s (bodies), {late_heads:.2f} s (headers)")
    stored = {e.source_id for e in inbox.events("alice")}
    assert not any(key.startswith("slow-") for key in stored)


@pytest.mark.parametrize("budget", [(), ("--max-buffered", str(16 << 20))],
                         ids=["default budget", "16 MiB budget"])
def test_many_large_badly_signed_bodies_hold_bounded_memory(slow_server, inbox, budget):
    """300 connections each pushing 1 MiB - 1 of a badly signed body as fast as
    the server reads (the review measured +383 MiB of RSS): within the budget,
    large requests wait their turn while a small signed one goes by."""
    room_for_sockets(400)
    server, base, port = slow_server(*budget, *MANY_CLIENTS)
    pid = server.process.pid
    baseline = rss_bytes(pid)
    crowd = Crowd(pid, tick=0.05)
    try:
        bad = "sha256=" + "0" * 64
        body = b"[" + b"0," * ((BIG_BODY - 2) // 2) + b"0]"
        body += b" " * (BIG_BODY - len(body))
        for n in range(300):
            crowd.add(Client(port, github_request(body, signature=bad, delivery=f"big-{n}")
                             + body, b"", chunk=0))
        crowd.start(deadline=time.monotonic() + BODY_TIMEOUT + 30)
        crowd.wait_ticks(5, timeout=10)

        status, took = signed_delivery(base, "while-big")
        assert status == 202
        assert took < 1.0, f"the signed delivery took {took:.2f} s among 300 large bodies"

        crowd.join(timeout=BODY_TIMEOUT + 30)
        crowd.sample_rss()
    finally:
        crowd.close()
    assert all(c.closed_at is not None for c in crowd.clients)
    answers = {c.answer.split(b"\r\n", 1)[0] for c in crowd.clients}
    # Each got its answer: refused for its signature if read whole in time,
    # else timed out; none was stored.
    assert answers <= {b"HTTP/1.1 401 Unauthorized", b"HTTP/1.1 408 Request Timeout"}, answers
    # Answered (401: the connection then idles, kept alive) or cut off (408) in time.
    latest = max(c.answered_at - c.opened for c in crowd.clients)
    assert latest <= BODY_TIMEOUT + MARGIN, f"a large body was answered after {latest:.1f} s"
    growth = crowd.max_rss - baseline
    assert growth <= 100 << 20, f"the server's RSS grew by {growth >> 20} MiB"
    print(f"\nlarge bodies: signed delivery {took * 1000:.0f} ms; RSS +{growth / 2**20:.1f} MiB; "
          f"{sum(a.startswith(b'HTTP/1.1 401') for a in (c.answer for c in crowd.clients))} "
          f"answered 401, the rest 408, all answered within {latest:.2f} s")
    assert {e.source_id for e in inbox.events("alice")} == {"warm-up", "while-big"}


def test_connections_past_the_cap_are_answered_503_and_closed(slow_server):
    room_for_sockets(100)
    server, base, port = slow_server("--max-connections", "20",
                                     "--max-connections-per-client", "20")
    held = []
    try:
        for _ in range(20):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(b"POST /hooks/github/alice HTTP/1.1\r\n")
            held.append(sock)
        extra = socket.create_connection(("127.0.0.1", port), timeout=10)
        held.append(extra)
        started = time.monotonic()
        answer = b""
        while chunk := extra.recv(4096):  # read until the server closes, 10 s at most
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 503 ") and b"retry-after: 5" in answer.lower()
        assert b"too many connections, retry later" in answer
        assert time.monotonic() - started < 1.0
    finally:
        for sock in held:
            sock.close()
    # Once those are gone (the server notices the closes), deliveries go through.
    deadline = time.monotonic() + 10
    while signed_delivery(base, "after-cap")[0] != 202:
        assert time.monotonic() < deadline, "deliveries were still refused after the crowd left"


def read_until_closed(sock: socket.socket) -> bytes:
    answer = b""
    while chunk := sock.recv(4096):  # the socket's timeout bounds each read
        answer += chunk
    return answer


def test_a_request_with_both_lengths_is_refused_and_closed(slow_server, inbox):
    """Content-Length and Transfer-Encoding together: a proxy trusting the first
    and this server the second would split requests differently (smuggling)."""
    server, base, port = slow_server()
    body = json.dumps({"delivery": "two-lengths"}).encode()
    signature = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    head = github_request(body, signature=signature, delivery="two-lengths")
    head = head[:-2] + b"Transfer-Encoding: chunked\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + chunked)
        answer = read_until_closed(sock)  # closed: read ends
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:80]
    assert b"both Content-Length and Transfer-Encoding" in answer
    assert ("github", "two-lengths") not in {(e.source, e.source_id) for e in inbox.events("alice")}


def test_one_client_address_cannot_hold_every_connection(slow_server):
    """A client on 127.0.0.2 opens as many idle sockets as the global cap: past
    its own share it is refused, and a signed delivery from 127.0.0.1 goes by."""
    room_for_sockets(100)
    server, base, port = slow_server("--max-connections", "20")
    held = []
    try:
        for n in range(20):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10,
                                            source_address=("127.0.0.2", 0))
            held.append(sock)
            if n < 10:  # half the cap is one address's share
                sock.sendall(b"POST /hooks/github/alice HTTP/1.1\r\n")
        for sock in held[10:]:
            answer = read_until_closed(sock)
            assert answer.startswith(b"HTTP/1.1 503 ") and b"from your address" in answer, answer
        status, took = signed_delivery(base, "beside-the-hog")
        assert status == 202, status
        assert took < 1.0
    finally:
        for sock in held:
            sock.close()
