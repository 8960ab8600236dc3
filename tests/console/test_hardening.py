"""Issue 20's findings on the console's sessions and inputs, each against a real
console process (or, for a 500, the application over a failing inbox)."""

import http.client
import urllib.error
import urllib.parse
import urllib.request

import pytest

from agent_inbox.services.console import auth
from agent_inbox.services.console.app import SECURITY_HEADERS, build_app
from tests.console.conftest import TOKENS, ConsoleProcess, _no_redirects
from tests.test_ingest_server import serving

ANN = TOKENS["ann"][1]


def fetch(url: str, headers: dict | None = None, data: bytes | None = None):
    """(status, headers, body) of a request, redirects not followed."""
    request = urllib.request.Request(url, data=data, headers=headers or {},
                                     method="POST" if data is not None else "GET")
    try:
        with _no_redirects().open(request, timeout=10) as answer:
            return answer.status, answer.headers, answer.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.headers, exc.read().decode()


def assert_security_headers(headers) -> None:
    for name, value in SECURITY_HEADERS:
        assert headers.get(name.decode()) == value.decode(), name


# --- every bad parameter a 400, every error with the security headers -----------------

@pytest.mark.parametrize("path", ["/user?u=%00", "/users?after=%00", "/users?q=%00",
                                  "/user?u=alice&before=%C2%B2",
                                  "/user?u=alice&before=99999999999999999999999",
                                  "/user?u=alice&before=-1"])
def test_bad_query_parameters_are_400_with_the_security_headers(console, path):
    status, headers, body = fetch(console.url + path, {"Authorization": f"Bearer {ANN}"})
    assert status == 400, (status, body[-300:])
    assert_security_headers(headers)


@pytest.mark.parametrize("route, pick", [("/dead/confirm", "99999999999999999999999:alice"),
                                         ("/dead/confirm", "²:alice"),
                                         ("/dead/confirm", "1:al\x00ice"),
                                         ("/outbox/confirm", "99999999999999999999999"),
                                         ("/outbox/confirm", "²")])
def test_bad_picks_are_400(console, route, pick):
    action = "requeue" if route.startswith("/dead") else "retry"
    status, body, _ = console.post(route, {"action": action, "pick": pick}, token=ANN)
    assert status == 400, (status, body[-300:])


def test_a_non_ascii_cookie_is_no_session(console):
    status, headers, _ = fetch(console.url + "/users",
                               {"Cookie": f"{auth.COOKIE}=x.\u00e9t\u00e9"})
    assert status == 303 and headers["Location"].startswith("/login")
    assert_security_headers(headers)


class Failing:
    """An inbox whose pool fails as a bug would."""

    class pool:
        @staticmethod
        def connection(*args, **kwargs):
            raise RuntimeError("a bug")


def test_a_500_carries_the_security_headers():
    [token] = auth.parse_tokens(f"ann:viewer:{ANN}", "test")
    app = build_app(Failing(), auth.Authenticator([token], session_ttl=60))
    with serving(app) as url:
        status, headers, body = fetch(url + "/users", {"Authorization": f"Bearer {ANN}"})
    assert status == 500 and "a bug" not in body
    assert_security_headers(headers)
    assert headers["Cache-Control"] == "no-store"


# --- user ids escaped in log lines ----------------------------------------------------

def test_a_requeue_logs_the_user_id_escaped(inbox, database_url):
    from tests.test_operator_cli import exhaust

    hostile = "\x1b[2J\u202eevil\r\nFAKE LOG LINE"
    inbox.ingest(hostile, "chat", "h-1", {"n": 1})
    exhaust(inbox, hostile, 1_000_000)
    [event] = inbox.events(hostile)
    started = ConsoleProcess(database_url)
    try:
        status, body, _ = started.post("/dead/apply", {"action": "requeue",
                                                      "pick": f"{event.id}:{hostile}"}, token=ANN)
        assert status == 200, body[-300:]
    finally:
        started.process.terminate()
        log = started.process.stderr.read()
        started.stop()
    [line] = [line for line in log.splitlines() if "console requeue" in line]
    assert "\x1b" not in line and "\u202e" not in line
    assert "\\x1b[2J\\u202eevil\\r\\nFAKE LOG LINE" in line
    assert "FAKE LOG LINE" not in log.replace(line, "")


# --- tokens must carry enough entropy ---------------------------------------------------

