"""`agent-inbox`: a thin shell over the programmatic API.

Every option can also be given as an environment variable AGENT_INBOX_<OPTION>
(for example AGENT_INBOX_DATABASE_URL); a flag on the command line wins.
"""

import argparse
import logging
import os
import sys

from agent_inbox import citus, db, errors, limits_command, operator
from agent_inbox.console import command as console_command
from agent_inbox.ingest import command as ingest_command


def env_default(option: str, default=None):
    return os.environ.get("AGENT_INBOX_" + option.upper().replace("-", "_"), default)


def env_flag(option: str) -> bool:
    """A switch's default: AGENT_INBOX_<OPTION> set to anything but '', '0' or 'false'."""
    return env_default(option, "").lower() not in ("", "0", "false")


def pooler_name(value: str) -> str:
    if value not in db.POOLERS:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {value!r} (choose from {', '.join(db.POOLERS)})")
    return value


URL_SCHEMES = ("postgresql", "postgres")


def database_url(value: str) -> str:
    """A --database-url (or --listen-url) as libpq reads it, checked before any
    command connects: a `postgresql://` (or `postgres://`) URL or a `key=value`
    connection string. Anything else is bad configuration: argparse's message
    and exit 2, whichever command or service (a worker does not start a
    runtime for it). The value is not echoed: it may hold a password."""
    from psycopg import conninfo

    if not value:
        return value  # none: the command says whether it needs one
    scheme, sep, _ = value.partition("://")
    if sep and scheme.lower() not in URL_SCHEMES:
        raise argparse.ArgumentTypeError(
            f"not a PostgreSQL URL: its scheme is {scheme[:20]!r}, not postgresql:// or "
            "postgres:// (or give a libpq string such as 'host=db dbname=app user=app')")
    try:
        conninfo.conninfo_to_dict(value)
    except Exception as exc:
        problem = str(exc).strip().replace(value, "...") or type(exc).__name__
        raise argparse.ArgumentTypeError(
            f"not a PostgreSQL URL or libpq connection string ({problem})") from None
    return value


def add_database_url(parser: argparse.ArgumentParser, *, required: bool) -> None:
    """--database-url, and --pooler: what sits between it and PostgreSQL."""
    parser.add_argument(
        "--database-url", default=env_default("database-url"), type=database_url,
        help="PostgreSQL URL or libpq connection string (env AGENT_INBOX_DATABASE_URL)"
             + ("" if required else "; without one, a throwaway local cluster is used"))
    parser.add_argument(
        "--pooler", type=pooler_name, choices=db.POOLERS, default=env_default("pooler", "none"),
        help="'transaction' when --database-url is a transaction pooler's (PgBouncer "
             "pool_mode = transaction): no server-side prepared statements, and no LISTEN "
             "but through --listen-url (default none; env AGENT_INBOX_POOLER)")


def cmd_migrate(args: argparse.Namespace) -> int:
    from agent_inbox import migrate, revision

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
        from agent_inbox import citus

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
    from agent_inbox import demo

    demo.main(args.database_url, pooler=args.pooler)
    return 0


def open_service_inbox(args: argparse.Namespace, pool_size: int, *, stop=None, **options):
    """Logging, the schema check (refuse to start on a schema not at head), the pool.
    With `stop`, a database that refuses connections (down, or too many clients)
    is waited for, with backoff, until it answers or `stop` is set (then None)."""
    from agent_inbox import Inbox, revision
    from agent_inbox.service import backoff_delays

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if not args.database_url:
        raise errors.InvalidInput("--database-url", None, "is required (or AGENT_INBOX_DATABASE_URL)")
    delays = backoff_delays()
    while True:
        try:
            revision.require_head(args.database_url, pooler=args.pooler)
            timeout = getattr(args, "statement_timeout", db.DEFAULT_STATEMENT_TIMEOUT) or None
            inbox = Inbox.connect(args.database_url, pool_size=pool_size, pooler=args.pooler,
                                  application_name=f"agent-inbox-{args.command}",
                                  statement_timeout=timeout,
                                  connect_timeout=timeout or db.DEFAULT_CONNECT_TIMEOUT,
                                  citus_nodes=args.citus_nodes, **options)
            break
        except errors.DatabaseUnavailable as exc:
            if stop is None:
                raise
            pause = next(delays)
            logging.getLogger("agent_inbox").warning(
                "database unavailable at start (%s); retrying in %.1f s", exc, pause)
            if stop.wait(pause):
                return None
    if args.metrics_port:
        from agent_inbox import metrics

        metrics.serve(args.metrics_port, inbox.pool, args.metrics_host)
    return inbox


