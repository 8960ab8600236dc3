"""The webhook intake: a Starlette application over one `Inbox`.

Invariant: nothing is stored unless the request's signature verified against
the secret configured for its user and source. Each request is checked in this
order, and the first failure answers without storing anything:

    Content-Length over the limit             413
    signature header missing                  401
    body over the limit while it streams      413
    no secret for user/source, bad signature  401  (same answer and same work
                                                    for both: no user oracle)
    body not UTF-8 JSON                       400
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
from collections.abc import Callable, Mapping
from typing import Any

import anyio.to_thread
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agent_inbox import errors
from agent_inbox.ingest import DEFAULT_MAX_BODY, DEFAULT_STRIPE_TOLERANCE, signatures
from agent_inbox.ingest.secrets import SecretStore

log = logging.getLogger("agent_inbox.ingest")

# When no secret exists for the user and source, the signature is still checked,
# against a key nobody knows, so the answer and its timing are a bad signature's.
_UNKNOWN_KEY = _random.token_bytes(32)
# Seconds a health check waits for a pooled connection.
HEALTH_TIMEOUT = 5.0


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


def _stripe_event_type(request: Request, payload: dict) -> str | None:
    kind = payload.get("type")
    return kind if isinstance(kind, str) and kind else None


class _Provider:
    """How one kind of sender signs its deliveries, names them (the event key)
    and says what they are (the event's kind, if it says)."""

    def __init__(self, signature_header: str, verify: Callable[[str | bytes, bytes, str], bool],
                 event_key: Callable[[Request, Any], str],
                 kind: Callable[[Request, Any], str | None]):
        self.signature_header = signature_header
        self.verify = verify
        self.event_key = event_key
        self.kind = kind


def build_app(inbox, secrets: SecretStore | Mapping[str, Mapping[str, str]],
              max_body: int = DEFAULT_MAX_BODY,
              stripe_tolerance: float = DEFAULT_STRIPE_TOLERANCE, *,
              threads: int | None = None, clock: Callable[[], float] = time.time) -> Starlette:
    """The intake over `inbox` (an `agent_inbox.Inbox`). `secrets` is a
    SecretStore (reloadable) or a mapping user -> source -> secret; `threads`
    caps the threadpool (default: anyio's); `clock` is for tests."""
    if not isinstance(secrets, SecretStore):
        secrets = SecretStore(secrets)
    if isinstance(max_body, bool) or not isinstance(max_body, int) or max_body <= 0:
        raise errors.InvalidInput("max_body", max_body, "must be a positive integer")
    if isinstance(stripe_tolerance, bool) or not isinstance(stripe_tolerance, (int, float)) \
            or not 0 <= stripe_tolerance < float("inf"):
        raise errors.InvalidInput("stripe_tolerance", stripe_tolerance,
                                  "must be a non-negative number of seconds")

    github = _Provider(
        "X-Hub-Signature-256", signatures.verify_github,
        lambda request, payload: _nonempty_key(request.headers.get("x-github-delivery"),
                                               "X-GitHub-Delivery header"),
        lambda request, payload: request.headers.get("x-github-event") or None)
    stripe = _Provider(
        "Stripe-Signature",
        lambda secret, body, header: signatures.verify_stripe(
            secret, body, header, now=clock(), tolerance=stripe_tolerance),
        _stripe_event_id, _stripe_event_type)
    generic = _Provider(
        "X-Signature", signatures.verify_generic,
        lambda request, payload: _nonempty_key(request.headers.get("idempotency-key"),
                                               "Idempotency-Key header"),
        lambda request, payload: request.headers.get("x-event-type") or None)

    async def receive(request: Request, source: str, provider: _Provider) -> JSONResponse:
        user = request.path_params["user"]
        try:
            check_content_length(request, max_body)
            header = request.headers.get(provider.signature_header)
            if header is None:
                raise Reject(401, f"missing {provider.signature_header} header")
            body = await read_limited_body(request, max_body)
            secret = secrets.get(user, source)
            verified = provider.verify(secret if secret is not None else _UNKNOWN_KEY, body, header)
            if secret is None or not verified:
                log.warning("refused a %s delivery for user %r: %s", source, user,
                            "no secret for this user and source" if secret is None
                            else "signature did not verify")
                raise Reject(401, "signature verification failed")
            payload = parse_json(body)
            key = provider.event_key(request, payload)
            kind = provider.kind(request, payload)
            stored = await run_in_threadpool(_ingest, inbox, user, source, key, payload, kind)
        except Reject as rejected:
            return rejected.response()
        if stored:
            log.debug("stored %s event %r for user %r", source, key, user)
            return JSONResponse({"status": "accepted"}, status_code=202)
        log.info("duplicate %s event %r for user %r: nothing stored", source, key, user)
        return JSONResponse({"status": "duplicate"}, status_code=200)

    async def github_hook(request: Request) -> JSONResponse:
        return await receive(request, "github", github)

    async def stripe_hook(request: Request) -> JSONResponse:
        return await receive(request, "stripe", stripe)

    async def generic_hook(request: Request) -> JSONResponse:
        return await receive(request, request.path_params["source"], generic)

    async def healthz(request: Request) -> JSONResponse:
        try:
            await run_in_threadpool(_ping, inbox)
        except Exception as exc:
            log.warning("health check: the database did not answer: %s", type(exc).__name__)
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
            Route("/hooks/{source}/{user}", generic_hook, methods=["POST"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )
    app.state.inbox = inbox
    app.state.secrets = secrets
    return app


def _ingest(inbox, user: str, source: str, key: str, payload: Any, kind: str | None) -> bool:
    """`Inbox.ingest`, with its refusals turned into answers (in the threadpool)."""
    try:
        return inbox.ingest(user, source, key, payload, kind=kind)
    except errors.PayloadTooLarge as exc:
        raise Reject(413, str(exc)) from None
    except errors.InvalidInput as exc:
        raise Reject(400, str(exc)) from None
    except UnicodeEncodeError:
        # A lone surrogate (valid JSON escape, not storable text): validate.payload
        # lets UnicodeEncodeError out instead of an InvalidPayload.
        raise Reject(400, "payload holds a lone UTF-16 surrogate, which cannot be stored") from None
    except RecursionError:
        raise Reject(400, "payload is nested too deeply") from None
    except (errors.DatabaseUnavailable, errors.TransactionConflict) as exc:
        log.warning("could not store a %s event for user %r: %s", source, user, exc)
        raise Reject(503, "database unavailable, retry later") from None


def _ping(inbox) -> None:
    with inbox.pool.connection(timeout=HEALTH_TIMEOUT) as conn:
        conn.execute("SELECT 1")
