"""The web console: a Starlette application over one `Inbox`, server-rendered.

Invariants:
- no page and no action without authentication (console/auth.py), and no
  action without the right for it: a role lacking it gets 403, and its pages
  do not show the button;
- every action is a POST carrying the session's CSRF token (a bearer request
  needs none; see auth.py), and a repair, a pause, a resume or a cancel is
  recorded in operator_actions as `console:<name>`, in the transaction that
  makes it, by the CLI's own SQL;
- everything shown is escaped (Jinja2 autoescape; payloads are attacker-made
  webhook bodies), and every response carries a Content-Security-Policy that
  allows only the console's own scripts, styles and images (no inline ones);
- pages read through api/admin.py (store/views.py and the CLI's views): plain SELECTs,
  never a lease row lock (only a pause, resume or cancel takes one, as the CLI's
  does: store/pauses.py);
- every page of a logged-in principal shows the fleet's pause, read once per
  request with the principal (`signed_in`: one SELECT of the one-row fleet_pause);
- a bad parameter (a NUL, a number that is not ASCII digits or does not fit a
  bigint) is a 400 naming it, and every answer, a 500 included, carries the
  security headers; user ids in log lines are escaped (ingest/logs.shown).

Database work is blocking psycopg, so every handler runs in the threadpool.
"""

import json
import logging
import math
import re
import urllib.parse
from dataclasses import dataclass
from importlib import resources

import jinja2
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from agent_inbox import db, errors, tables, validate
from agent_inbox.api import admin as views
from agent_inbox.services.worker import horizon
from agent_inbox.services.console import auth
from agent_inbox.services.console.auth import Authenticator, Principal
from agent_inbox.services.ingest.logs import Throttle, shown

log = logging.getLogger("agent_inbox.console")
# At most this many failure lines a second (then "N more ... not logged").
_failures = Throttle(per_second=10, what="failed console logins and bearer tokens")

