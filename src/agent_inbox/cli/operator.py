"""Operator commands: `agent-inbox status`, `events`, `dead list|requeue|discard`,
`outbox failed|retry|discard`, `timers` and `approve`.

Each prints a readable table, or with `--json` one JSON document on stdout for
scripts (times as epoch seconds). Progress, audit lines and errors go to stderr.

Exit codes: 0 done; 1 some ids given to `dead requeue|discard` were not dead
events, or to `outbox retry|discard` not failed batches (they are listed and
left alone); 2 bad input, or no usable
database (nothing changed); 3 `approve` named a request never made.
"""

import argparse
import json
import logging
import sys
import time

from agent_inbox import db, errors, tables
from agent_inbox.api import admin as admin_views
from agent_inbox.cli import options
from agent_inbox.records import EVENT_STATUSES
from agent_inbox.store import admin, outbox, steps

log = logging.getLogger("agent_inbox.operator")

DEFAULT_LIMIT = 100


# --- arguments ----------------------------------------------------------------


def _add_limit(parser, what: str) -> None:
    parser.add_argument("--limit", type=options.positive, default=DEFAULT_LIMIT,
                        help=f"show at most this many {what} (default {DEFAULT_LIMIT})")


def _add_now(parser) -> None:
    parser.add_argument("--now", type=options.epoch, default=None,
                        help="the current time in epoch seconds, for tests and simulations "
                             "(default: the database server's clock)")


