"""`agent-inbox console`: serve the web console with uvicorn.

Invariant: the console answers no request unless its tokens loaded whole and
valid (at least one; each `name:role:token` with a known role and a token of
at least 128 bits by auth.token_bits) and the schema is at head; anything else exits 2 with
what is wrong, before listening. Tokens come from AGENT_INBOX_CONSOLE_TOKENS or
--tokens-file, never the command line, and are never logged.
"""

import argparse
import logging
import os

from agent_inbox import errors, validate

log = logging.getLogger("agent_inbox.console")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8081
DEFAULT_POOL_SIZE = 4
DEFAULT_SESSION_TTL = 8 * 3600


def add_parser(commands) -> argparse.ArgumentParser:
    """Add `console` to an argparse subparsers object; sets run=cmd_console."""
    from agent_inbox.cli.options import add_service_options, env_default, env_flag

    parser = commands.add_parser(
        "console", help="serve the web console for operators and approvers",
        description="A server-rendered web console: overview, users, dead events, failed "
                    "outbox batches, approvals, and permission rules (approvers set them). "
                    "Tokens (name:role:token, roles viewer, operator, approver, or joined "
                    "as operator+approver) come from "
                    "AGENT_INBOX_CONSOLE_TOKENS (comma-separated) or --tokens-file (one a "
                    "line); sessions are signed with AGENT_INBOX_CONSOLE_SECRET if set, else "
                    "with a key made at start.")
    add_service_options(parser)
    parser.add_argument("--host", default=env_default("console-host", DEFAULT_HOST),
                        help=f"address to listen on (default {DEFAULT_HOST}; env "
                             "AGENT_INBOX_CONSOLE_HOST)")
    parser.add_argument("--port", type=int, default=env_default("console-port", DEFAULT_PORT),
                        help=f"port to listen on, 0 for any free one (default {DEFAULT_PORT}; "
                             "env AGENT_INBOX_CONSOLE_PORT)")
    parser.add_argument("--tokens-file", default=env_default("console-tokens-file"),
                        help="file of name:role:token lines (env AGENT_INBOX_CONSOLE_TOKENS_FILE)")
    parser.add_argument("--hide-payloads-from-viewers", action="store_true",
                        default=env_flag("hide-payloads-from-viewers"),
                        help="viewers see no event payloads, message bodies, step results or "
                             "memory documents (operators and approvers still do)")
    parser.add_argument("--session-ttl", type=int,
                        default=env_default("session-ttl", DEFAULT_SESSION_TTL),
                        help=f"seconds a login lasts (default {DEFAULT_SESSION_TTL})")
    parser.add_argument("--forwarded-allow-ips",
                        default=env_default("console-forwarded-allow-ips", "127.0.0.1,::1"),
                        help="addresses of proxies trusted for X-Forwarded-For and "
                             "X-Forwarded-Proto, comma-separated, '*' for any (default "
                             "127.0.0.1,::1; env AGENT_INBOX_CONSOLE_FORWARDED_ALLOW_IPS)")
    parser.add_argument("--insecure-cookies", action="store_true",
                        default=env_flag("console-insecure-cookies"),
                        help="session cookies without Secure over plain HTTP off loopback "
                             "(default: Secure unless listening on loopback; a browser then "
                             "keeps them only over HTTPS)")
    parser.add_argument("--pool-size", type=int,
                        default=env_default("console-pool-size", DEFAULT_POOL_SIZE),
                        help=f"database connections (default {DEFAULT_POOL_SIZE})")
    parser.set_defaults(run=cmd_console, command="console")
    actions = parser.add_subparsers(dest="console_action", metavar="{token}")
    token = actions.add_parser("token", help="make console tokens").add_subparsers(
        dest="token_action", metavar="{new}", required=True)
    new = token.add_parser("new", help="print a new random token (256 bits, base64url), or "
                                       "a whole name:role:token entry with --name and --role")
    new.add_argument("--name", help="the entry's name")
    new.add_argument("--role", help="the entry's role (viewer, operator, approver, or joined "
                                    "with '+')")
    new.set_defaults(run=cmd_token_new)
    return parser


def cmd_token_new(args: argparse.Namespace) -> int:
    """Print a new token, or a name:role:token entry (checked as the console would)."""
    from agent_inbox.services.console import auth

    token = auth.new_token()
    if args.name is None and args.role is None:
        print(token)
        return 0
    if not args.name or not args.role:
        raise errors.InvalidInput("--name and --role", None, "go together")
    entry = f"{args.name}:{args.role}:{token}"
    auth.parse_tokens(entry, "--name/--role")
    print(entry)
    return 0


def cmd_console(args: argparse.Namespace) -> int:
    import uvicorn

    from agent_inbox.cli.options import open_service_inbox
    from agent_inbox.services.console import auth
    from agent_inbox.services.console.app import Settings, build_app

    if not 0 <= int(args.port) <= 65535:
        raise errors.InvalidInput("--port", args.port, "must be between 0 and 65535")
    session_ttl = validate.positive_int("--session-ttl", int(args.session_ttl))
    pool_size = validate.positive_int("--pool-size", int(args.pool_size))
    # Before connecting: bad tokens fail fast, whatever the database's state.
    tokens = auth.load_tokens(os.environ.get(auth.TOKENS_ENV), args.tokens_file)
    key = auth.key_from_env(os.environ.get(auth.SECRET_ENV))
    secure = not args.insecure_cookies and not _loopback(args.host)
    with open_service_inbox(args, pool_size) as inbox:
        sessions = auth.Sessions(inbox.pool)
        authenticator = auth.Authenticator(tokens, session_ttl=session_ttl, key=key,
                                           sessions=sessions)
        ended = sessions.end_unconfigured(authenticator.key_id, authenticator.fingerprints())
        log.info("console: %d tokens (%s), sessions %s%s; cookies %s", len(tokens),
                 ", ".join(f"{t.name}:{'+'.join(t.roles)}" for t in tokens),
                 "signed with AGENT_INBOX_CONSOLE_SECRET" if key else "end at restart",
                 f" ({ended} of removed or changed tokens ended)" if ended else "",
                 "Secure" if secure else "Secure over HTTPS only")
        app = build_app(inbox, authenticator,
                        Settings(hide_payloads_from_viewers=args.hide_payloads_from_viewers,
                                 secure_cookies=secure))
        uvicorn.Server(uvicorn.Config(app, host=args.host, port=int(args.port),
                                      log_level=args.log_level.lower(), server_header=False,
                                      access_log=False, proxy_headers=True,
                                      forwarded_allow_ips=args.forwarded_allow_ips)).run()
    return 0


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
