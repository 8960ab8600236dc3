"""The intake's limits and defaults over real HTTP on loopback: event keys and
names over their length limits are a 400 naming the limit (never a 503 the
provider would retry for ever), PostgreSQL refusing an input is a 400, 401s are
logged escaped, cut short and rate-limited, the transport options are checked
(exit 2), and metrics listen on loopback unless told otherwise.
"""

import concurrent.futures
import contextlib
import json
import logging
import socket
import time
import types
import urllib.parse
import urllib.request

import psycopg
import pytest

from agent_inbox import cli, errors
from agent_inbox.services.ingest import logs
from agent_inbox.services.ingest.app import build_app
from agent_inbox.services.ingest.transport import Limits

from tests.test_ingest_server import (GITHUB_SECRET, SECRETS, github, serving, spawn_server,  # noqa: F401
                                      stored, stripe, write_secrets)

LONG_USER = "u" * 201
LIMIT_SECRETS = {**SECRETS, LONG_USER: {"github": GITHUB_SECRET}}


@pytest.fixture
def base(inbox):
    with serving(build_app(inbox, LIMIT_SECRETS, 1 << 20, 300, threads=4)) as url:
        yield url


# --- length limits --------------------------------------------------------------------

def test_a_12_kb_github_delivery_id_is_a_400_naming_the_limit(base, inbox):
    status, answer = github(base, "alice", {"n": 1}, delivery="d" * 12_000)
    assert status == 400
    assert "event key: source_id is 12000 bytes in UTF-8, over the limit of 500" in answer["error"]
    assert github(base, "alice", {"n": 2}, delivery="d" * 500)[0] == 202  # at the limit
    assert stored(inbox) == [("github", "d" * 500, {"n": 2})]


def test_a_12_kb_stripe_event_id_is_a_400(base, inbox):
    status, answer = stripe(base, "alice", {"id": "evt_" + "x" * 12_000, "type": "charge"})
    assert status == 400 and "over the limit of 500" in answer["error"]
    assert stored(inbox) == []


def test_a_user_name_over_200_bytes_is_a_400_even_with_a_secret(base, inbox):
    status, answer = github(base, LONG_USER, {"n": 1}, delivery="long-user")
    assert status == 400 and "user: user is 201 bytes in UTF-8, over the limit of 200" in \
        answer["error"]
    assert stored(inbox, LONG_USER[:200]) == []


def test_an_event_kind_over_200_bytes_is_a_400(base, inbox):
    status, answer = github(base, "alice", {"n": 1}, delivery="long-kind",
                            **{"X-GitHub-Event": "k" * 201})
    assert status == 400 and "event kind: kind is 201 bytes" in answer["error"]
    assert stored(inbox) == []


class Refusing:
    """An Inbox stand-in whose ingest raises what PostgreSQL would."""

    def __init__(self, error: BaseException):
        self.error = error

    def ingest(self, *args, **kwargs):
        raise self.error


def translated(error: psycopg.Error) -> errors.DatabaseUnavailable:
    """What db.translated makes of an OperationalError (class 54 is one)."""
    try:
        raise errors.DatabaseUnavailable(str(error)) from error
    except errors.DatabaseUnavailable as exc:
        return exc


@pytest.mark.parametrize("error, status", [
    (translated(psycopg.errors.ProgramLimitExceeded("index row size 12016 exceeds maximum 2704")),
     400),
    (psycopg.errors.InvalidTextRepresentation("invalid input syntax for type json"), 400),
    (psycopg.errors.CheckViolation("new row violates check constraint"), 400),
    (translated(psycopg.errors.AdminShutdown("terminating connection")), 503),
    (translated(psycopg.errors.TooManyConnections("too many clients already")), 503),
], ids=["54000 index row size", "22P02 data exception", "23514 check violation",
        "57P01 admin shutdown", "53300 too many connections"])
def test_only_a_database_that_cannot_be_reached_is_a_503(error, status):
    app = build_app(Refusing(error), SECRETS, 4096, 300, threads=2)
    with serving(app) as url:
        code, answer = github(url, "alice", {"n": 1}, delivery="refused-by-postgres")
    assert code == status
    if status == 400:
        assert answer["error"].startswith("the database refused this event: ")
    else:
        assert answer == {"error": "database unavailable, retry later"}


# --- 401 log lines ------------------------------------------------------------------

def test_refusals_are_logged_escaped_cut_short_and_rate_limited(base, caplog):
    hostile = "\x1b[2J\u202eevil\r\nFAKE LOG LINE " + "x" * 8000
    path_user = urllib.parse.quote(hostile, safe="")
    caplog.set_level(logging.WARNING, logger="agent_inbox.ingest")
    sent = 0
    for _ in range(60):
        assert github(base, path_user, {"n": 1}, delivery="hostile")[0] == 401
        sent += 1
    lines = [r.getMessage() for r in caplog.records if r.name == "agent_inbox.ingest"]
    refused = [line for line in lines if line.startswith("refused a github delivery")]
    assert refused, lines
    for line in refused:
        assert len(line) < 200, line
        assert not any(not c.isprintable() for c in line), line
        assert "\\x1b[2J\\u202eevil\\r\\nFAKE LOG LINE" in line and "(8025 characters)" in line
    # 60 refusals in well under 6 s: at most 10 a second were logged.
    assert len(refused) < sent


