"""--pooler and --listen-url: bad values are refused at start with exit code 2
and nothing done; behind a pooler with no listen URL a service does not LISTEN
and says that it polls; a listen URL is where the service LISTENs."""

import os
import socket
import subprocess
import sys
import threading

import pytest

from agent_inbox import Inbox, InvalidInput, cli
from agent_inbox.services.service import Listener, Stop
from tests.runtime.support import ROOT, read_until, scalar, wait_until

CHANNEL = "tests.runtime.handlers:echo"  # loadable: the dispatcher refuses before it sends
SERVICES = {
    "worker": ["--handler", "tests.runtime.handlers:echo"],
    "scheduler": [],
    "dispatcher": ["--channel", CHANNEL],
}


def agent_inbox(*args, env=None):
    done = subprocess.run([sys.executable, "-m", "agent_inbox.cli", *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT, env={**os.environ, **(env or {})})
    return done.returncode, done.stderr


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"postgresql://postgres@127.0.0.1:{port}/postgres"


@pytest.mark.parametrize("command", [
    ["worker", "--handler", "m:f"], ["scheduler"], ["dispatcher", "--channel", "m:f"],
    ["ingest-server", "--secrets", "s.json"], ["status"], ["migrate"], ["demo"],
    ["dead", "list"]])
def test_a_bad_pooler_is_an_argparse_error(command, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main([*command, "--database-url", "postgresql://nowhere/x", "--pooler", "session"])
    assert exited.value.code == 2
    assert "argument --pooler: invalid choice: 'session' (choose from none, transaction)" in (
        capsys.readouterr().err)


def test_a_bad_pooler_in_the_environment_is_refused_too():
    code, err = agent_inbox("status", "--database-url", "postgresql://nowhere/x",
                            env={"AGENT_INBOX_POOLER": "statement"})
    assert code == 2 and "argument --pooler: invalid choice: 'statement'" in err


def test_inbox_connect_refuses_an_unknown_pooler_before_connecting():
    with pytest.raises(InvalidInput, match="pooler must be one of none, transaction"):
        Inbox.connect("postgresql://nowhere.invalid/x", pooler="session")


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_a_listen_url_that_does_not_answer_stops_the_service_with_exit_2(service, database_url):
    listen_url = closed_port_url()
    code, err = agent_inbox(service, "--database-url", database_url, *SERVICES[service],
                            "--listen-url", listen_url)
    assert code == 2, err
    assert "agent-inbox: --listen-url does not answer" in err and "Connection refused" in err
    assert "port=" + listen_url.rsplit(":", 1)[1].split("/")[0] in err


def test_a_listener_without_a_url_does_not_start():
    before = {t.name for t in threading.enumerate()}
    listener = Listener(None, ["agent_inbox_work"], lambda: None, Stop())
    listener.start()
    assert not listener.is_alive()
    assert {t.name for t in threading.enumerate()} == before


@pytest.mark.parametrize("listen", [False, True])
def test_behind_a_pooler_a_service_listens_only_on_its_listen_url(listen, database_url):
    """--pooler transaction on a direct URL (the switch only changes how we
    talk): without --listen-url, the scheduler logs that it polls and opens no
    LISTEN connection; with one, its listener connects there."""
    extra = ["--listen-url", database_url] if listen else []
    process = subprocess.Popen(
        [sys.executable, "-m", "agent_inbox.cli", "scheduler", "--database-url", database_url,
         "--pooler", "transaction", "--poll-interval", "0.3", *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        listeners = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                     "AND application_name = 'agent-inbox-listener'")
        if listen:
            wait_until(lambda: scalar(database_url, listeners) == 1, "the scheduler's LISTEN")
        else:
            read_until(process, "no LISTEN, polling every 0.3 s")
            passes = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                      "AND application_name = 'agent-inbox-scheduler'")
            wait_until(lambda: scalar(database_url, passes) >= 1, "the scheduler's pool")
            assert scalar(database_url, listeners) == 0
    finally:
        process.terminate()
        out, _ = process.communicate(timeout=30)
    assert process.returncode == 0, out
    if listen:
        assert "no LISTEN" not in out, out
