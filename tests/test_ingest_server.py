"""The webhook intake over real HTTP on loopback: signatures checked before
anything is stored, limits, keys, duplicates, the database going away, and the
`ingest-server` command as a process (SIGHUP reload, logs free of secrets).

Servers run in a thread (uvicorn.Server) or as a subprocess; the client is
urllib.request. Every wait is on observable state (a server that answers, a
log line, a process exit), bounded; none is a bare sleep.
"""

import contextlib
import hashlib
import hmac
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import psycopg
import pytest
import uvicorn

from agent_inbox import errors
from agent_inbox.services.ingest import signatures
from agent_inbox.services.ingest.app import build_app
from agent_inbox.services.ingest.secrets import Credential, SecretStore, load_secrets

from tests.runtime.support import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GITHUB_SECRET = "gh-secret-Vq93xZ"
STRIPE_SECRET = "whsec_stripe-secret-Lp27"
STRIPE_OLD_SECRET = "whsec_stripe-old-Kd55"
LINEAR_SECRET = "linear-secret-Rt48"
SECRETS = {
    # A plain string on a generic source means Standard Webhooks: linear keeps
    # the old body-only X-Signature scheme by saying so.
    "alice": {"github": GITHUB_SECRET, "stripe": STRIPE_SECRET,
              "linear": {"scheme": "hmac-body", "secret": LINEAR_SECRET}},
    "bob": {"github": "bob-github-secret-Mm11"},
}
MAX_BODY = 4096

# --- the client -------------------------------------------------------------------

def sign(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()

def stripe_signature(secret: str, body: bytes, t: int | None = None, *,
                     also: tuple[str, ...] = ()) -> str:
    """A Stripe-Signature header; `also` adds v1 entries before the real one."""
    t = int(time.time()) if t is None else t
    v1 = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return ",".join([f"t={t}", *(f"v1={extra}" for extra in also), f"v1={v1}"])

def post(url: str, body, headers: dict[str, str] | None = None, *, timeout: float = 30):
    """POST; (status, decoded JSON body). An iterable body goes out chunked."""
    request = urllib.request.Request(url, data=body, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())

def get(url: str, *, timeout: float = 30):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())

def github(base: str, user: str, payload, *, secret: str = GITHUB_SECRET,
           delivery: str | None = "d-1", raw: bytes | None = None, signature: str | None = None,
           **extra_headers):
    body = raw if raw is not None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json", "X-GitHub-Event": "push", **extra_headers}
    headers["X-Hub-Signature-256"] = signature if signature is not None else sign(secret, body)
    if delivery is not None:
        headers["X-GitHub-Delivery"] = delivery
    return post(f"{base}/hooks/github/{user}", body, headers)

def stripe(base: str, user: str, payload, *, secret: str = STRIPE_SECRET, t: int | None = None,
           also: tuple[str, ...] = (), raw: bytes | None = None):
    body = raw if raw is not None else json.dumps(payload).encode()
    return post(f"{base}/hooks/stripe/{user}", body,
                {"Content-Type": "application/json",
                 "Stripe-Signature": stripe_signature(secret, body, t, also=also)})

def generic(base: str, source: str, user: str, payload, *, secret: str = LINEAR_SECRET,
            key: str | None = "k-1", raw: bytes | None = None, **extra_headers):
    body = raw if raw is not None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json", "X-Signature": sign(secret, body),
               **extra_headers}
    if key is not None:
        headers["Idempotency-Key"] = key
    return post(f"{base}/hooks/{source}/{user}", body, headers)

def stored(inbox, user="alice"):
    return [(e.source, e.source_id, e.payload) for e in inbox.events(user)]

# --- a server in a thread -----------------------------------------------------------