def test_the_throttle_logs_at_most_n_a_second_then_sums_up_the_rest(caplog):
    now = [100.0]
    throttle = logs.Throttle(per_second=3, what="refused deliveries", clock=lambda: now[0])
    logger = logging.getLogger("agent_inbox.test_throttle")
    caplog.set_level(logging.WARNING, logger=logger.name)
    logged = [throttle.log(logger, logging.WARNING, "refusal %d", n) for n in range(10)]
    assert logged == [True] * 3 + [False] * 7
    now[0] += 1.0
    assert throttle.log(logger, logging.WARNING, "refusal %d", 10)
    assert [r.getMessage() for r in caplog.records] == [
        "refusal 0", "refusal 1", "refusal 2", "7 more refused deliveries not logged",
        "refusal 10"]


def test_shown_escapes_and_cuts():
    assert logs.shown("a\u202eb\x85c\\'") == "'a\\u202eb\\x85c\\\\\\''"
    assert logs.shown("x" * 100) == "'" + "x" * 64 + "'... (100 characters)"


# --- the transport options ----------------------------------------------------------

def exit_code(argv: list[str]) -> int:
    """cli.main's exit code, argparse's refusals (SystemExit) included."""
    try:
        return cli.main(argv)
    except SystemExit as exc:
        return exc.code


def ingest_server(tmp_path, *argv: str) -> list[str]:
    # Refused before the secrets file is read or the database is tried.
    return ["ingest-server", "--database-url", "postgresql://127.0.0.1:1/none",
            "--secrets", str(tmp_path / "never-read.json"), *argv]


@pytest.mark.parametrize("argv, message", [
    (["--header-timeout", "0"], "--header-timeout must be a positive number of seconds"),
    (["--body-timeout", "nan"], "--body-timeout must be a positive number of seconds"),
    (["--body-timeout", "inf"], "--body-timeout must be a positive number of seconds"),
    (["--max-connections", "0"], "--max-connections must be a positive integer"),
    (["--max-buffered", "-1"], "--max-buffered must be a positive integer"),
    (["--max-connections-per-client", "0"],
     "--max-connections-per-client must be a positive integer"),
    (["--max-buffered", "1000", "--max-body", "4096"],
     "--max-buffered must be at least --max-body (4096)"),
])
def test_bad_transport_options_exit_2_with_a_clear_message(argv, message, capsys, tmp_path):
    assert exit_code(ingest_server(tmp_path, *argv)) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("variable, value, message", [
    ("AGENT_INBOX_HEADER_TIMEOUT", "soon", "argument --header-timeout: invalid float value: 'soon'"),
    ("AGENT_INBOX_MAX_CONNECTIONS", "many", "argument --max-connections: invalid int value"),
    ("AGENT_INBOX_BODY_TIMEOUT", "-3", "--body-timeout must be a positive number of seconds"),
    ("AGENT_INBOX_MAX_BUFFERED", "0", "--max-buffered must be a positive integer"),
])
def test_bad_transport_options_from_the_environment_exit_2(variable, value, message, capsys,
                                                           monkeypatch, tmp_path):
    monkeypatch.setenv(variable, value)
    assert exit_code(ingest_server(tmp_path)) == 2
    assert message in capsys.readouterr().err


def test_limits_refuse_bad_values_by_name():
    with pytest.raises(errors.InvalidInput, match="header_timeout must be a positive number"):
        Limits(header_timeout=-1)
    with pytest.raises(errors.InvalidInput, match="max_connections must be a positive integer"):
        Limits(max_connections=True)
    assert Limits(max_buffered=1 << 20, max_connections=1024).fair_share == 1024
    assert Limits(max_connections=1000).max_connections_per_client == 100
    assert Limits(max_connections=20).max_connections_per_client == 10


# --- metrics bind loopback unless told ---------------------------------------------------

def listening_address(port: int) -> str | None:
    """The local address (hex, as /proc/net/tcp writes it) of a socket
    listening on `port`, or None."""
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if int(hex_port, 16) == port and fields[3] == "0A":  # LISTEN
                return address
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("options, address", [((), "0100007F"),
                                              (("--metrics-host", "0.0.0.0"), "00000000")])
def test_metrics_listen_on_loopback_unless_metrics_host_says(spawn_server, database_url,  # noqa: F811
                                                             tmp_path, options, address):
    path = tmp_path / "secrets.json"
    write_secrets(path, SECRETS)
    port = free_port()
    server = spawn_server("--database-url", database_url, "--secrets", str(path), "--port", "0",
                          "--metrics-port", str(port), *options)
    server.base_url()  # serving: the metrics server started before it
    assert listening_address(port) == address
    assert server.stop() == 0


# --- /healthz ------------------------------------------------------------------------

class CountingPool:
    """A pool whose connections count their queries, each taking `delay` s."""

    def __init__(self, delay: float):
        self.delay = delay
        self.queries = 0

    @contextlib.contextmanager
    def connection(self, timeout=None):
        yield self

    def execute(self, sql):
        self.queries += 1
        time.sleep(self.delay)


def test_healthz_is_cheap_and_bounded():
    """100 health checks, 20 at a time: a query per second at most, not one each."""
    inbox = types.SimpleNamespace(pool=CountingPool(0.2))
    with serving(build_app(inbox, SECRETS, 4096, 300, threads=4)) as url:
        started = time.monotonic()

        def check(_):
            with urllib.request.urlopen(url + "/healthz", timeout=30) as answer:
                return answer.status, json.loads(answer.read())

        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(check, range(100)))
        took = time.monotonic() - started
    assert set(map(str, answers)) == {str((200, {"status": "ok"}))}
    assert inbox.pool.queries <= 2 + took / 1.0, (inbox.pool.queries, took)  # HEALTH_CACHE
