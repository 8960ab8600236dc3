"""The console without a browser: refusals at start, pages that never wait on a
worker's lease locks, and the run statistics behind the overview's chart."""

import psycopg
import pytest

from agent_inbox import cli
from agent_inbox.store import keys
from agent_inbox.store import stats
from agent_inbox.services.worker import Worker
from tests.console.conftest import TOKENS
from tests.races import lock_waiters
from tests.test_operator_cli import exhaust

PAGES = ("/", "/api/overview", "/overview/chart.svg", "/users", "/users?q=al", "/user?u=alice",
         "/user?u=bob", "/dead", "/outbox", "/approvals", "/policies")


@pytest.mark.parametrize("tokens, message", [
    (None, "none configured: set AGENT_INBOX_CONSOLE_TOKENS"),
    ("", "none configured"),
    ("ann:operator:short-token", "entry 1 has a token shorter than 16 characters"),
    ("ann:operator:long-enough-token-1-5f0c9e2a7b3d41e8a6c2d9f0b7e1a3c4,bob:root:long-enough-token-2-9a4e6c1b3d5f72a8e0c4b6d8f1a3e5c7",
     "entry 2 has unknown role 'root'"),
    ("ann:operator", "entry 1 must be name:role:token"),
    ("just-a-token-0123456789", "entry 1 must be name:role:token"),
    ("ann:viewer:long-enough-token-1-5f0c9e2a7b3d41e8a6c2d9f0b7e1a3c4,ann:operator:long-enough-token-2-9a4e6c1b3d5f72a8e0c4b6d8f1a3e5c7",
     "entry 2 repeats a name given before"),
    ("ann:viewer:long-enough-token-1-5f0c9e2a7b3d41e8a6c2d9f0b7e1a3c4,bob:operator:long-enough-token-1-5f0c9e2a7b3d41e8a6c2d9f0b7e1a3c4",
     "entry 2 repeats another entry's token"),
])
def test_bad_tokens_refuse_to_start(monkeypatch, capsys, tokens, message):
    if tokens is None:
        monkeypatch.delenv("AGENT_INBOX_CONSOLE_TOKENS", raising=False)
    else:
        monkeypatch.setenv("AGENT_INBOX_CONSOLE_TOKENS", tokens)
    # no database is reached: the tokens are checked first
    code = cli.main(["console", "--database-url", "postgresql://127.0.0.1:1/none"])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "long-enough-token" not in err and "short-token" not in err  # tokens never echoed