@contextlib.contextmanager
def serving(app):
    """Run `app` with uvicorn on 127.0.0.1 (a free port) in a thread; the base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, name="ingest-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive(), "the server thread ended before it started serving"
        assert time.monotonic() < deadline, "the server did not start within 20 s"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)

@pytest.fixture
def base(inbox):
    with serving(build_app(inbox, SECRETS, MAX_BODY, 300, threads=4)) as url:
        yield url

# --- each provider's valid delivery, and its redelivery ------------------------------

def test_github_delivery_is_stored_then_redelivery_is_a_duplicate(base, inbox):
    payload = {"ref": "refs/heads/main", "commits": [{"id": "abc", "message": "héllo"}]}
    assert github(base, "alice", payload, delivery="72d3162e") == (202, {"status": "accepted"})
    assert stored(inbox) == [("github", "72d3162e", payload)]
    assert github(base, "alice", payload, delivery="72d3162e") == (200, {"status": "duplicate"})
    assert stored(inbox) == [("github", "72d3162e", payload)]

def test_stripe_event_is_stored_under_its_body_id_then_redelivery_is_a_duplicate(base, inbox):
    payload = {"id": "evt_1NG8Du2eZvKYlo2C", "type": "invoice.paid", "data": {"amount": 1200}}
    assert stripe(base, "alice", payload) == (202, {"status": "accepted"})
    assert stored(inbox) == [("stripe", "evt_1NG8Du2eZvKYlo2C", payload)]
    # A redelivery is signed afresh, with a new timestamp: still a duplicate.
    assert stripe(base, "alice", payload, t=int(time.time()) - 5) == (200, {"status": "duplicate"})
    assert stored(inbox) == [("stripe", "evt_1NG8Du2eZvKYlo2C", payload)]

def test_generic_source_is_stored_under_its_idempotency_key_then_redelivery_is_a_duplicate(
        base, inbox):
    payload = {"action": "create", "data": {"title": "Fix the build"}}
    assert generic(base, "linear", "alice", payload, key="lin-9") == (202, {"status": "accepted"})
    assert stored(inbox) == [("linear", "lin-9", payload)]
    assert generic(base, "linear", "alice", payload, key="lin-9") == (200, {"status": "duplicate"})
    assert stored(inbox) == [("linear", "lin-9", payload)]

def test_what_the_provider_calls_the_event_is_stored_as_its_kind(base, inbox):
    assert github(base, "alice", {"n": 1}, delivery="g-1", **{"X-GitHub-Event": "issues"})[0] == 202
    assert stripe(base, "alice", {"id": "evt_1", "type": "invoice.paid"})[0] == 202
    assert stripe(base, "alice", {"id": "evt_2", "type": 7})[0] == 202      # not a name: no kind
    assert generic(base, "linear", "alice", {"n": 2}, key="l-1", **{"X-Event-Type": "Issue"})[0] == 202
    assert generic(base, "linear", "alice", {"n": 3}, key="l-2")[0] == 202
    assert [(e.source_id, e.kind) for e in inbox.events("alice")] == [
        ("g-1", "issues"), ("evt_1", "invoice.paid"), ("evt_2", None), ("l-1", "Issue"), ("l-2", None)]

def test_the_same_key_from_another_source_or_user_is_a_different_event(base, inbox):
    assert github(base, "alice", {"n": 1}, delivery="same") == (202, {"status": "accepted"})
    assert generic(base, "linear", "alice", {"n": 2}, key="same") == (202, {"status": "accepted"})
    assert github(base, "bob", {"n": 3}, delivery="same",
                  secret=SECRETS["bob"]["github"]) == (202, {"status": "accepted"})
    assert sorted(stored(inbox)) == [("github", "same", {"n": 1}), ("linear", "same", {"n": 2})]
    assert stored(inbox, "bob") == [("github", "same", {"n": 3})]

def test_any_json_value_is_a_payload_for_header_keyed_sources(base, inbox):
    assert github(base, "alice", [1, "two", None], delivery="list") == (202, {"status": "accepted"})
    assert generic(base, "linear", "alice", "just text", key="text") == (202, {"status": "accepted"})
    assert sorted(stored(inbox)) == [("github", "list", [1, "two", None]),
                                     ("linear", "text", "just text")]

# --- signatures: checked before anything is stored ----------------------------------

def test_a_bad_signature_is_refused_and_nothing_is_stored(base, inbox):
    payload = {"id": "evt_bad", "x": 1}
    body = json.dumps(payload).encode()
    # Signed with the wrong secret.
    assert github(base, "alice", payload, secret="not-the-secret")[0] == 401
    assert stripe(base, "alice", payload, secret="whsec_wrong")[0] == 401
    assert generic(base, "linear", "alice", payload, secret="wrong")[0] == 401
    # Signed correctly, then the body changed by one byte.
    tampered = body.replace(b"1", b"2")
    assert github(base, "alice", None, raw=tampered, signature=sign(GITHUB_SECRET, body))[0] == 401
    # Malformed signature values.
    for value in ("sha256=", "sha256=zz" * 16, "sha1=" + "0" * 40, sign(GITHUB_SECRET, body)[7:],
                  "sha256=" + "0" * 64):
        status, answer = github(base, "alice", payload, signature=value)
        assert (status, answer) == (401, {"error": "signature verification failed"}), value
    assert stored(inbox) == []

def test_a_missing_signature_header_is_refused(base, inbox):
    body = json.dumps({"id": "evt_1"}).encode()
    for source in ("github", "stripe", "linear"):
        status, answer = post(f"{base}/hooks/{source}/alice", body,
                              {"X-GitHub-Delivery": "d", "Idempotency-Key": "k"})
        assert status == 401, source
        assert "missing" in answer["error"]
    assert stored(inbox) == []

def test_no_secret_for_the_user_or_source_is_refused_like_a_bad_signature(base, inbox):
    unknown_user = github(base, "mallory", {"x": 1}, secret="anything")
    unknown_source = generic(base, "jira", "alice", {"x": 1}, secret=LINEAR_SECRET)
    # bob has a github secret only; alice's stripe secret does not open his inbox.
    other_users_secret = stripe(base, "bob", {"id": "evt_1"}, secret=STRIPE_SECRET)
    bad_signature = github(base, "alice", {"x": 1}, secret="anything")
    assert unknown_user == unknown_source == other_users_secret == bad_signature == (
        401, {"error": "signature verification failed"})
    assert stored(inbox) == [] and stored(inbox, "bob") == [] and stored(inbox, "mallory") == []

def test_a_stripe_timestamp_outside_the_tolerance_is_refused(base, inbox):
    now = int(time.time())
    assert stripe(base, "alice", {"id": "evt_old"}, t=now - 1000)[0] == 401
    assert stripe(base, "alice", {"id": "evt_future"}, t=now + 1000)[0] == 401
    assert stored(inbox) == []
    assert stripe(base, "alice", {"id": "evt_recent"}, t=now - 60)[0] == 202

def test_stripe_accepts_any_of_several_v1_signatures_while_secrets_rotate(base, inbox):
    body = json.dumps({"id": "evt_rotated"}).encode()
    t = int(time.time())
    old = hmac.new(STRIPE_OLD_SECRET.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    # The first v1 is by the old secret (unknown here), the second by the current one.
    assert stripe(base, "alice", None, raw=body, also=(old,)) == (202, {"status": "accepted"})
    assert stored(inbox) == [("stripe", "evt_rotated", {"id": "evt_rotated"})]
    # Only wrong entries: refused.
    header = f"t={t},v1={old},v1={'ab' * 32}"
    assert post(f"{base}/hooks/stripe/alice", body, {"Stripe-Signature": header})[0] == 401

def test_a_stripe_signature_over_a_different_timestamp_is_refused(base, inbox):
    body = json.dumps({"id": "evt_replayed"}).encode()
    t = int(time.time())
    signed_then = stripe_signature(STRIPE_SECRET, body, t - 1000)
    replayed = signed_then.replace(f"t={t - 1000}", f"t={t}")  # a fresh t on an old signature
    assert post(f"{base}/hooks/stripe/alice", body, {"Stripe-Signature": replayed})[0] == 401
    for header in ("", "t=abc,v1=00", f"t={t}", "v1=" + "0" * 64, f"t={t},t={t},v1=00"):
        assert post(f"{base}/hooks/stripe/alice", body, {"Stripe-Signature": header})[0] == 401
    assert stored(inbox) == []

# --- the body limit ------------------------------------------------------------------

def over_limit_payload() -> dict:
    return {"id": "evt_big", "blob": "x" * (MAX_BODY + 100)}

def test_a_body_over_the_limit_is_refused_by_its_content_length(base, inbox):
    payload = over_limit_payload()
    assert github(base, "alice", payload, delivery="big")[0] == 413
    assert stripe(base, "alice", payload)[0] == 413
    status, answer = generic(base, "linear", "alice", payload, key="big")
    assert status == 413 and "limit" in answer["error"]
    assert stored(inbox) == []

def chunks(data: bytes, size: int = 1000):
    """An iterable without a length: urllib sends it with Transfer-Encoding: chunked."""
    return (data[i:i + size] for i in range(0, len(data), size))

def test_a_chunked_body_over_the_limit_is_refused_while_it_streams(base, inbox):
    body = json.dumps(over_limit_payload()).encode()
    status, answer = post(f"{base}/hooks/github/alice", chunks(body),
                          {"X-Hub-Signature-256": sign(GITHUB_SECRET, body),
                           "X-GitHub-Delivery": "chunked-big"})
    assert status == 413 and "limit" in answer["error"]
    assert stored(inbox) == []

def test_a_chunked_body_within_the_limit_is_accepted(base, inbox):
    payload = {"blob": "y" * (MAX_BODY // 2)}
    body = json.dumps(payload).encode()
    status, answer = post(f"{base}/hooks/github/alice", chunks(body, 300),
                          {"X-Hub-Signature-256": sign(GITHUB_SECRET, body),
                           "X-GitHub-Delivery": "chunked-ok"})
    assert (status, answer) == (202, {"status": "accepted"})
    assert stored(inbox) == [("github", "chunked-ok", payload)]

def test_a_body_at_exactly_the_limit_is_accepted(base, inbox):
    prefix, suffix = b'{"pad":"', b'"}'
    body = prefix + b"z" * (MAX_BODY - len(prefix) - len(suffix)) + suffix
    assert len(body) == MAX_BODY
    assert github(base, "alice", None, raw=body, delivery="exact") == (202, {"status": "accepted"})

# --- malformed bodies and keys -----------------------------------------------------

def test_a_body_that_is_not_utf8_json_is_refused(base, inbox):
    for raw in (b"{not json", b"", b'{"a": 1} trailing', "{\"a\": \"é\"}".encode("latin-1"),
                '{"a": 1}'.encode("utf-16"), b'{"a": NaN}', b"\xef\xbb\xbf{}"):
        status, answer = github(base, "alice", None, raw=raw, delivery="bad-json")
        assert status == 400, raw
        assert answer["error"]
    assert stored(inbox) == []

def test_a_missing_or_empty_event_key_is_refused(base, inbox):
    assert github(base, "alice", {"x": 1}, delivery=None) == (
        400, {"error": "missing X-GitHub-Delivery header"})
    assert github(base, "alice", {"x": 1}, delivery="")[0] == 400
    assert stripe(base, "alice", {"type": "invoice.paid"}) == (400, {"error": "missing body id"})
    assert stripe(base, "alice", {"id": ""})[0] == 400
    assert stripe(base, "alice", {"id": 42})[0] == 400
    assert stripe(base, "alice", ["not", "an", "object"])[0] == 400
    assert generic(base, "linear", "alice", {"x": 1}, key=None) == (
        400, {"error": "missing Idempotency-Key header"})
    assert generic(base, "linear", "alice", {"x": 1}, key="   ")[0] == 400
    assert stored(inbox) == []

def test_a_payload_agent_inbox_refuses_is_a_400_with_its_reason(base, inbox):
    # JSON can carry a NUL character; PostgreSQL's jsonb cannot.
    status, answer = github(base, "alice", {"text": "a\u0000b"}, delivery="nul")
    assert status == 400 and "NUL" in answer["error"]
    # A lone surrogate is valid JSON but not storable text.
    status, answer = github(base, "alice", None, raw=b'{"text": "\\ud800"}', delivery="surrogate")
    assert status == 400
    # A NUL in the event key.
    assert stripe(base, "alice", {"id": "evt\u0000"})[0] == 400
    assert stored(inbox) == []

def test_wrong_methods_and_paths_answer_json_errors(base):
    status, answer = get(f"{base}/hooks/github/alice")
    assert status == 405 and answer["error"]
    status, answer = post(f"{base}/nowhere", b"{}")
    assert status == 404 and answer["error"]

# --- health and the database going away --------------------------------------------

def terminate_backends(database_url):
    """Kill every connection to the test database but this one, and wait until
    they are gone: the inbox's pooled connections are now dead."""
    dbname = psycopg.conninfo.conninfo_to_dict(database_url)["dbname"]
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                     "WHERE datname = %s AND pid <> pg_backend_pid()", (dbname,))
        deadline = time.monotonic() + 20
        while conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                           "AND pid <> pg_backend_pid()", (dbname,)).fetchone()[0]:
            assert time.monotonic() < deadline, "backends did not exit"
            time.sleep(0.02)

