"""The intake's HTTP transport: uvicorn's h11 protocol with deadlines and caps,
so that slow or many clients cannot hold the server's sockets or memory.

Invariants, per server process (one event loop, so no locks):

- **Headers** must arrive whole within `header_timeout` seconds of the
  connection opening or of the previous response (uvicorn alone only closes
  idle keep-alive connections: one header byte every few seconds kept a socket
  for ever). Past it: 408 if part of a request came, else the socket is closed.
- **A body** must arrive whole within `body_timeout` seconds of its headers,
  whether the application reads it or has already answered. Past it: 408 if no
  answer was sent yet, else the socket is closed.
- **Connections**: at most `max_connections` at once, and at most
  `max_connections_per_client` from one client address (the socket's peer:
  behind a proxy, the proxy's); one more is answered 503 (Retry-After) and
  closed at once, before it can send anything. So one client holding idle
  sockets cannot lock the other senders out.
- **One length**: a request with both Content-Length and Transfer-Encoding
  (which a proxy and this server could each read differently: request
  smuggling) is answered 400 and its connection closed, unread.
- **Buffered bytes**: a request's bytes count from the moment they are read off
  its socket until its response is sent (they sit in uvicorn's buffer, then in
  the application's), summed over every connection. While that sum is over
  `max_buffered`, a connection whose request holds more than its fair share
  (`max_buffered / max_connections`) is not read from (backpressure: TCP then
  stops its sender), except the oldest such request, so that one always
  progresses and the budget cannot lock itself up; small requests are never
  held back by large ones. Held bytes are at most about `max_buffered` + one
  body + `max_connections` x (fair share + one read of READ_SIZE).

Every refusal closes the connection, so a refused client cannot keep it. The
answers are written raw (the request may be half read, so h11 could not send
them); they are small, and a client that does not read them is cut off after
CLOSE_GRACE seconds.

`config(app, limits, ...)` gives the uvicorn.Config that serves `app` this way.
"""

import asyncio
import contextlib
import json
import logging
import math

import h11
import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol

from agent_inbox import errors, metrics
from agent_inbox.services.ingest import (DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT,
                                         DEFAULT_MAX_BUFFERED, DEFAULT_MAX_CONNECTIONS)

# The default cap per client address: half the global cap, at most this many.
MAX_CONNECTIONS_PER_CLIENT = 100
from agent_inbox.services.ingest.logs import Throttle

log = logging.getLogger("agent_inbox.ingest")

# Bytes read from a socket at once (asyncio's default is 256 KiB): what one
# connection can add to its buffer before backpressure stops it.
READ_SIZE = 16 << 10
# Seconds a refused connection gets to take its answer before it is cut off.
CLOSE_GRACE = 2.0
# The longest header block, in bytes (h11's default): past it, 400.
MAX_HEADER_BYTES = 16 << 10

_throttle = Throttle(per_second=5, what="connections closed by the intake's limits")


