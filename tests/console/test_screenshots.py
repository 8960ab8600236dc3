"""Screenshots of the overview and a user's page, from a small believable world.

Written to tmp_path, or to $AGENT_INBOX_SCREENSHOTS_DIR when set (how
docs/console-overview.png and docs/console-user.png are made:
AGENT_INBOX_SCREENSHOTS_DIR=docs ./dev test tests/console/test_screenshots.py).
"""

import os
import time

import psycopg
from playwright.sync_api import expect

from agent_inbox import Result
from tests.test_operator_cli import exhaust


def _world(inbox, database_url):
    for n in range(12):
        user = f"user-{n:03d}"
        for k in range(n % 4 + 1):
            inbox.ingest(user, "github", f"delivery-{n}-{k}",
                         {"action": "opened", "number": 800 + k, "title": f"Fix #{n}{k}"},
                         kind="pull_request")
    inbox.ingest("user-003", "stripe", "evt_1", {"type": "charge.refunded", "amount": 4200},
                 kind="charge.refunded")
    exhaust(inbox, "user-003", int(time.time()) - 1200)
    inbox.ingest("user-003", "slack", "msg-9", {"text": "<img src=x onerror=alert(1)> refund?"},
                 kind="message")
    run = inbox.take_work("worker-a")
    inbox.finish_run(run, Result(messages=[f"{run.user}: handled"]), release=False)
    for n in (1, 2, 5):
        gen = inbox.acquire(f"user-{n:03d}", f"worker-{'ab'[n % 2]}")
        inbox.claim_batch(f"user-{n:03d}", f"worker-{'ab'[n % 2]}", gen)
    inbox.request_approval("user-003", "refund-881", expires_in=1800,
                           action="refund order 881 (42.00 EUR)?")
    inbox.add_timer("user-003", "daily-digest", int(time.time()) + 5400, {"digest": True},
                    every=86400)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("""
            INSERT INTO run_stats (minute, process, finished, refused, takeovers, died)
            SELECT (floor(extract(epoch FROM now()))::bigint / 60 - m) * 60, 'worker-' || w,
                   40 + (m * 13 + w * 7) % 25, (m + w) % 7 / 5, (m * 3 + w) % 11 / 9,
                   (m + 2 * w) % 13 / 11
              FROM generate_series(0, 59) m, generate_series(0, 2) w""")


def test_screenshots(login, inbox, console, database_url, tmp_path):
    _world(inbox, database_url)
    target = os.environ.get("AGENT_INBOX_SCREENSHOTS_DIR") or str(tmp_path)
    page = login("ann")
    expect(page.locator("#chart")).to_have_js_property("complete", True)
    page.screenshot(path=os.path.join(target, "console-overview.png"), full_page=True)
    page.goto(console.url + "/user?u=user-003")
    page.locator("#events summary").first.click()
    page.screenshot(path=os.path.join(target, "console-user.png"), full_page=True)
    assert os.path.getsize(os.path.join(target, "console-user.png")) > 10_000