@pytest.mark.parametrize("weak", ["aaaaaaaaaaaaaaaa", "passwordpassword", "0123456789abcdef",
                                  "ann-token-0123456789", "hunter2hunter2hunter2hunter2",
                                  "0123456789abcdef0123456789abcdef"])
def test_low_entropy_tokens_refuse_to_start(monkeypatch, capsys, weak):
    from agent_inbox import cli

    monkeypatch.setenv("AGENT_INBOX_CONSOLE_TOKENS", f"ann:operator:{weak}")
    code = cli.main(["console", "--database-url", "postgresql://127.0.0.1:1/none"])
    err = capsys.readouterr().err
    assert code == 2 and "entry 1 has a weak token: a token needs at least 128 bits" in err, err
    assert "agent-inbox console token new" in err and weak not in err


def test_token_new_prints_a_strong_token_and_an_entry(capsys):
    from agent_inbox import cli

    printed = []
    for argv in ([], [], ["--name", "ann", "--role", "operator+approver"]):
        assert cli.main(["console", "token", "new", *argv]) == 0
        printed.append(capsys.readouterr().out.strip())
    first, second, entry = printed
    assert first != second and len(first) >= 43 and auth.strong(first)
    [token] = auth.parse_tokens(entry, "test")
    assert (token.name, token.roles) == ("ann", ("operator", "approver"))
    assert cli.main(["console", "token", "new", "--name", "ann", "--role", "root"]) == 2


# --- failed logins and bearer tokens throttled and logged -----------------------------

def stderr_of(started: ConsoleProcess) -> str:
    """Everything the console logged, once it has stopped."""
    started.process.terminate()
    text = started.process.stderr.read()
    started.stop()
    return text


def login_form(token: str) -> bytes:
    return urllib.parse.urlencode({"token": token, "next": "/"}).encode()


def test_failed_logins_are_throttled_per_address_and_logged(database_url):
    started = ConsoleProcess(database_url)
    try:
        statuses = [fetch(started.url + "/login", data=login_form(f"wrong-{n}-{'x' * 30}"))[0]
                    for n in range(30)]
        assert statuses[:10] == [401] * 10 and set(statuses[10:]) == {429}, statuses
        status, headers, body = fetch(started.url + "/login", data=login_form(ANN))
        assert status == 429 and int(headers["Retry-After"]) > 0  # not even the right one
        assert "Set-Cookie" not in headers and "too many failed logins" in body
    finally:
        log = stderr_of(started)
    assert log.count("console: failed login from '127.0.0.1'") == 10, log[-2000:]


def test_failed_bearer_tokens_are_throttled_and_logged(database_url):
    started = ConsoleProcess(database_url)
    try:
        statuses = [started.get("/api/overview", token=f"wrong-{n}-{'x' * 30}")[0]
                    for n in range(15)]
        assert statuses[:10] == [401] * 10 and set(statuses[10:]) == {429}, statuses
        assert started.get("/api/overview", token=ANN)[0] == 429
        assert fetch(started.url + "/login", data=login_form(ANN))[0] == 429  # same address
    finally:
        log = stderr_of(started)
    assert log.count("console: failed bearer token from '127.0.0.1'") == 10, log[-2000:]


def test_the_throttle_forgets_after_its_window_and_bounds_its_memory():
    now = [0.0]
    throttle = auth.Throttle(per_client=3, overall=5, window=60, clock=lambda: now[0])
    for _ in range(3):
        throttle.failed("a")
    assert throttle.wait("a") == 60 and throttle.wait("b") == 0
    throttle.failed("b"), throttle.failed("c")
    assert throttle.wait("d") == 60  # 5 failures from anyone: everyone waits
    now[0] = 61
    assert throttle.wait("a") == 0 and throttle.wait("d") == 0
    throttle.MAX_CLIENTS = 10
    for n in range(100):
        throttle.failed(f"client-{n}")
    assert len(throttle.clients) <= 10 and len(throttle.all) <= 5


# --- login CSRF ---------------------------------------------------------------------------

@pytest.mark.parametrize("headers", [{"Origin": "http://evil.example"}, {"Origin": "null"},
                                     {"Sec-Fetch-Site": "cross-site"},
                                     {"Sec-Fetch-Site": "same-site"}])
def test_a_login_from_another_site_is_refused(console, headers):
    status, answer, body = fetch(console.url + "/login", headers, login_form(ANN))
    assert status == 403 and "Set-Cookie" not in answer, status
    assert_security_headers(answer)


