"""A console process on a free loopback port over the test's database, and a
headless Chromium (the machine's own, Debian's package) driven by Playwright.

Tokens: ann (operator+approver), bea (approver), vic (viewer).
"""

import http.cookiejar
import os
import re
import subprocess
import sys
import urllib.parse
import urllib.request

import pytest

CHROMIUM = os.environ.get("AGENT_INBOX_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
TOKENS = {"ann": ("operator+approver", "ann-token-8f3a1c9e5b7d2f4a6c0e9b1d3f5a7c2e"),
          "bea": ("approver", "bea-token-2d7f9b1e4a6c8e0f3b5d7a9c1e2f4b6d"),
          "vic": ("viewer", "vic-token-6c1e3a5f7b9d2e4f8a0c6b1d3e5f7a9c")}
START_TIMEOUT = 30


class ConsoleProcess:
    """`agent-inbox console --port 0`, its address read from uvicorn's log line."""

    def __init__(self, database_url: str, *extra: str, tokens: dict | None = None,
                 host: str = "127.0.0.1", env: dict | None = None):
        env = {**os.environ, "AGENT_INBOX_CONSOLE_TOKENS": ",".join(
            f"{name}:{role}:{token}" for name, (role, token) in (tokens or TOKENS).items()),
            **(env or {})}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "agent_inbox.cli", "console", "--database-url", database_url,
             "--host", host, "--port", "0", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.url = self._address()

    def _address(self) -> str:
        lines = []
        for line in self.process.stderr:  # ends if the process exits
            lines.append(line)
            found = re.search(r"Uvicorn running on http://\S+:(\d+)", line)
            if found:  # any listening address: the test connects over loopback
                return f"http://127.0.0.1:{found.group(1)}"
        self.process.wait(timeout=START_TIMEOUT)
        raise AssertionError("the console did not start:\n" + "".join(lines))

    def get(self, path: str, token: str | None = None, timeout: float = 5.0):
        """(status, body) of a GET, with a bearer token if given."""
        request = urllib.request.Request(self.url + path, headers={
            "Authorization": f"Bearer {token}"} if token else {})
        try:
            with _no_redirects().open(request, timeout=timeout) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def post(self, path: str, form: dict, token: str | None = None, timeout: float = 5.0):
        """(status, body, Location) of a form POST, with a bearer token if given."""
        return _send(_no_redirects(), self.url + path, form,
                     {"Authorization": f"Bearer {token}"} if token else {}, timeout)

    def session(self, name: str) -> "Session":
        """A logged-in session of that token's name, as a browser holds one."""
        return Session(self, name)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process.stderr.close()


class Session:
    """A browser's session over plain HTTP: the login form's cookie, and each
    form's CSRF token read from the page the form is on."""

    def __init__(self, console: ConsoleProcess, name: str):
        self.console = console
        self.opener = _no_redirects(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
        status, _, _ = _send(self.opener, console.url + "/login",
                             {"token": TOKENS[name][1], "next": "/"}, {}, 5.0)
        assert status == 303, status

    def get(self, path: str, timeout: float = 5.0):
        try:
            with self.opener.open(self.console.url + path, timeout=timeout) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def csrf(self, path: str) -> str:
        """The CSRF token in the page at `path` (every page has one: log out's)."""
        status, body = self.get(path)
        assert status == 200, (status, body[-500:])
        return re.search(r'name="csrf" value="([^"]+)"', body).group(1)

    def post(self, path: str, form: dict, timeout: float = 5.0):
        """(status, body, Location) of a form POST."""
        return _send(self.opener, self.console.url + path, form, {}, timeout)


def _send(opener, url: str, form: dict, headers: dict, timeout: float):
    data = urllib.parse.urlencode(form, doseq=True).encode()
    request = urllib.request.Request(url, data=data, method="POST", headers={
        "Content-Type": "application/x-www-form-urlencoded", **headers})
    try:
        with opener.open(request, timeout=timeout) as answer:
            return answer.status, answer.read().decode(), answer.headers.get("Location")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), exc.headers.get("Location")


def _no_redirects(*handlers):
    class Keep(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None
    return urllib.request.build_opener(Keep, *handlers)


@pytest.fixture
def console(database_url):
    started = ConsoleProcess(database_url)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def browser():
    """One Chromium per test module: Playwright's sync API keeps an event loop
    running in this thread while it is open, so it must close before tests of
    other modules call asyncio.run()."""
    from playwright.sync_api import sync_playwright

    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian package chromium; tests/setup-deps.sh, "
                    "which ./dev test runs, installs it when run as root)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                              args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture
def login(browser, console):
    """login(name) -> a Playwright page logged in as that token's name."""
    contexts = []

    def log_in(name: str):
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        context.set_default_timeout(10_000)
        contexts.append(context)
        page = context.new_page()
        page.goto(console.url + "/")
        assert "/login" in page.url
        page.fill("input[name=token]", TOKENS[name][1])
        page.click("button[type=submit]")
        page.wait_for_url(console.url + "/")
        return page

    yield log_in
    for context in contexts:
        context.close()