def test_a_tokens_file_is_read_and_checked(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("AGENT_INBOX_CONSOLE_TOKENS", raising=False)
    tokens = tmp_path / "tokens"
    tokens.write_text("# operators\nann:operator:long-enough-token-1-5f0c9e2a7b3d41e8a6c2d9f0b7e1a3c4\n\nvic:nobody:long-enough-2\n")
    code = cli.main(["console", "--database-url", "postgresql://127.0.0.1:1/none",
                     "--tokens-file", str(tokens)])
    err = capsys.readouterr().err
    assert code == 2 and f"--tokens-file {tokens}, entry 2 has unknown role 'nobody'" in err
    code = cli.main(["console", "--database-url", "postgresql://127.0.0.1:1/none",
                     "--tokens-file", str(tmp_path / "missing")])
    assert code == 2 and "cannot be read: No such file or directory" in capsys.readouterr().err


@pytest.fixture
def busy(inbox):
    """alice: dead events and pending ones; bob: running under a live lease."""
    inbox.ingest("alice", "chat", "a-1", {"n": 1})
    exhaust(inbox, "alice", 1_000_000)
    inbox.ingest("alice", "chat", "a-2", {"n": 2})
    inbox.ingest("bob", "chat", "b-1", {"n": 1})
    gen = inbox.acquire("bob", "w-bob")
    inbox.claim_batch("bob", "w-bob", gen)
    return inbox


def test_pages_never_wait_on_a_workers_lease_locks(busy, console, database_url):
    """Every lease row locked (FOR UPDATE, as a take or a finish locks them) and
    a lease updated, uncommitted: every page still answers at once, and no
    console session is seen waiting on a lock."""
    with psycopg.connect(database_url) as worker:
        locked = [worker.execute("SELECT user_id FROM leases"
                                 " WHERE bucket = %(bucket)s AND user_id = %(user)s FOR UPDATE",
                                 keys.user_key(user)).fetchall() for user in ("alice", "bob")]
        worker.execute("UPDATE leases SET until = until + 1"
                       " WHERE bucket = %(bucket)s AND user_id = %(user)s", keys.user_key("bob"))
        assert locked == [[("alice",)], [("bob",)]]
        for path in PAGES:  # a page waiting on a lock would wait past this bound
            status, body = console.get(path, token=TOKENS["vic"][1], timeout=30)
            assert status == 200, (path, body[-2000:])
        assert lock_waiters(database_url, "agent-inbox-console") == 0
        worker.rollback()


def test_the_overview_json_matches_the_database(busy, console, database_url):
    import json

    status, body = console.get("/api/overview", token=TOKENS["vic"][1])
    document = json.loads(body)
    with psycopg.connect(database_url) as conn:
        by_status = dict(conn.execute("SELECT status, count(*) FROM events GROUP BY status"))
    assert status == 200
    assert (document["pending"], document["running"], document["dead"], document["workers"]) == (
        by_status["pending"], by_status["running"], by_status["dead"], 1)
    assert document["oldest_pending_age"] >= 0
    assert document["horizon"]["age_seconds"] >= 0 and "leases" in document["horizon"]["dead_tuples"]


def test_hidden_payloads_for_viewers(busy, database_url):
    from tests.console.conftest import ConsoleProcess

    hiding = ConsoleProcess(database_url, "--hide-payloads-from-viewers")
    try:
        _, seen_by_viewer = hiding.get("/user?u=alice", token=TOKENS["vic"][1])
        _, seen_by_operator = hiding.get("/user?u=alice", token=TOKENS["ann"][1])
    finally:
        hiding.stop()
    assert "pre class=\"payload\"" not in seen_by_viewer and "hidden" in seen_by_viewer
    assert seen_by_operator.count("pre class=\"payload\"") == 2


def test_a_worker_records_its_runs_for_the_chart(inbox, database_url):
    """Runs finished and events parked dead land in the worker's own row: alice's
    run, and carol's, whose event is out of attempts (parked at the take, the run
    holding no event is finished all the same)."""
    inbox.ingest("alice", "chat", "a-1", {"n": 1})
    inbox.ingest("carol", "chat", "c-1", {"n": 1})
    for _ in range(3):  # three crashed claims: the next take parks it dead
        gen = inbox.acquire("carol", "crashed")
        inbox.claim_batch("carol", "crashed", gen)
        inbox.runs.release("carol", "crashed", gen)
    worker = Worker(inbox, "agent_inbox.dev.examples:echo", holder="w-test")
    try:
        worker.run_once()
        worker.run_once()
    finally:
        worker.close()
    with psycopg.connect(database_url) as conn:
        rows = conn.execute("SELECT process, sum(finished), sum(refused), sum(died) "
                            "FROM run_stats GROUP BY process").fetchall()
        minutes = stats.last_minutes(conn, 60)
    assert rows == [("w-test", 2, 0, 1)]
    assert len(minutes) == 60 and sum(m["finished"] for m in minutes) == 2


def test_sessions_expire_and_cannot_be_forged():
    from agent_inbox.services.console import auth

    [token] = auth.parse_tokens("ann:operator:long-enough-token-1-5f0c9e2a7b3d41e8a6c2d9f0b7e1a3c4", "test")
    signer = auth.Authenticator([token], session_ttl=60)
    cookie = signer.new_session(token, now=1000)
    assert signer.from_session(cookie, now=1059).name == "ann"
    assert signer.from_session(cookie, now=1061) is None  # expired
    body, mac = cookie.split(".")
    assert signer.from_session(body[:-2] + "xx." + mac, now=1000) is None  # tampered
    other = auth.Authenticator([token], session_ttl=60)  # another key: a restart
    assert other.from_session(cookie, now=1000) is None
    [rotated] = auth.parse_tokens("ann:operator:long-enough-token-2-9a4e6c1b3d5f72a8e0c4b6d8f1a3e5c7", "test")
    assert auth.Authenticator([rotated], session_ttl=60, key=signer.key).from_session(
        cookie, now=1000) is None  # the token changed: its sessions end
    principal = signer.from_session(cookie, now=1000)
    assert signer.csrf_ok(principal, signer.csrf_token(principal))
    assert not signer.csrf_ok(principal, "") and not signer.csrf_ok(principal, None)
    assert signer.from_bearer("Bearer long-enough-token-1-5f0c9e2a7b3d41e8a6c2d9f0b7e1a3c4").nonce is None
    assert signer.from_bearer("Bearer long-enough-token-9") is None