def add_parsers(commands) -> None:
    """Add the operator subcommands to an argparse subparsers object."""
    status = options.operator_parser(commands, "status", "per-user work, leases and held messages, with totals",
                     "Per user: pending, running and dead events, the lease (holder, generation, "
                     "expiry) and held outbox messages, busiest first; then totals over every "
                     "user. Users with only finished work are not shown.")
    _add_limit(status, "users")
    _add_now(status)
    status.set_defaults(run=cmd_status)

    events = options.operator_parser(commands, "events", "a user's events, newest first")
    events.add_argument("--user", type=options.text, required=True)
    events.add_argument("--status", choices=EVENT_STATUSES)
    _add_limit(events, "events")
    events.set_defaults(run=cmd_events)

    dead = commands.add_parser("dead", help="list, requeue or discard dead events",
                               description="Events parked as dead after too many attempts.")
    dead_commands = dead.add_subparsers(dest="dead_command", required=True,
                                        metavar="{list,requeue,discard}")
    listing = options.operator_parser(dead_commands, "list", "dead events across users, newest first")
    listing.add_argument("--user", type=options.text, help="only this user's")
    _add_limit(listing, "events")
    listing.set_defaults(run=cmd_dead_list)

    requeue = options.operator_parser(
        dead_commands, "requeue", "make dead events pending again, as fresh",
        "Make dead events pending again with attempts 0, error cleared and claimable now, "
        "and wake the workers. Only dead events change: other ids are listed and left "
        "alone (exit 1). Each requeue is written to stderr as an audit line.")
    requeue.add_argument("ids", metavar="ID", nargs="+", type=options.positive, help="event ids")
    requeue.add_argument("--user", type=options.text, help="only events of this user")
    _add_now(requeue)
    requeue.set_defaults(run=cmd_dead_requeue)

    discard = options.operator_parser(
        dead_commands, "discard", "delete dead events (their dedup keys go with them)",
        "Delete dead events. Only dead events are deleted: other ids are listed and left "
        "alone (exit 1). Deleting an event deletes its dedup key: a later redelivery of "
        "the same (user, source, source_id) is stored and run again. Each deletion is "
        "written to stderr as an audit line.")
    discard.add_argument("ids", metavar="ID", nargs="+", type=options.positive, help="event ids")
    discard.add_argument("--user", type=options.text, help="only events of this user")
    discard.set_defaults(run=cmd_dead_discard)

    sends = commands.add_parser("outbox", help="list, retry or discard outbox batches that failed",
                                description="Outbox batches parked failed: sent too many times "
                                            "without success, or refused by the channel for good.")
    send_commands = sends.add_subparsers(dest="outbox_command", required=True,
                                         metavar="{failed,retry,discard}")
    failed = options.operator_parser(send_commands, "failed", "failed batches across users, newest first")
    failed.add_argument("--user", type=options.text, help="only this user's")
    _add_limit(failed, "batches")
    failed.set_defaults(run=cmd_outbox_failed)
    for verb, run, text in (
            ("retry", cmd_outbox_retry,
             "send failed batches again, under the same key, before the user's newer messages"),
            ("discard", cmd_outbox_discard,
             "delete failed batches (their bodies are kept in the audit record)")):
        repair = options.operator_parser(send_commands, verb, text,
                         f"{text[0].upper()}{text[1:]}. Only failed batches change: other ids are "
                         "listed with what they are and left alone (exit 1). Recorded in the "
                         "audit table.")
        repair.add_argument("ids", metavar="ID", nargs="+", type=options.positive,
                            help="batch ids (the number after ':' in a batch key)")
        _add_now(repair)
        repair.set_defaults(run=run)

    timers = options.operator_parser(commands, "timers", "a user's timers, the next to fire first")
    timers.add_argument("--user", type=options.text, required=True)
    _add_limit(timers, "timers")
    _add_now(timers)
    timers.set_defaults(run=cmd_timers)

    approve = options.operator_parser(
        commands, "approve", "answer an approval request and show the answer that stands",
        "Answer an approval request unless it is already answered or past its deadline, "
        "and print the answer that stands: yes, no or expired (exit 0, whether or not it "
        "is the answer given), or unknown for a request never made (exit 3).")
    approve.add_argument("user", type=options.text)
    approve.add_argument("request", type=options.text, help="the approval request id")
    approve.add_argument("answer", choices=("yes", "no"))
    _add_now(approve)
    approve.set_defaults(run=cmd_approve)

    memory = commands.add_parser("memory", help="read or change a user's memory",
                                 description="A user's memory: the JSON document its agent "
                                             "keeps between runs (ctx.memory).")
    memory_commands = memory.add_subparsers(dest="memory_command", required=True,
                                            metavar="{get,set,clear}")
    get = options.operator_parser(memory_commands, "get", "print a user's memory document (JSON)")
    get.add_argument("--user", type=options.text, required=True)
    get.set_defaults(run=cmd_memory_get)
    put = options.operator_parser(memory_commands, "set", "replace a user's memory with a JSON document",
                  "Replace a user's memory with the JSON document given (or read from "
                  "stdin with -). Refused (exit 2, nothing changed) while a run holds the "
                  "user's lease: its finish would replace the change. Recorded in the audit "
                  "table with the document replaced.")
    put.add_argument("--user", type=options.text, required=True)
    put.add_argument("document", help="a JSON document, or - to read it from stdin")
    _add_now(put)
    put.set_defaults(run=cmd_memory_set)
    clear = options.operator_parser(memory_commands, "clear", "delete a user's memory",
                    "Delete a user's memory, as `set` would (refused while a run holds the "
                    "lease; audited).")
    clear.add_argument("--user", type=options.text, required=True)
    _add_now(clear)
    clear.set_defaults(run=cmd_memory_clear)

    policy = commands.add_parser("policy", help="what ctx.permit answers for a tool",
                                 description="Rules that decide whether an agent's tool call "
                                             "may run: allow, deny, or ask (an approval request).")
    policy_commands = policy.add_subparsers(dest="policy_command", required=True,
                                            metavar="{set,clear,list,decisions}")
    for verb, text in (("set", "set the rule for a tool (`*`: every tool) of a user or the "
                               "default; applies to every call decided after it"),
                       ("clear", "remove a rule"),
                       ("list", "a user's rules, or the default rules")):
        command = options.operator_parser(policy_commands, verb, text,
                          f"{text[0].upper()}{text[1:]}. A call takes the user's rule for the "
                          "tool, else the user's `*`, else the default's for the tool, else the "
                          "default `*`, else deny. Changes are recorded in the audit table.")
        scope = command.add_mutually_exclusive_group(required=True)
        scope.add_argument("--user", type=options.text)
        scope.add_argument("--default", action="store_true", help="the rules for every user")
        if verb != "list":
            command.add_argument("--tool", type=options.text, required=True)
        if verb == "set":
            command.add_argument("answer", choices=("allow", "deny", "ask"))
            command.add_argument("--ask-expires-in", type=options.seconds, default=86400,
                                 help="how long an 'ask' approval waits (default 24h)")
            _add_now(command)
        command.set_defaults(run={"set": cmd_policy_set, "clear": cmd_policy_clear,
                                  "list": cmd_policy_list}[verb])
    decided = options.operator_parser(policy_commands, "decisions", "the answers a user's runs were given, "
                                                     "newest first")
    decided.add_argument("--user", type=options.text, required=True)
    _add_limit(decided, "decisions")
    decided.set_defaults(run=cmd_policy_decisions)

    audit = options.operator_parser(commands, "audit", "operators' recorded repairs, newest first",
                    "Every dead requeue and discard, recorded in the transaction that made it: "
                    "who, when, which event, and what it was before.")
    audit.add_argument("--user", type=options.text, help="only this user's")
    _add_limit(audit, "actions")
    audit.set_defaults(run=cmd_audit)

    prune = options.operator_parser(
        commands, "prune", "delete finished events, keeping keys inside the dedup window",
        "Delete done events created more than --older-than ago. An event still inside the "
        "dedup window (--dedup-window, default 7d: at least as long as any source may "
        "redeliver; Stripe retries for 3 days) keeps its row and key, so a redelivery is "
        "still a duplicate, and only loses its payload. Dead events are kept unless "
        "--include-dead. Progress goes to stderr.")
    prune.add_argument("--older-than", type=options.seconds, required=True,
                       help="age such as 30d, 12h, 90m or 3600 (seconds)")
    prune.add_argument("--dedup-window", type=options.seconds, default=7 * 86400,
                       help="keep keys this long after ingest (default 7d)")
    prune.add_argument("--include-dead", action="store_true", help="prune dead events too")
    _add_now(prune)
    prune.set_defaults(run=cmd_prune)