SECURITY_HEADERS = [
    (b"content-security-policy",
     b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
     b"connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
     b"frame-ancestors 'none'"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-content-type-options", b"nosniff"),
    (b"cross-origin-opener-policy", b"same-origin"),
]
MAX_FORM = 256 * 1024  # bytes of a POST body: a page of checkboxes fits many times over
MAX_PICKS = views.CHUNK  # rows one repair may name
DEAD_SHOWN = 200
DECISIONS_SHOWN = 20
ACTIONS_SHOWN = 20  # a user's newest operator actions, on its page
PAUSED_SHOWN = 20  # paused users, longest paused first, on the overview


@dataclass(frozen=True)
class Settings:
    hide_payloads_from_viewers: bool = False
    # Session cookies Secure even over plain HTTP (the console listens off
    # loopback: a TLS proxy is in front); else Secure over HTTPS only.
    secure_cookies: bool = False


class SecurityHeaders:
    """ASGI middleware: the security headers on every response, and no caching
    of pages (they hold data only their session may see)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        static = scope["path"].startswith("/static/")

        async def with_headers(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", [])) + SECURITY_HEADERS
                if not static:
                    headers.append((b"cache-control", b"no-store"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)


class _ConsoleApp(Starlette):
    """Starlette with SecurityHeaders outside its error middleware, so that a
    500 carries them too."""

    def build_middleware_stack(self):
        return SecurityHeaders(super().build_middleware_stack())


class Forbidden(Exception):
    pass


class Console:
    """The routes, over an Inbox (its pool for reads and repairs, answer_approval
    for answers) and an Authenticator."""

    def __init__(self, inbox, authenticator: Authenticator, settings: Settings):
        self.inbox = inbox
        self.auth = authenticator
        self.settings = settings
        environment = jinja2.Environment(
            loader=jinja2.PackageLoader("agent_inbox.services.console", "templates"),
            autoescape=True, undefined=jinja2.StrictUndefined)
        environment.filters.update(when=_when, relative=tables.relative,
                                   duration=tables.duration, pretty=_pretty)
        self.templates = Jinja2Templates(env=environment)

    # --- the plumbing -------------------------------------------------------------

    def principal(self, request: Request) -> Principal | None:
        """The bearer token's principal if the request has one (a wrong one is
        a failure: throttled, logged), else the session cookie's."""
        header = request.headers.get("authorization")
        if header is not None:
            principal = self.auth.from_bearer(header)
            if principal is None:
                self.count_failure(request, "bearer token")
            return principal
        return self.auth.from_session(request.cookies.get(auth.COOKIE))

    def signed_in(self, request: Request) -> Principal | None:
        """The request's principal (`principal`) and, for one, the fleet's pause
        in request.state.fleet, which every page's banner shows: never read for
        a request without a principal (the login page shows no state)."""
        principal = self.principal(request)
        if principal is not None:
            with db.connection(self.inbox.pool) as conn:
                request.state.fleet = views.fleet_pause(conn)
        return principal

    def throttled(self, request: Request) -> Response | None:
        """429 if this client (or everyone) failed too often lately."""
        wait = self.auth.throttle.wait(_client(request))
        if wait <= 0:
            return None
        seconds = max(1, math.ceil(wait))
        message = f"too many failed logins lately: try again in {seconds} s"
        headers = {"Retry-After": str(seconds)}
        if "authorization" in request.headers or request.url.path.startswith("/api/"):
            return JSONResponse({"error": message}, status_code=429, headers=headers)
        return self.render(request, None, "error.html", status_code=429, status=429,
                           message=message, headers=headers)

    def count_failure(self, request: Request, what: str) -> None:
        client = _client(request)
        count = self.auth.throttle.failed(client)
        _failures.log(log, logging.WARNING, "console: failed %s from %s (%d in the last %d s)",
                      what, shown(client), count, int(self.auth.throttle.window))

    def page(self, right: str, handler):
        """An endpoint: authenticate, check `right`, for a POST read the form and
        check its CSRF token, then run `handler(request, principal, form)` in the
        threadpool."""
        async def endpoint(request: Request) -> Response:
            if "authorization" in request.headers and (refused := self.throttled(request)):
                return refused
            try:
                principal = await run_in_threadpool(self.signed_in, request)
            except errors.DatabaseUnavailable as exc:
                log.warning("database unavailable: %s", exc)
                return PlainTextResponse("the database is unavailable", status_code=503)
            if principal is None:
                if "authorization" in request.headers or request.url.path.startswith("/api/"):
                    return JSONResponse({"error": "not authenticated"}, status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                target = urllib.parse.quote(request.url.path + (
                    f"?{request.url.query}" if request.url.query else ""), safe="")
                return RedirectResponse(f"/login?next={target}", status_code=303)
            form: dict[str, list[str]] = {}
            if request.method == "POST":
                form = await _read_form(request)
                if form is None:
                    return self.refuse(request, principal, 413, "the form is too large")
                if not self.auth.csrf_ok(principal, _one(form, "csrf")):
                    return self.refuse(request, principal, 403,
                                       "the form's CSRF token is missing or not this session's: "
                                       "reload the page and try again")
            if not principal.can(right):
                return self.refuse(request, principal, 403, f"your role may not {_VERBS[right]}")
            try:
                return await run_in_threadpool(handler, request, principal, form)
            except errors.DatabaseUnavailable as exc:
                log.warning("database unavailable: %s", exc)
                return self.refuse(request, principal, 503, "the database is unavailable")
            except errors.InvalidInput as exc:
                return self.refuse(request, principal, 400, str(exc))
        return endpoint

    def render(self, request: Request, principal: Principal | None, name: str,
               status_code: int = 200, headers: dict | None = None, **context) -> Response:
        return self.templates.TemplateResponse(request, name, {
            "me": principal, "csrf": self.auth.csrf_token(principal) if principal else "",
            "show_payloads": self.shows_payloads(principal),
            "fleet": getattr(request.state, "fleet", None), **context},
            status_code=status_code, headers=headers)

    def refuse(self, request: Request, principal: Principal, status: int, message: str):
        if "authorization" in request.headers:
            return JSONResponse({"error": message}, status_code=status)
        return self.render(request, principal, "error.html", status_code=status,
                           status=status, message=message)

    def shows_payloads(self, principal: Principal | None) -> bool:
        return principal is not None and not (
            self.settings.hide_payloads_from_viewers and principal.rights == {"view"})

    # --- login -------------------------------------------------------------------

    async def login_page(self, request: Request) -> Response:
        return self.render(request, None, "login.html", next=_safe_next(request), failed=False)

    async def login(self, request: Request) -> Response:
        """The one form without a session (so without a CSRF token): refused if
        sent from another site (login CSRF: Origin, Sec-Fetch-Site), throttled
        after failures; a token, checked in constant time; a session cookie on
        success."""
        if not _same_site(request):
            log.warning("console: refused a cross-site login from %s", shown(_client(request)))
            return self.render(request, None, "error.html", status_code=403, status=403,
                               message="a login must come from the console's own page")
        if refused := self.throttled(request):
            return refused
        form = await _read_form(request) or {}
        token = self.auth.by_token(_one(form, "token") or "")
        target = _safe_next(request, _one(form, "next"))
        if token is None:
            self.count_failure(request, "login")
            return self.render(request, None, "login.html", status_code=401, next=target,
                               failed=True)
        try:
            cookie = await run_in_threadpool(self.auth.new_session, token)
        except errors.DatabaseUnavailable as exc:
            log.warning("database unavailable: %s", exc)
            return self.render(request, None, "error.html", status_code=503, status=503,
                               message="the database is unavailable")
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(auth.COOKIE, cookie, max_age=self.auth.session_ttl, httponly=True,
                            samesite="strict", secure=self.secure(request), path="/")
        log.info("console login: %s from %s", token.name, shown(_client(request)))
        return response

    def secure(self, request: Request) -> bool:
        return self.settings.secure_cookies or request.url.scheme == "https"

    def logout(self, request, principal, form) -> Response:
        self.auth.end_session(principal)
        log.info("console logout: %s", principal.name)
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(auth.COOKIE, path="/", httponly=True, samesite="strict",
                               secure=self.secure(request))
        return response

    # --- overview ----------------------------------------------------------------

    def overview(self, request, principal, form, notice: str | None = None) -> Response:
        with db.connection(self.inbox.pool) as conn:
            totals = views.overview(conn)
            minutes = views.last_minutes(conn, 60)
            held = horizon.read(conn).as_json()
            paused, paused_total = views.paused_users(conn, PAUSED_SHOWN)
        return self.render(request, principal, "overview.html", totals=totals,
                           hour=_sums(minutes), now=totals["now"], horizon=held,
                           paused=paused, paused_total=paused_total, notice=notice)

    def overview_json(self, request, principal, form) -> Response:
        with db.connection(self.inbox.pool) as conn:
            totals = views.overview(conn)
            minutes = views.last_minutes(conn, 60)
            held = horizon.read(conn).as_json()
        return JSONResponse({**totals, "hour": _sums(minutes), "horizon": held})

    def chart(self, request, principal, form) -> Response:
        with db.connection(self.inbox.pool) as conn:
            minutes = views.last_minutes(conn, 60)
        svg = self.templates.get_template("chart.svg").render(**_chart(minutes))
        return Response(svg, media_type="image/svg+xml")

    # --- users -------------------------------------------------------------------

    def users(self, request, principal, form) -> Response:
        prefix = _param(request, "q")
        after = _param(request, "after")
        with db.connection(self.inbox.pool) as conn:
            rows, now = views.users(conn, prefix, after, views.PAGE + 1)
        more = len(rows) > views.PAGE
        rows = rows[:views.PAGE]
        next_after = rows[-1]["user"] if more else None
        return self.render(request, principal, "users.html", users=rows, q=prefix, after=after,
                           next_after=next_after, now=now)

    def user(self, request, principal, form) -> Response:
        return self.user_page(request, principal, _param(request, "u"))

    def user_page(self, request, principal, user: str, notice: str | None = None) -> Response:
        """The user's page (after a pause, resume or cancel, with `notice`
        saying what it did)."""
        before = _int("before", request.query_params.get("before"), 2**63 - 1)
        with db.connection(self.inbox.pool) as conn:
            lease = views.lease(conn, user)
            recent = views.actions(conn, user, ACTIONS_SHOWN)
            paused = views.user_pause(conn, user, recent)
            events = views.timeline(conn, user, before, views.PAGE + 1)
            runs = views.runs(conn, user)
            messages = views.messages(conn, user)
            timers, timers_total = views.timers(conn, user, views.PAGE, None)
            approvals = views.user_approvals(conn, user)
            recorded = views.list_steps(conn, user, views.PAGE)
            memory = views.memory(conn, user)
            rules = views.rules(conn, user)
            defaults = views.rules(conn, None)
            decisions = views.decisions(conn, user, DECISIONS_SHOWN)
        more = len(events) > views.PAGE
        events = events[:views.PAGE]
        if memory is not None:  # measured as its limit is (validate.payload): compact JSON
            memory["size"] = len(json.dumps(memory["doc"], ensure_ascii=False,
                                            separators=(",", ":")).encode())
        return self.render(request, principal, "user.html", user=user, lease=lease,
                           events=events, older=events[-1]["id"] if more else None, runs=runs,
                           messages=messages, timers=timers, timers_total=timers_total,
                           approvals=approvals, steps=recorded, memory=memory,
                           memory_limit=self.inbox.settings.max_memory_bytes, rules=rules,
                           defaults=defaults, decisions=decisions, actions=recent,
                           paused=paused, notice=notice, now=lease["now"] if lease else None)

    # --- stopping an agent (store/pauses.py, docs/operating/stopping.md) -----------

    def pause(self, request, principal, form) -> Response:
        """Pause a user, with `cancel` its run in flight too (Inbox.pause:
        checked, audited as console:<name>); the user's page says what it did."""
        user, cancel = _one(form, "user") or "", _flag(form, "cancel")
        done = self.inbox.pause(user, actor=principal.actor, reason=_reason(form), cancel=cancel)
        log.info("console pause by %s: user=%s cancel=%s already=%s cancelled=%s",
                 principal.actor, shown(user), cancel, done["already"],
                 (done["cancelled"] or {}).get("gen"))
        if done["already"]:
            notice = (f"User {user!r} was already paused (since {_when(done['paused_at'])}): "
                      "its pause and reason are kept")
        else:
            notice = (f"User {user!r} is paused: no run of it starts and its messages are "
                      "held until it is resumed")
        if cancel:
            notice += f"; {_cancelled(done['cancelled'])}"
        return self.user_page(request, principal, user, notice=notice + ".")

    def resume(self, request, principal, form) -> Response:
        user = _one(form, "user") or ""
        done = self.inbox.resume(user, actor=principal.actor)
        log.info("console resume by %s: user=%s resumed=%s", principal.actor, shown(user),
                 done["resumed"])
        notice = (f"User {user!r} is resumed: its events run and its held messages are sent, "
                  "in order." if done["resumed"] else
                  f"User {user!r} was not paused: nothing changed.")
        return self.user_page(request, principal, user, notice=notice)

    def cancel(self, request, principal, form) -> Response:
        user = _one(form, "user") or ""
        done = self.inbox.cancel(user, actor=principal.actor, reason=_reason(form))
        log.info("console cancel by %s: user=%s cancelled=%s", principal.actor, shown(user),
                 (done["cancelled"] or {}).get("gen"))
        return self.user_page(request, principal, user,
                              notice=f"User {user!r}: {_cancelled(done['cancelled'])}.")

    def pause_fleet(self, request, principal, form) -> Response:
        """Pause the fleet, with `cancel` every run in flight too
        (Inbox.pause_fleet); the overview says what it did, under the banner."""
        cancel = _flag(form, "cancel")
        done = self.inbox.pause_fleet(actor=principal.actor, reason=_reason(form), cancel=cancel)
        log.info("console fleet pause by %s: cancel=%s already=%s cancelled=%d",
                 principal.actor, cancel, done["already"], len(done["cancelled"]))
        request.state.fleet = {key: done[key] for key in ("paused_at", "actor", "reason")}
        notice = ("The fleet was already paused: its pause and reason are kept" if done["already"]
                  else "The fleet is paused: no run starts and no message is sent until it "
                       "is resumed")
        if cancel:
            notice += f"; {len(done['cancelled'])} runs in flight cancelled"
        return self.overview(request, principal, form, notice=notice + ".")

    def resume_fleet(self, request, principal, form) -> Response:
        done = self.inbox.resume_fleet(actor=principal.actor)
        log.info("console fleet resume by %s: resumed=%s", principal.actor, done["resumed"])
        request.state.fleet = None
        return self.overview(request, principal, form, notice=(
            "The fleet is resumed: runs start and messages are sent again." if done["resumed"]
            else "The fleet was not paused: nothing changed."))

    # --- dead events -------------------------------------------------------------

    def dead(self, request, principal, form) -> Response:
        with db.connection(self.inbox.pool) as conn:
            rows, total = views.dead(conn, None, DEAD_SHOWN)
        return self.render(request, principal, "dead.html", events=rows, total=total)

    def dead_confirm(self, request, principal, form) -> Response:
        action = _action(form, ("requeue", "discard"))
        pairs = _picked_events(form)
        with db.connection(self.inbox.pool) as conn:
            rows = views.dead_named(conn, pairs)
        return self.render(request, principal, "dead_confirm.html", action=action, events=rows,
                           gone=len(pairs) - len(rows))

    def dead_apply(self, request, principal, form) -> Response:
        action = _action(form, ("requeue", "discard"))
        pairs = _picked_events(form)
        done = self.inbox.repair_dead(pairs, requeue=action == "requeue", actor=principal.actor)
        log.info("console %s by %s: %d of %d events: %s", action, principal.actor, len(done),
                 len(pairs), ", ".join(f"{shown(r['user'])}/{r['id']}" for r in done))
        done_keys = {(r["user"], r["id"]) for r in done}
        return self.render(request, principal, "done.html", what="dead events", action=action,
                           past=_PAST[action], done=done,
                           left=[p for p in pairs if p not in done_keys],
                           back="/dead")

    # --- failed outbox batches ---------------------------------------------------

    def failed(self, request, principal, form) -> Response:
        with db.connection(self.inbox.pool) as conn:
            rows, total = views.failed_batches(conn, None, DEAD_SHOWN)
        return self.render(request, principal, "outbox.html", batches=rows, total=total)

    def failed_confirm(self, request, principal, form) -> Response:
        action = _action(form, ("retry", "discard"))
        picked = _picked_batches(form)
        with db.connection(self.inbox.pool) as conn:
            rows, _ = views.failed_batches(conn, None, DEAD_SHOWN)
        rows = [r for r in rows if r["batch"] in picked]
        return self.render(request, principal, "outbox_confirm.html", action=action,
                           batches=rows, picked=sorted(picked))

    def failed_apply(self, request, principal, form) -> Response:
        action = _action(form, ("retry", "discard"))
        picked = sorted(_picked_batches(form))
        done = self.inbox.repair_failed_batches(picked, retry=action == "retry",
                                                actor=principal.actor)
        log.info("console outbox %s by %s: batches %s", action, principal.actor,
                 [r["batch"] for r in done])
        done_batches = {r["batch"] for r in done}
        return self.render(request, principal, "done.html", what="failed batches",
                           action=action, past=_PAST[action], done=done,
                           left=[b for b in picked if b not in done_batches], back="/outbox")

    # --- approvals ---------------------------------------------------------------

    def approvals(self, request, principal, form, notice: str | None = None) -> Response:
        with db.connection(self.inbox.pool) as conn:
            rows = views.unanswered(conn)
        return self.render(request, principal, "approvals.html", requests=rows, notice=notice)

    def answer(self, request, principal, form) -> Response:
        user, request_id = _one(form, "user") or "", _one(form, "request") or ""
        answer = _action(form, ("yes", "no"), field="answer")
        standing = self.inbox.answer_approval(user, request_id, answer)
        log.info("console approval by %s: user=%s request=%s answer=%s standing=%s",
                 principal.actor, shown(user), shown(request_id), answer, standing)
        notice = views.describe_answer(user, request_id, answer, standing)
        return self.approvals(request, principal, form, notice=notice)


    # --- permission rules ---------------------------------------------------------

    def default_policies(self, request, principal, form) -> Response:
        with db.connection(self.inbox.pool) as conn:
            defaults = views.rules(conn, None)
        return self.render(request, principal, "policies.html", defaults=defaults)

    def policy_set(self, request, principal, form) -> Response:
        """Set a user's rule or a default one, as `agent-inbox policy set` does
        (Inbox.set_policy: checked, audited as console:<name>)."""
        user = _policy_scope(form)
        tool = (_one(form, "tool") or "").strip()
        answer = _action(form, views.ANSWERS, field="answer")
        expires_in = _duration("ask_expires_in", _one(form, "ask_expires_in"),
                               views.DEFAULT_ASK_EXPIRES_IN)
        self.inbox.set_policy(tool, answer, user=user, ask_expires_in=expires_in,
                              actor=principal.actor)
        log.info("console policy set by %s: user=%s tool=%s answer=%s ask_expires_in=%d",
                 principal.actor, _shown(user), shown(tool), answer, expires_in)
        return RedirectResponse(_rules_page(user), status_code=303)

    def policy_clear(self, request, principal, form) -> Response:
        user = _policy_scope(form)
        tool = (_one(form, "tool") or "").strip()
        cleared = self.inbox.clear_policy(tool, user=user, actor=principal.actor)
        log.info("console policy clear by %s: user=%s tool=%s cleared=%s", principal.actor,
                 _shown(user), shown(tool), cleared)
        if not cleared:
            scope = "the defaults have" if user is None else f"user {user!r} has"
            return self.refuse(request, principal, 404,
                               f"{scope} no rule for tool {tool!r}: nothing was cleared")
        return RedirectResponse(_rules_page(user), status_code=303)


_PAST = {"requeue": "requeued", "discard": "discarded", "retry": "retried"}
_VERBS = {"view": "view the console", "repair": "repair dead events or failed batches",
          "approve": "answer approval requests", "policy": "set or clear permission rules",
          "stop": "pause, resume or cancel a user's agent", "fleet": "pause or resume the fleet"}


def build_app(inbox, authenticator: Authenticator, settings: Settings = Settings()) -> Starlette:
    console = Console(inbox, authenticator, settings)
    page = console.page
    static = resources.files("agent_inbox.services.console") / "static"
    routes = [
        Route("/login", console.login_page, methods=["GET"]),
        Route("/login", console.login, methods=["POST"]),
        Route("/logout", page("view", console.logout), methods=["POST"]),
        Route("/", page("view", console.overview)),
        Route("/api/overview", page("view", console.overview_json)),
        Route("/overview/chart.svg", page("view", console.chart)),
        Route("/users", page("view", console.users)),
        Route("/user", page("view", console.user)),
        Route("/user/pause", page("stop", console.pause), methods=["POST"]),
        Route("/user/resume", page("stop", console.resume), methods=["POST"]),
        Route("/user/cancel", page("stop", console.cancel), methods=["POST"]),
        Route("/fleet/pause", page("fleet", console.pause_fleet), methods=["POST"]),
        Route("/fleet/resume", page("fleet", console.resume_fleet), methods=["POST"]),
        Route("/dead", page("view", console.dead)),
        Route("/dead/confirm", page("repair", console.dead_confirm), methods=["POST"]),
        Route("/dead/apply", page("repair", console.dead_apply), methods=["POST"]),
        Route("/outbox", page("view", console.failed)),
        Route("/outbox/confirm", page("repair", console.failed_confirm), methods=["POST"]),
        Route("/outbox/apply", page("repair", console.failed_apply), methods=["POST"]),
        Route("/approvals", page("view", console.approvals)),
        Route("/approvals/answer", page("approve", console.answer), methods=["POST"]),
        Route("/policies", page("view", console.default_policies)),
        Route("/policies/set", page("policy", console.policy_set), methods=["POST"]),
        Route("/policies/clear", page("policy", console.policy_clear), methods=["POST"]),
        Route("/healthz", lambda request: PlainTextResponse("ok")),
        Mount("/static", StaticFiles(directory=str(static)), name="static"),
    ]
    return _ConsoleApp(routes=routes)


# --- forms -------------------------------------------------------------------------


async def _read_form(request: Request) -> dict[str, list[str]] | None:
    """An application/x-www-form-urlencoded body (what the console's forms send),
    at most MAX_FORM bytes; None if larger."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM:
            return None
    return urllib.parse.parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)


def _one(form: dict, name: str) -> str | None:
    values = form.get(name)
    return values[0] if values else None


def _action(form: dict, allowed: tuple[str, ...], field: str = "action") -> str:
    value = _one(form, field)
    if value not in allowed:
        raise errors.InvalidInput(field, value, f"must be one of {', '.join(allowed)}")
    return value


def _flag(form: dict, name: str) -> bool:
    """A checkbox: absent (unticked) or 'yes' (ticked)."""
    value = _one(form, name)
    if value not in (None, "yes"):
        raise errors.InvalidInput(name, value, "must be 'yes' or absent")
    return value == "yes"


def _reason(form: dict) -> str | None:
    """A pause's or cancel's reason, trimmed: None if blank (Inbox checks the
    rest: at most 1000 bytes, no NUL)."""
    return (_one(form, "reason") or "").strip() or None


def _picked_events(form: dict) -> list[tuple[str, int]]:
    """The checked events: `pick` values '<id>:<user>' (an id has no ':')."""
    pairs = []
    for value in form.get("pick", []):
        event_id, _, user = value.partition(":")
        if _bigint(event_id) is None or not user or "\x00" in user:
            raise errors.InvalidInput("pick", value, "must be <event id>:<user>")
        pairs.append((user, int(event_id)))
    return _bounded(sorted(set(pairs)))


def _picked_batches(form: dict) -> set[int]:
    values = form.get("pick", [])
    if not all(_bigint(v) is not None for v in values):
        raise errors.InvalidInput("pick", values, "must be batch ids")
    return set(_bounded(sorted({int(v) for v in values})))


def _bounded(picked: list) -> list:
    if not picked:
        raise errors.InvalidInput("pick", None, "must name at least one row: tick some")
    if len(picked) > MAX_PICKS:
        raise errors.InvalidInput("pick", len(picked), f"must name at most {MAX_PICKS} rows")
    return picked


def _policy_scope(form: dict) -> str | None:
    """The user whose rule a form changes, or None for the default rules."""
    if _action(form, ("user", "default"), field="scope") == "default":
        return None
    return _one(form, "user") or ""  # Inbox checks it: must not be empty


_DURATION = re.compile(r"([0-9]{1,12})([dhms]?)")
_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1, "": 1}


def _duration(field: str, value: str | None, default: int) -> int:
    """Seconds from '30d', '12h', '90m', '45s' or plain seconds, as the CLI's
    --ask-expires-in takes them; `default` if not given."""
    if value is None or not value.strip():
        return default
    found = _DURATION.fullmatch(value.strip())
    if found is None or int(found.group(1)) == 0:
        raise errors.InvalidInput(field, value, "must be a positive duration such as 3600, "
                                                "90m, 12h or 30d")
    return validate.positive_seconds(field, int(found.group(1)) * _UNITS[found.group(2)])


def _rules_page(user: str | None) -> str:
    if user is None:
        return "/policies"
    return f"/user?u={urllib.parse.quote(user, safe='')}#permissions"


def _client(request: Request) -> str:
    """The client's address (uvicorn takes it from X-Forwarded-For only when
    the proxy is trusted: --forwarded-allow-ips)."""
    return request.client.host if request.client else "?"


def _same_site(request: Request) -> bool:
    """Whether a form POST came from the console's own pages: a browser says
    so in Sec-Fetch-Site, or else in Origin (a script sends neither)."""
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site in ("same-origin", "none")
    origin = request.headers.get("origin")
    if origin is None:
        return True
    return urllib.parse.urlsplit(origin).netloc == request.headers.get("host")


def _safe_next(request: Request, value: str | None = None) -> str:
    """Where to go after logging in: a path on this console only."""
    target = value if value is not None else request.query_params.get("next", "/")
    if not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


_DIGITS = re.compile(r"[0-9]{1,19}")  # ASCII only: str.isdigit() also takes '²'


def _bigint(value: str) -> int | None:
    """`value` as a non-negative bigint, or None if it is not one."""
    if not _DIGITS.fullmatch(value) or int(value) >= 2**63:
        return None
    return int(value)


def _int(field: str, value: str | None, default: int) -> int:
    """A query parameter's bigint, `default` if absent or empty; 400 otherwise."""
    if not value:
        return default
    number = _bigint(value)
    if number is None:
        raise errors.InvalidInput(field, value, "must be a whole number below 2**63")
    return number


