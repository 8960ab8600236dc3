"""Prometheus metrics for every service (`--metrics-port`).

Counters and histograms live in this process and are updated where things
happen; `inbox depth` (events by status, across users) is read from the database
when scraped, by a cross-user query that runs only then.
"""

import logging

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from agent_inbox import db, errors

log = logging.getLogger("agent_inbox.metrics")

INGESTED = Counter("agent_inbox_events_ingested_total", "Events stored", ["source"])
DUPLICATES = Counter("agent_inbox_events_duplicate_total", "Redeliveries dropped", ["source"])
CLAIMED = Counter("agent_inbox_events_claimed_total", "Events claimed by a run")
RUNS = Counter("agent_inbox_runs_total", "Runs started (each takes a lease over)")
FINISHES = Counter("agent_inbox_finishes_total", "Fenced finishes", ["outcome"])
RENEWALS_FAILED = Counter("agent_inbox_lease_renewals_failed_total",
                          "Lease renewals refused or failed past the TTL")
RUNS_TIMED_OUT = Counter("agent_inbox_runs_timed_out_total",
                         "Runs stopped past --run-timeout (released, attempt counted)")
RUNS_CANCELLED = Counter("agent_inbox_runs_cancelled_total",
                         "Runs stopped because an operator cancelled them (store/pauses.py)")
CANCELS_IGNORED = Counter("agent_inbox_cancels_ignored_total",
                          "Cancelled runs whose handler still ran 5 s after the cancel")
QUARANTINED = Counter("agent_inbox_runs_quarantined_total",
                      "Runs sent to a quarantine process (their last attempt ended without a finish)")
DEAD = Counter("agent_inbox_events_dead_total", "Events parked dead (out of attempts)")
RUN_SECONDS = Histogram("agent_inbox_run_seconds", "Handler run time",
                        buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900))
STEPS = Counter("agent_inbox_steps_total",
                "Durable steps: recorded, replayed to a later attempt, or refused by the fence",
                ["outcome"])
STEP_COMMIT_SECONDS = Histogram(
    "agent_inbox_step_commit_seconds", "From a step's result to its record committed",
    buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0))
RUN_PATH_DAMAGED = Gauge("agent_inbox_run_path_damaged",
                         "1 while the run path's state is damaged and no work is taken "
                         "(errors.RunPathDamaged; the log says what and how to repair)")
RSS = Gauge("agent_inbox_worker_rss_bytes", "The worker runtime's resident memory (--max-memory)")
RECYCLES = Counter("agent_inbox_worker_recycles_total",
                   "Worker runtimes replaced past --max-memory (by this worker's supervisor)")
LOOP_BLOCKED = Counter("agent_inbox_loop_blocked_total",
                       "Times one task or callback held the worker's event loop for 1 s or more "
                       "(an async handler blocking it: time.sleep, a blocking client)")
TIMERS_FIRED = Counter("agent_inbox_timers_fired_total", "Timers fired")
OCCURRENCES_SKIPPED = Counter("agent_inbox_timer_occurrences_skipped_total",
                              "Timer occurrences coalesced or over the catch-up limit")
TIMERS_PARKED = Counter("agent_inbox_timers_parked_total",
                        "Timers parked because firing them raised (skipped until replaced)")
SENDS = Counter("agent_inbox_outbox_sends_total", "Batches sent by the dispatcher")
MESSAGES_SENT = Counter("agent_inbox_outbox_messages_sent_total", "Messages sent")
SEND_FAILURES = Counter("agent_inbox_outbox_send_failures_total",
                        "Failed sends: retried after a backoff, parked failed, or lost "
                        "(--at-most-once)", ["outcome"])

INTAKE_REFUSED = Counter("agent_inbox_intake_refused_total",
                         "Webhook deliveries refused 401 (bad or missing signature, no secret)")
