"""The shipped HTTP channel, against a real HTTP server on loopback."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agent_inbox import Result
from agent_inbox.channels import ChannelError, HttpChannel
from agent_inbox.dispatcher import Dispatcher


class Receiver:
    """An HTTP server that answers with the scripted statuses, then 200."""

    def __init__(self, statuses=()):
        self.statuses = list(statuses)
        self.requests = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests.append((dict(self.headers), json.loads(body)))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

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

    def make(statuses=()):
        made.append(Receiver(statuses))
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


def test_a_client_error_is_final(receiver):
    server = receiver([400])
    with pytest.raises(ChannelError, match="HTTP 400"):
        HttpChannel(server.url, backoff=0.01)("alice", "hello", "alice:7")
    assert len(server.requests) == 1


def test_an_unreachable_receiver_fails_after_the_attempts(receiver):
    server = receiver()
    url = server.url
    server.close()
    with pytest.raises(ChannelError, match="after 2 attempts"):
        HttpChannel(url, attempts=2, backoff=0.01, timeout=2)("alice", "hello", "alice:7")


def test_the_dispatcher_leaves_a_refused_batch_unsent_and_resends_it_under_its_key(inbox, receiver):
    server = receiver([400])
    inbox.ingest("u", "chat", "1", {})
    run = inbox.take_work("w", now=1_000_000)
    inbox.finish_run(run, Result(messages=["report"]), now=1_000_000)
    dispatcher = Dispatcher(inbox, HttpChannel(server.url, backoff=0.01))
    dispatcher.run_once(now=1_000_000)             # refused: logged, the batch waits
    assert inbox.outbox("u")[0].sent_at is None
    dispatcher.run_once(now=1_000_001)
    first, second = (body for _, body in server.requests)
    assert first == second and first["text"] == "report"
    assert inbox.outbox("u")[0].sent_at == 1_000_001
