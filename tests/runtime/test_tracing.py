"""Tracing (agent_inbox/tracing.py), with the OpenTelemetry SDK's in-memory
exporter: a webhook's traceparent flows through its event to its run, the
run's steps and finish, its message and that message's send, in one trace;
a malformed traceparent is ignored; without OpenTelemetry (hidden from a
subprocess) the intake, worker and dispatcher work and import none of it."""

import json
import subprocess
import sys
import textwrap

import psycopg
import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter)

from agent_inbox import tracing  # noqa: E402
from agent_inbox.services.dispatcher import Dispatcher  # noqa: E402
from agent_inbox.services.ingest.app import build_app  # noqa: E402
from agent_inbox.services.worker import Worker  # noqa: E402
from tests.runtime.support import ROOT  # noqa: E402
from tests.test_ingest_server import MAX_BODY, SECRETS, github, serving  # noqa: E402

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{CALLER}-01"
H = "tests.runtime.tracing_handlers"

_EXPORTER = InMemorySpanExporter()


@pytest.fixture
def spans():
    """The spans ended during the test (the SDK's provider, set once per session)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    if not getattr(provider, "_agent_inbox_test", False):
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        provider._agent_inbox_test = True
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


def stored(url, table):
    with psycopg.connect(url, autocommit=True) as conn:
        return [tp for tp, in conn.execute(f"SELECT traceparent FROM {table} ORDER BY id")]


def by_name(exporter):
    found = {}
    for span in exporter.get_finished_spans():
        found.setdefault(span.name, []).append(span)
    return found


def child_of(span, parent) -> bool:
    return span.parent is not None and span.parent.span_id == parent.context.span_id


def tp(span) -> str:
    context = span.context
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


@pytest.mark.parametrize("handler", ["step_and_message", "plain_step_and_message"])
def test_a_webhooks_trace_runs_through_its_run_to_its_send(inbox, database_url, spans, handler):
    with serving(build_app(inbox, SECRETS, MAX_BODY, 300, threads=2)) as base:
        assert github(base, "alice", {"n": 1}, delivery="d-1",
                      traceparent=TRACEPARENT) == (202, {"status": "accepted"})
    worker = Worker(inbox, f"{H}:{handler}")
    try:
        assert worker.run_once()["accepted"] == 1
    finally:
        worker.close()
    seen = []
    Dispatcher(inbox, lambda user, text, key: seen.append(
        (text, tracing.current_traceparent()))).run_once()

    named = by_name(spans)
    [intake], [run], [step], [finish], [send], [own] = (
        named[name] for name in ("agent_inbox.intake", "agent_inbox.run", "agent_inbox.step",
                                 "agent_inbox.finish", "agent_inbox.send", "handler.own"))
    everything = [intake, run, step, finish, send, own]
    assert {f"{s.context.trace_id:032x}" for s in everything} == {TRACE}  # one trace
    assert intake.parent.span_id == int(CALLER, 16) and intake.parent.is_remote
    assert child_of(run, intake) and child_of(step, run) and child_of(finish, run)
    assert child_of(own, run)  # the handler's own spans are the run's children
    assert child_of(send, run)
    # what is stored: the event, the intake span's; the message, the run span's
    assert stored(database_url, "events") == [tp(intake)]
    assert stored(database_url, "outbox") == [tp(run)]
    # the channel sends inside the send span
    assert seen == [("answer 41", tp(send))]

    assert intake.kind == trace.SpanKind.SERVER and run.kind == trace.SpanKind.CONSUMER
    assert send.kind == trace.SpanKind.PRODUCER
    assert intake.attributes["http.response.status_code"] == 202
    assert (intake.attributes["agent_inbox.source"], intake.attributes["agent_inbox.user"]) == (
        "github", "alice")
    assert run.attributes["agent_inbox.user"] == "alice"
    assert run.attributes["agent_inbox.events"] == 1
    assert run.attributes["agent_inbox.run.ending"] == "finish"
    assert (step.attributes["agent_inbox.step.name"], step.attributes["agent_inbox.step.position"],
            step.attributes["agent_inbox.step.replayed"]) == ("think", 1, False)
    assert finish.attributes["agent_inbox.finish.accepted"] is True
    assert finish.attributes["agent_inbox.finish.messages"] == 1
    assert send.attributes["agent_inbox.messages"] == 1
    assert send.attributes["agent_inbox.send.key"].startswith("alice:")
    # the run span covers the finish; the intake ended before the run began
    assert run.start_time <= finish.start_time and finish.end_time <= run.end_time
    assert intake.end_time <= run.start_time


def test_a_run_of_several_events_is_the_first_ones_child_and_links_the_others(inbox, spans):
    other = f"00-{'1' * 32}-{'2' * 16}-01"
    inbox.ingest("u", "chat", "1", {}, traceparent=TRACEPARENT)
    inbox.ingest("u", "chat", "2", {})  # none
    inbox.ingest("u", "chat", "3", {}, traceparent=other)
    worker = Worker(inbox, f"{H}:step_and_message")
    try:
        worker.run_once()
    finally:
        worker.close()
    [run] = by_name(spans)["agent_inbox.run"]
    assert run.parent.span_id == int(CALLER, 16) and run.context.trace_id == int(TRACE, 16)
    assert [(link.context.trace_id, link.context.span_id) for link in run.links] == [
        (int("1" * 32, 16), int("2" * 16, 16))]


def test_a_failed_run_is_an_error_span_and_queues_nothing(inbox, spans, database_url):
    inbox.ingest("u", "chat", "1", {}, traceparent=TRACEPARENT)
    worker = Worker(inbox, "tests.runtime.handlers:explode")
    try:
        worker.run_once()
    finally:
        worker.close()
    named = by_name(spans)
    [run], [finish] = named["agent_inbox.run"], named["agent_inbox.finish"]
    assert run.status.status_code == trace.StatusCode.ERROR
    assert "tool failed" in run.status.description
    assert finish.attributes["agent_inbox.finish.error"] is True
    assert stored(database_url, "outbox") == []


@pytest.mark.parametrize("header", [
    "garbage",
    f"00-{TRACE}-{CALLER}-01-extra",       # version 00 has exactly four fields
    f"ff-{TRACE}-{CALLER}-01",             # version ff is invalid
    f"00-{'0' * 32}-{CALLER}-01",          # all-zero trace id
    f"00-{TRACE}-{'0' * 16}-01",           # all-zero span id
    f"00-{TRACE.upper()}-{CALLER}-01",     # upper case
    f"00-{TRACE}-{CALLER}",                # no flags
])
def test_a_malformed_traceparent_is_ignored(inbox, database_url, spans, header):
    assert tracing.valid_traceparent(header) is None
    with serving(build_app(inbox, SECRETS, MAX_BODY, 300, threads=2)) as base:
        assert github(base, "alice", {}, delivery="d-1", traceparent=header)[0] == 202
    [intake] = by_name(spans)["agent_inbox.intake"]
    assert intake.parent is None  # a trace of its own, and what the event stores
    assert stored(database_url, "events") == [tp(intake)]
    # through the API, with no span current: nothing stored
    assert inbox.ingest("bob", "chat", "1", {}, traceparent=header)
    assert inbox.ingest_many([("bob", "chat", "2", {}, None, header)]) == [True]
    assert [e.traceparent for e in inbox.events("bob")] == [None, None]


def test_valid_traceparents():
    assert tracing.valid_traceparent(TRACEPARENT) == TRACEPARENT
    assert tracing.valid_traceparent(f" {TRACEPARENT} ") == TRACEPARENT
    # a later version is read as version 00, its extra fields dropped
    assert tracing.valid_traceparent(f"01-{TRACE}-{CALLER}-00-more") == f"00-{TRACE}-{CALLER}-00"
    assert tracing.valid_traceparent(None) is None and tracing.valid_traceparent(7) is None


def test_ingest_takes_the_current_spans_traceparent_by_default(inbox, spans):
    with tracing.span("the caller's") as caller:
        inbox.ingest("u", "chat", "1", {})
        inbox.ingest_many([("u", "chat", "2", {})])
    assert [e.traceparent for e in inbox.events("u")] == [tp(caller)] * 2


def test_a_limit_wait_span_is_a_child_of_the_current_step(spans):
    with tracing.span("agent_inbox.step") as step:
        with tracing.span("agent_inbox.limit.wait",
                          attributes={"agent_inbox.limit": "openai"}) as waiting:
            waiting.set_attribute("agent_inbox.limit.waited_seconds", 0.5)
    [wait] = by_name(spans)["agent_inbox.limit.wait"]
    assert child_of(wait, step)
    assert dict(wait.attributes) == {"agent_inbox.limit": "openai",
                                     "agent_inbox.limit.waited_seconds": 0.5}


# Run in a process where OpenTelemetry cannot be imported: the webhook's
# traceparent is still stored and carried to the message; nothing is imported.
WITHOUT_OTEL = textwrap.dedent("""
    import json, sys

    class Hidden:
        def find_spec(self, name, path=None, target=None):
            if name == "opentelemetry" or name.startswith("opentelemetry."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, Hidden())
    from agent_inbox import Inbox, tracing
    from agent_inbox.services.dispatcher import Dispatcher
    from agent_inbox.services.ingest.app import build_app
    from agent_inbox.services.worker import Worker
    from tests.test_ingest_server import MAX_BODY, SECRETS, github, serving

    url, good, bad = sys.argv[1:]
    answers = []
    with Inbox.connect(url) as inbox:
        with serving(build_app(inbox, SECRETS, MAX_BODY, 300, threads=2)) as base:
            answers.append(github(base, "alice", {"n": 1}, delivery="d-1", traceparent=good)[0])
            answers.append(github(base, "alice", {"n": 2}, delivery="d-2", traceparent=bad)[0])
        worker = Worker(inbox, "tests.runtime.tracing_handlers:step_and_message")
        counts = worker.run_once()
        worker.close()
        sent = []
        Dispatcher(inbox, lambda user, text, key: sent.append(text)).run_once()
        events = [e.traceparent for e in inbox.events("alice")]
    assert tracing.span("agent_inbox.limit.wait") is tracing.NO_SPAN
    print(json.dumps({"answers": answers, "counts": counts, "events": events, "sent": sent,
                      "enabled": tracing.enabled(),
                      "imported": sorted(m for m in sys.modules if m.startswith("opentelemetry"))}))
""")


def test_without_opentelemetry_nothing_is_imported_and_the_context_still_flows(database_url):
    done = subprocess.run([sys.executable, "-c", WITHOUT_OTEL, database_url, TRACEPARENT,
                           "not-a-traceparent"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["answers"] == [202, 202]
    assert report["counts"] == {"runs": 1, "events": 2, "accepted": 1}
    assert report["events"] == [TRACEPARENT, None]
    assert report["sent"] == ["answer 42"]
    assert (report["enabled"], report["imported"]) == (False, [])
    assert stored(database_url, "outbox") == [TRACEPARENT]  # the first event's, carried on
