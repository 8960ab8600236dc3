"""Stopping an agent: `agent-inbox pause`, `resume` and `cancel`
(store/pauses.py; docs/operating/stopping.md).

    agent-inbox pause  --user U [--reason TEXT] [--cancel]
    agent-inbox pause  --all    [--reason TEXT] [--cancel]
    agent-inbox resume --user U | --all
    agent-inbox cancel --user U [--reason TEXT]

Each change is recorded in operator_actions with its actor (login@host) and
reason, and written to stderr as an audit line. Exit codes as the operator
commands': 0 done (also when there was nothing to change: said so), 2 bad
input (an empty or unknown user, --all with --user, a reason over 1000
bytes) with nothing changed.
"""

import argparse
import sys

from agent_inbox import tables
from agent_inbox.cli import options
from agent_inbox.store.pauses import MAX_REASON_BYTES


def _add_target(parser, verb: str) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--user", type=options.text, help=f"{verb} this user's agent")
    target.add_argument("--all", action="store_true", help=f"{verb} the whole fleet")


def _add_reason(parser) -> None:
    parser.add_argument("--reason", default=None,
                        help=f"why, recorded in the audit table (at most {MAX_REASON_BYTES} bytes)")


def _add_now(parser) -> None:
    parser.add_argument("--now", type=options.epoch, default=None,
                        help="the current time in epoch seconds, for tests (default: the "
                             "database server's clock)")


def add_parsers(commands) -> None:
    """Add pause, resume and cancel to an argparse subparsers object."""
    pause = options.operator_parser(
        commands, "pause", "stop a user's agent, or the fleet, from running",
        "Pause a user: its events are still stored (deduplicated as usual), its timers "
        "still fire and its approvals can still be answered, but no run of it starts and "
        "its outbox messages are held until `resume` (a batch already handed to the channel "
        "is not recalled). A run in flight goes on to its end unless --cancel. With --all, "
        "the fleet: no run starts on any worker and no dispatcher sends, within seconds.")
    _add_target(pause, "pause")
    _add_reason(pause)
    pause.add_argument("--cancel", action="store_true",
                       help="also cancel the run in flight (each run's, with --all): its lease "
                            "is fenced off, nothing it would commit commits, its events are "
                            "pending again with the attempt undone, its steps kept")
    _add_now(pause)
    pause.set_defaults(run=cmd_pause)

    resume = options.operator_parser(
        commands, "resume", "let a paused user's agent, or the fleet, run again",
        "Resume a paused user (its events run and its held messages are sent, in order) "
        "or, with --all, the fleet.")
    _add_target(resume, "resume")
    _add_now(resume)
    resume.set_defaults(run=cmd_resume)

    cancel = options.operator_parser(
        commands, "cancel", "cancel a user's run in flight, without pausing it",
        "Fence off the run holding the user's lease: its renewal, step records and finish "
        "are refused, its worker stops its handler within seconds, and its events are "
        "pending again with the attempt undone, so the next take runs them again "
        "(completed durable steps are not called again). Use `pause --cancel` to stop it "
        "for good.")
    cancel.add_argument("--user", type=options.text, required=True)
    _add_reason(cancel)
    _add_now(cancel)
    cancel.set_defaults(run=cmd_cancel)


def _audit(action: str, **fields) -> None:
    shown = " ".join(f"{key}={value!r}" for key, value in fields.items() if value is not None)
    print(f"agent-inbox audit: {action} by {options.actor()}: {shown}", file=sys.stderr,
          flush=True)


def _cancelled_text(cancelled: dict | None) -> str:
    if not cancelled:
        return "no run was in flight"
    return (f"the run in flight (generation {cancelled['gen']}) is cancelled; its "
            f"{len(cancelled['events'])} events are pending again")


@options.reports_errors("pause")
def cmd_pause(args: argparse.Namespace, name: str) -> int:
    actor = options.actor()
    with options.opened(args, name) as inbox:
        if args.all:
            done = inbox.pause_fleet(actor=actor, reason=args.reason, cancel=args.cancel,
                                     now=args.now)
            text = ("the fleet was already paused" if done["already"]
                    else "the fleet is paused: no run starts and no message is sent until "
                         "`agent-inbox resume --all`")
            if args.cancel:
                text += f"; {len(done['cancelled'])} runs in flight cancelled"
            if not done["already"] or done["cancelled"]:
                _audit("fleet_pause", reason=args.reason, cancelled=len(done["cancelled"]))
        else:
            done = inbox.pause(args.user, actor=actor, reason=args.reason, cancel=args.cancel,
                               now=args.now)
            text = (f"user {args.user!r} was already paused (since "
                    f"{tables.when(done['paused_at'])})" if done["already"]
                    else f"user {args.user!r} is paused")
            if args.cancel:
                text += f"; {_cancelled_text(done['cancelled'])}"
            if not done["already"] or done["cancelled"]:
                _audit("pause", user=args.user, reason=args.reason,
                       cancelled_gen=(done["cancelled"] or {}).get("gen"))
    options.emit(args, done, text)
    return 0


@options.reports_errors("resume")
def cmd_resume(args: argparse.Namespace, name: str) -> int:
    actor = options.actor()
    with options.opened(args, name) as inbox:
        if args.all:
            done = inbox.resume_fleet(actor=actor, now=args.now)
            text = "the fleet is resumed" if done["resumed"] else "the fleet was not paused"
            if done["resumed"]:
                _audit("fleet_resume")
        else:
            done = inbox.resume(args.user, actor=actor, now=args.now)
            text = (f"user {args.user!r} is resumed" if done["resumed"]
                    else f"user {args.user!r} was not paused")
            if done["resumed"]:
                _audit("resume", user=args.user)
    options.emit(args, done, text)
    return 0


@options.reports_errors("cancel")
def cmd_cancel(args: argparse.Namespace, name: str) -> int:
    with options.opened(args, name) as inbox:
        done = inbox.cancel(args.user, actor=options.actor(), reason=args.reason, now=args.now)
    if done["cancelled"]:
        _audit("cancel", user=args.user, reason=args.reason, gen=done["cancelled"]["gen"])
    options.emit(args, done, f"user {args.user!r}: {_cancelled_text(done['cancelled'])}")
    return 0
