"""`agent-inbox limits set NAME --rate N --per SECONDS [--burst B]` and
`agent-inbox limits list`: the fleet's rate budgets (limits.py), kept in the
database, so a change reaches every worker at its next grant (within a second
for a worker that has callers waiting).

`set` makes the limit or changes it: `--rate` tokens per `--per` seconds, at
most `--burst` at once (default: the rate). A new limit starts full; a changed
one keeps what its bucket holds, no more than the new burst. The row records
who changed it and when (`updated_by`, `updated_at`), and an audit line goes to
stderr. Exit 2 for bad input (nothing changed).
"""

import argparse
import sys

from agent_inbox.api import limits
from agent_inbox import tables
from agent_inbox.cli import options


def add_parser(commands) -> None:
    group = commands.add_parser("limits", help="set or list the fleet's rate limits (ctx.limit)",
                                description=__doc__.split("\n\n")[0])
    verbs = group.add_subparsers(dest="limits_command", required=True, metavar="{set,list}")
    setting = options.operator_parser(verbs, "set", "make or change a limit shared by every worker",
                      __doc__.split("\n\n")[1])
    setting.add_argument("name", type=options.text, metavar="NAME")
    setting.add_argument("--rate", type=options.positive, required=True, help="tokens per period")
    setting.add_argument("--per", type=options.positive, required=True, metavar="SECONDS",
                         help="the period, in seconds")
    setting.add_argument("--burst", type=options.positive, default=None,
                         help="most tokens at once, after a quiet spell (default: the rate)")
    setting.set_defaults(run=cmd_limits_set)
    listing = options.operator_parser(verbs, "list", "every limit, with what its bucket holds now")
    listing.set_defaults(run=cmd_limits_list)



@options.reports_errors("limits-set")
def cmd_limits_set(args: argparse.Namespace, name: str) -> int:
    actor = options.actor()
    limits.check_limit(args.name, args.rate, args.per, args.burst)  # before any connection
    with options.opened(args, name) as inbox:
        change = limits.set_limit(inbox, args.name, args.rate, args.per, args.burst, actor=actor)
    before, after = change["before"], change["after"]
    was = describe(before) if before else "new"
    print(f"agent-inbox audit: limits set by {actor}: {args.name!r} {describe(after)} "
          f"(was {was})", file=sys.stderr, flush=True)
    options.emit(args, change, f"limit {args.name!r}: {describe(after)} (was {was}); every worker "
                        "uses it from its next grant")
    return 0


@options.reports_errors("limits-list")
def cmd_limits_list(args: argparse.Namespace, name: str) -> int:
    with options.opened(args, name) as inbox:
        found = limits.list_limits(inbox)
    text = tables.format_table(
        ["name", "rate", "per (s)", "burst", "tokens now", "updated", "by"],
        [[x["name"], x["rate"], x["per_seconds"], x["burst"], f"{x['tokens']:.1f}",
          tables.when(x["updated_at"]), x["updated_by"]] for x in found]) if found else (
        "no limits: make one with agent-inbox limits set NAME --rate N --per SECONDS")
    options.emit(args, {"limits": found}, text)
    return 0


def describe(limit: dict) -> str:
    return f"{limit['rate']} per {limit['per_seconds']} s, burst {limit['burst']}"
