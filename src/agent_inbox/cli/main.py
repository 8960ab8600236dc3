"""`agent-inbox`: a thin shell over the programmatic API.

Every option can also be given as an environment variable AGENT_INBOX_<OPTION>
(for example AGENT_INBOX_DATABASE_URL); a flag on the command line wins.
"""

import argparse
import os
import sys

from agent_inbox import errors
from agent_inbox.cli import limits as limits_command, operator, options, stopping
from agent_inbox.cli import console as console_command
from agent_inbox.cli import intake as ingest_command


def cmd_migrate(args: argparse.Namespace) -> int:
    from agent_inbox.schema import migrate, revision

    if args.sql:
        sys.stdout.write(migrate.upgrade_sql(args.revision))
        return 0
    if not args.database_url:
        raise errors.InvalidInput("--database-url", None, "is required (or AGENT_INBOX_DATABASE_URL)")
    current = revision.current_revision(args.database_url, pooler=args.pooler)
    if current is not None and current not in revision.KNOWN:
        print(f"database at revision {current}, newer than this agent-inbox knows "
              f"({revision.HEAD}): nothing to do")
        return 0
    if args.citus:
        from agent_inbox.backend.citus import layout as citus

        if args.revision != "head":
            raise errors.InvalidInput("--revision", args.revision, "must be head with --citus")
        citus.require_coordinator(args.database_url)
    migrate.upgrade(args.database_url, args.revision, pooler=args.pooler)
    now_at = revision.current_revision(args.database_url, pooler=args.pooler)
    print(f"database at revision {now_at}")
    if args.citus:
        done = citus.distribute(args.database_url)
        print(f"tables distributed by bucket over the Citus cluster"
              f"{'' if done else ' (already)'}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from agent_inbox.dev import demo

    demo.main(args.database_url, pooler=args.pooler)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from agent_inbox.services.worker import supervisor

    for flag in ("isolation", "max_users_per_take"):
        if getattr(args, flag) is not None:
            raise errors.InvalidInput(f"--{flag.replace('_', '-')}", getattr(args, flag),
                                      REMOVED_WORKER_FLAGS)
    holder = os.environ.get(supervisor.HOLDER_ENV)
    if holder is None:  # the supervisor: it runs the runtime below in a child
        return supervisor.supervise(args.argv)
    try:
        return run_worker_runtime(args, holder)
    except errors.AgentInboxError as exc:
        print(f"agent-inbox: {exc}", file=sys.stderr)
        return supervisor.EXIT_REFUSED


def run_worker_runtime(args: argparse.Namespace, holder: str) -> int:
    """The worker runtime, in the supervisor's child (see supervisor.py)."""
    from agent_inbox.services.worker import blame, supervisor
    from agent_inbox import metrics
    from agent_inbox.services.service import Stop
    from agent_inbox.services.worker import POOL_SIZE, Worker

    stop = Stop().install(only_from=os.getppid())
    inbox = options.open_service_inbox(args, POOL_SIZE, stop=stop, lease_ttl=args.lease_ttl,
                               max_attempts=args.max_attempts, retry_backoff=args.retry_backoff,
                               max_batch=args.max_batch)
    if inbox is None:
        return 0
    predecessor = os.environ.get(supervisor.PREDECESSOR_ENV)
    with inbox:
        # Checked by the first runtime only: a later one starts after a crash,
        # maybe while the server restarts, and must not end the worker for that.
        listen = options.listen_url(args, check=predecessor is None)
        slot = os.environ.get(supervisor.SLOT_ENV)
        worker = Worker(inbox, args.app or args.handler, concurrency=args.concurrency,
                        poll_interval=args.poll_interval, grace=args.grace,
                        run_timeout=args.run_timeout, quarantine=args.quarantine, holder=holder,
                        stop=stop, max_memory=args.max_memory, horizon_warn=args.horizon_warn,
                        compact_held_for=args.compact_held_for,
                        slot=blame.Slot(int(slot)) if slot else None)
        if predecessor is None:
            require_memory_room(worker)
        metrics.RECYCLES.inc(int(os.environ.get(supervisor.RECYCLES_ENV, "0")))
        worker.serve(listen, predecessor=predecessor,
                     predecessor_fate=os.environ.get(supervisor.FATE_ENV, "died"),
                     suspect=blame.parse(os.environ.get(supervisor.SUSPECT_ENV)))
    return supervisor.EXIT_RECYCLE if worker.recycled and not stop.signalled else 0


def require_memory_room(worker) -> None:
    """--max-memory must leave room above what the runtime holds at start
    (its handler imported): else every runtime would be recycled at once."""
    from agent_inbox.services.worker import rss_mib

    rss = rss_mib()
    if worker.max_memory is not None and rss >= worker.max_memory:
        raise errors.InvalidInput("--max-memory", worker.max_memory,
                                  f"must be above the runtime's memory at start ({rss:.0f} MiB)")


# The worker's default --concurrency: agents mostly wait (on an LLM, on HTTP),
# so a process runs many at once; a plain handler's runs are that many threads.
WORKER_CONCURRENCY = 100

REMOVED_WORKER_FLAGS = (
    "was removed: a worker now runs up to --concurrency runs in one process (async handlers "
    "on one event loop, plain ones on threads), takes exactly as many users as it has room "
    "for, and runs a run whose last attempt ended without a finish alone in a quarantine "
    "process (--quarantine N); drop the flag")


def cmd_scheduler(args: argparse.Namespace) -> int:
    from agent_inbox.services.scheduler import Scheduler
    from agent_inbox.services.service import Stop

    stop = Stop().install()
    with options.open_service_inbox(args, 2) as inbox:
        Scheduler(inbox, poll_interval=args.poll_interval, stop=stop).serve(options.listen_url(args))
    return 0


def cmd_dispatcher(args: argparse.Namespace) -> int:
    from agent_inbox.agent import handler
    from agent_inbox.services.dispatcher import Dispatcher
    from agent_inbox.services.service import Stop

    channel = handler.load(args.channel, what="channel")
    if args.concurrency < 1:
        raise errors.InvalidInput("--concurrency", args.concurrency, "must be at least 1")
    stop = Stop().install()
    # one connection claims and records, one scans; sends hold none
    with options.open_service_inbox(args, 2, outbox_gap=args.outbox_gap, send_timeout=args.send_timeout,
                            max_send_attempts=args.max_send_attempts,
                            send_backoff=args.send_backoff) as inbox:
        Dispatcher(inbox, channel, concurrency=args.concurrency, poll_interval=args.poll_interval,
                   at_most_once=args.at_most_once, stop=stop).serve(options.listen_url(args))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agent-inbox", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    migrate = commands.add_parser("migrate", help="upgrade the schema to the newest revision")
    options.add_database_url(migrate, required=True)
    migrate.add_argument("--sql", action="store_true",
                         help="print the SQL instead of running it (no database needed)")
    migrate.add_argument("--revision", default="head", help="target revision (default: head)")
    migrate.add_argument("--citus", action="store_true", default=options.env_flag("citus"),
                         help="the database is a Citus coordinator's: distribute every table "
                              "by bucket (see README, Citus; env AGENT_INBOX_CITUS)")
    migrate.set_defaults(run=cmd_migrate)

    demo = commands.add_parser("demo", help="run the eight failure scenarios of the reference")
    options.add_database_url(demo, required=False)
    demo.set_defaults(run=cmd_demo)

    worker = options.service_parser(commands, "worker", "run handlers for users with work", 1.0)
    agent = worker.add_mutually_exclusive_group(
        required=not (options.env_default("handler") or options.env_default("app")))
    agent.add_argument("--app", default=options.env_default("app"),
                       help="module:attribute naming an agent_inbox.App (its handler, hooks and "
                            "declared defaults)")
    agent.add_argument("--handler", default=options.env_default("handler"),
                       help="module:function called as handle(batch, ctx): an App of that "
                            "handler alone")
    worker.add_argument("--concurrency", type=int,
                        default=options.env_default("concurrency", WORKER_CONCURRENCY),
                        help=f"users' runs at once in this process (default {WORKER_CONCURRENCY}): "
                             "an async handler's runs share one event loop, a plain handler's "
                             "each run on a thread of its own (up to that many threads: lower it "
                             "for CPU-bound or thread-unsafe plain handlers); the process uses "
                             "4 database connections whatever this is")
    worker.add_argument("--lease-ttl", type=int, default=options.env_default("lease-ttl", 120),
                        help="seconds a lease lasts without renewal (default 120)")
    worker.add_argument("--max-attempts", type=int, default=options.env_default("max-attempts", 3))
    worker.add_argument("--retry-backoff", type=int, default=options.env_default("retry-backoff", 5),
                        help="first retry's backoff in seconds, doubling per attempt (default 5)")
    worker.add_argument("--grace", type=float, default=options.env_default("grace", 30.0),
                        help="seconds running handlers get to finish on SIGTERM (default 30)")
    worker.add_argument("--run-timeout", type=float, default=options.env_default("run-timeout", 900.0),
                        help="seconds a run may take before it is stopped and its lease "
                             "released, the attempt counted (default 900)")
    worker.add_argument("--max-batch", type=int, default=options.env_default("max-batch", 100),
                        help="most events one run claims (default 100)")
    worker.add_argument("--quarantine", type=int, default=options.env_default("quarantine", 2),
                        help="processes that run, each alone, the runs whose last attempt ended "
                             "without a finish (default 2)")
    worker.add_argument("--max-memory", type=int, default=options.env_default("max-memory"),
                        metavar="MiB",
                        help="recycle the runtime when its resident memory passes this many MiB: "
                             "it stops taking work, its runs end within --grace, and a fresh one "
                             "starts (default: off)")
    worker.add_argument("--horizon-warn", type=float, default=options.env_default("horizon-warn", 60.0),
                        help="warn when a transaction held open elsewhere has held VACUUM back "
                             "this many seconds (checked every 30 s; 0: no check; README: A "
                             "transaction held open elsewhere)")
    worker.add_argument("--compact-held-for", type=float,
                        default=options.env_default("compact-held-for"), metavar="SECONDS",
                        help="rotate wakes and rewrite leases without their dead tuples only while "
                             "something has held VACUUM back this many seconds (default: "
                             "whenever their dead tuples call for it; this spares a burst "
                             "about 8 %%, but lets dead wakes build up between autovacuum's "
                             "passes under a steady load)")
    worker.add_argument("--isolation", default=None, help=argparse.SUPPRESS)
    worker.add_argument("--max-users-per-take", default=None, help=argparse.SUPPRESS)
    worker.set_defaults(run=cmd_worker)

    scheduler = options.service_parser(commands, "scheduler", "turn due timers into inbox events", 5.0)
    scheduler.set_defaults(run=cmd_scheduler)

    dispatcher = options.service_parser(commands, "dispatcher", "send held outbox messages, paced", 5.0)
    dispatcher.add_argument("--channel", default=options.env_default("channel"), required=not options.env_default("channel"),
                            help="module:function called as send(user, text, key), imported "
                                 "from the current folder as python -m would")
    dispatcher.add_argument("--outbox-gap", type=int, default=options.env_default("outbox-gap", 3600),
                            help="least seconds between two sends to one user (default 3600: a "
                                 "second reply within the hour waits; an urgent message goes at "
                                 "once); a lower gap applies to messages already held too")
    dispatcher.add_argument("--concurrency", type=int, default=options.env_default("concurrency", 16),
                            help="users' batches sent at once, each on a thread with no database "
                                 "connection held (default 16)")
    dispatcher.add_argument("--send-timeout", type=int, default=options.env_default("send-timeout", 120),
                            help="seconds a send may take before another dispatcher sends its "
                                 "batch again under the same key (default 120; keep the "
                                 "channel's own timeout below it)")
    dispatcher.add_argument("--max-send-attempts", type=int,
                            default=options.env_default("max-send-attempts", 10),
                            help="failed sends before a batch is parked failed (default 10)")
    dispatcher.add_argument("--send-backoff", type=int, default=options.env_default("send-backoff", 5),
                            help="seconds before a failed batch is retried, doubling per "
                                 "failure up to 300, jittered (default 5)")
    dispatcher.add_argument("--at-most-once", action="store_true",
                            default=options.env_flag("at-most-once"),
                            help="mark a batch sent before sending it (a crash loses it) instead "
                                 "of after (a crash resends it, under the same key)")
    dispatcher.set_defaults(run=cmd_dispatcher)

    ingest_command.add_parser(commands)
    console_command.add_parser(commands)
    operator.add_parsers(commands)
    stopping.add_parsers(commands)
    limits_command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.run(args)
    except errors.AgentInboxError as exc:
        print(f"agent-inbox: {exc}", file=sys.stderr)
        return 2

