"""Issue 20's findings on the console's sessions and inputs, each against a real
console process (or, for a 500, the application over a failing inbox)."""

import logging
import urllib.error
import urllib.request

import pytest

from agent_inbox.console import auth
from agent_inbox.console.app import SECURITY_HEADERS, build_app
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
