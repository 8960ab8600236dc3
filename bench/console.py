"""The console's pages at scale: 100,000 users and 1,000,000 events.

    .venv/bin/python -m bench.console [--users 100000] [--events-per-user 10] [--reps 15]

Fills a database of its own with generate_series SQL (events: 90% done, 6%
pending, 2% running under live leases of 8 workers, 2% dead; one outbox
message per user, some held, some failed; a timer per user and 1,000 approval
requests; an hour of run_stats for 8 processes), starts `agent-inbox console`
on a free loopback port, and times each page over HTTP with a bearer token,
--reps times after one warm-up, interleaved; medians and p95 in
bench/results/console.json. EXPLAIN (ANALYZE, BUFFERS) of each page's
statements, with the parameters the page uses, goes to
bench/results/console_<page>.txt. The database is dropped and the console
stopped at the end.
"""

import argparse
import http.client
import json
import socket
import statistics
import time

import psycopg

from agent_inbox.store import views as queries
from agent_inbox.store import admin, outbox, stats
from bench.common import RESULTS, VENV_BIN, ours_database, resources, spawn, src_fingerprint

SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"
TOKEN = "bench-token-4e8a2c6f0b3d7e1a5c9f2b4d6e8a0c3f"
WORKERS = 8

FILL = """
INSERT INTO events (user_id, source, source_id, payload, status, attempts, claim_gen, error,
                    created_at, available_at, claimed_at, kind)
SELECT 'u' || lpad((n / %(per)s)::text, 6, '0'), 'github', 'delivery-' || n,
       jsonb_build_object('action', 'opened', 'number', n, 'body', repeat('x', 200)),
       s.status,
       CASE s.status WHEN 'pending' THEN 0 WHEN 'dead' THEN 3 ELSE 1 END,
       CASE WHEN s.status = 'pending' THEN NULL ELSE 1 END,
       CASE WHEN s.status = 'dead' THEN 'too many attempts' END,
       %(now)s - 3600 + n %% 3600, %(now)s - 3600 + n %% 3600,
       CASE WHEN s.status = 'pending' THEN NULL ELSE %(now)s - 60 END, 'pull_request'
  FROM generate_series(0, %(total)s - 1) AS n
 CROSS JOIN LATERAL (SELECT CASE WHEN n %% 100 < 90 THEN 'done'
                                 WHEN n %% 100 < 96 THEN 'pending'
                                 WHEN n %% 100 < 98 THEN 'dead'
                                 ELSE 'running' END AS status) s
"""

STATEMENTS = [
    # the running users' leases: held by one of WORKERS live holders
    """UPDATE leases l SET holder = 'worker-' || (hashtext(l.user_id) & 7), gen = 1,
              until = %(now)s + 120
         FROM (SELECT DISTINCT user_id FROM events WHERE status = 'running') r
        WHERE r.user_id = l.user_id""",
    """UPDATE leases SET gen = 1 WHERE gen = 0""",
    # one message per user: 80% sent, 15% held, 5% failed (batches of one)
    """INSERT INTO outbox (user_id, body, created, sent_at, batch, failed_at, error)
       SELECT user_id, 'message for ' || user_id, %(now)s - 600,
              CASE WHEN k < 80 THEN %(now)s - 500 END,
              CASE WHEN k >= 95 THEN 0 END,
              CASE WHEN k >= 95 THEN %(now)s - 300 END,
              CASE WHEN k >= 95 THEN 'HTTP 410 Gone' END
         FROM (SELECT user_id, hashtext(user_id || 'o') & 127 AS k FROM leases) u
        WHERE k < 100""",
    """UPDATE outbox SET batch = id WHERE batch = 0""",
    # a daily timer per user, and 1,000 approval requests
    """INSERT INTO timers (user_id, timer_id, due, every, payload)
       SELECT user_id, 'daily-digest', %(now)s + (hashtext(user_id) & 65535), 86400, '{}'
         FROM leases""",
    """INSERT INTO timers (user_id, timer_id, due, payload, event_source, event_source_id)
       SELECT 'u' || lpad((n * 97)::text, 6, '0'), 'expire:req-' || n, %(now)s + 60 * n,
              jsonb_build_object('approval', 'req-' || n, 'answer', 'expired',
                                 'action', 'refund order ' || n || '?'),
              'approval', 'req-' || n
         FROM generate_series(1, 1000) AS n""",
    # an hour of statistics for WORKERS processes
    """INSERT INTO run_stats (minute, process, finished, refused, takeovers, died)
       SELECT %(now)s / 60 * 60 - m * 60, 'worker-' || w, 100 + (m * 7 + w) %% 40,
              (m + w) %% 3, (m * w) %% 2, (m + w) %% 5
         FROM generate_series(0, 59) AS m, generate_series(0, 7) AS w""",
]

PAGES = {
    "overview": "/",
    "overview_json": "/api/overview",
    "chart": "/overview/chart.svg",
    "users": "/users",
    "users_search": "/users?q=u0424",
    "users_search_none": "/users?q=zzz",
    "users_late_page": "/users?after=u099000",
    "user": "/user?u=u042424",
    "dead": "/dead",
    "outbox_failed": "/outbox",
    "approvals": "/approvals",
}