def _param(request: Request, name: str) -> str:
    """A text query parameter ('' if absent); 400 if PostgreSQL could not take it."""
    value = request.query_params.get(name, "")
    if "\x00" in value:
        raise errors.InvalidInput(name, value, "must not contain NUL characters")
    return value


def _shown(user: str | None) -> str:
    return "(defaults)" if user is None else shown(user)


def _cancelled(cancelled: dict | None) -> str:
    """What a cancel did (store/pauses.py's {"gen", "events"}, None: no run)."""
    if not cancelled:
        return "no run was in flight, nothing was cancelled"
    return (f"the run in flight (generation {cancelled['gen']}) is cancelled: nothing it "
            f"would commit commits, and its {len(cancelled['events'])} events are pending again")


# --- presentation ------------------------------------------------------------------


def _when(epoch) -> str:
    return "-" if epoch is None else tables.when(epoch)


def _pretty(value) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)


def _sums(minutes: list[dict]) -> dict:
    return {name: sum(m[name] for m in minutes) for name in views.RUN_STAT_FIELDS}


# Two panels, each scaled to its own largest count: runs finished, and the
# rarer trouble (refusals, takeovers, deaths) that would lie flat beside them.
PANELS = ((("finished", "#2e7d32"),),
          (("refused", "#c62828"), ("takeovers", "#ef6c00"), ("died", "#6a1b9a")))
CHART_W, PANEL_H, PAD = 600, 110, 30


def _chart(minutes: list[dict]) -> dict:
    """Polylines for the last hour, one per series, in PANELS."""
    step = (CHART_W - 2 * PAD) / max(1, len(minutes) - 1)
    panels = []
    for number, series in enumerate(PANELS):
        top = max([1] + [m[name] for m in minutes for name, _ in series])
        base = (number + 1) * PANEL_H - 5

        def point(i, value):
            return f"{PAD + i * step:.1f},{base - value * (PANEL_H - 35) / top:.1f}"

        panels.append({"top": top, "base": base, "lines": [
            {"name": name, "color": color, "total": sum(m[name] for m in minutes),
             "points": " ".join(point(i, m[name]) for i, m in enumerate(minutes))}
            for name, color in series]})
    return {"panels": panels, "width": CHART_W, "height": PANEL_H * len(PANELS) + 30,
            "pad": PAD}