# --- running ------------------------------------------------------------------


@options.reports_errors("status")
def cmd_status(args: argparse.Namespace, name: str) -> int:
    with options.opened(args, name) as inbox:
        with db.connection(inbox.pool) as conn:
            report = admin.status(conn, args.limit, args.now)
        paused = inbox.pauses(limit=1)
    now, users, totals = report["now"], report["users"], report["totals"]
    rows = [[u["user"], u["pending"], u["running"], u["dead"], u["outbox_held"],
             u["outbox_failed"], u["lease_holder"], u["lease_gen"] or None, _lease_expiry(u),
             _paused(u["paused_at"], u["paused_reason"])]
            for u in users]
    lines = [_fleet_line(paused["fleet"])] if paused["fleet"] else []
    lines += [tables.format_table(["user", "pending", "running", "dead", "outbox held",
                                   "outbox failed", "lease holder", "gen", "lease expires",
                                   "paused"],
                                  rows)] if users else [
        "no user has pending, running or dead events, held messages, a lease or a pause"]
    lines.append(f"total: {totals['users']} users, {totals['pending']} pending, "
                 f"{totals['running']} running, {totals['dead']} dead, "
                 f"{totals['outbox_held']} outbox held, {totals['outbox_failed']} outbox failed")
    if paused["users_total"]:
        lines.append(f"paused: {paused['users_total']} users (`agent-inbox resume --user U`)")
    if len(users) < totals["users"]:
        lines.append(f"(showing the {len(users)} busiest of {totals['users']} users: --limit)")
    options.emit(args, {"now": now, "users": users, "totals": totals, "fleet": paused["fleet"],
                        "users_paused": paused["users_total"]}, "\n".join(lines))
    return 0


def _paused(paused_at: int | None, reason: str | None) -> str | None:
    if paused_at is None:
        return None
    return f"since {tables.when(paused_at)}" + (f": {reason}" if reason else "")


def _fleet_line(fleet: dict) -> str:
    return (f"THE FLEET IS PAUSED {_paused(fleet['paused_at'], fleet['reason'])} (by "
            f"{fleet['actor']}): no run starts, no message is sent (`agent-inbox resume --all`)")