def test_healthz_answers_ok_while_the_database_answers(base):
    assert get(f"{base}/healthz") == (200, {"status": "ok"})

def test_healthz_answers_503_when_the_database_does_not(base, database_url):
    terminate_backends(database_url)
    status, answer = get(f"{base}/healthz")
    assert status == 503 and answer["status"] != "ok"
    # The pool replaces the dead connection: health comes back.
    wait_until(lambda: get(f"{base}/healthz")[0] == 200, "/healthz to answer 200 again")

def test_a_lost_database_connection_is_a_503_so_the_provider_retries(base, inbox, database_url):
    github(base, "alice", {"warm": True}, delivery="warm")  # a pooled connection exists
    terminate_backends(database_url)
    status, answer = github(base, "alice", {"n": 1}, delivery="retry-me")
    assert status == 503 and answer["error"]
    # The provider's retry lands.
    status = wait_until(lambda: (s := github(base, "alice", {"n": 1}, delivery="retry-me")[0]) != 503
                        and s, "a retry that is not answered 503")
    assert status == 202
    assert ("github", "retry-me", {"n": 1}) in stored(inbox)

def test_concurrent_deliveries_of_one_event_store_it_once(inbox):
    from concurrent.futures import ThreadPoolExecutor

    with serving(build_app(inbox, SECRETS, MAX_BODY, threads=2)) as url:
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(
                lambda n: github(url, "alice", {"same": True}, delivery="race"), range(24)))
    assert sorted(status for status, _ in answers) == [200] * 23 + [202]
    assert stored(inbox) == [("github", "race", {"same": True})]

