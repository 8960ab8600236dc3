"""The shipped HTTP channel, against a real HTTP server on loopback."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agent_inbox import PermanentSendError, Result
from agent_inbox.channels import ChannelError, HttpChannel
from agent_inbox.services.dispatcher import Dispatcher

T = 1_000_000


class Receiver:
    """An HTTP server that answers with the scripted statuses, then 200 (a 3xx
    with a Location to `redirect_to`); it records every request, GETs too."""

    def __init__(self, statuses=(), redirect_to=None):
        self.statuses = list(statuses)
        self.requests = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                receiver.requests.append((dict(self.headers), json.loads(body) if body else None))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                if redirect_to is not None:
                    self.send_header("Location", redirect_to)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_PUT = do_POST

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks/agent"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    made = []

    def make(statuses=(), redirect_to=None):
        made.append(Receiver(statuses, redirect_to))
        return made[-1]

    yield make
    for r in made:
        r.close()


def test_a_batch_is_posted_with_its_key_as_the_idempotency_header(receiver):
    server = receiver()
    HttpChannel(server.url, token="s3cret")("alice", "hello", "alice:7")
    [(headers, body)] = server.requests
    assert body == {"user": "alice", "text": "hello", "key": "alice:7"}
    assert headers["Idempotency-Key"] == "alice:7"
    assert headers["Authorization"] == "Bearer s3cret"


def test_server_errors_are_retried_with_the_same_key(receiver):
    server = receiver([503, 429])
    HttpChannel(server.url, backoff=0.01)("alice", "hello", "alice:7")
    assert [h["Idempotency-Key"] for h, _ in server.requests] == ["alice:7"] * 3


@pytest.mark.parametrize("status", [400, 401, 403, 404, 410, 413, 422])
def test_a_client_error_is_permanent(receiver, status):
    server = receiver([status])
    with pytest.raises(PermanentSendError, match=f"HTTP {status}"):
        HttpChannel(server.url, backoff=0.01)("alice", "hello", "alice:7")
    assert len(server.requests) == 1


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503])
def test_timeouts_throttling_and_server_errors_are_temporary(receiver, status):
    server = receiver([status, status])
    with pytest.raises(ChannelError, match=f"after 2 attempts \\(HTTP {status}\\)"):
        HttpChannel(server.url, attempts=2, backoff=0.01)("alice", "hello", "alice:7")
    assert len(server.requests) == 2


def test_an_unreachable_receiver_fails_after_the_attempts(receiver):
    server = receiver()
    url = server.url
    server.close()
    with pytest.raises(ChannelError, match="after 2 attempts"):
        HttpChannel(url, attempts=2, backoff=0.01, timeout=2)("alice", "hello", "alice:7")


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_never_followed_and_the_batch_is_not_sent(inbox, receiver, status):
    elsewhere = receiver()
    server = receiver([status] * 10, redirect_to=elsewhere.url)
    with pytest.raises(ChannelError, match=f"HTTP {status}, a redirect to '{elsewhere.url}'"):
        HttpChannel(server.url, token="s3cret", backoff=0.01)("alice", "hello", "alice:7")
    assert len(server.requests) == 1                 # failed at once, not retried inside
    queue_report(inbox, T)
    Dispatcher(inbox, HttpChannel(server.url, token="s3cret")).run_once(now=T)
    [held] = inbox.outbox("u")
    assert held.sent_at is None and f"HTTP {status}" in held.error
    assert elsewhere.requests == []                  # no header, no token went to the other host


def queue_report(inbox, now):
    inbox.ingest("u", "chat", str(now), {})
    run = inbox.take_work("w", now=now)
    assert inbox.finish_run(run, Result(messages=[f"report {now}"]), now=now)


def test_the_dispatcher_retries_a_failed_batch_after_a_backoff_under_its_key(inbox, receiver):
    server = receiver([503])
    queue_report(inbox, T)
    dispatcher = Dispatcher(inbox, HttpChannel(server.url, attempts=1))
    dispatcher.run_once(now=T)                     # 503: the batch backs off
    [held] = inbox.outbox("u")
    assert held.sent_at is None and held.failed_at is None and "HTTP 503" in held.error
    dispatcher.run_once(now=T)                     # still backing off: not sent again
    assert len(server.requests) == 1
    dispatcher.run_once(now=T + 5)                 # base 5 s, scaled into [2.5, 5]
    first, second = (body for _, body in server.requests)
    assert first == second and first["text"] == f"report {T}"
    assert inbox.outbox("u")[0].sent_at == T + 5


def test_a_refused_batch_is_parked_failed_and_later_messages_go_on(inbox, receiver):
    server = receiver([422])
    queue_report(inbox, T)
    dispatcher = Dispatcher(inbox, HttpChannel(server.url))
    dispatcher.run_once(now=T)
    [parked] = inbox.outbox("u")
    assert parked.failed_at == T and "HTTP 422" in parked.error and parked.sent_at is None
    queue_report(inbox, T + 1)
    dispatcher.run_once(now=T + 1)                 # no send yet: the gap counts real sends
    [_, second] = (body for _, body in server.requests)
    assert second["text"] == f"report {T + 1}"
    assert [m.sent_at for m in inbox.outbox("u")] == [None, T + 1]