def _lease_expiry(user: dict) -> str | None:
    if not user["lease_gen"]:
        return None  # never held
    return f"{tables.relative(user['lease_expires_in'])} ({tables.when(user['lease_until'])})"


@options.reports_errors("events")
def cmd_events(args: argparse.Namespace, name: str) -> int:
    with options.opened(args, name) as inbox, db.connection(inbox.pool) as conn:
        events, total = admin.events(conn, args.user, args.status, args.limit)
        recorded = steps.list_steps(conn, args.user, args.limit)
        held_by = admin.held_by_pause(conn, args.user)
    rows = [[e["id"], e["source"], e["source_id"], e["kind"], e["status"], e["attempts"],
             e["error"], tables.when(e["created_at"])] for e in events]
    what = f"{args.status} events" if args.status else "events"
    text = (tables.format_table(["id", "source", "source_id", "kind", "status", "attempts", "error",
                                 "created"], rows) if events else f"user {args.user!r} has no {what}")
    if len(events) < total:
        text += f"\n(showing the newest {len(events)} of {total} {what}: --limit)"
    if held_by["user"] or held_by["fleet"]:
        by = (f"the user's pause {_paused(*held_by['user'])}" if held_by["user"]
              else f"the fleet's pause {_paused(*held_by['fleet'])}")
        text += f"\n\nheld by {by}: its pending events run after `agent-inbox resume`"
    if recorded:  # runs in flight, or that have not finished successfully yet
        text += "\n\ndurable steps recorded:\n" + tables.format_table(
            ["events", "step", "gen", "holder", "recorded", "result"],
            [[",".join(map(str, s.event_ids)), s.label, s.gen, s.holder,
              tables.when(s.recorded_at), json.dumps(s.result)] for s in recorded])
    steps_out = [{"event_ids": list(s.event_ids), "position": s.position, "name": s.name,
                  "occurrence": s.occurrence, "gen": s.gen, "holder": s.holder,
                  "recorded_at": s.recorded_at, "result": s.result} for s in recorded]
    options.emit(args, {"user": args.user, "status": args.status, "total": total, "events": events,
                 "steps": steps_out, "held_by_pause": held_by}, text)
    return 0


@options.reports_errors("memory-get")
def cmd_memory_get(args: argparse.Namespace, name: str) -> int:
    with options.opened(args, name) as inbox:
        doc = inbox.memory(args.user)
    options.emit(args, {"user": args.user, "memory": doc},
          json.dumps(doc, indent=2, ensure_ascii=False) if doc is not None
          else f"user {args.user!r} has no memory")
    return 0


@options.reports_errors("memory-set")
def cmd_memory_set(args: argparse.Namespace, name: str) -> int:
    text = sys.stdin.read() if args.document == "-" else args.document
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise errors.InvalidInput("document", text, f"is not JSON: {exc}") from None
    return _change_memory(args, name, doc)


@options.reports_errors("memory-clear")
def cmd_memory_clear(args: argparse.Namespace, name: str) -> int:
    return _change_memory(args, name, None)


def _change_memory(args: argparse.Namespace, name: str, doc) -> int:
    with options.opened(args, name) as inbox:
        inbox.set_memory(args.user, doc, actor=options.actor(), now=args.now)
    action = "memory_clear" if doc is None else "memory_set"
    print(f"agent-inbox audit: {action} by {options.actor()} at {tables.when(int(time.time()))}: "
          f"user={args.user!r}", file=sys.stderr, flush=True)
    options.emit(args, {"user": args.user, "memory": doc},
          f"memory of user {args.user!r} " + ("cleared" if doc is None else "replaced"))
    return 0


@options.reports_errors("policy-set")
def cmd_policy_set(args: argparse.Namespace, name: str) -> int:
    with options.opened(args, name) as inbox:
        inbox.set_policy(args.tool, args.answer, user=args.user, actor=options.actor(),
                         ask_expires_in=args.ask_expires_in, now=args.now)
    scope = f"user {args.user!r}" if args.user else "the default"
    options.emit(args, {"user": args.user, "tool": args.tool, "answer": args.answer},
          f"{scope}: {args.tool} -> {args.answer}")
    return 0