# --- pure parts: signatures and the secrets file ------------------------------------

def test_signature_checks_answer_false_on_malformed_input_instead_of_raising():
    body = b'{"a": 1}'
    good = sign("k", body)
    assert signatures.verify_github("k", body, good)
    assert signatures.verify_generic(b"k", body, good.upper().replace("SHA256=", "sha256="))
    for header in (None, "", "sha256", "sha256=é" + "0" * 63, good + "00", " " + good[:-1]):
        assert not signatures.verify_github("k", body, header), header
    t = 1_700_000_000
    header = stripe_signature("k", body, t)
    assert signatures.verify_stripe("k", body, header, now=t + 300, tolerance=300)
    assert not signatures.verify_stripe("k", body, header, now=t + 301, tolerance=300)
    assert not signatures.verify_stripe("k", body, header, now=t - 301, tolerance=300)
    assert not signatures.verify_stripe("k", body, "t=١٧٠٠,v1=00", now=t)  # non-ASCII digits
    parsed = signatures.parse_stripe_header(f"t={t}, v1=aa ,v0=bb,v1=cc")
    assert (parsed.timestamp, parsed.v1) == (t, ("aa", "cc"))
    with pytest.raises(ValueError):
        signatures.parse_stripe_header("v1=aa")
    with pytest.raises(ValueError):
        signatures.parse_stripe_header(f"t={t},v1=" + ",v1=".join(["aa"] * 9))

