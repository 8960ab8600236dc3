"""A fake Anthropic Messages API for the tool loop's tests: a threaded HTTP
server on 127.0.0.1 (an ephemeral port) that speaks the SDK's wire format
(POST /v1/messages: a JSON Message with id, type "message", role, content
blocks of type text and tool_use, stop_reason, usage) and scripts a
conversation.

`script(turn, body, nth)` answers the `nth` request (1, 2, ...) of a turn
(turn N: the request holds N-1 assistant messages) with `reply(...)`, an
`error(status)`, or `DROP` (the connection closed without an answer). Every
request is kept (`requests`), and counted per turn as received and as
answered with a 200 (`answered`), under one lock, so a test reads real state.
"""

import itertools
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DROP = object()
_ids = itertools.count(1)


def text(value):
    return {"type": "text", "text": value}


def tool_use(block_id, name, tool_input):
    return {"type": "tool_use", "id": block_id, "name": name, "input": tool_input}


def reply(*content):
    """A 200 with a Message of these blocks; stop_reason from what they are."""
    stop = "tool_use" if any(block["type"] == "tool_use" for block in content) else "end_turn"
    return 200, {"id": f"msg_{next(_ids):04}", "type": "message", "role": "assistant",
                 "model": "claude-fake", "content": list(content), "stop_reason": stop,
                 "stop_sequence": None, "usage": {"input_tokens": 10, "output_tokens": 5}}, {}


def error(status):
    """An API error the SDK retries (500, 529 overloaded), asking for a 1 ms wait."""
    kind = "overloaded_error" if status == 529 else "api_error"
    return status, {"type": "error", "error": {"type": kind, "message": f"fake {status}"}}, {
        "retry-after-ms": "1"}


def turn_of(body):
    return 1 + sum(1 for message in body["messages"] if message["role"] == "assistant")


class FakeMessagesAPI:
    def __init__(self, script):
        self.script = script
        self.requests: list[tuple[int, dict]] = []
        self.received: Counter = Counter()
        self.answered: Counter = Counter()
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def bodies(self, turn):
        """The request bodies of `turn`, in arrival order."""
        with self.lock:
            return [body for t, body in self.requests if t == turn]

    def _handler(self):
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                if self.path.split("?")[0] != "/v1/messages":
                    self.send_error(404)
                    return
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                turn = turn_of(body)
                with api.lock:
                    api.requests.append((turn, body))
                    api.received[turn] += 1
                    nth = api.received[turn]
                answer = api.script(turn, body, nth)
                if answer is DROP:
                    self.close_connection = True
                    return
                status, document, headers = answer
                data = json.dumps(document).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)
                if status == 200:
                    with api.lock:
                        api.answered[turn] += 1

        return Handler