@options.reports_errors("policy-clear")
def cmd_policy_clear(args: argparse.Namespace, name: str) -> int:
    with options.opened(args, name) as inbox:
        cleared = inbox.clear_policy(args.tool, user=args.user, actor=options.actor())
    scope = f"user {args.user!r}" if args.user else "the default"
    options.emit(args, {"user": args.user, "tool": args.tool, "cleared": cleared},
          f"{scope}: rule for {args.tool} " + ("removed" if cleared else "not found"))
    return 0 if cleared else 1


@options.reports_errors("policy-list")
def cmd_policy_list(args: argparse.Namespace, name: str) -> int:
    with options.opened(args, name) as inbox:
        rules = inbox.policies(args.user)
    rows = [[r["tool"], r["answer"], r["ask_expires_in"] if r["answer"] == "ask" else None,
             tables.when(r["updated_at"]), r["updated_by"]] for r in rules]
    scope = f"user {args.user!r}" if args.user else "the default"
    text = (tables.format_table(["tool", "answer", "ask waits (s)", "updated", "by"], rows)
            if rules else f"{scope} has no rules")
    options.emit(args, {"user": args.user, "rules": rules}, text)
    return 0


@options.reports_errors("policy-decisions")
def cmd_policy_decisions(args: argparse.Namespace, name: str) -> int:
    with options.opened(args, name) as inbox:
        decisions = inbox.permit_decisions(args.user, limit=args.limit)
    rows = [[tables.when(d["at"]), d["tool"], d["answer"], d["rule"], d["gen"],
             d["args_digest"][:12]] for d in decisions]
    text = (tables.format_table(["at", "tool", "answer", "rule", "gen", "args"], rows)
            if decisions else f"user {args.user!r} has no decisions")
    options.emit(args, {"user": args.user, "decisions": decisions}, text)
    return 0


@options.reports_errors("dead-list")
def cmd_dead_list(args: argparse.Namespace, name: str) -> int:
    with options.opened(args, name) as inbox, db.connection(inbox.pool) as conn:
        events, total = admin.dead(conn, args.user, args.limit)
    rows = [[e["user"], e["id"], e["source"], e["source_id"], e["attempts"], e["error"]]
            for e in events]
    text = (tables.format_table(["user", "id", "source", "source_id", "attempts", "error"], rows)
            if events else "no dead events" + (f" for user {args.user!r}" if args.user else ""))
    if len(events) < total:
        text += f"\n(showing the newest {len(events)} of {total} dead events: --limit)"
    options.emit(args, {"user": args.user, "total": total, "events": events}, text)
    return 0


@options.reports_errors("dead-requeue")
def cmd_dead_requeue(args: argparse.Namespace, name: str) -> int:
    return _repair(args, name, "requeue", "requeued", "(attempts 0, claimable now)",
                   lambda inbox, pairs: inbox.repair_dead(pairs, requeue=True, actor=options.actor(),
                                                          now=args.now))


@options.reports_errors("dead-discard")
def cmd_dead_discard(args: argparse.Namespace, name: str) -> int:
    return _repair(args, name, "discard", "discarded", "(their keys can be stored again)",
                   lambda inbox, pairs: inbox.repair_dead(pairs, requeue=False,
                                                          actor=options.actor()))


