"""OpenTelemetry spans, with the optional extra `agent-inbox[otel]`.

Spans (tracer `agent_inbox`):

- `agent_inbox.intake` (SERVER): one webhook request at the HTTP intake. Its
  parent is the current span if there is one (an ASGI instrumentation's), else
  the request's W3C `traceparent` header. The event stores the intake span's
  traceparent (without the SDK: the header's), so the run is its child.
- `agent_inbox.run` (CONSUMER): one run, from its take to the commit of its
  ending. Its parent is the traceparent of its first event (by id) that has
  one; the other events' traceparents are its links. It is the current span
  while the handler runs (on its task, or its thread), so the handler's own
  spans (an LLM client's) are its children.
- `agent_inbox.step`: one `ctx.step` (a replay too: `agent_inbox.step.replayed`),
  child of the run's span, current while `fn` runs.
- `agent_inbox.finish`: one per run committed (a child of its run's span), over
  the completer's commit it shared with the other runs that ended meanwhile
  (`agent_inbox.finish.runs` says how many): per run, not per batch, so that
  every run's trace shows its own commit and verdict.
- `agent_inbox.send` (PRODUCER): one batch handed to a channel. The outbox row
  stores the run span's traceparent (without the SDK: the first event's, so the
  context still flows); the send's parent is that of the batch's first message,
  the others' are links. It is current while the channel sends
  (`channels.http_post` passes it on as a `traceparent` header).
- `agent_inbox.limit.wait`: for code that waits on a rate limit
  (`with tracing.span("agent_inbox.limit.wait", attributes={...}):`); any other
  name works the same way.

Without OpenTelemetry installed nothing is imported (one failed import, once)
and every helper is a no-op that allocates nothing; with the API but no SDK
the spans are the API's non-recording ones, and traceparents still flow.
"""

import re

# "version-trace_id-span_id-flags", lower-case hex (W3C Trace Context, level 1).
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_MAX_HEADER = 512

_api = None      # opentelemetry.trace once looked for; False: not installed
_tracer = None   # the agent_inbox tracer (a proxy until an SDK provider is set)


def _trace():
    global _api, _tracer
    if _api is None:
        try:
            from opentelemetry import trace
        except ImportError:
            _api = False
        else:
            _tracer = trace.get_tracer("agent_inbox")
            _api = trace
    return _api


def enabled() -> bool:
    """Whether OpenTelemetry's API is installed (spans are made)."""
    return bool(_trace())


def valid_traceparent(value) -> str | None:
    """`value` as a W3C traceparent (version 00), or None if it is not one:
    wrong shape, version ff, an all-zero id, or a version 00 with more
    fields. A later version is read as version 00, as the spec says."""
    if not isinstance(value, str) or len(value) > _MAX_HEADER:
        return None
    match = _TRACEPARENT.fullmatch(value.strip())
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if (version == "ff" or (version == "00" and rest) or trace_id == "0" * 32
            or span_id == "0" * 16):
        return None
    return f"00-{trace_id}-{span_id}-{flags}"


class _NoSpan:
    """What every helper gives without OpenTelemetry: a context manager and a
    span that do nothing (one shared instance)."""

    traceparent = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False

    def set_attribute(self, key, value) -> None:
        pass

    def accepted(self, flags) -> None:
        pass


NO_SPAN = _NoSpan()


def span(name: str, *, parent=None, links=(), attributes: dict | None = None, kind=None):
    """A context manager for a span `name`, current inside it, ended (with
    an exception recorded) on leaving; it gives the span (`set_attribute`).
    `parent`: a span, a traceparent, or None for the current span. `links`:
    spans or traceparents. No-op without OpenTelemetry.

        with tracing.span("agent_inbox.limit.wait",
                          attributes={"agent_inbox.limit": name}) as waiting:
            ...
            waiting.set_attribute("agent_inbox.limit.waited_seconds", waited)
    """
    trace = _trace()
    if not trace:
        return NO_SPAN
    return _tracer.start_as_current_span(
        name, context=_context(trace, parent), kind=_kind(trace, kind),
        links=_links(trace, links), attributes=attributes)


def traceparent_of(span) -> str | None:
    """The traceparent of a span (an OpenTelemetry span, or None)."""
    if span is None or span is NO_SPAN:
        return None
    context = span.get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def current_traceparent() -> str | None:
    """The current span's traceparent, if OpenTelemetry is installed and one is current."""
    trace = _trace()
    return traceparent_of(trace.get_current_span()) if trace else None


def _span_context(trace, traceparent: str | None):
    traceparent = valid_traceparent(traceparent)
    if traceparent is None:
        return None
    _, trace_id, span_id, flags = traceparent.split("-")
    return trace.SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=True,
                             trace_flags=trace.TraceFlags(int(flags, 16)))


def _context(trace, parent):
    """An OpenTelemetry Context whose span is `parent`; None (the current) for none."""
    if parent is None:
        return None
    if isinstance(parent, str):
        span_context = _span_context(trace, parent)
        if span_context is None:
            return None
        parent = trace.NonRecordingSpan(span_context)
    return trace.set_span_in_context(parent)


def _links(trace, links) -> list:
    found = []
    for link in links:
        context = (_span_context(trace, link) if isinstance(link, str)
                   else link.get_span_context() if link is not None else None)
        if context is not None and context.is_valid:
            found.append(trace.Link(context))
    return found


def _kind(trace, kind: str | None):
    return trace.SpanKind[kind] if kind else trace.SpanKind.INTERNAL


# --- intake ------------------------------------------------------------------------


