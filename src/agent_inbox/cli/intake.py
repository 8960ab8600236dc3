"""`agent-inbox ingest-server`: serve the webhook intake with uvicorn.

Invariant: the server answers no request unless the schema is at head
(`revision.require_head`) and the secrets file loaded whole and valid; after
that, SIGHUP reloads the secrets (a failed reload keeps the ones in use) and
SIGTERM or SIGINT stops it gracefully. No option value that is a secret is
logged: secrets come only from the file, never from the command line.

Wired into cli.py with `ingest.command.add_parser(commands)`; `args.run(args)`
returns the exit code, and errors.AgentInboxError is reported by cli.main
(exit 2). It takes the options every service takes (--metrics-port too).
"""

import argparse
import logging

from agent_inbox import errors, validate
from agent_inbox.services.ingest import (DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT,
                                         DEFAULT_MAX_BODY, DEFAULT_MAX_BUFFERED,
                                         DEFAULT_MAX_CONNECTIONS, DEFAULT_STRIPE_TOLERANCE)

log = logging.getLogger("agent_inbox.ingest")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_POOL_SIZE = 8
# Seconds a delivery waits for a pooled connection before it is answered 503:
# less than a sender waits for an answer (GitHub gives up after 10 s), so that
# while no primary is reachable (a failover) the sender hears 503 and
# redelivers, rather than timing out on a request held for the pool's 30 s.
POOL_WAIT = 5.0


def add_parser(commands) -> argparse.ArgumentParser:
    """Add `ingest-server` to an argparse subparsers object; sets run=cmd_ingest_server."""
    # Imported here, not at the top: cli.py imports this module, at whatever
    # point of its own loading the lead chooses.
    from agent_inbox.cli.options import add_service_options, env_default

    parser = commands.add_parser(
        "ingest-server", help="receive signed webhooks (GitHub, Stripe, generic) into users' inboxes")
    add_service_options(parser)
    parser.add_argument("--host", default=env_default("host", DEFAULT_HOST),
                        help=f"address to listen on (default {DEFAULT_HOST})")
    parser.add_argument("--port", type=int, default=env_default("port", DEFAULT_PORT),
                        help=f"port to listen on, 0 for any free one (default {DEFAULT_PORT})")
    # Not required by argparse: AGENT_INBOX_SECRETS="" (compose without a secrets
    # file) must get cmd_ingest_server's message, which says what to do.
    # AGENT_INBOX_SECRETS_FILE too: the name compose and the README give the
    # file's path (compose maps it to AGENT_INBOX_SECRETS inside the container).
    parser.add_argument("--secrets", default=env_default("secrets") or env_default("secrets-file"),
                        help="JSON or TOML file of {user: {source: secret}}, re-read on SIGHUP "
                             "(env AGENT_INBOX_SECRETS, else AGENT_INBOX_SECRETS_FILE)")
    parser.add_argument("--max-body", type=int, default=env_default("max-body", DEFAULT_MAX_BODY),
                        help=f"largest request body in bytes (default {DEFAULT_MAX_BODY})")
    parser.add_argument("--stripe-tolerance", type=int,
                        default=env_default("stripe-tolerance", DEFAULT_STRIPE_TOLERANCE),
                        help="seconds a Stripe-Signature timestamp may differ from now "
                             f"(default {DEFAULT_STRIPE_TOLERANCE})")
    parser.add_argument("--header-timeout", type=float,
                        default=env_default("header-timeout", DEFAULT_HEADER_TIMEOUT),
                        help="seconds a request's headers may take to arrive, from the connection "
                             "or the previous answer (default %g; then 408)" % DEFAULT_HEADER_TIMEOUT)
    parser.add_argument("--body-timeout", type=float,
                        default=env_default("body-timeout", DEFAULT_BODY_TIMEOUT),
                        help="seconds a whole request body may take to arrive after its headers "
                             "(default %g; then 408)" % DEFAULT_BODY_TIMEOUT)
    parser.add_argument("--max-connections", type=int,
                        default=env_default("max-connections", DEFAULT_MAX_CONNECTIONS),
                        help="connections at once; one more is answered 503 and closed "
                             f"(default {DEFAULT_MAX_CONNECTIONS})")
    parser.add_argument("--max-connections-per-client", type=int,
                        default=env_default("max-connections-per-client"),
                        help="connections at once from one client address; one more is "
                             "answered 503 and closed (default half of --max-connections, at "
                             "most 100; behind a proxy every client is the proxy's address)")
    parser.add_argument("--max-buffered", type=int,
                        default=env_default("max-buffered", DEFAULT_MAX_BUFFERED),
                        help="bytes of requests held across all connections before large ones "
                             f"are read no further until room frees (default {DEFAULT_MAX_BUFFERED})")
    parser.add_argument("--pool-size", type=int, default=env_default("pool-size", DEFAULT_POOL_SIZE),
                        help="database connections, and threads running ingests "
                             f"(default {DEFAULT_POOL_SIZE})")
    parser.set_defaults(run=cmd_ingest_server, command="ingest-server")
    return parser


