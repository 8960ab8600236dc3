"""What a newcomer tripped on (issue 20, point 5): module:attr references
loaded from the current folder by every service, a malformed --database-url
refused up front, the worker's default concurrency, Event's fields documented,
one channel shape for Inbox.dispatch, the intake's secrets variable."""

import dataclasses
import os
import pathlib
import subprocess
import sys
import time

import pytest

from agent_inbox import cli, records

ROOT = pathlib.Path(__file__).resolve().parents[1]
BAD_URLS = ["http://localhost/foo", "postgresql://app:s3cret@db/app?bogus=1", "db.example/app"]


# --- module:attr references load from the current folder --------------------------------

def test_a_reference_loads_from_the_current_folder_as_the_console_script_runs_it(tmp_path):
    """The `agent-inbox` script's sys.path holds its own folder, not the
    current one: `--channel myapp.channels:send` must load from where the
    newcomer stands, as `--handler myapp.agent:handle` does in the worker."""
    (tmp_path / "myapp").mkdir()
    (tmp_path / "myapp" / "__init__.py").write_text("")
    (tmp_path / "myapp" / "channels.py").write_text("def send(user, text, key):\n    pass\n")
    # -I: no current folder on sys.path, no PYTHON* variables (as a console script)
    probe = ("from agent_inbox.agent import handler\n"
             "print(handler.load('myapp.channels:send', what='channel').__module__)")
    done = subprocess.run([sys.executable, "-I", "-c", probe], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "myapp.channels"


def test_the_dispatcher_loads_its_channel_from_the_current_folder(tmp_path):
    (tmp_path / "newcomer_channels.py").write_text("def send(user, text, key):\n    pass\n")
    # as the console script does: agent_inbox.cli's main with no current folder on sys.path;
    # the URL does not answer, so the dispatcher ends after loading its channel
    probe = ("import sys; from agent_inbox import cli\n"
             "sys.exit(cli.main(['dispatcher', '--channel', 'newcomer_channels:send', "
             "'--database-url', 'postgresql://nobody@127.0.0.1:1/none?connect_timeout=2']))")
    done = subprocess.run([sys.executable, "-I", "-c", probe], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert "cannot be loaded" not in done.stderr, done.stderr
    assert "No module named" not in done.stderr, done.stderr


# --- a malformed --database-url is bad configuration ----------------------------------------

@pytest.mark.parametrize("url", BAD_URLS)
@pytest.mark.parametrize("command", [["status"], ["events", "alice"], ["migrate"]])
def test_a_malformed_database_url_is_a_clear_message_and_exit_2(command, url, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main([*command, "--database-url", url])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--database-url" in err and "not a PostgreSQL URL" in err, err
    assert "Traceback" not in err and "s3cret" not in err, err


def test_a_malformed_database_url_from_the_environment_is_refused_too(monkeypatch, capsys):
    monkeypatch.setenv("AGENT_INBOX_DATABASE_URL", "http://localhost/foo")
    with pytest.raises(SystemExit) as exited:
        cli.main(["status"])
    assert exited.value.code == 2
    assert "not a PostgreSQL URL" in capsys.readouterr().err


def test_a_worker_given_a_malformed_url_exits_2_and_starts_no_runtime():
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_INBOX_")}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "agent_inbox.cli", "worker", "--database-url",
                           "http://localhost/foo", "--handler", "tests.runtime.handlers:echo"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, done.stderr
    assert "not a PostgreSQL URL" in done.stderr
    assert "runtime" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert time.monotonic() - started < 20


@pytest.mark.parametrize("url", ["postgresql://app@db:5432/app", "postgres://db/app",
                                 "host=db dbname=app user=app", "postgresql:///app?host=/tmp"])
def test_good_urls_and_connection_strings_pass(url):
    assert cli.options.database_url(url) == url


# --- the worker's default concurrency fits agents -------------------------------------------

def test_the_worker_runs_many_runs_at_once_by_default(monkeypatch):
    monkeypatch.delenv("AGENT_INBOX_CONCURRENCY", raising=False)
    args = cli.build_parser().parse_args(["worker", "--handler", "myapp.agent:handle"])
    assert int(args.concurrency) == 100
    worker = cli.build_parser()._subparsers._group_actions[0].choices["worker"]
    assert "default 100" in worker.format_help() and "thread" in worker.format_help()


# --- Inbox.dispatch takes a channel, as the dispatcher does -----------------------------------

def queue(inbox, user, now, *messages):
    from agent_inbox import Result

    inbox.ingest(user, "chat", f"{user}-{now}", {})
    run = inbox.take_work(f"w-{user}", now=now)
    assert inbox.finish_run(run, Result(messages=list(messages)), now=now)


def test_dispatch_takes_the_channel_the_dispatcher_takes(inbox):
    sent = []

    def send(user, text, key):  # the dispatcher's channel shape
        sent.append((user, text, key))

    queue(inbox, "alice", 1_000_000, "hello", "again")
    assert inbox.dispatch("alice", send, now=1_000_000) == 2
    [(user, text, key)] = sent
    assert (user, text) == ("alice", "hello\n\nagain") and key.startswith("alice:")


def test_dispatch_still_takes_a_one_argument_send(inbox):
    sent = []
    queue(inbox, "bob", 1_000_000, "hi")
    assert inbox.dispatch("bob", lambda text: sent.append(text), now=1_000_000) == 1
    assert sent == ["hi"]


def test_dispatch_refuses_a_send_of_neither_shape(inbox):
    from agent_inbox import InvalidInput

    with pytest.raises(InvalidInput, match="send"):
        inbox.dispatch("carol", lambda a, b: None, now=1_000_000)


# --- the intake's secrets file: the variable compose and the README name ---------------------

@pytest.mark.parametrize("variables, expected", [
    ({"AGENT_INBOX_SECRETS_FILE": "/etc/hooks.json"}, "/etc/hooks.json"),
    ({"AGENT_INBOX_SECRETS": "/run/secrets/w"}, "/run/secrets/w"),
    ({"AGENT_INBOX_SECRETS": "/run/secrets/w", "AGENT_INBOX_SECRETS_FILE": "/x"}, "/run/secrets/w"),
])
def test_the_intake_reads_either_secrets_variable(monkeypatch, variables, expected):
    for name in ("AGENT_INBOX_SECRETS", "AGENT_INBOX_SECRETS_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert cli.build_parser().parse_args(["ingest-server"]).secrets == expected


# --- Event's fields are documented ---------------------------------------------------------

def test_every_event_field_is_documented_in_its_docstring_and_the_docs():
    readme = (ROOT / "docs" / "writing-an-agent.md").read_text()
    for field in dataclasses.fields(records.Event):
        assert f"- `{field.name}`:" in records.Event.__doc__, field.name
        assert f"`{field.name}`" in readme.split("| field | what it holds |")[1].split("\n\n")[0], \
            field.name


def test_the_outbox_gap_is_in_the_dispatchers_synopsis_and_help():
    readme = (ROOT / "docs" / "services.md").read_text()
    synopsis = readme[readme.index("agent-inbox dispatcher --database-url URL"):]
    assert "[--outbox-gap S]" in synopsis.split("```")[0]
    dispatcher = cli.build_parser()._subparsers._group_actions[0].choices["dispatcher"]
    assert "default 3600" in " ".join(dispatcher.format_help().split())


# --- point 4: CI lists the slowest tests ----------------------------------------------------

def test_ci_runs_the_readmes_test_command_listing_the_slowest_tests():
    [command] = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                 if line.startswith("./dev test")]
    assert "--durations=25" in command.split("#")[0]