def _repair(args: argparse.Namespace, name: str, verb: str, done_word: str, note: str,
            apply) -> int:
    """Resolve the ids to users, then apply `verb` to the dead ones, admin_views.CHUNK ids
    per transaction; each chunk is audited on stderr once committed."""
    ids = sorted(set(args.ids))
    done: list[dict] = []
    with options.opened(args, name) as inbox:
        with db.connection(inbox.pool) as conn:
            found = admin.resolve(conn, ids, args.user)
        pairs = [(found[i][0], i) for i in ids if i in found]
        for start in range(0, len(pairs), admin_views.CHUNK):
            rows = apply(inbox, pairs[start:start + admin_views.CHUNK])  # a transaction each
            _audit(f"dead {verb}", rows)
            done += rows
            if len(pairs) > admin_views.CHUNK:
                print(f"dead {verb}: {min(start + admin_views.CHUNK, len(pairs))}/{len(pairs)} ids processed, "
                      f"{len(done)} {done_word}", file=sys.stderr, flush=True)
    done_ids = {row["id"] for row in done}
    left = [_left_alone(i, found.get(i), args.user) for i in ids if i not in done_ids]
    lines = []
    if done:
        lines += [f"{done_word} {len(done)} dead events {note}:",
                  tables.format_table(list(done[0]), [list(row.values()) for row in done])]
    if left:
        lines += [f"not {done_word} (left alone):",
                  tables.format_table(["id", "user", "reason"],
                               [[x["id"], x["user"], x["reason"]] for x in left])]
    lines.append(f"{done_word} {len(done)} of {len(ids)} ids; {len(left)} not {done_word}")
    options.emit(args, {"requested": len(ids), done_word: done, f"not_{done_word}": left},
          "\n".join(lines))
    return options.EXIT_NOT_ALL if left else 0


def _left_alone(event_id: int, found: tuple[str, str] | None, user: str | None) -> dict:
    if found is None:
        owner, state = None, None
        reason = "no such event" + (f" for user {user!r}" if user else "")
    else:
        owner, state = found
        reason = "no longer dead (changed meanwhile)" if state == "dead" else f"status {state}"
    return {"id": event_id, "user": owner, "status": state, "reason": reason}


def _audit(action: str, rows: list[dict]) -> None:
    """One line per event changed, on stderr, once its chunk committed (the
    durable record is the operator_actions table, written in the same commit)."""
    if not rows:
        return
    stamp = f"by {options.actor()} at {tables.when(int(time.time()))}"
    for row in rows:
        if "previous_attempts" in row:
            before = (f"previous attempts={row['previous_attempts']} "
                      f"previous error={row['previous_error']!r}")
        else:
            before = f"attempts={row['attempts']} error={row['error']!r}"
        print(f"agent-inbox audit: {action} {stamp}: user={row['user']!r} id={row['id']} "
              f"source={row['source']!r} source_id={row['source_id']!r} {before}",
              file=sys.stderr, flush=True)
    log.info("%s %s: %d events: %s", action, stamp, len(rows),
             ", ".join(f"{row['user']}/{row['id']}" for row in rows))


@options.reports_errors("audit")
def cmd_audit(args: argparse.Namespace, name: str) -> int:
    with options.opened(args, name) as inbox, db.connection(inbox.pool) as conn:
        rows = admin.actions(conn, args.user, args.limit)
    text = tables.format_table(
        ["when", "actor", "action", "user", "event", "detail"],
        [[tables.when(r["at"]), r["actor"], r["action"], r["user"], r["event_id"],
          json.dumps(r["detail"], sort_keys=True)] for r in rows]) if rows else "no recorded actions"
    options.emit(args, {"actions": rows}, text)
    return 0


@options.reports_errors("outbox-failed")
def cmd_outbox_failed(args: argparse.Namespace, name: str) -> int:
    with options.opened(args, name) as inbox, db.connection(inbox.pool) as conn:
        batches, total = outbox.failed_batches(conn, args.user, args.limit)
    rows = [[b["user"], b["batch"], b["messages"], tables.when(b["failed_at"]), b["error"]]
            for b in batches]
    text = (tables.format_table(["user", "batch", "messages", "failed", "error"], rows)
            if batches else "no failed batches" + (f" for user {args.user!r}" if args.user else ""))
    if len(batches) < total:
        text += f"\n(showing the newest {len(batches)} of {total} failed batches: --limit)"
    options.emit(args, {"user": args.user, "total": total, "batches": batches}, text)
    return 0


@options.reports_errors("outbox-retry")
def cmd_outbox_retry(args: argparse.Namespace, name: str) -> int:
    return _repair_batches(args, name, retry=True, done_word="retried")


@options.reports_errors("outbox-discard")
def cmd_outbox_discard(args: argparse.Namespace, name: str) -> int:
    return _repair_batches(args, name, retry=False, done_word="discarded")


