"""The intake while no primary answers: `agent-inbox ingest-server` as a
process answers each delivery 503 with Retry-After (never 500, and within
cli/intake.py's POOL_WAIT, well inside a sender's own timeout), so the sender
redelivers; once a primary answers again, the redelivery is stored, and every
later one is a duplicate: each delivery stored once.

Twice: on a throwaway cluster that is stopped and started again on its port,
and on a synchronous pair whose primary is SIGKILLed and whose standby is
promoted, the intake on the multi-host URL. Every wait polls the intake's
answers or its output against a deadline; the process is stopped by its pid
and every cluster stopped in a `finally`.
"""

import hashlib
import hmac
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psycopg

from agent_inbox.cli.intake import POOL_WAIT
from agent_inbox.dev import pgserver
from agent_inbox.schema import migrate
from tests.failover import scenario

SECRET = "failover-linear-secret-Qa71"


def post(base: str, key: str, payload: dict, timeout: float = 30):
    """(status, headers, JSON body, seconds taken) of a signed generic
    (hmac-body) delivery."""
    body = json.dumps(payload).encode()
    signature = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    request = urllib.request.Request(
        f"{base}/hooks/linear/alice", data=body, method="POST",
        headers={"Content-Type": "application/json", "X-Signature": signature,
                 "Idempotency-Key": key})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return (response.status, _lower(response.headers), json.loads(response.read()),
                    time.monotonic() - started)
    except urllib.error.HTTPError as exc:
        with exc:
            return (exc.code, _lower(exc.headers), json.loads(exc.read()),
                    time.monotonic() - started)


def _lower(headers) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}


class Intake:
    """`agent-inbox ingest-server` on `url` as a process (its own session), its
    merged output read by a thread; `stop()` SIGTERMs it by pid, then SIGKILLs."""

    def __init__(self, url: str, workdir: Path):
        secrets = workdir / "secrets.json"
        secrets.write_text(json.dumps({"alice": {"linear": {"scheme": "hmac-body",
                                                             "secret": SECRET}}}))
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "agent_inbox.cli", "ingest-server", "--database-url", url,
             "--secrets", str(secrets), "--port", "0", "--log-level", "info"],
            cwd=scenario.REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        port = scenario.wait_for(
            lambda: (m := re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)",
                                    self.text())) and m.group(1),
            "the intake to listen", 60)
        self.base = f"http://127.0.0.1:{port}"

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def refused_while_down(intake: Intake, key: str, answers: int) -> list[tuple[int, float]]:
    """Post `key` until `answers` deliveries were answered 503 (each asserted
    to carry Retry-After and to come within POOL_WAIT + 3 s); (status,
    seconds) of each delivery posted."""
    seen: list[tuple[int, float]] = []

    def refused():
        status, headers, _, took = post(intake.base, key, {"n": 1})
        seen.append((status, round(took, 2)))
        if status == 503:
            assert headers.get("retry-after") == "5", headers
            assert took < POOL_WAIT + 3, (seen, intake.text()[-3000:])
        return sum(1 for s, _ in seen if s == 503) >= answers

    scenario.wait_for(refused, f"{answers} answers 503 while no primary answers",
                      answers * (POOL_WAIT + 3) + 10, every=0.2)
    assert {s for s, _ in seen} == {503}, seen
    return seen


def stored_after(intake: Intake, key: str) -> list[int]:
    """Post `key` until it is stored (202); the statuses seen, the 202 last."""
    seen: list[int] = []

    def accepted():
        status, _, body, _ = post(intake.base, key, {"n": 1})
        seen.append(status)
        assert status in (202, 503), (status, body, intake.text()[-3000:])
        return status == 202

    scenario.wait_for(accepted, "the intake to store on a primary again", 30, every=0.2)
    return seen


def test_a_stopped_database_is_answered_503_and_each_redelivery_is_stored_once(tmp_path):
    cluster = pgserver.TemporaryCluster()
    intake = None
    try:
        cluster.start()
        url = pgserver.create_database(cluster.url, prefix="agent_inbox_intake")
        migrate.upgrade(url)
        intake = Intake(url, tmp_path)
        assert post(intake.base, "before", {"n": 0})[0] == 202

        cluster.stop(remove=False)
        seen = refused_while_down(intake, "during", answers=3)
        cluster.start()  # the same data, on the same port
        after = stored_after(intake, "during")

        assert post(intake.base, "during", {"n": 1})[::2] == (200, {"status": "duplicate"})
        assert post(intake.base, "before", {"n": 0})[::2] == (200, {"status": "duplicate"})
        with psycopg.connect(url) as conn:
            stored = conn.execute("SELECT source_id, count(*) FROM events GROUP BY 1"
                                  " ORDER BY 1").fetchall()
        assert stored == [("before", 1), ("during", 1)]
        assert "Traceback" not in intake.text(), intake.text()[-3000:]
        print(f"\nintake, database stopped: {seen}; started again: {after}")
    finally:
        if intake is not None:
            intake.stop()
        cluster.stop()


def test_a_failover_is_answered_503_until_the_promotion_and_stored_once_after(tmp_path):
    intake = None
    with scenario.replicated_pair("on") as (primary, standby, relay):
        dbname, url = scenario.fresh_database(primary, standby)
        try:
            intake = Intake(url, tmp_path)
            assert post(intake.base, "before", {"n": 0})[0] == 202

            primary.kill()
            relay.cut()
            seen = refused_while_down(intake, "during", answers=2)
            standby.promote()
            after = stored_after(intake, "during")

            assert post(intake.base, "during", {"n": 1})[::2] == (200, {"status": "duplicate"})
            assert post(intake.base, "before", {"n": 0})[::2] == (200, {"status": "duplicate"})
            with psycopg.connect(pgserver.with_database(standby.url, dbname)) as conn:
                stored = conn.execute("SELECT source_id, count(*) FROM events GROUP BY 1"
                                      " ORDER BY 1").fetchall()
            assert stored == [("before", 1), ("during", 1)]
            assert "Traceback" not in intake.text(), intake.text()[-3000:]
            print(f"\nintake during a failover: {seen} before the promotion, then {after}")
        finally:
            if intake is not None:
                intake.stop()