class _Intake:
    """The intake's span and what the event stores: `traceparent`."""

    __slots__ = ("traceparent", "_manager", "span")

    def __init__(self, traceparent, manager=None):
        self.traceparent, self._manager, self.span = traceparent, manager, None

    def __enter__(self):
        if self._manager is not None:
            self.span = self._manager.__enter__()
            self.traceparent = traceparent_of(self.span) or self.traceparent
        return self

    def __exit__(self, *exc_info):
        return self._manager is not None and self._manager.__exit__(*exc_info)

    def answered(self, status: int) -> None:
        if self.span is not None:
            self.span.set_attribute("http.response.status_code", status)
            self.span.set_attribute("agent_inbox.duplicate", status == 200)
            if status >= 500:
                self.span.set_status(_api.StatusCode.ERROR)


def intake(header: str | None, source: str, user: str) -> _Intake:
    """The intake of one webhook request with `header` (its traceparent, or
    None): a context manager giving `.traceparent`, what its event stores (a
    malformed header is ignored), and `.answered(status)`."""
    traceparent = valid_traceparent(header)
    trace = _trace()
    if not trace:
        return _Intake(traceparent)
    parent = None if trace.get_current_span().get_span_context().is_valid else traceparent
    return _Intake(traceparent, span(
        "agent_inbox.intake", parent=parent, kind="SERVER",
        attributes={"agent_inbox.source": source, "agent_inbox.user": user}))


# --- runs --------------------------------------------------------------------------


def start_run(run):
    """`run` with its span started (`run.trace`), or `run` itself without
    OpenTelemetry."""
    trace = _trace()
    if not trace:
        return run
    found = [e.traceparent for e in run.events if e.traceparent]
    span_ = _tracer.start_span(
        "agent_inbox.run", context=_context(trace, found[0] if found else None),
        kind=trace.SpanKind.CONSUMER,
        links=_links(trace, dict.fromkeys(found[1:])),
        attributes={"agent_inbox.user": run.user, "agent_inbox.holder": run.holder,
                    "agent_inbox.gen": run.gen, "agent_inbox.events": len(run.events),
                    "agent_inbox.quarantine": bool(run.unfinished)})
    from dataclasses import replace
    return replace(run, trace=span_)


def end_run(run, ending: str, error: str | None = None) -> None:
    """End a run's span: `ending` is what the worker wrote (finish, release,
    give_back, lost), `error` the run's error, if any."""
    span_ = getattr(run, "trace", None)
    if span_ is None:
        return
    span_.set_attribute("agent_inbox.run.ending", ending)
    if error is not None or ending in ("release", "lost"):
        span_.set_status(_api.StatusCode.ERROR, error or ending)
    span_.end()


def run_traceparent(run) -> str | None:
    """What a run's messages store: its span's traceparent, else that of its
    first event that has one."""
    found = traceparent_of(getattr(run, "trace", None))
    if found is None:
        found = next((e.traceparent for e in run.events if e.traceparent), None)
    return found


def activate(steps):
    """A context manager making the run span of `steps` (a RunSteps, or None)
    the current span: a handler runs inside it."""
    span_ = getattr(steps, "trace", None)
    if span_ is None:
        return NO_SPAN
    return _api.use_span(span_, end_on_exit=False, record_exception=False,
                         set_status_on_exception=False)


def step(run_span, name: str, position: int, occurrence: int):
    """A context manager for one durable step's span (a child of `run_span`,
    else of the current span), current inside it."""
    if not _trace():
        return NO_SPAN
    return span("agent_inbox.step", parent=run_span,
                attributes={"agent_inbox.step.name": name, "agent_inbox.step.position": position,
                            "agent_inbox.step.occurrence": occurrence})


class _Finish:
    """One finish span per traced run of a commit."""

    def __init__(self, spans):
        self._spans = spans  # (index in the commit, span)

    def __enter__(self):
        return self

    def accepted(self, flags) -> None:
        for n, span_ in self._spans:
            if n < len(flags) and flags[n] is not None:
                span_.set_attribute("agent_inbox.finish.accepted", bool(flags[n]))

    def __exit__(self, kind, exc, tb):
        for _, span_ in self._spans:
            if exc is not None:
                span_.record_exception(exc)
                span_.set_status(_api.StatusCode.ERROR, f"{type(exc).__name__}: {exc}")
            span_.end()
        return False


def finish(outcomes):
    """A context manager over one commit of `outcomes` (runs.Outcome): a span
    per run that has one; `.accepted(flags)` records the verdicts."""
    trace = _trace()
    if not trace:
        return NO_SPAN
    spans = []
    for n, outcome in enumerate(outcomes):
        run = outcome.run
        if getattr(run, "trace", None) is None:
            continue
        spans.append((n, _tracer.start_span(
            "agent_inbox.finish", context=trace.set_span_in_context(run.trace),
            attributes={"agent_inbox.user": run.user, "agent_inbox.gen": run.gen,
                        "agent_inbox.finish.runs": len(outcomes),
                        "agent_inbox.finish.messages": len(outcome.messages),
                        "agent_inbox.finish.error": outcome.error is not None})))
    return _Finish(spans) if spans else NO_SPAN


# --- delivery ----------------------------------------------------------------------


def send(batch):
    """A context manager for a batch's send (store/outbox.py Batch), current
    while the channel sends."""
    trace = _trace()
    if not trace:
        return NO_SPAN
    found = [t for t in getattr(batch, "traceparents", ()) if t]
    return span("agent_inbox.send", parent=found[0] if found else None,
                links=dict.fromkeys(found[1:]), kind="PRODUCER",
                attributes={"agent_inbox.user": batch.user, "agent_inbox.batch": batch.batch,
                            "agent_inbox.send.key": batch.key,
                            "agent_inbox.messages": len(batch.ids)})
