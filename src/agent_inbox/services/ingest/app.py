"""The webhook intake: a Starlette application over one `Inbox`.

Invariant: nothing is stored unless the request's signature verified against
the secret configured for its user and source. Each request is checked in this
order, and the first failure answers without storing anything:

    Content-Length over the limit             413
    signature header missing                  401
    body over the limit while it streams      413
    no secret for user/source, bad signature  401  (same answer and same work
                                                    for both: no user oracle)
    body not UTF-8 JSON                       400  (GitHub: or a form field
                                                    `payload` holding it)
    Slack url_verification                    200  {"challenge": ...}
    event key missing or empty                400
    payload refused by agent-inbox's checks   400  (413 if only its size)
    database unavailable                      503  (the provider retries)
    duplicate delivery                        200  {"status": "duplicate"}
    stored                                    202  {"status": "accepted"}

The endpoint only ingests: it answers once the event is committed, without
waiting for any run. `Inbox.ingest` is a blocking psycopg call, so it runs in
the threadpool, whose size is the connection pool's (requests past that wait
in the event loop, not for a pooled connection).
"""

import contextlib
import json
import logging
import secrets as _random
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

import anyio.to_thread
import psycopg
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agent_inbox import errors, tracing
from agent_inbox.services.ingest import DEFAULT_MAX_BODY, DEFAULT_STRIPE_TOLERANCE, signatures
from agent_inbox.services.ingest import logs
from agent_inbox.services.ingest.secrets import MAX_SECRETS, PROVIDER_SCHEMES, SecretStore

log = logging.getLogger("agent_inbox.ingest")

# When no secret exists for the user and source, the signature is still checked,
# against keys nobody knows, so the answer and its timing are a bad signature's.
# Every check pads the keys it has to MAX_SECRETS with these: the work is the
# same for a source with one secret, two (rotating) or none.
_UNKNOWN_KEYS = tuple(_random.token_bytes(32) for _ in range(MAX_SECRETS))
# Seconds a health check waits for a pooled connection.
HEALTH_TIMEOUT = 5.0
# Seconds a health check's answer is reused: at most one database query per
# this interval, however many requests come (they wait on the one in flight).
HEALTH_CACHE = 1.0


class Reject(Exception):
    """An answer other than success: status and JSON {"error": message}."""

    def __init__(self, status: int, message: str, *, close: bool = False):
        super().__init__(message)
        self.status = status
        self.message = message
        self.close = close

    def response(self) -> JSONResponse:
        headers = {"Connection": "close"} if self.close else None
        if self.status == 503:
            headers = {**(headers or {}), "Retry-After": "5"}
        return JSONResponse({"error": self.message}, status_code=self.status, headers=headers)


def _too_large(limit: int) -> Reject:
    # Closing the connection stops a client that keeps streaming a refused body.
    return Reject(413, f"body is over the limit of {limit} bytes", close=True)


def check_content_length(request: Request, limit: int) -> None:
    """413 if the declared Content-Length is over `limit` (the server has
    already refused a malformed one)."""
    declared = request.headers.get("content-length", "").strip()
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)


async def read_limited_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing (413) on a declared Content-Length over `limit`
    before reading, and again while reading, so a chunked body or a lying
    Content-Length cannot get past it; at most `limit` bytes are held."""
    check_content_length(request, limit)
    body = bytearray()
    try:
        async for chunk in request.stream():
            if len(body) + len(chunk) > limit:
                raise _too_large(limit)
            body += chunk
    except ClientDisconnect:
        raise Reject(400, "the client disconnected before the body ended", close=True) from None
    return bytes(body)


def parse_json(body: bytes) -> Any:
    """Strict UTF-8 JSON (no BOM, no UTF-16/32 guessing, no NaN or Infinity)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise Reject(400, "body is not valid UTF-8") from None
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise Reject(400, f"body is not valid JSON: {exc.msg} at line {exc.lineno} "
                          f"column {exc.colno}") from None
    except (ValueError, RecursionError) as exc:  # NaN, >4300-digit ints, deep nesting
        raise Reject(400, f"body is not acceptable JSON: {_short(exc)}") from None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _nonempty_key(value: object, what: str) -> str:
    if value is None:
        raise Reject(400, f"missing {what}")
    if not isinstance(value, str) or not value.strip():
        raise Reject(400, f"{what} must be a non-empty string")
    return value


def _stripe_event_id(request: Request, payload: Any) -> str:
    if not isinstance(payload, dict):
        raise Reject(400, "missing body id (the body is not a JSON object)")
    return _nonempty_key(payload.get("id"), "body id")


