"""What the chaos run must leave behind, checked from the database alone.

After the faults, with every service stopped, a snapshot of the events, outbox
and timers tables must show:

- every ingested key stored once; nothing left pending or running;
- every healthy event `done`, named by exactly one outbox message (one accepted
  finish), whose gen and claim time are the event's own claim_gen and claimed_at;
- every poison event `dead` after exactly max_attempts claims; healthy events
  parked dead are counted separately (the goal is none);
- every message names done events of its own user only, no two messages name
  the same event, and no (user, gen) has two messages;
- per user, accepted runs in strictly increasing gen whose lease times never
  overlap: each run finished (DB clock) no later than the next one was claimed;
- per recurring timer, occurrences fired once each, on the timer's grid, in
  order, with every gap accounted for by the coalesced `skipped` count, and the
  timer's next due time right after the last occurrence;
- every message sent by the dispatcher, and delivered at least once.

Each check returns a list of problems (empty when it holds) and adds its
figures to `stats`.
"""

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from psycopg.rows import dict_row

from tests.chaos.handlers import is_poison
from tests.chaos.workload import SOURCE, Item, TimerSpec

MAX_SHOWN = 10


@dataclass
class Snapshot:
    events: list[dict]
    messages: list[dict]
    timers: list[dict]
    stats: dict = field(default_factory=dict)

    @classmethod
    def load(cls, url: str) -> "Snapshot":
        with psycopg.connect(url, autocommit=True, row_factory=dict_row) as conn:
            events = conn.execute(
                "SELECT id, user_id, source, source_id, payload, status, attempts, error,"
                " claim_gen, claimed_at FROM events ORDER BY id").fetchall()
            messages = conn.execute(
                "SELECT id, user_id, body, created, sent_at FROM outbox ORDER BY id").fetchall()
            timers = conn.execute(
                "SELECT user_id, timer_id, due, every, done FROM timers").fetchall()
        for message in messages:
            message["run"] = json.loads(message["body"])
        return cls(events, messages, timers)

    def dump(self, path: Path) -> None:
        """The tables as JSON, for reading a failure after the cluster is gone."""
        rows = {"events": self.events, "messages": self.messages, "timers": self.timers}
        path.write_text(json.dumps(rows, default=str))

    def healthy(self) -> list[dict]:
        return [e for e in self.events if not is_poison(e["payload"])]

    def poison(self) -> list[dict]:
        return [e for e in self.events if is_poison(e["payload"])]


def _shown(problems: list[str]) -> list[str]:
    if len(problems) <= MAX_SHOWN:
        return problems
    return problems[:MAX_SHOWN] + [f"... and {len(problems) - MAX_SHOWN} more"]


def check_ingest(snap: Snapshot, items: list[Item]) -> list[str]:
    keys = Counter((e["user_id"], e["source"], e["source_id"]) for e in snap.events)
    problems = [f"event key {key} stored {n} times" for key, n in keys.items() if n != 1]
    problems += [f"ingested item {item.user}/{item.source_id} missing" for item in items
                 if (item.user, SOURCE, item.source_id) not in keys]
    stored = sum(1 for e in snap.events if e["source"] == SOURCE)
    if stored != len(items):
        problems.append(f"{stored} '{SOURCE}' events stored, {len(items)} ingested")
    snap.stats.update(users=len({e["user_id"] for e in snap.events}), events=len(snap.events),
                      timer_events=sum(1 for e in snap.events if e["source"] == "timer"))
    return _shown(problems)


def check_outcomes(snap: Snapshot, max_attempts: int) -> tuple[list[str], list[dict]]:
    """Problems, and the healthy events parked dead (reported on their own)."""
    problems = [f"event {e['id']} left {e['status']}" for e in snap.events
                if e["status"] in ("pending", "running")]
    for event in snap.poison():
        if event["status"] != "dead" or event["attempts"] != max_attempts:
            problems.append(f"poison event {event['id']} is {event['status']} after "
                            f"{event['attempts']} attempts (want dead after {max_attempts})")
    healthy = snap.healthy()
    healthy_dead = [e for e in healthy if e["status"] == "dead"]
    snap.stats.update(done=sum(1 for e in healthy if e["status"] == "done"),
                      dead=sum(1 for e in snap.events if e["status"] == "dead"),
                      poison=len(snap.poison()), healthy_dead=len(healthy_dead),
                      healthy_retried=sum(1 for e in healthy if e["attempts"] > 1),
                      max_healthy_attempts=max((e["attempts"] for e in healthy), default=0))
    return _shown(problems), healthy_dead


def check_runs(snap: Snapshot) -> list[str]:
    """One message per accepted run; each done event in exactly one of them."""
    problems = []
    by_id = {e["id"]: e for e in snap.events}
    named = Counter()
    for message in snap.messages:
        run = message["run"]
        if run["user"] != message["user_id"]:
            problems.append(f"message {message['id']} of {message['user_id']} names {run['user']}")
        if not run["ids"]:
            problems.append(f"message {message['id']} names no event")
        for event_id in run["ids"]:
            named[event_id] += 1
            problems += _event_matches_run(by_id.get(event_id), event_id, message)
    problems += [f"event {i} named by {n} messages" for i, n in named.items() if n > 1]
    problems += [f"done event {e['id']} named by no message" for e in snap.events
                 if e["status"] == "done" and e["id"] not in named]
    gens = Counter((m["user_id"], m["run"]["gen"]) for m in snap.messages)
    problems += [f"user {u} gen {g} has {n} messages" for (u, g), n in gens.items() if n > 1]
    snap.stats.update(runs=len(snap.messages),
                      events_per_run=round(sum(named.values()) / max(1, len(snap.messages)), 2))
    return _shown(problems)


