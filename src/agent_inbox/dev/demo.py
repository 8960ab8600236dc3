"""The eight failure scenarios of the single-host design, run on PostgreSQL.

Prints exactly the reference demo's lines. A simulated clock (`now=`) drives
every call; a "crash" is a worker that claims and never finishes. The demo runs
in a scratch database that it creates and drops, on the server given, or on a
throwaway cluster started from the local PostgreSQL binaries.
"""

from collections.abc import Callable

from agent_inbox.schema import migrate
from agent_inbox.dev import pgserver
from agent_inbox.api.inbox import Inbox

USER = "demo"
T0 = 1_000_000
DAY = 86400
HOUR = 3600


def scenarios(inbox: Inbox, say: Callable[..., None] = print) -> None:
    ttl = inbox.settings.lease_ttl

    def run(holder: str, now: int, messages=()) -> list:
        gen = inbox.acquire(USER, holder, now=now)
        batch = inbox.claim_batch(USER, holder, gen, now=now)
        inbox.finish(USER, holder, gen, [e.id for e in batch], messages=messages, now=now)
        return batch

    def status(source_id: str) -> tuple[str, int]:
        event = next(e for e in inbox.events(USER) if e.source_id == source_id)
        return event.status, event.attempts

    def digest_events() -> list:
        return [e for e in inbox.events(USER) if e.source_id.startswith("digest@")]

    say("1. webhook delivered twice")
    say("   first:", inbox.ingest(USER, "github", "delivery-7f3a", {"pr": 12}),
        " retry:", inbox.ingest(USER, "github", "delivery-7f3a", {"pr": 12}),
        " rows:", len(inbox.events(USER)))

    say("2. two workers ask for the lease at the same time")
    say("   A:", inbox.acquire(USER, "A", now=T0), " B:", inbox.acquire(USER, "B", now=T0))
    run("A", T0)

    say("3. three quick chat messages")
    for n in range(3):
        inbox.ingest(USER, "chat", f"msg-{n}", {"text": f"message {n}"})
    say("   events in one run:", len(run("A", T0 + 5)))

    say("4. A stalls mid-run; B takes over; A wakes up")
    inbox.ingest(USER, "chat", "msg-3", {"text": "send the report"})
    gen_a = inbox.acquire(USER, "A", now=T0 + 10)
    batch_a = inbox.claim_batch(USER, "A", gen_a, now=T0 + 10)  # A stalls here
    say("   B before A's lease expires:", inbox.acquire(USER, "B", now=T0 + 60))
    t2 = T0 + 10 + ttl + 1
    gen_b = inbox.acquire(USER, "B", now=t2)
    batch_b = inbox.claim_batch(USER, "B", gen_b, now=t2)
    say("   B after expiry: gen", gen_b, " re-claims", [e.source_id for e in batch_b])
    inbox.finish(USER, "B", gen_b, [e.id for e in batch_b], messages=["report sent"], now=t2)
    t3 = t2 + ttl + 1  # B's lease lapses too
    say("   A renews after both leases lapsed: gen", inbox.acquire(USER, "A", now=t3))
    say("   A finishes its old claim (gen", gen_a, "):",
        inbox.finish(USER, "A", gen_a, [e.id for e in batch_a], messages=["report sent"], now=t3))
    say("   msg-3:", status("msg-3"), " outbox rows:", len(inbox.outbox(USER)))

    say("5. a poison event arrives together with a healthy one")
    inbox.ingest(USER, "chat", "poison", {"text": "x"})
    inbox.ingest(USER, "chat", "healthy", {"text": "ok"})
    now = t3 + ttl + 1
    for n in range(5):
        holder = f"W{n}"
        gen = inbox.acquire(USER, holder, now=now)
        got = inbox.claim_batch(USER, holder, gen, now=now)
        names = [e.source_id for e in got]
        if "poison" in names:
            say(f"   {holder} claimed {names} and crashed")  # no finish
        else:
            inbox.finish(USER, holder, gen, [e.id for e in got], now=now)
            say(f"   {holder} claimed {names} and finished")
        now += ttl + 1
    say("   poison:", status("poison"), " healthy:", status("healthy"))

    say("6. timers: a second scheduler pass, a replay, a three-day outage")
    inbox.add_timer(USER, "digest", now, {"task": "daily digest"}, every=DAY)
    say("   pass 1:", inbox.run_scheduler(now=now), " pass 2:", inbox.run_scheduler(now=now))
    inbox.add_timer(USER, "digest", now, {"task": "daily digest"}, every=DAY)  # replay
    say("   replay of the same occurrence:", inbox.run_scheduler(now=now), "due,",
        len(digest_events()), "event total")
    later = now + DAY + 3 * DAY + 600  # next due + 3 days
    inbox.run_scheduler(now=later)
    latest = digest_events()[-1].payload
    digest = next(t for t in inbox.timers(USER) if t.timer_id == "digest")
    say("   after the outage: events total", len(digest_events()), " skipped", latest["skipped"],
        " late by", latest["late_by"] // 60, "min",
        " next due in", round((digest.due - later) / HOUR, 1), "h")

    say("7. approvals with a four-hour window")

    def request(request_id: str, order: int) -> None:
        inbox.request_approval(USER, request_id, expires_in=4 * HOUR,
                               action=f"refund order {order}", now=later)

    request("refund-881", 881)
    inbox.run_scheduler(now=later + 5 * HOUR)
    say("   881: expiry ran at 5h, yes at 6h ->",
        inbox.answer_approval(USER, "refund-881", "yes", now=later + 6 * HOUR))
    request("refund-882", 882)
    say("   882: yes at 5h, scheduler not run yet ->",
        inbox.answer_approval(USER, "refund-882", "yes", now=later + 5 * HOUR))
    request("refund-883", 883)
    say("   883: yes at 1h ->", inbox.answer_approval(USER, "refund-883", "yes", now=later + HOUR),
        " second tap no at 2h ->",
        inbox.answer_approval(USER, "refund-883", "no", now=later + 2 * HOUR))
    inbox.run_scheduler(now=later + 5 * HOUR)
    standing = next(e for e in inbox.events(USER)
                    if e.source == "approval" and e.source_id == "refund-883")
    say("   883 after its expiry timer fired:", standing.payload["answer"])
    say("   never requested ->", inbox.answer_approval(USER, "refund-999", "yes", now=later))

    say("8. outbox: three updates inside an hour")
    sent: list[str] = []
    m = later + 6 * HOUR
    inbox.dispatch(USER, lambda text: None, now=m - 2 * HOUR)  # the last send was 2 h ago
    for n, minute in enumerate((0, 10, 20)):
        at = m + minute * 60
        inbox.ingest(USER, "chat", f"update-{n}", {"text": f"update {n}"})
        run("A", at, messages=[f"update {n}"])
        inbox.dispatch(USER, sent.append, now=at)
    inbox.dispatch(USER, sent.append, now=m + 61 * 60)
    say("   sends:", [s.replace("\n\n", " | ") for s in sent])


def main(database_url: str | None, say: Callable[..., None] = print, *,
         pooler: str = "none") -> None:
    """Run the scenarios in a scratch database on `database_url`'s server (which
    may be reached through `pooler`), or on a throwaway cluster when it is None;
    nothing is left behind."""
    with pgserver.scratch_database(database_url, prefix="agent_inbox_demo") as url:
        migrate.upgrade(url, pooler=pooler)
        with Inbox.connect(url, pool_size=1, pooler=pooler) as inbox:
            scenarios(inbox, say)