def _body_type(request: Request, payload: Any) -> str | None:
    """The body's `type`, if the body is an object and it is a name."""
    kind = payload.get("type") if isinstance(payload, dict) else None
    return kind if isinstance(kind, str) and kind else None


_stripe_event_type = _body_type


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").partition(";")[0].strip().lower()


# A GitHub form is one field; a few more are parsed only to be refused.
_MAX_FORM_FIELDS = 8


def _github_payload(request: Request, body: bytes) -> Any:
    """GitHub's body: JSON, or (a hook set to application/x-www-form-urlencoded)
    the single form field `payload=<url-encoded JSON>`; the signature was over
    the raw body as sent, and the JSON inside is what is stored. A body labelled
    form-encoded that does not start with `payload=` is read as JSON: curl -d
    and urllib label any body so, and GitHub's form always starts so."""
    if _media_type(request) != "application/x-www-form-urlencoded" \
            or not body.startswith(b"payload="):
        return parse_json(body)
    try:
        fields = urllib.parse.parse_qsl(body.decode("ascii"), keep_blank_values=True,
                                        strict_parsing=True, encoding="utf-8", errors="strict",
                                        max_num_fields=_MAX_FORM_FIELDS)
    except UnicodeDecodeError:
        raise Reject(400, "form-encoded body is not ASCII, or its payload not UTF-8") from None
    except ValueError:
        raise Reject(400, "form-encoded body is malformed") from None
    if [name for name, _ in fields] != ["payload"]:
        raise Reject(400, "form-encoded body must hold exactly one field, payload")
    return parse_json(fields[0][1].encode("utf-8"))


def _slack_event_id(request: Request, payload: Any) -> str:
    if not isinstance(payload, dict):
        raise Reject(400, "missing body event_id (the body is not a JSON object)")
    return _nonempty_key(payload.get("event_id"), "body event_id")


def _slack_event_type(request: Request, payload: Any) -> str | None:
    event = payload.get("event") if isinstance(payload, dict) else None
    return _body_type(request, event)


def _slack_answer(payload: Any) -> JSONResponse | None:
    """Slack's url_verification (sent when the Request URL is set): answer the
    challenge, store nothing."""
    if not (isinstance(payload, dict) and payload.get("type") == "url_verification"):
        return None
    challenge = payload.get("challenge")
    if not isinstance(challenge, str) or not challenge:
        raise Reject(400, "url_verification without a challenge string")
    return JSONResponse({"challenge": challenge}, status_code=200)


def _raw_header(request: Request, name: str) -> bytes | None:
    """A header's bytes as sent (Starlette decodes them as latin-1)."""
    value = request.headers.get(name)
    return None if value is None else value.encode("latin-1")


class _Provider:
    """How one scheme signs its deliveries (`verify(keys, request, body)`, with
    every key tried), reads the body into the payload, names the delivery (the
    event key) and says what it is (the event's kind, if it says). `answer`
    may answer a verified request itself instead of storing it."""

    def __init__(self, verify: Callable[[tuple[bytes, ...], Request, bytes], bool],
                 event_key: Callable[[Request, Any], str],
                 kind: Callable[[Request, Any], str | None], *,
                 parse: Callable[[Request, bytes], Any] = lambda request, body: parse_json(body),
                 answer: Callable[[Any], JSONResponse | None] = lambda payload: None):
        self.verify = verify
        self.event_key = event_key
        self.kind = kind
        self.parse = parse
        self.answer = answer