def fill(url: str, users: int, per: int) -> float:
    began = time.monotonic()
    with psycopg.connect(url, autocommit=True) as conn:
        now = conn.execute("SELECT floor(extract(epoch FROM now()))::bigint").fetchone()[0]
        params = {"now": now, "per": per, "total": users * per}
        conn.execute(FILL, params)
        for statement in STATEMENTS:
            conn.execute(statement, params)
        for table in ("events", "leases", "wakes", "outbox", "timers", "run_stats"):
            conn.execute(f"VACUUM ANALYZE {table}")
    return time.monotonic() - began


def explain(url: str) -> None:
    """EXPLAIN ANALYZE of each page's statements, as the page runs them."""
    user = "u042424"
    plans = {
        "overview": [(queries.OVERVIEW, {"now": None}),
                     (stats.LAST_MINUTES, {"minutes": 60, "now": None})],
        "users": [(queries.USERS, {"prefix": "", "after": "", "limit": queries.PAGE + 1,
                                   "now": None})],
        "users_search": [(queries.USERS, {"prefix": "u0424", "after": "",
                                          "limit": queries.PAGE + 1, "now": None})],
        "users_search_none": [(queries.USERS, {"prefix": "zzz", "after": "",
                                               "limit": queries.PAGE + 1, "now": None})],
        "user": [(queries.LEASE, {"user": user, "now": None}),
                 (queries.TIMELINE, {"user": user, "before": 2**63 - 1,
                                     "limit": queries.PAGE + 1}),
                 (queries.RUNS, {"user": user, "limit": queries.PAGE}),
                 (queries.MESSAGES, {"user": user, "limit": queries.PAGE}),
                 (admin.TIMERS, {"user": user, "limit": queries.PAGE, "now": None}),
                 (queries.USER_APPROVALS, {"user": user, "limit": queries.PAGE, "now": None})],
        "dead": [(admin.DEAD, {"user": None, "limit": 200})],
        "outbox_failed": [(outbox.FAILED, {"user": None, "limit": 200})],
        "approvals": [(queries.UNANSWERED, {"limit": queries.PAGE * 2, "now": None})],
    }
    with psycopg.connect(url, autocommit=True) as conn:
        for page, statements in plans.items():
            text = [f"# console page {PAGES[page]}: its statements, EXPLAIN (ANALYZE, BUFFERS)\n"]
            for statement, params in statements:
                rows = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + statement, params).fetchall()
                text.append(statement.strip() + "\n\n" + "\n".join(r[0] for r in rows) + "\n")
            (RESULTS / f"console_{page}.txt").write_text("\n\n".join(text))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_ready(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("GET", "/healthz")
            if connection.getresponse().status == 200:
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)  # the process is starting: nothing to wait on but its port


def time_pages(port: int, reps: int) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    times: dict[str, list[float]] = {name: [] for name in PAGES}
    for rep in range(reps + 1):
        for name, path in PAGES.items():
            began = time.perf_counter()
            connection.request("GET", path, headers=headers)
            answer = connection.getresponse()
            body = answer.read()
            elapsed = time.perf_counter() - began
            if answer.status != 200:
                raise SystemExit(f"{path}: {answer.status} {body[:300]!r}")
            if rep:  # the first round warms caches and the pool
                times[name].append(elapsed * 1000)
    return {name: {"median_ms": round(statistics.median(values), 1),
                   "p95_ms": round(sorted(values)[max(0, int(len(values) * 0.95) - 1)], 1),
                   "max_ms": round(max(values), 1)}
            for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server-url", default=SERVER)
    parser.add_argument("--users", type=int, default=100_000)
    parser.add_argument("--events-per-user", type=int, default=10)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()

    url = ours_database(args.server_url)
    seconds = fill(url, args.users, args.events_per_user)
    with psycopg.connect(url) as conn:
        counts = dict(conn.execute("SELECT status, count(*) FROM events GROUP BY status"))
        users = conn.execute("SELECT count(*) FROM leases").fetchone()[0]
    print(f"filled in {seconds:.0f} s: {users} users, events {counts}", flush=True)
    explain(url)
    port = free_port()
    log = resources().tempdir("console") + "/console.log"
    spawn([str(VENV_BIN / "agent-inbox"), "console", "--database-url", url, "--port", str(port),
           "--log-level", "warning"], {"AGENT_INBOX_CONSOLE_TOKENS": f"bench:viewer:{TOKEN}"}, log)
    wait_ready(port)
    pages = time_pages(port, args.reps)
    for name, figures in pages.items():
        print(f"{PAGES[name]:<24} median {figures['median_ms']:>6} ms  p95 {figures['p95_ms']:>6} ms")
    result = {"users": users, "events": counts, "reps": args.reps, "pages": pages,
              "worst_median_ms": max(f["median_ms"] for f in pages.values()),
              "source": src_fingerprint()}
    (RESULTS / "console.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