def test_secrets_files_load_from_json_and_toml_and_errors_never_show_a_secret(tmp_path):
    as_json = tmp_path / "s.json"
    g1, whsec_x = "g1-github-secret-16", "whsec_x-stripe-secret"
    as_json.write_text(json.dumps({"alice": {"github": g1}}))
    as_toml = tmp_path / "s.toml"
    as_toml.write_text(f'[alice]\ngithub = "{g1}"\n\n[bob]\nstripe = "{whsec_x}"\n')
    assert load_secrets(as_json) == {"alice": {"github": Credential("github", (g1.encode(),))}}
    assert load_secrets(as_toml) == {"alice": {"github": Credential("github", (g1.encode(),))},
                                     "bob": {"stripe": Credential("stripe", (whsec_x.encode(),))}}
    secret = "TOPSECRET-value-99"
    broken = {
        "a.json": '{"alice": {"github": "%s"' % secret,
        "b.toml": '[alice]\ngithub = "%s\x01"\n' % secret,
        "c.toml": '[alice]\ngithub = %s\n' % secret,
        "d.json": json.dumps({"alice": secret}),
        "e.json": json.dumps({"alice": {"github": [[secret]]}}),
        "f.json": json.dumps({"alice": {"github": ""}}),
        "g.yaml": json.dumps({"alice": {"github": secret}}),
        "h.json": json.dumps([secret]),
    }
    for name, text in broken.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(errors.InvalidInput) as caught:
            load_secrets(path)
        assert secret not in str(caught.value) and "\x01" not in str(caught.value), name
        # Not chained to the parser's error either (JSONDecodeError holds the whole file).
        assert caught.value.__cause__ is None, name
        assert caught.value.__context__ is None or caught.value.__suppress_context__, name
    store = SecretStore.from_file(as_toml)
    assert g1 not in repr(store) and whsec_x not in repr(store)
    assert g1 not in repr(store.get("alice", "github"))