def listen_url(args: argparse.Namespace, *, check: bool = True) -> str | None:
    """Where a service LISTENs for wake-ups: --listen-url, which must answer at
    start (with `check`; else InvalidInput: exit 2); without one, the database
    URL, unless that is a transaction pooler's, which cannot carry LISTEN: then
    None, and the service polls every --poll-interval."""
    from agent_inbox.service import check_answers

    if args.listen_url:
        if check:
            check_answers(args.listen_url, "--listen-url")
        return args.listen_url
    if args.pooler == "none":
        return args.database_url
    logging.getLogger("agent_inbox").info(
        "--pooler %s and no --listen-url: no LISTEN, polling every %s s", args.pooler,
        args.poll_interval)
    return None


def cmd_worker(args: argparse.Namespace) -> int:
    from agent_inbox import supervisor

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
    from agent_inbox import blame, metrics, supervisor
    from agent_inbox.service import Stop
    from agent_inbox.worker import POOL_SIZE, Worker

    stop = Stop().install(only_from=os.getppid())
    inbox = open_service_inbox(args, POOL_SIZE, stop=stop, lease_ttl=args.lease_ttl,
                               max_attempts=args.max_attempts, retry_backoff=args.retry_backoff,
                               max_batch=args.max_batch)
    if inbox is None:
        return 0
    predecessor = os.environ.get(supervisor.PREDECESSOR_ENV)
    with inbox:
        # Checked by the first runtime only: a later one starts after a crash,
        # maybe while the server restarts, and must not end the worker for that.
        listen = listen_url(args, check=predecessor is None)
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
    from agent_inbox.worker import rss_mib

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
    from agent_inbox.scheduler import Scheduler
    from agent_inbox.service import Stop

    stop = Stop().install()
    with open_service_inbox(args, 2) as inbox:
        Scheduler(inbox, poll_interval=args.poll_interval, stop=stop).serve(listen_url(args))
    return 0


def cmd_dispatcher(args: argparse.Namespace) -> int:
    from agent_inbox import handler
    from agent_inbox.dispatcher import Dispatcher
    from agent_inbox.service import Stop

    channel = handler.load(args.channel, what="channel")
    if args.concurrency < 1:
        raise errors.InvalidInput("--concurrency", args.concurrency, "must be at least 1")
    stop = Stop().install()
    # one connection claims and records, one scans; sends hold none
    with open_service_inbox(args, 2, outbox_gap=args.outbox_gap, send_timeout=args.send_timeout,
                            max_send_attempts=args.max_send_attempts,
                            send_backoff=args.send_backoff) as inbox:
        Dispatcher(inbox, channel, concurrency=args.concurrency, poll_interval=args.poll_interval,
                   at_most_once=args.at_most_once, stop=stop).serve(listen_url(args))
    return 0