INTAKE_CLOSED = Counter("agent_inbox_intake_connections_closed_total",
                        "Intake connections closed by a limit", ["reason"])

HORIZON_AGE_SECONDS = Gauge("agent_inbox_horizon_age_seconds",
                            "How long the oldest transaction, slot or prepared transaction has "
                            "held the xmin horizon back (VACUUM keeps what it may still see)")
HORIZON_AGE_XIDS = Gauge("agent_inbox_horizon_age_xids",
                         "Transactions since the oldest xmin still held (age(xmin))")
DEAD_TUPLES = Gauge("agent_inbox_dead_tuples", "Dead tuples of the inbox's tables (n_dead_tup)",
                    ["table"])
COMPACTIONS = Counter("agent_inbox_compactions_total",
                      "Rewrites of a table without its dead tuples (store/compaction.py), and "
                      "tries whose table lock was not granted in time", ["table", "result"])
COMPACTION_REFUSED_SECONDS = Gauge(
    "agent_inbox_compaction_refused_seconds",
    "How long a table's compaction has been refused its table lock (a pg_dump, another "
    "session holding a lock on it); 0 once it is granted", ["table"])


def count_ingested(source: str, stored: bool) -> None:
    (INGESTED if stored else DUPLICATES).labels(source).inc()


# Spans users (an operator view): open and dead events, counted on scrape.
DEPTH = """
SELECT status, count(*) FROM events WHERE outcome IS NULL OR outcome = 'dead' GROUP BY status
"""
# Spans users: unsent outbox messages, held (to be sent) or in a parked batch.
OUTBOX_DEPTH = """
SELECT count(*) FILTER (WHERE failed_at IS NULL), count(*) FILTER (WHERE failed_at IS NOT NULL)
  FROM outbox WHERE sent_at IS NULL
"""

# Paused users (ix_leases_paused) and whether the fleet is paused (store/pauses.py).
PAUSED_USERS = "SELECT count(*) FROM leases WHERE paused_at IS NOT NULL"
FLEET_PAUSED = "SELECT count(*) FROM fleet_pause"


class InboxDepth:
    """Events by status, unsent outbox messages, paused users and the fleet's
    pause, read from the database when Prometheus scrapes."""

    def __init__(self, pool):
        self.pool = pool

    def collect(self):
        family = GaugeMetricFamily("agent_inbox_events", "Events by status", labels=["status"])
        try:
            with db.connection(self.pool) as conn:
                counts = dict(conn.execute(DEPTH).fetchall())
                held, failed = conn.execute(OUTBOX_DEPTH).fetchone()
                [paused_users] = conn.execute(PAUSED_USERS).fetchone()
                [fleet_paused] = conn.execute(FLEET_PAUSED).fetchone()
        except errors.DatabaseUnavailable as exc:
            log.warning("inbox depth unavailable: %s", exc)
            return
        for status in ("pending", "running", "dead"):
            family.add_metric([status], counts.get(status, 0))
        yield family
        unsent = GaugeMetricFamily("agent_inbox_outbox_messages",
                                   "Unsent outbox messages: held, or in a batch parked failed",
                                   labels=["state"])
        unsent.add_metric(["held"], held)
        unsent.add_metric(["failed"], failed)
        yield unsent
        yield GaugeMetricFamily("agent_inbox_users_paused",
                                "Users paused (agent-inbox pause --user)", value=paused_users)
        yield GaugeMetricFamily("agent_inbox_fleet_paused",
                                "1 while the fleet is paused (agent-inbox pause --all)",
                                value=int(fleet_paused))


DEFAULT_HOST = "127.0.0.1"


def serve(port: int, pool, host: str = DEFAULT_HOST) -> None:
    """Expose /metrics on `host`:`port` (loopback unless told), with the inbox depth."""
    REGISTRY.register(InboxDepth(pool))
    start_http_server(port, addr=host)
    log.info("metrics on %s:%d/metrics", host, port)