def cmd_ingest_server(args: argparse.Namespace) -> int:
    import uvicorn

    from agent_inbox.cli.options import open_service_inbox

    from agent_inbox.services.ingest import transport
    from agent_inbox.services.ingest.app import build_app
    from agent_inbox.services.ingest.secrets import SecretStore
    from agent_inbox.services.service import Stop

    max_body = validate.positive_int("--max-body", args.max_body)
    tolerance = validate.epoch("--stripe-tolerance", args.stripe_tolerance)
    pool_size = validate.positive_int("--pool-size", args.pool_size)
    if not 0 <= args.port <= 65535:
        raise errors.InvalidInput("--port", args.port, "must be between 0 and 65535")
    limits = transport.Limits(header_timeout=_number("--header-timeout", args.header_timeout),
                              body_timeout=_number("--body-timeout", args.body_timeout),
                              max_connections=validate.positive_int("--max-connections",
                                                                    args.max_connections),
                              max_connections_per_client=None
                              if args.max_connections_per_client is None
                              else validate.positive_int("--max-connections-per-client",
                                                         args.max_connections_per_client),
                              max_buffered=validate.positive_int("--max-buffered",
                                                                 args.max_buffered))
    if limits.max_buffered < max_body:
        raise errors.InvalidInput("--max-buffered", limits.max_buffered,
                                  f"must be at least --max-body ({max_body})")
    if not args.secrets:
        raise errors.InvalidInput(
            "--secrets", args.secrets,
            "is required: a JSON or TOML file of {user: {source: secret}} (or "
            "AGENT_INBOX_SECRETS or AGENT_INBOX_SECRETS_FILE; with docker compose, set AGENT_INBOX_SECRETS_FILE to its path "
            "on the host; deploy/webhook-secrets.example.json shows the form)")
    secrets = SecretStore.from_file(args.secrets)  # before connecting: a bad file fails fast

    stop = Stop().install()  # uvicorn takes SIGTERM/SIGINT over while it serves
    secrets.install_sighup()  # from here on, SIGHUP reloads instead of killing the process
    try:
        with open_service_inbox(args, pool_size, max_payload_bytes=max_body) as inbox:
            log.info("secrets loaded from %s", secrets.describe())
            inbox.pool.timeout = POOL_WAIT  # psycopg_pool's wait in connection()
            app = build_app(inbox, secrets, max_body, tolerance, threads=pool_size)
            server = uvicorn.Server(transport.config(
                app, limits, host=args.host, port=args.port, log_level=args.log_level.lower(),
                lifespan="on", server_header=False))
            if not stop.is_set():
                server.run()
    finally:
        secrets.close()
    return 0


def _number(option: str, value) -> float:
    """A positive, finite number of seconds (an option's value)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 < value < float("inf"):
        raise errors.InvalidInput(option, value, "must be a positive number of seconds")
    return float(value)
