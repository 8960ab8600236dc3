"""What every command of the command line shares, importing no command.

The options every service takes (`add_service_options`, `service_parser`),
the database URL and its checks, AGENT_INBOX_<OPTION> environment defaults,
argument types, and the operator commands' frame: their parser, exit codes,
error reporting, JSON output and the Inbox they open. Every option can also be
given as an environment variable AGENT_INBOX_<OPTION> (for example
AGENT_INBOX_DATABASE_URL); a flag on the command line wins.
"""

import argparse
import contextlib
import functools
import getpass
import json
import logging
import os
import re
import socket
import sys

from agent_inbox import db, errors
from agent_inbox.backend.citus import nodes as citus_nodes

OPERATOR_EXIT_CODES = """Exit codes: 0 done; 1 some ids given to `dead requeue|discard` were not dead
events, or to `outbox retry|discard` not failed batches (they are listed and
left alone); 2 bad input, or no usable
database (nothing changed); 3 `approve` named a request never made."""


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
        "--citus-nodes", choices=citus_nodes.NODES, default=env_default("citus-nodes", "auto"),
        help="on Citus, where the run path's take and finish calls go: through the "
             "'coordinator', or 'direct' to the worker node that holds each bucket (at the "
             "address the coordinator has for it: the nodes must be reachable from here); "
             "'auto' is direct if every node answers at start, else the coordinator, with a "
             "log line saying which and why; the coordinator still carries the rest "
             "(default auto; env AGENT_INBOX_CITUS_NODES)")
    parser.add_argument("--metrics-host", default=env_default("metrics-host", "127.0.0.1"),
                        help="address the metrics listen on (default 127.0.0.1; 0.0.0.0 for "
                             "every interface)")


def service_parser(commands, name: str, help_text: str, poll_default: float):
    parser = commands.add_parser(name, help=help_text)
    add_service_options(parser)
    parser.add_argument("--poll-interval", type=float, default=env_default("poll-interval", poll_default),
                        help=f"seconds between polls when no notification comes (default {poll_default})")
    parser.add_argument("--listen-url", default=env_default("listen-url"), type=database_url,
                        help="a direct PostgreSQL URL (not a transaction pooler's) to LISTEN on "
                             "for wake-ups; default: --database-url, or none with --pooler "
                             "transaction, and the service polls (env AGENT_INBOX_LISTEN_URL)")
    return parser


def open_service_inbox(args: argparse.Namespace, pool_size: int, *, stop=None, **options):
    """Logging, the schema check (refuse to start on a schema not at head), the pool.
    With `stop`, a database that refuses connections (down, or too many clients)
    is waited for, with backoff, until it answers or `stop` is set (then None)."""
    from agent_inbox import Inbox
    from agent_inbox.schema import revision
    from agent_inbox.services.service import backoff_delays

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
    from agent_inbox.services.service import check_answers

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


# --- operator commands ---------------------------------------------------------

# Longest text shown in a table cell; --json shows everything.
_BIGINT_MAX = 2**63 - 1


EXIT_NOT_ALL = 1


EXIT_BAD_INPUT = 2


EXIT_UNKNOWN = 3


def text(value: str) -> str:
    if not value:
        raise argparse.ArgumentTypeError("must not be empty")
    if "\x00" in value:
        raise argparse.ArgumentTypeError("must not contain NUL characters")
    return value


def positive(value: str) -> int:
    try:
        number = int(value, 10)
    except ValueError:
        number = 0
    if not 0 < number <= _BIGINT_MAX:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive integer")
    return number


def epoch(value: str) -> int:
    try:
        number = int(value, 10)
    except ValueError:
        number = -1
    if not 0 <= number <= _BIGINT_MAX:
        raise argparse.ArgumentTypeError(f"{value!r} is not a time in whole epoch seconds")
    return number


def seconds(value: str) -> int:
    """A duration: '30d', '12h', '90m', '45s' or plain seconds."""
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    number, unit = (value[:-1], value[-1]) if value[-1:] in units else (value, "s")
    if not number.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is not a duration such as 30d, 12h or 3600")
    return int(number) * units[unit]


def operator_parser(commands, name: str, help_text: str, description: str | None = None):
    parser = commands.add_parser(name, help=help_text, description=description or help_text,
                                 epilog=OPERATOR_EXIT_CODES)
    add_database_url(parser, required=True)
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document on stdout (for scripts)")
    return parser


def reports_errors(name: str):
    """Errors agent-inbox names (no database URL, schema not at head, database
    unavailable) become a message on stderr and exit code 2."""
    def decorate(handler):
        @functools.wraps(handler)
        def run(args: argparse.Namespace) -> int:
            try:
                return handler(args, name)
            except errors.AgentInboxError as exc:
                print(f"agent-inbox: {exc}", file=sys.stderr)
                return EXIT_BAD_INPUT
        return run
    return decorate


@contextlib.contextmanager
def opened(args: argparse.Namespace, name: str):
    """The schema check (refuse a schema not at head), then an Inbox on one connection."""
    from agent_inbox import Inbox
    from agent_inbox.schema import revision

    if not args.database_url:
        raise errors.InvalidInput("--database-url", None,
                                  "is required (or AGENT_INBOX_DATABASE_URL)")
    revision.require_head(args.database_url, pooler=args.pooler)
    with Inbox.connect(args.database_url, pool_size=1, pooler=args.pooler,
                       application_name=f"agent-inbox-{name}",
                       statement_timeout=None) as inbox:  # an operator's scans take their time
        yield inbox


# What a terminal acts on or reorders text by, beyond the C0 controls json
# escapes itself: DEL and the C1 controls, bidi marks, embeddings, overrides and
# isolates, and the line and paragraph separators. Provider data holds any of them.
_UNSAFE = re.compile("[\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def json_text(document: dict) -> str:
    """`document` as JSON, readable (non-ASCII kept) but with every character of
    _UNSAFE escaped as \\uXXXX (they occur only inside strings, so it stays JSON)."""
    text = json.dumps(document, indent=2, ensure_ascii=False)
    return _UNSAFE.sub(lambda match: "\\u%04x" % ord(match.group()), text)


def emit(args: argparse.Namespace, document: dict, text: str) -> None:
    if args.json:
        sys.stdout.write(json_text(document) + "\n")
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")


def actor() -> str:
    """Who repairs: login@host, recorded with each action."""
    try:
        who = getpass.getuser()
    except Exception:  # no login name in the environment or the password database
        who = "unknown"
    return f"{who}@{socket.gethostname()}"