def add_service_options(parser: argparse.ArgumentParser) -> None:
    """--database-url, --pooler, --log-level, --metrics-port and --metrics-host: what
    every service takes."""
    add_database_url(parser, required=True)
    parser.add_argument("--log-level", default=env_default("log-level", "info"),
                        choices=["debug", "info", "warning", "error"])
    parser.add_argument("--metrics-port", type=int, default=env_default("metrics-port", 0),
                        help="serve Prometheus metrics on this port (default: off)")
    parser.add_argument(
        "--statement-timeout", type=float,
        default=float(env_default("statement-timeout", db.DEFAULT_STATEMENT_TIMEOUT)),
        help="seconds the service waits for any one answer of the database (a statement, a "
             "commit) before it gives up on it, and a new connection may take to open; on "
             "Citus also the coordinator's to a worker node: a node that hangs holds up "
             "only its own users; 0 for no bound (default 5; env "
             "AGENT_INBOX_STATEMENT_TIMEOUT)")
    parser.add_argument(
        "--citus-nodes", choices=citus.NODES, default=env_default("citus-nodes", "coordinator"),
        help="on Citus, where the run path's take and finish calls go: through the "
             "coordinator, or 'direct' to the worker node that holds each bucket (at the "
             "address the coordinator has for it: the nodes must be reachable from here); "
             "the coordinator still carries the rest (default coordinator; env "
             "AGENT_INBOX_CITUS_NODES)")
    parser.add_argument("--metrics-host", default=env_default("metrics-host", "127.0.0.1"),
                        help="address the metrics listen on (default 127.0.0.1; 0.0.0.0 for "
                             "every interface)")