# --- the command, as a process --------------------------------------------------------

COMMAND = [sys.executable, "-m", "agent_inbox.cli", "ingest-server"]

class ServerProcess:
    """`ingest-server` as a subprocess; its stdout and stderr are captured whole."""

    def __init__(self, argv):
        self.process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "".join(self.lines)

    def wait_for_line(self, pattern: str, timeout: float = 30.0) -> re.Match:
        """The first log line matching `pattern` (waits for it, or fails when the
        process exits or the timeout passes)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if match := re.search(pattern, line):
                        return match
                if self.process.poll() is not None and not self._reader.is_alive():
                    raise AssertionError(f"the server exited ({self.process.returncode}) before "
                                         f"logging {pattern!r}:\n{''.join(self.lines)}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no log line {pattern!r} within {timeout} s:\n"
                                         + "".join(self.lines))
                self._changed.wait(min(left, 0.2))

    def base_url(self) -> str:
        port = self.wait_for_line(r"Uvicorn running on http://127\.0\.0\.1:(\d+)",
                                  timeout=60).group(1)
        return f"http://127.0.0.1:{port}"

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=20)
        finally:
            self._reader.join(timeout=5)

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        self._reader.join(timeout=5)
        self.process.stdout.close()

@pytest.fixture
def spawn_server():
    """Start `agent-inbox ingest-server ARGS` as a process; killed at teardown."""
    started = []

    def spawn(*args) -> ServerProcess:
        server = ServerProcess([*COMMAND, *args])
        started.append(server)
        return server

    yield spawn
    for server in started:
        server.kill()

def write_secrets(path, secrets: dict):
    """Replace the file at once (as a deploy tool would), never half-written."""
    staging = path.with_name(path.name + ".new")
    if path.suffix == ".toml":
        staging.write_text("".join(
            f"[{user}]\n" + "".join(f'{source} = "{secret}"\n' for source, secret in sources.items())
            for user, sources in secrets.items()))
    else:
        staging.write_text(json.dumps(secrets))
    os.replace(staging, path)

def test_the_command_serves_and_reloads_its_secrets_on_sighup_without_logging_them(
        spawn_server, database_url, inbox, tmp_path):
    old, new, never = "OLD-secret-ZK41-a", "NEW-secret-QW83-b", "BROKEN-secret-PL27"
    path = tmp_path / "secrets.toml"
    write_secrets(path, {"alice": {"github": old}})
    server = spawn_server("--database-url", database_url, "--secrets", str(path), "--port", "0",
                          "--log-level", "debug")
    base = server.base_url()
    assert get(f"{base}/healthz") == (200, {"status": "ok"})
    assert github(base, "alice", {"n": 1}, secret=old, delivery="before")[0] == 202

    write_secrets(path, {"alice": {"github": new}})
    server.process.send_signal(signal.SIGHUP)
    # Wait on what a provider would see: the new secret starts working.
    deadline = time.monotonic() + 20
    attempt = 0
    while github(base, "alice", {"n": 2}, secret=new, delivery=f"after-{attempt}")[0] != 202:
        assert time.monotonic() < deadline, "the new secret never started to work"
        attempt += 1
    assert github(base, "alice", {"n": 3}, secret=old, delivery="old-again")[0] == 401

    # A reload that fails keeps the secrets in use, and says why without showing them.
    path.write_text(f'[alice]\ngithub = "{never}\n')  # an unterminated string
    server.process.send_signal(signal.SIGHUP)
    server.wait_for_line(r"secrets reload failed, keeping the previous secrets")
    assert github(base, "alice", {"n": 4}, secret=new, delivery="still-new")[0] == 202
    assert github(base, "alice", {"n": 5}, secret=never, delivery="never")[0] == 401

    # Refused requests are logged, never with the signature or the secret.
    github(base, "mallory", {"n": 6}, secret=old, delivery="mallory")
    assert server.stop() == 0
    sources = {(source, key) for source, key, _ in stored(inbox)}
    assert ("github", "before") in sources and ("github", "still-new") in sources
    assert ("github", "old-again") not in sources and ("github", "never") not in sources
    output = server.output
    assert "secrets reloaded from" in output and "refused a github delivery" in output
    for secret in (old, new, never):
        assert secret not in output

def test_the_command_with_a_json_secrets_file_from_the_environment(spawn_server, database_url,
                                                                    inbox, tmp_path, monkeypatch):
    path = tmp_path / "secrets.json"
    write_secrets(path, SECRETS)
    monkeypatch.setenv("AGENT_INBOX_SECRETS", str(path))
    server = spawn_server("--database-url", database_url, "--port", "0", "--max-body", "64")
    base = server.base_url()
    assert stripe(base, "alice", {"id": "evt_env"}) == (202, {"status": "accepted"})
    assert stripe(base, "alice", {"id": "evt_big", "pad": "p" * 64})[0] == 413
    assert server.stop() == 0
    assert stored(inbox) == [("stripe", "evt_env", {"id": "evt_env"})]
    for sources in SECRETS.values():
        for secret in sources.values():
            assert (secret["secret"] if isinstance(secret, dict) else secret) not in server.output

def test_the_command_refuses_a_schema_not_at_head(spawn_server, empty_database_url, tmp_path):
    path = tmp_path / "secrets.json"
    write_secrets(path, SECRETS)
    server = spawn_server("--database-url", empty_database_url, "--secrets", str(path),
                          "--port", "0")
    assert server.process.wait(timeout=60) == 2
    server._reader.join(timeout=5)
    assert "run `agent-inbox migrate` first" in server.output

def test_the_command_refuses_a_bad_secrets_file_without_showing_it(spawn_server, database_url,
                                                                    tmp_path):
    path = tmp_path / "secrets.json"
    path.write_text('{"alice": {"github": "LEAKED-secret-77"')
    server = spawn_server("--database-url", database_url, "--secrets", str(path), "--port", "0")
    assert server.process.wait(timeout=60) == 2
    server._reader.join(timeout=5)
    assert "secrets file is not valid JSON" in server.output
    assert "LEAKED-secret-77" not in server.output
