"""`agent-inbox`: a thin shell over the programmatic API.

Every option can also be given as an environment variable AGENT_INBOX_<OPTION>
(for example AGENT_INBOX_DATABASE_URL); a flag on the command line wins.
"""

import argparse
import os
import sys

from agent_inbox import errors


def env_default(option: str, default=None):
    return os.environ.get("AGENT_INBOX_" + option.upper().replace("-", "_"), default)


def _add_database_url(parser: argparse.ArgumentParser, *, required: bool) -> None:
    parser.add_argument(
        "--database-url", default=env_default("database-url"),
        help="PostgreSQL URL or libpq connection string (env AGENT_INBOX_DATABASE_URL)"
             + ("" if required else "; without one, a throwaway local cluster is used"))


def cmd_migrate(args: argparse.Namespace) -> int:
    from agent_inbox import migrate

    if args.sql:
        sys.stdout.write(migrate.upgrade_sql(args.revision))
        return 0
    if not args.database_url:
        raise errors.InvalidInput("--database-url", None, "is required (or AGENT_INBOX_DATABASE_URL)")
    migrate.upgrade(args.database_url, args.revision)
    print(f"database at revision {migrate.current_revision(args.database_url)}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from agent_inbox import demo

    demo.main(args.database_url)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agent-inbox", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    migrate = commands.add_parser("migrate", help="upgrade the schema to the newest revision")
    _add_database_url(migrate, required=True)
    migrate.add_argument("--sql", action="store_true",
                         help="print the SQL instead of running it (no database needed)")
    migrate.add_argument("--revision", default="head", help="target revision (default: head)")
    migrate.set_defaults(run=cmd_migrate)

    demo = commands.add_parser("demo", help="run the eight failure scenarios of the reference")
    _add_database_url(demo, required=False)
    demo.set_defaults(run=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except errors.AgentInboxError as exc:
        print(f"agent-inbox: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