def _positive_seconds(field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 < value < math.inf:
        raise errors.InvalidInput(field, value, "must be a positive number of seconds")
    return float(value)


def _positive_int(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise errors.InvalidInput(field, value, "must be a positive integer")
    return value


class Limits:
    """The limits of one server, and the state they share: bytes held, and the
    connections whose requests hold more than their fair share."""

    def __init__(self, *, header_timeout: float = DEFAULT_HEADER_TIMEOUT,
                 body_timeout: float = DEFAULT_BODY_TIMEOUT,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 max_connections_per_client: int | None = None,
                 max_buffered: int = DEFAULT_MAX_BUFFERED):
        self.header_timeout = _positive_seconds("header_timeout", header_timeout)
        self.body_timeout = _positive_seconds("body_timeout", body_timeout)
        self.max_connections = _positive_int("max_connections", max_connections)
        if max_connections_per_client is None:
            max_connections_per_client = default_per_client(self.max_connections)
        self.max_connections_per_client = _positive_int("max_connections_per_client",
                                                        max_connections_per_client)
        # Open connections per client address.
        self.clients: dict[str, int] = {}
        self.max_buffered = _positive_int("max_buffered", max_buffered)
        self.fair_share = max(1, self.max_buffered // self.max_connections)
        self.held = 0
        # Connections holding over their fair share, oldest first (a dict as an
        # ordered set).
        self.large: dict["LimitedH11Protocol", None] = {}

    def add_client(self, host: str) -> bool:
        """Count a connection from `host`; False if it is one too many."""
        self.clients[host] = self.clients.get(host, 0) + 1
        return self.clients[host] <= self.max_connections_per_client

    def remove_client(self, host: str) -> None:
        left = self.clients.get(host, 0) - 1
        if left > 0:
            self.clients[host] = left
        else:
            self.clients.pop(host, None)

    def over_budget(self) -> bool:
        return self.held > self.max_buffered

    def wake(self) -> None:
        """After bytes were released: resume what the budget now allows."""
        for n, protocol in enumerate(list(self.large)):
            if n == 0 or not self.over_budget():
                protocol.flow.resume_for_budget()


class _Flow(FlowControl):
    """uvicorn's flow control (paused while the application has not taken the
    body read so far), which also stays paused while the budget says so."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__(transport)
        self.budget_paused = False

    def _apply(self) -> None:
        if self.read_paused or self.budget_paused:
            self._transport.pause_reading()
        else:
            self._transport.resume_reading()

    def pause_reading(self) -> None:
        self.read_paused = True
        self._apply()

    def resume_reading(self) -> None:
        self.read_paused = False
        self._apply()

    def pause_for_budget(self) -> None:
        self.budget_paused = True
        self._apply()

    def resume_for_budget(self) -> None:
        if self.budget_paused:
            self.budget_paused = False
            self._apply()


def default_per_client(max_connections: int) -> int:
    return max(1, min(MAX_CONNECTIONS_PER_CLIENT, max_connections // 2))


_PHRASES = {400: "Bad Request", 408: "Request Timeout", 503: "Service Unavailable"}


class LimitedH11Protocol(H11Protocol):
    """H11Protocol with the deadlines and caps of `limits` (see the module)."""

    limits: Limits  # set on the subclass that protocol_class() makes

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None
        self._held = 0
        self._host: str | None = None

    # --- the connection's life ------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        with contextlib.suppress(AttributeError, TypeError):
            transport.max_size = READ_SIZE  # asyncio's selector transports read this
        self.flow = _Flow(transport)
        self.conn.next_event = self._next_event  # type: ignore[method-assign]
        self._host = self.client[0] if self.client else "?"
        within_share = self.limits.add_client(self._host)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, "too many connections, retry later", "too_many_connections",
                         retry_after=True)
            return
        if not within_share:
            self._refuse(503, "too many connections from your address, retry later",
                         "too_many_client_connections", retry_after=True)
            return
        self._arm("headers")

    def _next_event(self):
        """h11's next event, but a request with two lengths refused (h11 would
        let Transfer-Encoding win)."""
        event = h11.Connection.next_event(self.conn)
        if isinstance(event, h11.Request):
            names = {name for name, _ in event.headers}
            if b"content-length" in names and b"transfer-encoding" in names:
                self._refuse(400, "a request may not carry both Content-Length and "
                                  "Transfer-Encoding", "ambiguous_length")
                return h11.PAUSED
        return event

    def data_received(self, data: bytes) -> None:
        if self.cycle is None or not self.cycle.response_complete:
            self._hold(len(data))  # else uvicorn drops the rest of an answered body
        super().data_received(data)
        self._follow()
        limits = self.limits
        if self._held > limits.fair_share and not self.transport.is_closing():
            limits.large.setdefault(self, None)
            if limits.over_budget() and next(iter(limits.large)) is not self:
                self.flow.pause_for_budget()

    def on_response_complete(self) -> None:
        self._release()
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self._host is not None:
            self.limits.remove_client(self._host)
            self._host = None
        self._arm(None)
        self._release()

    # --- deadlines --------------------------------------------------------------

    def _follow(self) -> None:
        """Arm the deadline of the phase the request is in: its headers, its
        body, or none while the application works on a whole request."""
        state = self.conn.their_state
        phase = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if phase != self._phase and not self.transport.is_closing():
            self._arm(phase)

    def _arm(self, phase: str | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is not None:
            timeout = self.limits.header_timeout if phase == "headers" else self.limits.body_timeout
            self._deadline = self.loop.call_later(timeout, self._expired, phase)

    def _expired(self, phase: str) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if phase == "headers":
            started = bool(self.conn.trailing_data[0])
            answer = started
            message = f"the request headers did not arrive within {self.limits.header_timeout:g} s"
        else:
            answer = self.cycle is None or not self.cycle.response_started
            message = f"the request body did not arrive within {self.limits.body_timeout:g} s"
        if answer:
            self._refuse(408, message, f"{phase}_timeout")
        else:
            self._refuse(None, message, f"{phase}_timeout")

    # --- the buffered-bytes budget -----------------------------------------------

    def _hold(self, size: int) -> None:
        self._held += size
        self.limits.held += size

    def _release(self) -> None:
        if not self._held:
            return
        limits = self.limits
        limits.held -= self._held
        self._held = 0
        limits.large.pop(self, None)
        self.flow.resume_for_budget()
        limits.wake()

    # --- refusals -------------------------------------------------------------

    def _refuse(self, status: int | None, message: str, reason: str, *,
                retry_after: bool = False) -> None:
        """Answer `status` (None: no answer) and close; counted and logged."""
        metrics.INTAKE_CLOSED.labels(reason).inc()
        client = "%s:%s" % self.client if self.client else "?"
        _throttle.log(log, logging.INFO, "closed a connection from %s: %s", client, message)
        if self.cycle is not None:
            self.cycle.keep_alive = False
        if status is not None:
            body = json.dumps({"error": message}).encode()
            head = [f"HTTP/1.1 {status} {_PHRASES[status]}", "content-type: application/json",
                    f"content-length: {len(body)}", "connection: close"]
            if retry_after:
                head.append("retry-after: 5")
            self.transport.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        self.transport.close()
        self.loop.call_later(CLOSE_GRACE, self._cut_off)

    def _cut_off(self) -> None:
        if self in self.connections:  # still not closed: its peer reads nothing
            self.transport.abort()


def protocol_class(limits: Limits) -> type[LimitedH11Protocol]:
    """A LimitedH11Protocol subclass bound to `limits` (one per server)."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {"limits": limits})


def config(app, limits: Limits, **options) -> uvicorn.Config:
    """A uvicorn.Config serving `app` over LimitedH11Protocol under `limits`;
    `options` are uvicorn.Config's (host, port, log_level, ...). No WebSocket:
    an upgrade would leave this protocol's deadlines behind."""
    options.setdefault("ws", "none")
    return uvicorn.Config(app, http=protocol_class(limits),
                          h11_max_incomplete_event_size=MAX_HEADER_BYTES, **options)