def test_a_login_from_the_consoles_own_page_is_accepted(console):
    host = console.url.split("//", 1)[1]
    for headers in ({"Origin": console.url, "Sec-Fetch-Site": "same-origin"},
                    {"Origin": f"http://{host}"}, {}):
        status, answer, _ = fetch(console.url + "/login", headers, login_form(ANN))
        assert status == 303 and "Set-Cookie" in answer, (headers, status)


# --- sessions end on the server -------------------------------------------------------------

SECRET = "a-console-secret-kept-across-restarts-0123456789"


def cookie_of(session) -> str:
    [cookie] = [c for c in session.opener.handlers if hasattr(c, "cookiejar")][0].cookiejar
    return f"{cookie.name}={cookie.value}"


def opens(started: ConsoleProcess, cookie: str) -> int:
    return fetch(started.url + "/users", {"Cookie": cookie})[0]


def test_a_logout_ends_the_session_also_after_a_restart(database_url):
    env = {"AGENT_INBOX_CONSOLE_SECRET": SECRET}
    first = ConsoleProcess(database_url, env=env)
    try:
        leaving, staying = first.session("ann"), first.session("vic")
        old, kept = cookie_of(leaving), cookie_of(staying)
        assert opens(first, old) == 200
        status, _, _ = leaving.post("/logout", {"csrf": leaving.csrf("/")})
        assert status == 303
        assert opens(first, old) == 303  # to the login page
        second = ConsoleProcess(database_url, env=env)  # another process, the same secret
        try:
            assert opens(second, old) == 303
            assert opens(second, kept) == 200  # a session not ended lives on
        finally:
            second.stop()
    finally:
        first.stop()
    again = ConsoleProcess(database_url, env=env)  # a restart
    try:
        assert opens(again, old) == 303 and opens(again, kept) == 200
    finally:
        again.stop()


def test_a_removed_tokens_sessions_do_not_come_back(database_url):
    env = {"AGENT_INBOX_CONSOLE_SECRET": SECRET}
    started = ConsoleProcess(database_url, env=env)
    try:
        cookie = cookie_of(started.session("vic"))
        assert opens(started, cookie) == 200
    finally:
        started.stop()
    without_vic = {k: v for k, v in TOKENS.items() if k != "vic"}
    started = ConsoleProcess(database_url, env=env, tokens=without_vic)
    try:
        assert opens(started, cookie) == 303
    finally:
        started.stop()
    started = ConsoleProcess(database_url, env=env)  # vic's token back, unchanged
    try:
        assert opens(started, cookie) == 303
    finally:
        started.stop()


# --- Secure cookies off loopback, and trusted proxies -------------------------------------

def login_cookie_header(url: str, headers: dict, source: str = "127.0.0.1") -> str:
    host, port = url.split("//", 1)[1].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10,
                                            source_address=(source, 0))
    try:
        connection.request("POST", "/login", body=login_form(ANN), headers={
            "Content-Type": "application/x-www-form-urlencoded", **headers})
        answer = connection.getresponse()
        answer.read()
        assert answer.status == 303, answer.status
        return answer.headers["Set-Cookie"]
    finally:
        connection.close()


def test_cookies_are_secure_when_listening_off_loopback(database_url):
    started = ConsoleProcess(database_url, host="0.0.0.0")
    try:
        assert "secure" in login_cookie_header(started.url, {}).lower()
    finally:
        started.stop()
    started = ConsoleProcess(database_url)  # on loopback, plain HTTP: not Secure
    try:
        assert "secure" not in login_cookie_header(started.url, {}).lower()
    finally:
        started.stop()


def test_a_trusted_proxy_on_another_host_makes_cookies_secure(database_url):
    """The proxy on 127.0.0.2 (another host, as compose has it) says the client
    came over HTTPS: trusted with --forwarded-allow-ips, not by default."""
    forwarded = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "203.0.113.9"}
    started = ConsoleProcess(database_url, "--forwarded-allow-ips", "127.0.0.2")
    try:
        assert "secure" in login_cookie_header(started.url, forwarded, "127.0.0.2").lower()
    finally:
        log = stderr_of(started)
    assert "console login: ann from '203.0.113.9'" in log
    started = ConsoleProcess(database_url)
    try:
        assert "secure" not in login_cookie_header(started.url, forwarded, "127.0.0.2").lower()
    finally:
        started.stop()
