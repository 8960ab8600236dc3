"""Metrics: a service exposes them over HTTP, and they count what happened."""

import socket
import urllib.request

from agent_inbox.services.worker import Worker

from tests.runtime.support import wait_until, worker_args

T = 1_000_000


def sample(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def test_a_worker_run_counts_claims_finishes_and_dead_events(inbox):
    from agent_inbox import metrics

    before = {m: m._value.get() for m in (metrics.CLAIMED, metrics.RUNS, metrics.DEAD)}
    accepted = metrics.FINISHES.labels("accepted")._value.get()
    inbox.ingest("u", "chat", "1", {})
    worker = Worker(inbox, "tests.runtime.handlers:echo")
    try:
        worker.run_once(now=T)
    finally:
        worker.close()
    assert metrics.CLAIMED._value.get() == before[metrics.CLAIMED] + 1
    assert metrics.RUNS._value.get() == before[metrics.RUNS] + 1
    assert metrics.FINISHES.labels("accepted")._value.get() == accepted + 1


def test_a_service_serves_prometheus_metrics_with_the_inbox_depth(database_url, inbox, spawn):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    inbox.ingest("idle-user", "github", "d-1", {})      # pending: no worker takes "never"
    spawn(*worker_args(database_url, "echo", "--metrics-port", str(port)))

    def scrape():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                return r.read().decode()
        except OSError:
            return None

    text = wait_until(lambda: (t := scrape()) and "agent_inbox_finishes_total{" in t and t,
                      "the worker to finish a run and expose it")
    assert sample(text, 'agent_inbox_finishes_total{outcome="accepted"}') >= 1
    assert 'agent_inbox_events{status="pending"}' in text
    assert "agent_inbox_run_seconds_bucket" in text