def _service_parser(commands, name: str, help_text: str, poll_default: float):
    parser = commands.add_parser(name, help=help_text)
    add_service_options(parser)
    parser.add_argument("--poll-interval", type=float, default=env_default("poll-interval", poll_default),
                        help=f"seconds between polls when no notification comes (default {poll_default})")
    parser.add_argument("--listen-url", default=env_default("listen-url"), type=database_url,
                        help="a direct PostgreSQL URL (not a transaction pooler's) to LISTEN on "
                             "for wake-ups; default: --database-url, or none with --pooler "
                             "transaction, and the service polls (env AGENT_INBOX_LISTEN_URL)")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agent-inbox", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    migrate = commands.add_parser("migrate", help="upgrade the schema to the newest revision")
    add_database_url(migrate, required=True)
    migrate.add_argument("--sql", action="store_true",
                         help="print the SQL instead of running it (no database needed)")
    migrate.add_argument("--revision", default="head", help="target revision (default: head)")
    migrate.add_argument("--citus", action="store_true", default=env_flag("citus"),
                         help="the database is a Citus coordinator's: distribute every table "
                              "by bucket (see README, Citus; env AGENT_INBOX_CITUS)")
    migrate.set_defaults(run=cmd_migrate)

    demo = commands.add_parser("demo", help="run the eight failure scenarios of the reference")
    add_database_url(demo, required=False)
    demo.set_defaults(run=cmd_demo)

    worker = _service_parser(commands, "worker", "run handlers for users with work", 1.0)
    agent = worker.add_mutually_exclusive_group(
        required=not (env_default("handler") or env_default("app")))
    agent.add_argument("--app", default=env_default("app"),
                       help="module:attribute naming an agent_inbox.App (its handler, hooks and "
                            "declared defaults)")
    agent.add_argument("--handler", default=env_default("handler"),
                       help="module:function called as handle(batch, ctx): an App of that "
                            "handler alone")
    worker.add_argument("--concurrency", type=int,
                        default=env_default("concurrency", WORKER_CONCURRENCY),
                        help=f"users' runs at once in this process (default {WORKER_CONCURRENCY}): "
                             "an async handler's runs share one event loop, a plain handler's "
                             "each run on a thread of its own (up to that many threads: lower it "
                             "for CPU-bound or thread-unsafe plain handlers); the process uses "
                             "4 database connections whatever this is")
    worker.add_argument("--lease-ttl", type=int, default=env_default("lease-ttl", 120),
                        help="seconds a lease lasts without renewal (default 120)")
    worker.add_argument("--max-attempts", type=int, default=env_default("max-attempts", 3))
    worker.add_argument("--retry-backoff", type=int, default=env_default("retry-backoff", 5),
                        help="first retry's backoff in seconds, doubling per attempt (default 5)")
    worker.add_argument("--grace", type=float, default=env_default("grace", 30.0),
                        help="seconds running handlers get to finish on SIGTERM (default 30)")
    worker.add_argument("--run-timeout", type=float, default=env_default("run-timeout", 900.0),
                        help="seconds a run may take before it is stopped and its lease "
                             "released, the attempt counted (default 900)")
    worker.add_argument("--max-batch", type=int, default=env_default("max-batch", 100),
                        help="most events one run claims (default 100)")
    worker.add_argument("--quarantine", type=int, default=env_default("quarantine", 2),
                        help="processes that run, each alone, the runs whose last attempt ended "
                             "without a finish (default 2)")
    worker.add_argument("--max-memory", type=int, default=env_default("max-memory"),
                        metavar="MiB",
                        help="recycle the runtime when its resident memory passes this many MiB: "
                             "it stops taking work, its runs end within --grace, and a fresh one "
                             "starts (default: off)")
    worker.add_argument("--horizon-warn", type=float, default=env_default("horizon-warn", 60.0),
                        help="warn when a transaction held open elsewhere has held VACUUM back "
                             "this many seconds (checked every 30 s; 0: no check; README: A "
                             "transaction held open elsewhere)")
    worker.add_argument("--compact-held-for", type=float,
                        default=env_default("compact-held-for"), metavar="SECONDS",
                        help="rotate wakes and rewrite leases without their dead tuples only while "
                             "something has held VACUUM back this many seconds (default: "
                             "whenever their dead tuples call for it; this spares a burst "
                             "about 8 %%, but lets dead wakes build up between autovacuum's "
                             "passes under a steady load)")
    worker.add_argument("--isolation", default=None, help=argparse.SUPPRESS)
    worker.add_argument("--max-users-per-take", default=None, help=argparse.SUPPRESS)
    worker.set_defaults(run=cmd_worker)

    scheduler = _service_parser(commands, "scheduler", "turn due timers into inbox events", 5.0)
    scheduler.set_defaults(run=cmd_scheduler)

    dispatcher = _service_parser(commands, "dispatcher", "send held outbox messages, paced", 5.0)
    dispatcher.add_argument("--channel", default=env_default("channel"), required=not env_default("channel"),
                            help="module:function called as send(user, text, key), imported "
                                 "from the current folder as python -m would")
    dispatcher.add_argument("--outbox-gap", type=int, default=env_default("outbox-gap", 3600),
                            help="least seconds between two sends to one user (default 3600: a "
                                 "second reply within the hour waits; an urgent message goes at "
                                 "once); a lower gap applies to messages already held too")
    dispatcher.add_argument("--concurrency", type=int, default=env_default("concurrency", 16),
                            help="users' batches sent at once, each on a thread with no database "
                                 "connection held (default 16)")
    dispatcher.add_argument("--send-timeout", type=int, default=env_default("send-timeout", 120),
                            help="seconds a send may take before another dispatcher sends its "
                                 "batch again under the same key (default 120; keep the "
                                 "channel's own timeout below it)")
    dispatcher.add_argument("--max-send-attempts", type=int,
                            default=env_default("max-send-attempts", 10),
                            help="failed sends before a batch is parked failed (default 10)")
    dispatcher.add_argument("--send-backoff", type=int, default=env_default("send-backoff", 5),
                            help="seconds before a failed batch is retried, doubling per "
                                 "failure up to 300, jittered (default 5)")
    dispatcher.add_argument("--at-most-once", action="store_true",
                            default=env_flag("at-most-once"),
                            help="mark a batch sent before sending it (a crash loses it) instead "
                                 "of after (a crash resends it, under the same key)")
    dispatcher.set_defaults(run=cmd_dispatcher)

    ingest_command.add_parser(commands)
    console_command.add_parser(commands)
    operator.add_parsers(commands)
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


if __name__ == "__main__":
    sys.exit(main())