def _repair_batches(args: argparse.Namespace, name: str, *, retry: bool, done_word: str) -> int:
    """Retry or discard the failed batches among the ids, in one transaction
    (recorded in operator_actions); the others are listed as what they are."""
    ids = sorted(set(args.ids))
    with options.opened(args, name) as inbox:
        done = inbox.repair_failed_batches(ids, retry=retry, actor=options.actor(), now=args.now)
        done_ids = {row["batch"] for row in done}
        with db.connection(inbox.pool) as conn:
            states = outbox.batch_states(conn, [i for i in ids if i not in done_ids])
    left = [{"batch": i, "reason": f"not failed: {states[i]}" if i in states else "no such batch"}
            for i in ids if i not in done_ids]
    for row in done:
        print(f"agent-inbox audit: outbox {'retry' if retry else 'discard'} by {options.actor()}: "
              f"user={row['user']!r} batch={row['batch']} messages={row['messages']} "
              f"error={row['error']!r}", file=sys.stderr, flush=True)
    lines = []
    if done:
        lines += [f"{done_word} {len(done)} failed batches:",
                  tables.format_table(["user", "batch", "messages", "error"],
                                      [[r["user"], r["batch"], r["messages"], r["error"]]
                                       for r in done])]
    if left:
        lines += [f"not {done_word} (left alone):",
                  tables.format_table(["batch", "reason"], [[x["batch"], x["reason"]] for x in left])]
    lines.append(f"{done_word} {len(done)} of {len(ids)} ids; {len(left)} not {done_word}")
    options.emit(args, {"requested": len(ids), done_word: done, f"not_{done_word}": left},
          "\n".join(lines))
    return options.EXIT_NOT_ALL if left else 0


@options.reports_errors("timers")
def cmd_timers(args: argparse.Namespace, name: str) -> int:
    with options.opened(args, name) as inbox, db.connection(inbox.pool) as conn:
        found, total = admin.timers(conn, args.user, args.limit, args.now)
    rows = [[t["timer_id"], tables.when(t["due"]), _repeats(t),
             "/".join(t["key"]) if t["key"] else None, t["state"],
             tables.relative(t["due_in"]) if t["state"] == "waiting" else None] for t in found]
    text = (tables.format_table(["timer", "due", "every", "key", "state", "next due"], rows)
            if found else f"user {args.user!r} has no timers")
    if len(found) < total:
        text += f"\n(showing {len(found)} of {total} timers: --limit)"
    parked = [t for t in found if t["state"] == "parked"]
    if parked:
        text += "\n\nparked (skipped by schedulers until add_timer replaces the timer):"
        text += "".join(f"\n  {t['timer_id']} since {tables.when(t['parked_at'])}: {t['error']}"
                        for t in parked)
    options.emit(args, {"user": args.user, "total": total, "timers": found}, text)
    return 0


def _repeats(timer: dict) -> str | None:
    """'1d', or the cron expression and its zone; None for a one-off."""
    if timer["cron"]:
        return f"cron {timer['cron']} ({timer['timezone']})"
    return tables.duration(timer["every"]) if timer["every"] else None


@options.reports_errors("approve")
def cmd_approve(args: argparse.Namespace, name: str) -> int:
    with options.opened(args, name) as inbox:
        standing = inbox.answer_approval(args.user, args.request, args.answer, now=args.now)
    document = {"user": args.user, "request": args.request, "answer": args.answer,
                "standing": standing, "stood": standing == args.answer}
    options.emit(args, document, admin_views.describe_answer(args.user, args.request, args.answer, standing))
    return options.EXIT_UNKNOWN if standing == "unknown" else 0


@options.reports_errors("prune")
def cmd_prune(args: argparse.Namespace, name: str) -> int:
    def progress(users: int, deleted: int, compacted: int) -> None:
        print(f"prune: {users} users, {deleted} deleted, {compacted} emptied", file=sys.stderr)

    with options.opened(args, name) as inbox:
        deleted, compacted = inbox.prune(older_than=args.older_than,
                                         dedup_window=args.dedup_window,
                                         include_dead=args.include_dead, now=args.now,
                                         progress=progress)
    options.emit(args, {"deleted": deleted, "emptied": compacted},
          f"deleted {deleted} events; emptied {compacted} inside the dedup window (keys kept)")
    return 0
