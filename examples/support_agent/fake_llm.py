"""A stand-in for an LLM provider's HTTP API, on 127.0.0.1: POST /v1/complete
with {"prompt": ...} answers {"text": ..., "tool": ...}. It answers by
keywords, counts its calls (GET /calls), and can fail a call on purpose."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeLLM:
    def __init__(self):
        self.calls = 0
        self._guard = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                with owner._guard:
                    owner.calls += 1
                self._answer(200, owner.complete(body.get("prompt", "")))

            def do_GET(self):
                self._answer(200, {"calls": owner.calls})

            def _answer(self, status, document):
                data = json.dumps(document).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @staticmethod
    def complete(prompt: str) -> dict:
        words = prompt.lower()
        if "refund" in words:
            order = next((w for w in words.split() if w.isdigit()), "unknown")
            return {"text": f"I can refund order {order} once it is approved.",
                    "tool": {"name": "refund", "args": {"order": order}}}
        return {"text": "Thanks for writing! How can I help?", "tool": None}

    def __enter__(self) -> "FakeLLM":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