def _event_matches_run(event: dict | None, event_id: int, message: dict) -> list[str]:
    run = message["run"]
    where = f"message {message['id']} (user {message['user_id']} gen {run['gen']})"
    if event is None:
        return [f"{where} names unknown event {event_id}"]
    wrong = []
    if event["user_id"] != message["user_id"]:
        wrong.append(f"{where} names event {event_id} of user {event['user_id']}")
    if event["status"] != "done":
        wrong.append(f"{where} names event {event_id} left {event['status']}")
    if event["claim_gen"] != run["gen"] or event["claimed_at"] != run["claimed_at"]:
        wrong.append(f"{where} names event {event_id} claimed in gen {event['claim_gen']} "
                     f"at {event['claimed_at']}, not gen {run['gen']} at {run['claimed_at']}")
    return wrong


def check_leases(snap: Snapshot) -> list[str]:
    """Per user, accepted runs in strictly increasing gen, never overlapping in time."""
    problems = []
    per_user = defaultdict(list)
    for message in snap.messages:  # ordered by id: finish (commit) order per user
        per_user[message["user_id"]].append(message)
    for user, runs in per_user.items():
        for earlier, later in zip(runs, runs[1:]):
            a, b = earlier["run"], later["run"]
            if b["gen"] <= a["gen"]:
                problems.append(f"user {user}: gen {b['gen']} accepted after gen {a['gen']}")
            if earlier["created"] > b["claimed_at"]:
                problems.append(f"user {user}: gen {a['gen']} finished at {earlier['created']}, "
                                f"after gen {b['gen']} was claimed at {b['claimed_at']}")
        for message in runs:
            if message["created"] < message["run"]["claimed_at"]:
                problems.append(f"user {user}: gen {message['run']['gen']} finished before "
                                f"its claim")
    snap.stats["max_runs_per_user"] = max((len(r) for r in per_user.values()), default=0)
    return _shown(problems)


def check_timers(snap: Snapshot, specs: list[TimerSpec]) -> list[str]:
    """Each occurrence fired once, on the grid, in order, gaps accounted for."""
    problems = []
    rows = {(t["user_id"], t["timer_id"]): t for t in snap.timers}
    fired = coalesced = 0
    for spec in specs:
        prefix = f"{spec.timer_id}@"
        events = [e for e in snap.events if e["user_id"] == spec.user and e["source"] == "timer"
                  and e["source_id"].startswith(prefix)]
        fired += len(events)
        coalesced += sum(e["payload"].get("skipped", 0) for e in events)
        problems += _timer_sequence(spec, events, rows.get((spec.user, spec.timer_id)))
    snap.stats.update(timer_occurrences=fired, timer_coalesced=coalesced)
    return _shown(problems)


def _timer_sequence(spec: TimerSpec, events: list[dict], row: dict | None) -> list[str]:
    name = f"timer {spec.user}/{spec.timer_id} (every {spec.every}s)"
    if len(events) < 2:
        return [f"{name} fired {len(events)} times during the run"]
    problems = []
    expected = spec.first_due
    for event in events:  # by id: insertion order
        at = int(event["source_id"].split("@", 1)[1])
        payload = event["payload"]
        if payload.get("scheduled_for") != at:
            problems.append(f"{name}: event {event['id']} key says {at}, payload "
                            f"{payload.get('scheduled_for')}")
        if (at - spec.first_due) % spec.every:
            problems.append(f"{name}: occurrence {at} is off the grid from {spec.first_due}")
        want = expected + payload.get("skipped", 0) * spec.every
        if at != want:
            problems.append(f"{name}: occurrence {at} where {want} was due "
                            f"(skipped {payload.get('skipped')})")
        expected = at + spec.every
    if row is None or row["due"] != expected:
        problems.append(f"{name}: next due {row and row['due']}, want {expected} after the last")
    return problems


def check_deliveries(snap: Snapshot, send_log: Path) -> list[str]:
    """Every queued message sent, and delivered at least once, in its user's text."""
    problems = [f"message {m['id']} of {m['user_id']} never sent" for m in snap.messages
                if m["sent_at"] is None]
    delivered = Counter()
    lines = send_log.read_text().splitlines() if send_log.exists() else []
    for line in lines:
        send = json.loads(line)
        for body in send["text"].split("\n\n"):
            delivered[(send["user"], body)] += 1
    bodies = {(m["user_id"], m["body"]) for m in snap.messages}
    problems += [f"message of {user} never delivered" for user, body in bodies
                 if (user, body) not in delivered]
    problems += [f"delivered text for {user} that is no message" for user, body in delivered
                 if (user, body) not in bodies]
    snap.stats.update(sends=len(lines),
                      repeated_deliveries=sum(n - 1 for n in delivered.values() if n > 1))
    return _shown(problems)