def build_app(inbox, secrets: SecretStore | Mapping[str, Mapping[str, Any]],
              max_body: int = DEFAULT_MAX_BODY,
              stripe_tolerance: float = DEFAULT_STRIPE_TOLERANCE, *,
              threads: int | None = None, clock: Callable[[], float] = time.time) -> Starlette:
    """The intake over `inbox` (an `agent_inbox.Inbox`). `secrets` is a
    SecretStore (reloadable) or a mapping user -> source -> entry, as in the
    secrets file (secrets.py); `threads`
    caps the threadpool (default: anyio's); `clock` is for tests."""
    if not isinstance(secrets, SecretStore):
        secrets = SecretStore(secrets)
    if isinstance(max_body, bool) or not isinstance(max_body, int) or max_body <= 0:
        raise errors.InvalidInput("max_body", max_body, "must be a positive integer")
    if isinstance(stripe_tolerance, bool) or not isinstance(stripe_tolerance, (int, float)) \
            or not 0 <= stripe_tolerance < float("inf"):
        raise errors.InvalidInput("stripe_tolerance", stripe_tolerance,
                                  "must be a non-negative number of seconds")

    def header(name: str) -> Callable[[Request, Any], str | None]:
        return lambda request, payload: request.headers.get(name) or None

    def key_header(name: str) -> Callable[[Request, Any], str]:
        return lambda request, payload: _nonempty_key(request.headers.get(name), f"{name} header")

    providers = {
        "github": _Provider(
            lambda keys, request, body: signatures.verify_github_any(
                keys, body, request.headers.get("x-hub-signature-256")),
            key_header("X-GitHub-Delivery"), header("x-github-event"), parse=_github_payload),
        "stripe": _Provider(
            lambda keys, request, body: signatures.verify_stripe_any(
                keys, body, request.headers.get("stripe-signature"), now=clock(),
                tolerance=stripe_tolerance),
            _stripe_event_id, _stripe_event_type),
        "slack": _Provider(
            lambda keys, request, body: signatures.verify_slack(
                keys, body, request.headers.get("x-slack-request-timestamp"),
                request.headers.get("x-slack-signature"), now=clock()),
            # A retry (X-Slack-Retry-Num) carries the same event_id: the key
            # makes it a duplicate (200) if stored, and stores it if not.
            _slack_event_id, _slack_event_type, answer=_slack_answer),
        "standard-webhooks": _Provider(
            lambda keys, request, body: signatures.verify_standard_webhooks(
                keys, body, _raw_header(request, "webhook-id"),
                request.headers.get("webhook-timestamp"),
                request.headers.get("webhook-signature"), now=clock()),
            key_header("webhook-id"), _body_type),
        "hmac-body": _Provider(
            lambda keys, request, body: signatures.verify_generic_any(
                keys, body, request.headers.get("x-signature")),
            key_header("Idempotency-Key"), header("x-event-type")),
    }

    def scheme_for(request: Request, source: str, credential) -> str:
        """The configured scheme; with no secret, the one the route and headers
        suggest (so the work is the same as for a configured source)."""
        if source in PROVIDER_SCHEMES:
            return PROVIDER_SCHEMES[source]
        if credential is not None:
            return credential.scheme
        return "standard-webhooks" if "webhook-signature" in request.headers else "hmac-body"

    async def receive(request: Request, source: str,
                      signature_headers: tuple[str, ...]) -> JSONResponse:
        """The request in its intake span (tracing.py): its event stores the
        span's traceparent (or the request's `traceparent` header, if valid)."""
        with tracing.intake(request.headers.get("traceparent"), source,
                            request.path_params["user"]) as intake:
            response = await store(request, source, signature_headers, intake.traceparent)
            intake.answered(response.status_code)
            return response

    async def store(request: Request, source: str, signature_headers: tuple[str, ...],
                    traceparent: str | None) -> JSONResponse:
        """`signature_headers`: the request needs one of them (the first is named
        when none is there), checked before the body is read."""
        user = request.path_params["user"]
        try:
            check_content_length(request, max_body)
            if not any(name in request.headers for name in signature_headers):
                raise Reject(401, f"missing {signature_headers[0]} header")
            body = await read_limited_body(request, max_body)
            secret = secrets.get(user, source)
            scheme = scheme_for(request, source, secret)
            if secret is not None and secret.scheme != scheme:
                secret = None  # never a scheme a source is not for (validated: cannot happen)
            provider = providers[scheme]
            keys = secret.keys if secret is not None else ()
            verified = provider.verify(keys + _UNKNOWN_KEYS[len(keys):], request, body)
            if secret is None or not verified:
                logs.refused(source, user, "no secret for this user and source"
                             if secret is None else "signature did not verify")
                raise Reject(401, "signature verification failed")
            payload = provider.parse(request, body)
            answer = provider.answer(payload)
            if answer is not None:
                return answer
            key = provider.event_key(request, payload)
            kind = provider.kind(request, payload)
            stored = await run_in_threadpool(_ingest, inbox, user, source, key, payload, kind,
                                             traceparent)
        except Reject as rejected:
            return rejected.response()
        if stored:
            log.debug("stored %s event %r for user %r", source, key, user)
            return JSONResponse({"status": "accepted"}, status_code=202)
        log.info("duplicate %s event %r for user %r: nothing stored", source, key, user)
        return JSONResponse({"status": "duplicate"}, status_code=200)

    async def github_hook(request: Request) -> JSONResponse:
        return await receive(request, "github", ("X-Hub-Signature-256",))

    async def stripe_hook(request: Request) -> JSONResponse:
        return await receive(request, "stripe", ("Stripe-Signature",))

    async def slack_hook(request: Request) -> JSONResponse:
        return await receive(request, "slack", ("X-Slack-Signature",))

    async def generic_hook(request: Request) -> JSONResponse:
        # Standard Webhooks, or hmac-body's X-Signature where so configured.
        return await receive(request, request.path_params["source"],
                             ("webhook-signature", "X-Signature"))

    health = {"at": -HEALTH_CACHE, "ok": False}
    health_lock = anyio.Lock()

    async def healthz(request: Request) -> JSONResponse:
        """Cheap and bounded: one query at a time, its answer reused for
        HEALTH_CACHE seconds (the requests meanwhile wait on it, not on the pool)."""
        async with health_lock:
            if time.monotonic() - health["at"] >= HEALTH_CACHE:
                try:
                    await run_in_threadpool(_ping, inbox)
                    health["ok"] = True
                except Exception as exc:
                    log.warning("health check: the database did not answer: %s",
                                type(exc).__name__)
                    health["ok"] = False
                health["at"] = time.monotonic()
            ok = health["ok"]
        if not ok:
            return JSONResponse({"status": "unavailable", "error": "database unavailable"},
                                status_code=503)
        return JSONResponse({"status": "ok"})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if threads is not None:
            # The default limiter belongs to this event loop: one per server.
            anyio.to_thread.current_default_thread_limiter().total_tokens = threads
        yield

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"error": "internal server error"}, status_code=500)

    app = Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/hooks/github/{user}", github_hook, methods=["POST"]),
            Route("/hooks/stripe/{user}", stripe_hook, methods=["POST"]),
            Route("/hooks/slack/{user}", slack_hook, methods=["POST"]),
            Route("/hooks/{source}/{user}", generic_hook, methods=["POST"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )
    app.state.inbox = inbox
    app.state.secrets = secrets
    return app


def _ingest(inbox, user: str, source: str, key: str, payload: Any, kind: str | None,
            traceparent: str | None = None) -> bool:
    """`Inbox.ingest`, with its refusals turned into answers (in the threadpool)."""
    try:
        return inbox.ingest(user, source, key, payload, kind=kind, traceparent=traceparent)
    except errors.PayloadTooLarge as exc:
        raise Reject(413, str(exc)) from None
    except errors.InvalidInput as exc:
        what = _WHAT.get(exc.field)
        raise Reject(400, f"{what}: {exc}" if what else str(exc)) from None
    except UnicodeEncodeError:
        # A lone surrogate (valid JSON escape, not storable text): validate.payload
        # lets UnicodeEncodeError out instead of an InvalidPayload.
        raise Reject(400, "payload holds a lone UTF-16 surrogate, which cannot be stored") from None
    except RecursionError:
        raise Reject(400, "payload is nested too deeply") from None
    except (errors.DatabaseUnavailable, errors.DatabaseRefused, errors.TransactionConflict,
            psycopg.Error) as exc:
        if _permanent(exc):
            # The same delivery would fail the same way for ever: a 503 would
            # have the provider retry it without end.
            log.warning("the database refused a %s event for user %r: %s", source, user,
                        _short(exc))
            raise Reject(400, f"the database refused this event: {_short(exc)}") from None
        if isinstance(exc, psycopg.Error):
            raise  # not the input, not a lost server: a bug, answered 500
        log.warning("could not store a %s event for user %r: %s", source, user, exc)
        raise Reject(503, "database unavailable, retry later") from None


# What the provider calls the field an InvalidInput names.
_WHAT = {"source_id": "event key", "kind": "event kind", "source": "source", "user": "user"}
# SQLSTATE classes that mean "this input, never": data exception, integrity
# constraint violation, program limit exceeded (an index row too large).
_PERMANENT_CLASSES = ("22", "23", "54")


def _permanent(exc: BaseException) -> bool:
    """Whether PostgreSQL refused the input itself (its SQLSTATE, on the error or
    on the psycopg error it was translated from), not a lost or busy server."""
    for error in (exc, exc.__cause__):
        sqlstate = getattr(error, "sqlstate", None) or ""
        if sqlstate[:2] in _PERMANENT_CLASSES:
            return True
    return False


def _ping(inbox) -> None:
    with inbox.pool.connection(timeout=HEALTH_TIMEOUT) as conn:
        conn.execute("SELECT 1")
